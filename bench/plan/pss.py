"""Per-rank memory and time to the first batch of ``solar.DataLoader`` under ``mpirun``.

Run: ``mpirun -n 4 .venv/bin/python bench/plan/pss.py [--samples 20000000] [--batch-size 32]
[--planner sharded|full] [--out bench/plan/pss.json]``

Every rank opens one file of ``--samples`` one-byte rows (written once, by rank 0, into
``--dir``), builds the loader with a ``DistributedSampler`` and ``buffer=0.5``, and takes two
batches up to the first one after the epoch's head. Reported per rank: the growth of its
proportional set size (PSS, from ``/proc/self/smaps_rollup``: memory a rank shares with others,
such as the node's window of the order, counts its share) from before the loader to after that
batch, in bytes per sample, and seconds to the first, the second and the first batch after the
head (a sharded epoch not planned ahead hands out its first ``head_steps`` steps before its plan
is made, behind their reads: NOTE [ First steps ] in solar/schedule.py; the first step after the
head waits for that plan). ``--planner full`` plans the whole plan on every rank
(``SOLAR_PLANNER=full``); ``sharded`` (the default under mpirun with parallel HDF5) plans each
rank's share (NOTE [ Sharded planning ] in solar/shardplan.py). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time


def pss() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=20_000_000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--planner", choices=["sharded", "full"], default="sharded")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "pss.json"))
    a = ap.parse_args()
    os.environ["SOLAR_PLANNER"] = a.planner

    import h5py
    import numpy as np
    import torch.utils.data as tud

    import solar
    from solar.dist import mpi_comm

    comm = mpi_comm()
    if comm is None:
        raise SystemExit("run under mpirun: mpirun -n 4 .venv/bin/python bench/plan/pss.py")
    path = os.path.join(a.dir, f"solar-pss-{a.samples}.h5")
    if comm.rank == 0 and not os.path.exists(path):
        with h5py.File(path + ".tmp", "w") as f:
            f.create_dataset("x", data=np.zeros((a.samples, 1), np.uint8))
        os.replace(path + ".tmp", path)
    comm.Barrier()
    load_before = os.getloadavg()
    gc.collect()
    before = pss()
    t0 = time.perf_counter()
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=1)
    loader = solar.DataLoader(ds, batch_size=a.batch_size, sampler=sampler, buffer=0.5)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    next(it)
    second = time.perf_counter() - t0
    head = loader.solar_sampler._planner.config.head_steps
    for _ in range(2, head + 1):  # batches 2 .. head: the last is the first after the head
        next(it)
    after_head = time.perf_counter() - t0
    grown = pss() - before
    planner = type(loader.solar_sampler._planner).__name__
    mine = {"rank": comm.rank, "pss_growth_B_per_sample": grown / a.samples, "first_batch_s": first,
            "second_batch_s": second, "head_steps": head, "first_after_head_s": after_head,
            "planner": planner}
    everyone = comm.gather(mine)
    del it
    ds.close()
    if comm.rank == 0:
        from solar.fileio import write_text_atomic

        worst = max(r["pss_growth_B_per_sample"] for r in everyone)
        slowest = max(r["first_batch_s"] for r in everyone)
        out = {"config": vars(a), "ranks": everyone, "max_pss_growth_B_per_sample": worst,
               "max_first_batch_s": slowest, "max_second_batch_s": max(r["second_batch_s"] for r in everyone),
               "max_first_after_head_s": max(r["first_after_head_s"] for r in everyone),
               "load_average_before": load_before, "load_average": os.getloadavg()}
        print(f"{a.planner} ({planner}), N={a.samples}, {comm.size} ranks: PSS growth <= {worst:.1f} B/sample "
              f"per rank, first batch <= {slowest:.2f} s, second <= {out['max_second_batch_s']:.2f} s, first after the "
              f"head <= {out['max_first_after_head_s']:.2f} s (load average {os.getloadavg()[0]:.2f})")
        write_text_atomic(a.out, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
