#!/usr/bin/env bash
# The competitors' environments for bench/compete (git-ignored, not part of `make test`):
#   .venv-compete    LitData, torchdata                (run.py, most contenders)
#   .venv-streaming  MosaicML Streaming                (contender "streaming")
#   .venv-hf         Hugging Face datasets             (contender "hf")
#   .s3rver          npm's s3rver, the S3 server of the --where s3 runs (bench/compete/s3rver.py)
# Each reuses the project's torch, h5py and editable SOLAR through a .pth file (every contender
# runs on the same torch) and installs its loader with torch pinned to that version: without the
# pin pip replaces torch with the newest CUDA build. Streaming and datasets pin different
# huggingface-hub/fsspec ranges, hence one environment each.
# Usage: bash bench/compete/venvs.sh [compete|streaming|hf|s3rver ...]   (default: all four)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=$(readlink -f .venv/bin/python)
PYV=$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
MAIN_SP=$ROOT/.venv/lib/$PYV/site-packages
TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH" > "$CONSTRAINTS"

make_venv() {  # make_venv DIR PACKAGE...
    local dir=$1; shift
    [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
    local sp=$dir/lib/$PYV/site-packages
    echo "$MAIN_SP" > "$sp/00-main-venv.pth"  # sorted before the editable .pth: main venv first
    cp "$MAIN_SP"/__editable__.solar_loader-*.pth "$sp/"
    "$dir/bin/pip" install -q -c "$CONSTRAINTS" "$@"
}

for which in "${@:-compete streaming hf s3rver}"; do for w in $which; do
    case $w in
    compete) make_venv .venv-compete litdata torchdata boto3 ;;
    streaming)
        # Streaming pulls in torchvision, whose PyPI wheel for this torch is built for CUDA: its
        # compiled operators do not load here; bench/compete/torchvision_ops.py defines the two
        # that torchvision registers at import (NOTE there).
        make_venv .venv-streaming mosaicml-streaming boto3 ;;
    hf) make_venv .venv-hf datasets s3fs ;;
    s3rver) mkdir -p .s3rver && (cd .s3rver && npm install --silent --no-save s3rver@3) ;;
    *) echo "unknown environment $w (compete, streaming, hf, s3rver)" >&2; exit 2 ;;
    esac
done; done
