#!/usr/bin/env bash
# SimCSE loss curves, allgrad against PyTorch + transformers (scripts/reference/simcse_loss_compare.py):
# same weights (all-MiniLM-L6-v2), same batches, dropout off, 20 AdamW steps with the
# configs' schedule and clipping; allgrad on 1 rank and on 2 ranks through `launch`. Three
# cases, each a table and a verdict (|loss difference| <= 1e-4 at every step):
#   1. configs/simcse.yaml as it is (unsupervised, temperature 0.05). With dropout off both
#      views of a sentence are equal, so the positive's cosine is exactly 1 and the loss is
#      about 1e-5: the check is weak there;
#   2. the same at temperature 0.5 (loss about 2.3: the encoder, the head, the loss, AdamW,
#      the schedule and clipping all shape the curve);
#   3. configs/simcse_sup.yaml as it is (supervised triplets, hard negatives, temperature 0.05).
#
#   scripts/reference/simcse_loss_compare.sh [--steps 20] [--ranks 1,2]      (extra options go to each case)
#
# Needs the weights (scripts/data/get_minilm.sh); PYTHON picks the interpreter with torch,
# transformers, tokenizers, safetensors and PyYAML (default python3). Exits 1 when a case fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
cargo build --release -q --workspace --bins >&2
bin="${CARGO_TARGET_DIR:-target}/release"
status=0
run() {
  echo "== $*"
  "$python" scripts/reference/simcse_loss_compare.py --bin "$bin" "$@" || status=1
}
run --config configs/simcse.yaml "$@"
run --config configs/simcse.yaml --set loss.temperature=0.5 "$@"
run --config configs/simcse_sup.yaml "$@"
exit $status
