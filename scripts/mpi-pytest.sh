#!/usr/bin/env bash
# Run pytest on every MPI rank: rank 0 prints to the terminal, the others to .mpi-logs/rank<N>.log
# (printed if that rank fails). Used by `make test-mpi`.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SOLAR_VENV:-$ROOT/.venv}/bin/python"
RANK="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}"
cd "$ROOT"
if [ "$RANK" = 0 ]; then
  exec "$PY" -m pytest -p no:cacheprovider "$@"
fi
mkdir -p .mpi-logs
"$PY" -m pytest -p no:cacheprovider -q "$@" > ".mpi-logs/rank$RANK.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "---- rank $RANK failed (exit $rc); its log:"; cat ".mpi-logs/rank$RANK.log"
fi
exit $rc
