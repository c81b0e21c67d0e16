#!/usr/bin/env bash
# Fetches the word- and document-similarity sets of gensim's test data from the PyPI wheel
# `gensim` into data/eval/gensim/ (git-ignored; not committed: their licences are those of
# their authors, see below). Does nothing when the files are there.
#
#   lee.cor              the 50 news documents of Lee, Pincombe & Welsh (2005)
#   similarities0-1.txt  their mean human similarity ratings (50 x 50, upper triangle: 1,225 pairs)
#   simlex999.txt        SimLex-999 (Hill, Reichart & Korhonen 2015)
#   wordsim353.tsv       WordSim-353 (Finkelstein et al. 2002)
#
#   scripts/data/get_text_eval.sh [PYTHON]     (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=data/eval/gensim
files=(lee.cor similarities0-1.txt simlex999.txt wordsim353.tsv)
if [[ -f $dest/lee.cor && -f $dest/similarities0-1.txt && -f $dest/simlex999.txt && -f $dest/wordsim353.tsv ]]; then
  echo "gensim test data already in $dest"
  exit 0
fi
python=${1:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --no-deps --only-binary=:all: gensim -d "$tmp"
wheel=$(ls "$tmp"/gensim-*.whl | head -1)
mkdir -p "$dest"
"$python" - "$wheel" "$dest" "${files[@]}" <<'PY'
import os, sys, zipfile
wheel, dest, names = sys.argv[1], sys.argv[2], sys.argv[3:]
z = zipfile.ZipFile(wheel)
for n in names:
    with open(os.path.join(dest, n), "wb") as f:
        f.write(z.read(f"gensim/test/test_data/{n}"))
PY
echo "gensim test data unpacked into $dest"
