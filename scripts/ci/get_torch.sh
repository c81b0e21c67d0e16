#!/usr/bin/env bash
# Installs PyTorch (torch==2.15.0, the version tests/repo/torchrun.rs is run against) from PyPI into a
# virtual environment outside the repository, for the tests that need torchrun and PyTorch's
# TCPStore (tests/repo/torchrun.rs, run with ALLGRAD_WITH_TORCH=1), with the reference packages that
# tests compare against in the same environment, pinned: transformers (a trained CLIP export loaded
# by `CLIPModel`), webdataset (allgrad-written shards read by webdataset's own reader),
# tensorboard (a run's events file read by TensorBoard's own reader), and, installed without
# their dependencies (they would pull another torch), open-clip-torch (OpenCLIP's own losses,
# schedule and parameter groups in the recipe-parity test, and its losses beside allgrad's ring
# losses in scripts/bench/bench_ring_memory.sh), torchvision and timm (an exported ResNet loaded by
# `torchvision.models.resnet18` and `timm.create_model`). Reuses the
# environment when it already imports those versions. Prints the environment's path as its last line.
#
#   scripts/ci/get_torch.sh [VENV]    (default: $ALLGRAD_TORCH_VENV, else ~/.cache/allgrad/torch-2.15.0)
#
# PyPI's Linux wheel of torch carries its CUDA libraries: about 3 GB to download and 5.3 GB
# installed; on the CI machine (2 cores) the install took about 5 minutes.
set -euo pipefail
version=2.15.0
# The reference packages (pip's requirement syntax), each checked by its installed version below.
refs=(transformers==5.24.0 webdataset==1.0.2 tensorboard==2.21.0)
# Installed with --no-deps: their requirements would pull another torch (torchvision pins one),
# and what else they import (pyyaml, huggingface_hub, safetensors) comes with transformers or is
# unused.
nodeps=(open-clip-torch==3.3.0 torchvision==0.29.2 timm==1.0.31)
venv=${1:-${ALLGRAD_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/allgrad/torch-$version}}
python=${PYTHON:-python3}
have_torch() { [[ -x $venv/bin/python && -x $venv/bin/torchrun ]] &&
  [[ $("$venv/bin/python" -c 'import torch, torch.distributed; print(torch.__version__.split("+")[0])' 2>/dev/null) == "$version" ]]; }
# Every reference package at its pinned version.
have_refs() {
  local want got
  want=$(printf '%s\n' "${refs[@]}" "${nodeps[@]}")
  got=$("$venv/bin/python" - "${refs[@]}" "${nodeps[@]}" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
for r in sys.argv[1:]:
    name = r.split("==")[0]
    print(f"{name}=={m.version(name)}")
PY
  ) || return 1
  [[ $got == "$want" ]]
}
have() { have_torch && have_refs; }
if have; then
  echo "torch $version already in $venv"
elif have_torch; then
  "$venv/bin/python" -m pip install --no-cache-dir --quiet "${refs[@]}"
  "$venv/bin/python" -m pip install --no-cache-dir --quiet --no-deps "${nodeps[@]}"
  have || { echo "error: ${refs[*]} ${nodeps[*]} in $venv do not import" >&2; exit 1; }
  echo "torch $version already in $venv; ${refs[*]} ${nodeps[*]} installed"
else
  if [[ -e $venv ]]; then
    # Only a virtual environment (a failed earlier install) is replaced.
    [[ -f $venv/pyvenv.cfg ]] || { echo "error: $venv exists and is not a virtual environment" >&2; exit 1; }
    rm -rf "$venv"
  fi
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  # No cache: the wheels would double the disk used.
  "$venv/bin/python" -m pip install --no-cache-dir --quiet "torch==$version" "${refs[@]}"
  "$venv/bin/python" -m pip install --no-cache-dir --quiet --no-deps "${nodeps[@]}"
  have || { echo "error: torch $version in $venv does not import" >&2; exit 1; }
  echo "torch $version installed in $venv"
fi
echo "$venv"
