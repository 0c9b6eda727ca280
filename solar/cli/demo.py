"""``solar demo``: the main job.

Builds a PtychoNN-like synthetic HDF5 dataset — written by 2 MPI ranks through parallel HDF5
when MPI is available, serially otherwise — and reads it back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=512, help="number of samples (default 512)")
    parser.add_argument("--size", type=int, default=64, help="field edge length in pixels (default 64)")
    parser.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks for the parallel write (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)


def _parallel_possible() -> bool:
    from solar.capabilities import h5py_has_mpi

    return shutil.which("mpirun") is not None and h5py_has_mpi()


def _write(args: argparse.Namespace, path: str) -> str:
    from solar.dist import mpi_comm, under_mpirun
    from solar.synthetic import write_ptycho_h5

    if args.write_only or under_mpirun():
        comm = mpi_comm()
        write_ptycho_h5(path, args.samples, args.size, args.seed, comm=comm)
        return f"{comm.size if comm else 1} MPI rank(s)"
    if _parallel_possible() and args.ranks > 1:
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        cmd = ["mpirun", "-n", str(args.ranks), "--bind-to", "none", sys.executable, "-m", "solar.cli", "demo",
               "--write-only", "--samples", str(args.samples), "--size", str(args.size), "--out", args.out,
               "--seed", str(args.seed)]
        subprocess.run(cmd, check=True, env=env)
        return f"{args.ranks} MPI ranks, parallel HDF5 (driver='mpio')"
    print("MPI or MPI-enabled h5py not available: writing serially", file=sys.stderr)
    write_ptycho_h5(path, args.samples, args.size, args.seed, comm=None)
    return "1 process, serial HDF5"


def run(args: argparse.Namespace) -> int:
    import h5py
    import numpy as np

    from solar.synthetic import ptycho_sample

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
    return 0 if ok else 1
