# shellcheck shell=bash
# Sourced by scripts/ci/check_cuda_build.sh and scripts/ci/build_cuda_bins.sh: a CUDA 13 toolchain
# for building allgrad's `cuda`/`nccl` features on a machine without a CUDA installation,
# from PyPI's wheels installed into a virtual environment outside the repository.
#
#   cuda_toolchain VENV [WHEEL...]   installs the pinned compiler wheels (plus WHEEL...) into
#                                    VENV and exports PATH, CUDA_ROOT/CUDA_PATH/CUDA_HOME,
#                                    CUDA_COMPUTE_CAP (default 90), CUDARC_CUDA_VERSION and the
#                                    CCCL include path; sets CUDA_LIB to the wheels' lib
#                                    directory. Returns 1 with CUDA_SKIP saying why when the
#                                    toolchain cannot be had (no python3 or g++, PyPI refused).
#
# The compiler is CUDA 13.0 (nvcc, NVVM and the front end pinned together): the PTX it writes
# loads on every driver that supports CUDA 13.0 or newer, which a newer nvcc's PTX does not
# (a 13.0 driver refuses PTX ISA 9.5 "Unsupported .version"). ALLGRAD_CUDA_WHEELS replaces
# the list, CUDARC_CUDA_VERSION must then match it (cudarc knows versions up to 13.4).
CUDA_WHEELS_DEFAULT="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"

cuda_toolchain() {
    local venv="$1"
    shift
    CUDA_SKIP=""
    case "$(realpath -m "$venv")/" in
    "$(pwd -P)"/*) CUDA_SKIP="the toolchain's venv $venv lies inside the repository; choose a directory outside it"; return 1 ;;
    esac
    command -v python3 >/dev/null 2>&1 || { CUDA_SKIP="no python3 on PATH to install nvcc from PyPI"; return 1; }
    command -v g++ >/dev/null 2>&1 || { CUDA_SKIP="no g++ on PATH: nvcc needs it for the host side of candle's kernels"; return 1; }
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" >/dev/null 2>&1 || { CUDA_SKIP="python3 -m venv $venv failed (python3-venv missing?)"; return 1; }
    fi
    # shellcheck disable=SC2086 # the list is split on purpose
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check ${ALLGRAD_CUDA_WHEELS:-$CUDA_WHEELS_DEFAULT} "$@" >"$venv/pip.log" 2>&1; then
        tail -n 5 "$venv/pip.log" >&2 || true
        CUDA_SKIP="pip could not install the CUDA wheels from PyPI (log: $venv/pip.log)"
        return 1
    fi
    local site cuda cccl=""
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cuda="$site/nvidia/cu13"
    [ -x "$cuda/bin/nvcc" ] || { CUDA_SKIP="the wheels gave no nvcc at $cuda/bin/nvcc"; return 1; }
    # The CCCL headers (cuda/std/..., thrust, cub) sit beside include/ in their own wheel.
    [ -d "$cuda/cccl" ] && cccl="$cuda/cccl"
    [ -d "$cuda/include/cccl" ] && cccl="$cuda/include/cccl"
    export PATH="$cuda/bin:$PATH"
    export CUDA_ROOT="$cuda" CUDA_PATH="$cuda" CUDA_HOME="$cuda"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
    if [ -n "$cccl" ]; then
        export CPATH="$cccl${CPATH:+:$CPATH}"
        export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cccl"
    fi
    CUDA_LIB="$cuda/lib"
    CUDA_SITE="$site"
}
