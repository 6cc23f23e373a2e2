#!/usr/bin/env bash
# `make bench-peers`, step 1: one virtual environment per peer under bench/.venvs/<peer> (ignored by git).
# Each sees the project's venv (torch, numpy, Pillow...) through a .pth file placed *after* its own
# site-packages, so every contender runs on the same torch; what a peer pins (e.g. an older numpy for
# numba) is installed in its own venv and wins there. FFCV 1.0.2 is an sdist that compiles against
# libturbojpeg and OpenCV: Debian's pkg-config libturbojpeg0-dev libopencv-dev (apt-get, as root).
# DALI's CPU pipeline needs no GPU (the cuda120 wheel carries its CUDA parts and runs without a device).
# A peer that fails to install is reported and left out; the harness then skips it with the reason.
# BENCH_PEERS="dali streaming" makes only those (default: every peer).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DEST=${BENCH_VENVS:-bench/.venvs}
mkdir -p "$DEST"
site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
status=0
WANT=" ${BENCH_PEERS:-ffcv litdata webdataset dali spdl streaming datago} "

make_venv() {  # make_venv NAME: a venv that also sees the project's site-packages
    local name=$1
    $PY -m venv --clear "$DEST/$name" || return 1
    local own
    own=$("$DEST/$name/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$site" > "$own/zz_project_venv.pth"
    "$DEST/$name/bin/python" -m pip install -q --upgrade pip
}

peer() {  # peer NAME CHECK PIP-ARGS...: install, then prove it imports
    local name=$1 check=$2
    shift 2
    case "$WANT" in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name: pip install $*"
    if make_venv "$name" && "$DEST/$name/bin/python" -m pip install -q "$@" \
        && "$DEST/$name/bin/python" -c "$check"; then
        echo "== $name ready: $DEST/$name/bin/python"
    else
        echo "== $name FAILED (the harness will skip it)"; rm -rf "${DEST:?}/$name"; status=1
    fi
}

if [[ "$WANT" == *" ffcv "* ]] && ! pkg-config --exists libturbojpeg opencv4 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pkg-config libturbojpeg0-dev libopencv-dev >/dev/null
    else
        echo "FFCV needs Debian's pkg-config libturbojpeg0-dev libopencv-dev: run as root or install them first"
    fi
fi
if [[ "$WANT" == *" spdl "* ]] && ! ldconfig -p | grep -q libavfilter; then  # spdl.io loads FFmpeg's libraries
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libavcodec59 libavformat59 \
            libavfilter8 libswscale6 libswresample4 libavdevice59 >/dev/null
    else
        echo "SPDL needs FFmpeg's shared libraries (Debian: libavfilter8 libavformat59 ...): run as root or install them"
    fi
fi
peer ffcv "import ffcv, numba; from importlib.metadata import version; print('ffcv', version('ffcv'), 'numba', numba.__version__)" \
    numba ffcv==1.0.2
peer litdata "import litdata; print('litdata', litdata.__version__)" litdata
peer webdataset "import webdataset; print('webdataset', webdataset.__version__)" webdataset
peer dali "import nvidia.dali as d; print('nvidia-dali', d.__version__)" nvidia-dali-cuda120
peer spdl "import spdl.io, spdl.pipeline; spdl.io.load_image; from spdl.io.lib import _import_libspdl; _import_libspdl(); from importlib.metadata import version; print('spdl', version('spdl_io'))" spdl
peer streaming "import streaming; print('mosaicml-streaming', streaming.__version__)" mosaicml-streaming
peer datago "import datago; from importlib.metadata import version; print('datago', version('datago'))" datago
exit $status
