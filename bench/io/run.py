"""I/O benchmark: coalesced collective reads vs per-sample independent reads vs torch's DataLoader.

Run (2 ranks): ``mpirun -n 2 .venv/bin/python bench/io/run.py [--samples 2048] [--size 64]
[--batch-size 32] [--bandwidth 100e6] [--latency 2e-3] [--out bench/io/results.json]``

One PtychoNN-like HDF5 file (fields ``x`` 1xSxS and ``y`` 2xSxS float32) is read for one epoch
by every rank, each rank taking its ``DistributedSampler`` share of one seeded shuffled order, in
steps of ``--batch-size`` samples. Three ways to read the same samples:

``collective``
    SOLAR's ``mpi-hdf5`` backend: per step and field, the step's rows sorted and coalesced into
    ranges and read with ONE collective ``H5Dread`` of a union hyperslab (MPI-IO may aggregate).
``union-indep``
    the same single union-hyperslab read per step and field, with an independent transfer
    (``MPIHDF5Backend(transfer="independent")``): one request per rank, no two-phase aggregation.
``per-sample``
    What SOLAR's released code does: the file opened with the ``mpio`` driver, ``dset[i]`` per
    sample and field (independent I/O, one request each).
``torch``
    ``torch.utils.data.DataLoader`` (``num_workers=--workers`` per rank) over a map-style dataset
    doing per-sample serial h5py reads (:class:`solar.testing.baselines.PerSampleH5`), sampler
    ``DistributedSampler``.

Two storages, each method run side by side in this one job:

``cold``
    the local file with its pages dropped from the page cache before each method
    (``posix_fadvise(DONTNEED)``), so reads hit the disk; the machine has too much RAM for a file
    that does not fit, so this is how "larger than the page cache" is emulated.
``throttled``
    every request through ``ThrottledBackend`` (``--bandwidth`` bytes/s and ``--latency`` s per
    request for each rank; torch's workers split the rank's bandwidth): a rank's share of a
    parallel file system. For ``collective`` a request is one collective call.

Reported per method: epoch time (max over ranks), MB/s (all ranks' bytes / that time), storage
calls (sum over ranks), and ratios against ``collective``. The machine is shared (2 cores, other
jobs running): compare ratios from this one run, not absolute numbers. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drop_page_cache(path: str) -> None:
    """Evict ``path``'s clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rank_steps(n: int, rank: int, size: int, batch: int, seed: int) -> list[np.ndarray]:
    """This rank's samples per step: DistributedSampler's strided share of one shuffled order."""
    order = np.random.default_rng(seed).permutation(n)
    mine = order[rank::size]
    return [mine[i:i + batch] for i in range(0, len(mine), batch)]


def coalesce(rows: np.ndarray) -> np.ndarray:
    rows = np.sort(rows)
    if not len(rows):
        return np.empty((0, 2), np.int64)
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    return np.array([[r[0], r[-1] + 1] for r in runs], np.int64)


class _PerSampleStats:
    def __init__(self) -> None:
        self.read_calls = self.bytes_read = 0


def run_collective(path, steps, fields, throttle, comm, **options):
    from solar.io_backends.mpi_hdf5 import MPIHDF5Backend
    from solar.io_backends.throttled import ThrottledBackend

    be = MPIHDF5Backend(path, comm=comm, **options)
    if throttle:
        be = ThrottledBackend(be, bandwidth=throttle[0], latency=throttle[1])
    be.ensure_open()
    nsteps = comm.allreduce(len(steps), op=_max())
    comm.Barrier()
    t0 = time.perf_counter()
    for k in range(nsteps):  # every rank makes every collective call, even past its last step
        rows = steps[k] if k < len(steps) else np.empty(0, np.int64)
        for f in fields:
            # DistributedSampler's shares of one permutation: no row is read by two ranks, so
            # the collective transfer is safe (NOTE [ Disjoint collective reads ])
            be.read_ranges(f, coalesce(rows), disjoint=True)
    dt = time.perf_counter() - t0
    stats = (be.stats.read_calls, be.stats.bytes_read)
    be.close()
    return dt, stats


def run_per_sample(path, steps, fields, throttle, comm):
    """SOLAR's released pattern: an mpio file, ``dset[i]`` per sample and field (independent)."""
    import h5py

    from solar.io_backends.base import ArrayInfo
    from solar.io_backends.throttled import delay_for  # the model ThrottledBackend charges per request

    st = _PerSampleStats()
    f = h5py.File(path, "r", driver="mpio", comm=comm)
    dsets = {k: f[k] for k in fields}
    infos = {k: ArrayInfo(d.shape, d.dtype) for k, d in dsets.items()}
    comm.Barrier()
    t0 = time.perf_counter()
    for rows in steps:
        for i in rows.tolist():
            for k, d in dsets.items():
                t1 = time.perf_counter()
                d[i]
                st.read_calls += 1
                st.bytes_read += infos[k].row_nbytes
                if throttle:
                    wait = delay_for(1, infos[k].row_nbytes, *throttle) - (time.perf_counter() - t1)
                    if wait > 0:
                        time.sleep(wait)
    dt = time.perf_counter() - t0
    f.close()
    return dt, (st.read_calls, st.bytes_read)


def run_torch(path, steps, fields, throttle, comm, workers, batch, seed):
    import torch.utils.data as tud

    from solar.io_backends.hdf5 import HDF5Backend
    from solar.io_backends.throttled import ThrottledBackend
    from solar.testing.baselines import PerSampleH5

    be = HDF5Backend(path, direct_reads=False)  # a torch user's h5py reads
    if throttle:
        be = ThrottledBackend(be, bandwidth=throttle[0] / max(workers, 1), latency=throttle[1])
    ds = PerSampleH5(be, fields)
    order = np.concatenate(steps) if steps else np.empty(0, np.int64)
    loader = tud.DataLoader(ds, batch_size=batch, sampler=order.tolist(), num_workers=workers,
                            multiprocessing_context="fork" if workers else None)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in loader:
        pass
    dt = time.perf_counter() - t0
    return dt, (ds.calls, ds.bytes)


def _max():
    from mpi4py import MPI

    return MPI.MAX


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, typ, default, help_ in (
            ("--samples", int, 2048, "samples in the file"),
            ("--size", int, 64, "field edge (x: 1xSxS, y: 2xSxS float32)"),
            ("--batch-size", int, 32, "samples per step per rank"),
            ("--bandwidth", float, 100e6, "bytes/s per rank on throttled storage"),
            ("--latency", float, 2e-3, "seconds per request on throttled storage"),
            ("--workers", int, 1, "torch DataLoader workers per rank")):
        ap.add_argument(flag, type=typ, default=default, help=help_)
    ap.add_argument("--storage", nargs="+", default=["cold", "throttled"], choices=["cold", "warm", "throttled"])
    ap.add_argument("--methods", nargs="+", default=["collective", "union-indep", "per-sample", "torch"],
                    choices=["collective", "union-indep", "per-sample", "torch"])
    ap.add_argument("--hints", type=json.loads, default=None, metavar="JSON",
                    help='MPI-IO hints for the collective reads, e.g. \'{"romio_cb_read": "disable"}\'')
    ap.add_argument("--data", default=os.path.join(ROOT, "out", "bench", "io.h5"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json"))
    args = ap.parse_args(argv)

    from solar.dist import mpi_comm
    from solar.synthetic import write_ptycho_h5

    comm = mpi_comm()
    if comm is None:
        print("bench/io runs under mpirun: mpirun -n 2 .venv/bin/python bench/io/run.py", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    rank = comm.rank
    if rank == 0:
        os.makedirs(os.path.dirname(args.data), exist_ok=True)
    comm.Barrier()
    import h5py

    need = True
    if rank == 0 and os.path.exists(args.data):
        with h5py.File(args.data, "r") as f:
            need = f["x"].shape[0] != args.samples or f["x"].shape[-1] != args.size
    need = comm.bcast(need, root=0)
    if need:
        write_ptycho_h5(args.data, args.samples, args.size, seed=0, comm=comm, progress=False)
    fields = ("x", "y")
    steps = rank_steps(args.samples, rank, comm.size, args.batch_size, args.seed)
    file_mb = os.path.getsize(args.data) / 1e6
    if rank == 0:
        print(f"{args.data}: {args.samples} samples, {file_mb:.0f} MB; {comm.size} ranks x batch {args.batch_size}; "
              f"throttle {args.bandwidth / 1e6:.0f} MB/s + {args.latency * 1e3:.1f} ms per request per rank; "
              "shared 2-core machine: compare ratios")
    results = {"config": vars(args), "machine": platform.platform(), "world_size": comm.size,
               "file_mb": file_mb, "runs": {}}
    for storage in args.storage:
        throttle = (args.bandwidth, args.latency) if storage == "throttled" else None
        rows = {}
        for method in args.methods:
            if storage == "cold" and rank == 0:
                drop_page_cache(args.data)
            comm.Barrier()
            if method == "collective":
                dt, (calls, nbytes) = run_collective(args.data, steps, fields, throttle, comm, mpi_hints=args.hints,
                                                     transfer="collective")
            elif method == "union-indep":
                dt, (calls, nbytes) = run_collective(args.data, steps, fields, throttle, comm, transfer="independent")
            elif method == "per-sample":
                dt, (calls, nbytes) = run_per_sample(args.data, steps, fields, throttle, comm)
            else:
                dt, (calls, nbytes) = run_torch(args.data, steps, fields, throttle, comm, args.workers,
                                                args.batch_size, args.seed)
            t = comm.allreduce(dt, op=_max())
            calls, nbytes = comm.allreduce(calls), comm.allreduce(nbytes)
            rows[method] = {"seconds": t, "MBps": nbytes / t / 1e6, "calls": calls, "bytes": nbytes}
        base = rows.get("collective")
        for r in rows.values():
            if base:
                r["speedup_of_collective"] = r["seconds"] / base["seconds"]
        results["runs"][storage] = rows
        if rank == 0:
            print(f"\n[{storage}]  {'method':<11} {'epoch s':>8} {'MB/s':>8} {'calls':>7} {'collective is':>14}")
            for m, r in rows.items():
                ratio = f"{r['speedup_of_collective']:.2f}x faster" if base and m != "collective" else ""
                print(f"           {m:<11} {r['seconds']:8.2f} {r['MBps']:8.1f} {r['calls']:7d} {ratio:>14}")
    if rank == 0:
        from solar.fileio import write_text_atomic

        write_text_atomic(args.out, json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
