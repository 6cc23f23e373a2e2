#!/usr/bin/env bash
# `make bench-peers`, step 1: one virtual environment per peer under bench/.venvs/<peer> (ignored by git).
# Each sees the project's venv (torch, numpy, Pillow...) through a .pth file placed *after* its own
# site-packages, so every contender runs on the same torch; what a peer pins (e.g. an older numpy for
# numba) is installed in its own venv and wins there. FFCV 1.0.2 is an sdist that compiles against
# libturbojpeg and OpenCV: Debian's pkg-config libturbojpeg0-dev libopencv-dev (apt-get, as root).
# A peer that fails to install is reported and left out; the harness then skips it with the reason.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DEST=${BENCH_VENVS:-bench/.venvs}
mkdir -p "$DEST"
site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
status=0

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
    echo "== $name: pip install $*"
    if make_venv "$name" && "$DEST/$name/bin/python" -m pip install -q "$@" \
        && "$DEST/$name/bin/python" -c "$check"; then
        echo "== $name ready: $DEST/$name/bin/python"
    else
        echo "== $name FAILED (the harness will skip it)"; rm -rf "${DEST:?}/$name"; status=1
    fi
}

if ! pkg-config --exists libturbojpeg opencv4 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pkg-config libturbojpeg0-dev libopencv-dev >/dev/null
    else
        echo "FFCV needs Debian's pkg-config libturbojpeg0-dev libopencv-dev: run as root or install them first"
    fi
fi
peer ffcv "import ffcv, numba; from importlib.metadata import version; print('ffcv', version('ffcv'), 'numba', numba.__version__)" \
    numba ffcv==1.0.2
peer litdata "import litdata; print('litdata', litdata.__version__)" litdata
peer webdataset "import webdataset; print('webdataset', webdataset.__version__)" webdataset
exit $status
