#!/usr/bin/env bash
# One shared, idempotent set-up step for `make test` and `make demo`.
#
# Installs Debian's OpenMPI + parallel HDF5 (when root/apt is available), creates .venv at the
# repository root, installs torch (CPU wheel pinned to 2.13.0), builds h5py from source against
# parallel HDF5 (so h5py.get_config().mpi is True), and installs SOLAR editable with its extras.
# A second run with everything in place takes seconds: each step checks before it acts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SOLAR_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
H5PY_VERSION=3.16.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.solar-setup-stamp"
log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# The tests' own programs; `make demo` (SOLAR_SETUP=demo) needs neither, so it installs no web server service.
TEST_PKGS="nginx chromium"
[ "${SOLAR_SETUP:-test}" = demo ] && TEST_PKGS=""
APT_PKGS="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config $TEST_PKGS"
have_parallel_stack() {
  command -v mpirun >/dev/null && command -v mpicc >/dev/null && pkg-config --exists hdf5-openmpi 2>/dev/null || return 1
  for c in $TEST_PKGS; do command -v "$c" >/dev/null || return 1; done
}

# 1. Debian packages (OpenMPI 4.1, parallel HDF5 1.10, nginx for the HTTP range-server tests,
#    chromium to render the built docs in tests/test_docs_site.py).
PARALLEL=1
if have_parallel_stack; then
  :
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "installing Debian packages: $APT_PKGS"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed; check the network to Debian's mirrors"
  apt-get install -y -qq --no-install-recommends $APT_PKGS >/dev/null || die "apt-get install $APT_PKGS failed"
  have_parallel_stack || die "packages installed but mpicc/hdf5-openmpi.pc/$TEST_PKGS still missing"
else
  PARALLEL=0
  log "WARNING: not root or no apt-get: cannot install OpenMPI + parallel HDF5."
  log "WARNING: falling back to the serial h5py wheel; SOLAR will run as world size 1 and MPI tests cannot run."
fi

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
fi
V="$VENV/bin"
PIP_CMD=("$V/python" -m pip --disable-pip-version-check -q)
# pip on this kind of machine warns about each package missing from a secondary on-disk index;
# drop that noise, keep everything else and pip's exit status.
pip_() { "${PIP_CMD[@]}" "$@" 2>&1 | sed '/is ignored: it is neither a file nor a directory/d'; return "${PIPESTATUS[0]}"; }

# Fingerprint of what this script installs: if unchanged and the checks pass, nothing to do.
FPR="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$PARALLEL"
check_stack() {
  "$V/python" - "$PARALLEL" <<'PYCHECK'
import sys
import torch, numpy, h5py, fsspec, lz4, solar  # noqa: F401
need_mpi = sys.argv[1] == "1"
if need_mpi:
    import mpi4py  # noqa: F401
    assert h5py.get_config().mpi, "h5py was built without MPI"
PYCHECK
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FPR" ] && check_stack 2>/dev/null; then
  log "environment up to date ($VENV)"
  exit 0
fi

# 3. torch: the pinned CPU wheel (a looser pin downloads gigabytes of CUDA wheels).
if ! "$V/python" -c "import torch,sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  pip_ install "torch==$TORCH_VERSION" || die "pip install torch==$TORCH_VERSION failed"
fi

# 4. Build tools for h5py and the wheels everything else comes as.
pip_ install "setuptools>=77.0.1" wheel "cython>=3,<4" pkgconfig "numpy>=1.26" \
  || die "pip install of build tools failed"

# 5. h5py against parallel HDF5 (or the serial wheel as a fallback).
if [ "$PARALLEL" = 1 ]; then
  pip_ install "mpi4py==4.1.2" || die "pip install mpi4py failed"
  if ! "$V/python" -c "import h5py,sys; sys.exit(not (h5py.get_config().mpi and h5py.__version__=='$H5PY_VERSION'))" 2>/dev/null; then
    log "building h5py==$H5PY_VERSION from source against parallel HDF5 (about 2.5 min)"
    printf '[build_ext]\nparallel = %s\n' "$(nproc)" > "$VENV/h5py-build_ext.cfg"
    PATH="$V:$PATH" DIST_EXTRA_CONFIG="$VENV/h5py-build_ext.cfg" CC=mpicc HDF5_MPI=ON \
        HDF5_PKGCONFIG_NAME=hdf5-openmpi \
        pip_ install --no-cache-dir --no-binary=h5py --no-build-isolation --no-deps \
        --force-reinstall "h5py==$H5PY_VERSION" || die "building h5py against parallel HDF5 failed"
  fi
  "$V/python" -c "import h5py,sys; sys.exit(not h5py.get_config().mpi)" \
    || die "h5py.get_config().mpi is False after the build; remove $VENV and re-run"
  EXTRAS="mpi,s3,dali,test,bench"
else
  pip_ install "h5py==$H5PY_VERSION" || die "pip install h5py failed"
  EXTRAS="s3,dali,test,bench"
fi

# 6. SOLAR itself, editable, with extras; h5py is already satisfied so pip keeps the parallel build.
log "installing solar[$EXTRAS] (editable)"
pip_ install -e "$ROOT[$EXTRAS]" || die "pip install -e .[$EXTRAS] failed"
if [ "$PARALLEL" = 1 ]; then
  "$V/python" -c "import h5py,sys; sys.exit(not h5py.get_config().mpi)" \
    || die "a dependency replaced the parallel h5py with the serial wheel; keep h5py==$H5PY_VERSION"
fi
check_stack || die "the installed stack does not import; see the error above"
# The codec's cpu-kernel decoder (numba, the test extra) compiles once here into numba's on-disk
# cache, so the first decode of a run does not stall for it.
"$V/python" -c "import solar.codec.paths as p; p.warm()" || log "WARNING: the codec's numba kernels did not compile"
echo "$FPR" > "$STAMP"
log "ready: $("$V/python" -c 'import torch,h5py;print("torch",torch.__version__,"| h5py",h5py.__version__,"mpi",h5py.get_config().mpi)')"
