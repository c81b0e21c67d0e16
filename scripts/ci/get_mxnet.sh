#!/usr/bin/env bash
# Installs MXNet (mxnet==1.9.1, its last release) from PyPI into a virtual environment of its own,
# outside the repository, for the test that reads RecordIO files written by MXNet's own
# `recordio` module (crates/allgrad-data/tests/data_tests/recordio.rs, through
# scripts/reference/recordio_write.py --writer mxnet). Its own environment because mxnet 1.9.1
# needs numpy < 1.24 (it uses `np.bool`), which the PyTorch environment of get_torch.sh does not
# have. Pillow encodes the test images. Reuses the environment when it already imports them.
# Prints the environment's Python as its last line: export it as ALLGRAD_MXNET_PYTHON.
#
#   scripts/ci/get_mxnet.sh [VENV]    (default: ~/.cache/allgrad/mxnet)
#
# The wheel (manylinux, x86-64) installed on Python 3.11 here; on a Python it has no wheel
# for, the install fails and the test falls back to the format writer of recordio_write.py
# (it skips the MXNet case, saying so).
set -euo pipefail
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/allgrad/mxnet}
python=${PYTHON:-python3}
pins=(mxnet==1.9.1 numpy==1.23.5 pillow==13.0.0)
have() { [[ -x $venv/bin/python ]] && "$venv/bin/python" -c 'import mxnet, PIL; assert mxnet.__version__ == "1.9.1"' 2>/dev/null; }
if have; then
  echo "mxnet 1.9.1 already in $venv" >&2
else
  if [[ -e $venv ]]; then
    [[ -f $venv/pyvenv.cfg ]] || { echo "error: $venv exists and is not a virtual environment" >&2; exit 1; }
    rm -rf "$venv"
  fi
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --no-cache-dir --quiet "${pins[@]}"
  have || { echo "error: mxnet 1.9.1 in $venv does not import" >&2; exit 1; }
  echo "mxnet 1.9.1 installed in $venv" >&2
fi
echo "$venv/bin/python"
