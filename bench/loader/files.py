"""Many small files under ``mpirun``: a ConcatDataset of ``--files`` HDF5 files of ``--per-file``
samples each, SOLAR against torch, one shuffled epoch after another.

Run: ``mpirun -n 2 .venv/bin/python bench/loader/files.py [--files 200] [--per-file 20] [--size 64]
[--epochs 3] [--buffer 0.5] [--workers 0] [--out bench/loader/files.json]`` (also runs without
``mpirun``, as one rank).

Why: NOTE [ Several files ] in ``solar/concat.py``. Under ``mpirun`` every file a pass reads costs
a few collective calls, so datasets of hundreds of files of a few samples each are where SOLAR
gains least over torch; this bench keeps that figure measurable. The files are read from the
page cache (no throttle): what is left is the per-file cost, not storage bandwidth. Two sides,
in this one run, on every rank:

``torch``
    ``torch.utils.data.DataLoader`` over ``ConcatDataset`` of per-sample serial h5py datasets
    (``solar.testing.baselines.PerSampleH5``), ``DistributedSampler``, ``--workers`` workers.
``solar``
    ``solar.DataLoader`` over ``ConcatDataset`` of ``solar.H5Dataset`` (parallel HDF5 under
    ``mpirun``), the same sampler, ``buffer=--buffer``.

Reported: steady epoch seconds (mean of epochs >= 2, the slowest rank's), calls and bytes summed
over ranks, the hit rate against its bound, and torch/solar. Writes JSON (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from run import allsum, report, run_epochs, steady  # noqa: E402  (bench/loader/run.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--per-file", type=int, default=20)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--buffer", type=float, default=0.5, help="SOLAR's buffer, fraction of the rank's share")
    ap.add_argument("--workers", type=int, default=0, help="torch's num_workers")
    ap.add_argument("--data", default="out/bench/files")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "files.json"))
    a = ap.parse_args()

    import torch.utils.data as tud

    import solar
    from solar.dist import mpi_comm, under_mpirun
    from solar.io_backends.hdf5 import HDF5Backend
    from solar.synthetic import write_ptycho_h5
    from solar.testing.baselines import PerSampleH5

    comm = mpi_comm() if under_mpirun() else None
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    paths = [os.path.join(a.data, f"f{k}-of-{a.files}-{a.per_file}x{a.size}.h5") for k in range(a.files)]
    if rank == 0:
        os.makedirs(a.data, exist_ok=True)
        for k, p in enumerate(paths):
            if not os.path.exists(p):
                write_ptycho_h5(p, a.per_file, a.size, seed=k, progress=False)
    if comm is not None:
        comm.Barrier()

    rows = {}
    for side in ("torch", "solar"):
        if side == "torch":
            members = [PerSampleH5(HDF5Backend(p, direct_reads=False)) for p in paths]
        else:
            members = [solar.H5Dataset(p) for p in paths]
        data = tud.ConcatDataset(members)
        sampler = tud.DistributedSampler(data, num_replicas=size, rank=rank, seed=1)
        if side == "torch":
            loader = tud.DataLoader(data, batch_size=a.batch_size, sampler=sampler, num_workers=a.workers,
                                    persistent_workers=a.workers > 0)
        else:
            loader = solar.DataLoader(data, batch_size=a.batch_size, sampler=sampler, buffer=a.buffer)
        times = run_epochs(loader, a.epochs, comm)
        row = {"epoch_s": times, "steady_s": steady(times)}
        if side == "torch":
            row.update(calls=allsum(sum(m.calls for m in members), comm),
                       bytes=allsum(sum(m.bytes for m in members), comm))
        else:
            row.update(calls=allsum(sum(m.stats.read_calls for m in members), comm),
                       bytes=allsum(sum(m.stats.bytes_in for m in members), comm),
                       collective=bool(members[0].backend.collective))
            later = (a.epochs - 1) * len(sampler) * size
            row.update(hit_rate=allsum(sum(m.stats.hits for m in members), comm) / later if later else 0.0,
                       bound=min(1.0, a.buffer))
        rows[side] = row
        del loader
        for m in members:
            if hasattr(m, "close"):
                m.close()
    if rank == 0:
        report(f"{a.files} files x {a.per_file} samples ({a.size}x{a.size}), {size} rank(s), page cache, batch "
               f"{a.batch_size}; torch num_workers={a.workers}; solar buffer {a.buffer:.0%}"
               + (", parallel HDF5" if rows["solar"]["collective"] else ""),
               rows, {"torch/solar": rows["torch"]["steady_s"] / rows["solar"]["steady_s"]},
               dict(vars(a), ranks=size), a.out)


if __name__ == "__main__":
    main()
