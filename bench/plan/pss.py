"""Per-rank memory and time to the first batch of ``solar.DataLoader`` under ``mpirun``.

Run: ``mpirun -n 4 .venv/bin/python bench/plan/pss.py [--samples 20000000] [--batch-size 32]
[--planner sharded|full] [--out bench/plan/pss.json]``

Every rank opens one file of ``--samples`` one-byte rows (written once, by rank 0, into
``--dir``), builds the loader with a ``DistributedSampler`` and ``buffer=0.5``, and takes the
batches up to the first one after the epoch's head, then ``--after`` more (``--step-ms`` of
sleep per step stands for the model's compute; 0 by default: the loader alone, the hardest case
for planning behind it).

Reported per rank: the growth of its proportional set size (PSS, from
``/proc/self/smaps_rollup``: memory a rank shares with others, such as the node's window of the
order, counts its share) from before the loader, in bytes per sample, at the second batch (the
issue's measure), 64 batches before the head's end (by then the whole plan is made, and the next
epoch's is not begun: what the plan keeps), and at most (read every 256 batches and after the
last one, while the next epoch's plan is being made ahead: a plan's working set); seconds to the first, the second and
the first batch after the head; and the longest wait for any one batch after the first, with
its step.

A sharded epoch not planned ahead hands out its head (an eighth of the epoch) in pieces while
the planning thread makes the whole plan (NOTE [ First steps ] in solar/schedule.py): a step
waits only where training outruns the planning. ``--planner full`` plans the whole plan on
every rank (``SOLAR_PLANNER=full``); ``sharded`` (the default under mpirun with parallel HDF5)
plans each rank's share (NOTE [ Sharded planning ] in solar/shardplan.py). Rank 0 writes the
JSON.
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
    ap.add_argument("--after", type=int, default=64, help="batches taken after the first one after the head")
    ap.add_argument("--step-ms", type=float, default=0.0, help="sleep per step (the model's compute)")
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
    head = loader.solar_sampler._planner.config.head_steps
    stamps = [first]
    at_second = most = planned = 0
    for k in range(1, head + 1 + a.after):  # batch `head` is the first after the head
        time.sleep(a.step_ms / 1e3)
        next(it)
        stamps.append(time.perf_counter() - t0)
        if k == 1 or k % 256 == 0 or k == max(2, head - 64):
            now = pss() - before
            most = max(most, now)
            at_second = at_second or now
            planned = now if k == max(2, head - 64) else planned
    waits = np.diff(stamps) - a.step_ms / 1e3
    worst_at = int(np.argmax(waits)) + 1
    second, after_head = stamps[1], stamps[head]
    grown = max(most, pss() - before)
    planner = type(loader.solar_sampler._planner).__name__
    mine = {"rank": comm.rank, "pss_growth_B_per_sample": at_second / a.samples,
            "most_pss_growth_B_per_sample": grown / a.samples, "planned_pss_growth_B_per_sample": planned / a.samples,
            "first_batch_s": first,
            "second_batch_s": second, "head_steps": head, "first_after_head_s": after_head,
            "longest_wait_s": float(waits[worst_at - 1]), "longest_wait_step": worst_at,
            "steps_per_s": len(waits) / (stamps[-1] - first), "planner": planner}
    everyone = comm.gather(mine)
    del it
    ds.close()
    if comm.rank == 0:
        from solar.fileio import write_text_atomic

        worst = max(r["pss_growth_B_per_sample"] for r in everyone)
        most = max(r["most_pss_growth_B_per_sample"] for r in everyone)
        slowest = max(r["first_batch_s"] for r in everyone)
        out = {"config": vars(a), "ranks": everyone, "max_pss_growth_B_per_sample": worst,
               "max_most_pss_growth_B_per_sample": most,
               "max_planned_pss_growth_B_per_sample": max(r["planned_pss_growth_B_per_sample"] for r in everyone),
               "max_first_batch_s": slowest, "max_second_batch_s": max(r["second_batch_s"] for r in everyone),
               "max_first_after_head_s": max(r["first_after_head_s"] for r in everyone),
               "max_longest_wait_s": max(r["longest_wait_s"] for r in everyone),
               "load_average_before": load_before, "load_average": os.getloadavg()}
        print(f"{a.planner} ({planner}), N={a.samples}, {comm.size} ranks: PSS growth <= {worst:.1f} B/sample "
              f"per rank at the second batch, {out['max_planned_pss_growth_B_per_sample']:.1f} with the plan made, "
              f"{most:.1f} at most, first batch <= {slowest:.2f} s, "
              f"second <= {out['max_second_batch_s']:.2f} s, first after the "
              f"head <= {out['max_first_after_head_s']:.2f} s (step {head}), longest wait for one batch "
              f"<= {out['max_longest_wait_s']:.2f} s (load average {os.getloadavg()[0]:.2f})")
        write_text_atomic(a.out, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
