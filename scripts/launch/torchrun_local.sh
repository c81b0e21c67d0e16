#!/usr/bin/env bash
# allgrad's ranks under the real torchrun, by hand: the same checks as tests/repo/torchrun.rs,
# with every command shown.
#
#   scripts/launch/torchrun_local.sh [path/to/torchrun]     (default: torchrun on PATH)
#
# 1. `launch` and `torchrun --nproc-per-node 2 --no-python train` train the vectors config;
#    their last losses are printed side by side (torchrun's agent serves a TCPStore on
#    MASTER_PORT; rank 0 rendezvouses through it instead of binding that port).
# 2. `torchrun --max-restarts 1`: once the run has a checkpoint, one worker is SIGKILLed;
#    torchrun restarts the workers, which resume from the checkpoint (the "resumed from" line).
# 3. The test file itself, with ALLGRAD_WITH_TORCH=1 and ALLGRAD_TORCHRUN set.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
TORCHRUN="${1:-}"
if [ -z "$TORCHRUN" ]; then
    TORCHRUN="$(command -v torchrun || true)"
fi
if [ -z "$TORCHRUN" ] || ! "$TORCHRUN" --help >/dev/null 2>&1; then
    echo "torchrun not found or not working (pip install torch; or pass its path)" >&2
    exit 2
fi
echo "torchrun: $TORCHRUN ($("$(dirname "$TORCHRUN")/python" -c 'import torch; print("PyTorch", torch.__version__)' 2>/dev/null || echo "PyTorch version unknown"))"

# ALLGRAD_BIN_DIR=target/debug uses binaries built already (default: build target/release).
BIN="${ALLGRAD_BIN_DIR:-}"
if [ -z "$BIN" ]; then cargo build --release --bin train --bin launch; BIN=target/release; fi
OUT="$(mktemp -d "${TMPDIR:-/tmp}/allgrad-torchrun.XXXXXX")"
export ALLGRAD_JOB_TOKEN="${ALLGRAD_JOB_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "== 1. launch vs torchrun, 2 ranks, configs/vectors.yaml"
"$BIN/launch" --nproc-per-node 2 "$BIN/train" --config configs/vectors.yaml \
    --output-dir "$OUT/launch" | tee "$OUT/launch.txt"
"$TORCHRUN" --nproc-per-node 2 --master-port "$(free_port)" --no-python "$BIN/train" \
    --config configs/vectors.yaml --output-dir "$OUT/torchrun" | tee "$OUT/torchrun.txt"
loss() { grep -o 'last loss [0-9.eE+-]*' "$1"; }
echo "launch:   $(loss "$OUT/launch.txt")"
echo "torchrun: $(loss "$OUT/torchrun.txt")"
[ "$(loss "$OUT/launch.txt")" = "$(loss "$OUT/torchrun.txt")" ] || { echo "the losses differ" >&2; exit 1; }

echo "== 2. torchrun --max-restarts 1, one worker SIGKILLed after the first checkpoint"
RUN="$OUT/restarted"
"$TORCHRUN" --nproc-per-node 2 --max-restarts 1 --master-port "$(free_port)" --no-python "$BIN/train" \
    --config configs/vectors.yaml --set train.epochs=100 --set checkpoint.every=8 --output-dir "$RUN" \
    >"$OUT/restarted.txt" 2>&1 &
AGENT=$!
for _ in $(seq 1 3000); do [ -e "$RUN/checkpoints/latest" ] && break; sleep 0.01; done
VICTIM="$(pgrep -P "$AGENT" -x train | tail -n 1 || true)"
if [ -n "$VICTIM" ]; then echo "SIGKILL worker $VICTIM (latest: $(cat "$RUN/checkpoints/latest"))"; kill -9 "$VICTIM"; fi
wait "$AGENT"
grep -E "resumed from|trained|exitcode|closing signal" "$OUT/restarted.txt" | sed 's/^/    /'
grep -q "resumed from" "$OUT/restarted.txt" || { echo "no resume: see $OUT/restarted.txt" >&2; exit 1; }

echo "== 3. cargo test --test repo torchrun::"
ALLGRAD_WITH_TORCH=1 ALLGRAD_TORCHRUN="$TORCHRUN" cargo test --test repo torchrun:: -- --nocapture
echo "outputs kept in $OUT"
