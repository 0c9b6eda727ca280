"""``solar demo``: the main job.

Builds a PtychoNN-like synthetic HDF5 dataset — written by 2 MPI ranks through parallel HDF5
when MPI is available, serially otherwise — reads it back, then trains the same small CNN
surrogate (diffraction pattern -> amplitude and phase) for a few epochs twice, from the same
initial weights and the same DistributedSampler order: with ``torch.utils.data.DataLoader`` over
a per-sample h5py dataset (``num_workers=2``, the file opened per worker: today's practice) and
with ``solar.DataLoader`` over ``solar.H5Dataset`` (buffer, schedule, coalesced reads, prefetch).
Storage is the local file behind a throttle that models one rank's share of a parallel file
system (``--bandwidth``, ``--latency``; 0 turns it off), split evenly among each loader's
concurrent readers. Prints a side-by-side table: epoch time, samples/s, storage bytes and calls,
SOLAR's hit rate against the bound min(1, buffer), final loss.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from solar.capabilities import h5py_has_mpi
from solar.dist import mpi_comm, under_mpirun
from solar.synthetic import ptycho_sample, write_ptycho_h5


def _at_least(lo: float, kind=int):
    """An argparse type: ``kind`` values >= ``lo``, else a one-line usage error (exit 2) while the
    arguments are parsed, before any MPI write starts."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v >= lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo:g}, got {text}")
        return v
    return parse


def _fraction(text: str) -> float:
    v = _at_least(0.0, float)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"is a fraction of the dataset, 0..1, got {text}")
    return v


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=_at_least(1), default=1024, help="number of samples (default 1024)")
    parser.add_argument("--size", type=_at_least(1), default=64, help="field edge length in pixels (default 64)")
    parser.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    parser.add_argument("--ranks", type=_at_least(1), default=2, help="MPI ranks for the parallel write (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=_at_least(0), default=3,
                        help="training epochs per loader (default 3; 0 skips training)")
    parser.add_argument("--batch-size", type=_at_least(1), default=32)
    parser.add_argument("--buffer", type=_fraction, default=0.5,
                        help="SOLAR buffer, fraction of the dataset (default 0.5)")
    parser.add_argument("--bandwidth", type=_at_least(0.0, float), default=200e6,
                        help="storage bytes/s for the process (default 200e6; 0: unthrottled)")
    parser.add_argument("--latency", type=_at_least(0.0, float), default=1e-3,
                        help="seconds per storage request (default 1e-3)")
    parser.add_argument("--workers", type=_at_least(0), default=2, help="num_workers of the torch baseline (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)


def _parallel_possible() -> bool:
    return shutil.which("mpirun") is not None and h5py_has_mpi()


def _write(args: argparse.Namespace, path: str) -> str:
    if args.write_only or under_mpirun():
        comm = mpi_comm()
        write_ptycho_h5(path, args.samples, args.size, args.seed, comm=comm, progress=not args.no_progress)
        return f"{comm.size if comm else 1} MPI rank(s)"
    if _parallel_possible() and args.ranks > 1:
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        cmd = ["mpirun", "-n", str(args.ranks), "--bind-to", "none", sys.executable, "-m", "solar.cli", "demo",
               "--write-only", "--samples", str(args.samples), "--size", str(args.size), "--out", args.out,
               "--seed", str(args.seed)] + (["--no-progress"] if args.no_progress else [])
        subprocess.run(cmd, check=True, env=env)
        return f"{args.ranks} MPI ranks, parallel HDF5 (driver='mpio')"
    if args.ranks > 1:
        print("MPI or MPI-enabled h5py not available: writing serially", file=sys.stderr)
    write_ptycho_h5(path, args.samples, args.size, args.seed, comm=None, progress=not args.no_progress)
    return "1 process, serial HDF5"


def run(args: argparse.Namespace) -> int:
    import h5py  # heavy; `solar demo --help` stays fast without it

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ptycho.h5")
    t0 = time.perf_counter()
    how = _write(args, path)
    if args.write_only:
        return 0
    dt = time.perf_counter() - t0
    with h5py.File(path, "r") as f:
        shapes = {k: (f[k].shape, str(f[k].dtype)) for k in f}
        nbytes = sum(f[k].size * f[k].dtype.itemsize for k in f)
        probe = [0, args.samples // 2, args.samples - 1]
        ok = all(np.array_equal(f["x"][i], ptycho_sample(i, args.size, args.seed)[0]) for i in probe)
    print(f"wrote {path} with {how} in {dt:.2f} s ({nbytes / 2**20:.1f} MiB)")
    for k, (shape, dtype) in shapes.items():
        print(f"  field {k}: shape {shape} {dtype}")
    print(f"read back samples {probe}: {'match' if ok else 'MISMATCH'}")
    if not ok:
        return 1
    if args.epochs > 0:
        from solar.cli._train import compare  # imports torch: the --write-only ranks never train

        compare(path, args)
    return 0
