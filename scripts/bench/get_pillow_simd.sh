#!/usr/bin/env bash
# Pillow-SIMD beside torch and torchvision, for scripts/bench/bench_loader.sh's third column
# (torchvision's transforms on Pillow-SIMD). Prints the environment's folder as its last line.
#
#   scripts/bench/get_pillow_simd.sh
#
# A virtual environment of its own, $XDG_CACHE_HOME/allgrad/pillow-simd (~/.cache/allgrad/...),
# made from the Python of scripts/ci/get_torch.sh's environment: its own site-packages holds
# Pillow-SIMD 12.1.1.post0, built from source with AVX2 (CC="cc -mavx2", as Pillow-SIMD's
# documentation says; it needs a C compiler and Debian's libjpeg-dev and zlib1g-dev, installed
# through apt-get when missing and run as root), and a .pth file puts the torch environment's
# site-packages (torch 2.15, torchvision 0.29.2, numpy) after it, so `import PIL` finds
# Pillow-SIMD and everything else is the plain-Pillow column's. Checks at the end that PIL comes
# from this environment and is the SIMD build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/allgrad"
VENV="$CACHE/pillow-simd"
PILLOW_SIMD="12.1.1.post0"

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi

TORCH_VENV="$("$ROOT/scripts/ci/get_torch.sh" | tail -n 1)"
if ! "$TORCH_VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    "$TORCH_VENV/bin/python" -m pip install --quiet --no-deps "torchvision==0.29.2" "pillow==13.0.0" "numpy==2.4.6"
fi

check() {
    "$VENV/bin/python" - "$VENV" "$PILLOW_SIMD" <<'PY'
import os, sys
import PIL, torchvision
venv, want = sys.argv[1], sys.argv[2]
where = os.path.realpath(PIL.__file__)
assert where.startswith(os.path.realpath(venv)), f"PIL imported from {where}, not from {venv}"
assert PIL.__version__ == want, f"PIL {PIL.__version__}, want Pillow-SIMD {want}"
print(f"Pillow-SIMD {PIL.__version__} ({where}), torchvision {torchvision.__version__}")
PY
}

if ! check >/dev/null 2>&1; then
    missing=()
    for pkg in libjpeg-dev zlib1g-dev; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        if [[ $(id -u) -ne 0 ]]; then
            echo "get_pillow_simd.sh: Pillow-SIMD's build needs ${missing[*]}: apt-get install ${missing[*]} (as root)" >&2
            exit 1
        fi
        apt-get update -q && apt-get install -y -q "${missing[@]}"
    fi
    rm -rf "$VENV"
    "$TORCH_VENV/bin/python" -m venv "$VENV"
    torch_site="$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    own_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$torch_site" > "$own_site/allgrad-torch-site.pth"
    CC="cc -mavx2" "$VENV/bin/python" -m pip install --quiet --no-cache-dir --no-binary pillow-simd "pillow-simd==$PILLOW_SIMD"
fi
check >&2
echo "$VENV"
