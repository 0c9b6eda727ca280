"""Per-rank planning cost at scale: sharded planning (solar/shardplan.py) beside the Planner and torch.

Run: ``.venv/bin/python bench/plan/scale.py [--samples 1000000 3000000 10000000] [--world-size 4096]
[--ranks-per-node 8] [--batch-size 32] [--epochs 3] [--out bench/plan/scale.json]``

The simulation holds every rank's state in one process, but not every exchange: each round's
records go to a file in ``--spill`` (default: the temporary directory) as the ranks post them,
and come back a few destinations at a time (``run_together(spill=)``). So N = 1e8 at P = 4096
(``--samples 100000000``) fits in 5.2 GiB here (with ``MALLOC_MMAP_THRESHOLD_=131072``, so that
freed arrays go back to the system), with at most 5.5 GB of round files on disk at once; a rank
of a real job holds only its own share. ``sim_peak_rss_bytes`` is this process's peak (all
simulated ranks together), for the record.

What it simulates: a job of ``P`` ranks, ``--ranks-per-node`` per node, buffer 50% (``C = N/2P``).
Every rank's planner runs in this process with :func:`solar.exchange.run_together`: the same
code a rank runs under MPI, each ``Alltoallv`` replaced by the records it would deliver (the
transfer itself is not timed). Measured for one node's ranks (0 .. ranks-per-node - 1) and a
sample of other ranks (every ``P/8``-th and the last):

``private``
    the rank's planner state between epochs (its homes, its held set) plus its plan, and the
    most its code held at once during one exchange step (tracemalloc, with the records
    delivered to it): bytes, and bytes per sample of the dataset.
``seconds``
    CPU time inside the rank's code per epoch (``time.process_time``). Rank 0 is resumed first
    after each simulated exchange, and pays more than the others for the allocator's handling
    of the exchange's buffers in this one process (a rank of a real job has its own).
``node``
    the node's shared memory (the permutation of the epochs a plan reads: two, as int32 below
    2**31 samples) and the CPU time to generate one epoch's permutation (``torch.randperm``,
    made once per node per epoch: by one of the node's ranks in turn, so each pays it every
    ``ranks-per-node``-th epoch).
``hit rate``
    over all ranks, epochs >= 2, against the bound ``min(1, P*C/N)``.
``torch``
    ``DistributedSampler``'s per-rank cost (``bench/plan/memory.py --side torch``: peak bytes
    per sample and seconds per epoch), where it fits this machine (``--torch-max``); it is O(N)
    on every rank.
``planner``
    the Planner's (every rank plans everything) from bench/plan/memory.json's method, where it
    fits (``--planner-max``).

Writes JSON; prints one line per size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

from solar.exchange import run_together
from solar.fileio import write_text_atomic
from solar.schedule import PlanConfig
from solar.shardplan import LocalOrder, ShardPlanner

HERE = os.path.dirname(os.path.abspath(__file__))


def plan_bytes(plan) -> int:
    return sum(a.nbytes for a in (plan.pos, plan.samples, plan.flags, plan.evict_step, plan.evict_sample,
                                  plan.release_sample, plan.release_step, plan.twins))


def simulate(n: int, P: int, per_node: int, b: int, epochs: int, spill: str | None = None) -> dict:
    c = PlanConfig(n, P, b, n // 2 // P, seed=1, long_head=True)  # as the sampler plans sharded
    order = LocalOrder(c)
    planners = [ShardPlanner(c, q, order) for q in range(P)]
    watched = sorted(set(range(min(per_node, P))) | set(range(0, P, max(1, P // 8))) | {P - 1})
    per_rank = {q: {"seconds": [], "private_bytes": []} for q in watched}
    rates, order_s = [], []
    for e in range(epochs):
        for ep in (e, e + 1):  # the node's window: made before the ranks read it
            t = time.process_time()
            order.perm(ep)
            if ep == e + 1 or e == 0:
                order_s.append(time.process_time() - t)
        kept = {q: planners[q].nbytes() for q in watched}
        tracemalloc.start()
        plans, costs = run_together([p.plan_steps(e) for p in planners], measure=lambda q: q in per_rank,
                                    spill=spill)
        tracemalloc.stop()
        rates.append(sum(p.hits for p in plans) / c.epoch_length)
        for p in planners:
            p.settle()  # no rewind here: the plans of the ranks not watched go now
        for q in watched:
            per_rank[q]["seconds"].append(costs[q].seconds)
            after = planners[q].nbytes() + plan_bytes(plans[q])
            per_rank[q]["private_bytes"].append(max(after, kept[q] + plan_bytes(plans[q]) + costs[q].peak_bytes))
        del plans
    window = 2 * n * np.dtype(planners[0].dtype).itemsize
    later = rates[1:]
    worst = max(watched, key=lambda q: max(per_rank[q]["private_bytes"]))
    slowest = max(watched, key=lambda q: max(per_rank[q]["seconds"]))
    return {
        "config": {"samples": n, "world_size": P, "ranks_per_node": per_node, "batch_size": b,
                   "capacity": c.capacity, "epochs": epochs},
        "ranks": {str(q): v for q, v in per_rank.items()},
        "max_private_bytes": max(per_rank[worst]["private_bytes"]),
        "max_private_B_per_sample": max(per_rank[worst]["private_bytes"]) / n,
        "max_seconds_per_epoch": max(per_rank[slowest]["seconds"]),
        "median_seconds_per_epoch": float(np.median([s for v in per_rank.values() for s in v["seconds"]])),
        "node": {"shared_bytes": window, "shared_B_per_sample": window / n,
                 "order_seconds_per_epoch": order_s,
                 "order_seconds_per_rank_per_epoch": max(order_s) / per_node},
        "hit_rate": rates, "hit_rate_epochs_2_on": sum(later) / len(later) if later else None,
        "bound": c.bound, "hit_rate_over_bound": (min(later) / c.bound) if later and c.bound else None,
        "sim_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "exchanges": "spilled to files" if spill else "in memory",
    }


def side(name: str, n: int, P: int, b: int) -> dict:
    """bench/plan/memory.py's measurement of one side (``torch`` or ``solar``) in a fresh process."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "memory.py"), "--side", name, "--samples", str(n),
                          "--world-size", str(P), "--batch-size", str(b)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    ap.add_argument("--world-size", type=int, default=4096)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--torch-max", type=int, default=10_000_000, help="largest N to run DistributedSampler at")
    ap.add_argument("--planner-max", type=int, default=10_000_000, help="largest N to run the Planner at")
    ap.add_argument("--out", default=os.path.join(HERE, "scale.json"))
    ap.add_argument("--spill", default=tempfile.gettempdir(),
                    help="directory for each exchange round's records ('' keeps them in memory)")
    a = ap.parse_args()
    # the other sides first, for every size: a child process inherits this one's peak RSS
    # (ru_maxrss) on Linux, which the simulation raises
    sides: dict[int, dict] = {n: {} for n in a.samples}
    for n in a.samples:
        if n <= a.torch_max:
            sides[n]["torch"] = side("torch", n, a.world_size, a.batch_size)
        if n <= a.planner_max:
            sides[n]["planner"] = side("solar", n, a.world_size, a.batch_size)
    runs = []
    for n in a.samples:
        r = simulate(n, a.world_size, a.ranks_per_node, a.batch_size, a.epochs, a.spill or None)
        r.update(sides[n])
        r["load_average"] = os.getloadavg()
        runs.append(r)
        t = r.get("torch")
        print(f"N={n:.0e} P={a.world_size}: private <= {r['max_private_bytes'] / 2**20:.1f} MiB/rank "
              f"({r['max_private_B_per_sample']:.3f} B/sample), plan <= {r['max_seconds_per_epoch']:.3f} s/epoch/rank "
              f"(median {r['median_seconds_per_epoch']:.4f}), "
              f"node window {r['node']['shared_B_per_sample']:.0f} B/sample, order "
              f"{r['node']['order_seconds_per_rank_per_epoch']:.3f} s/epoch/rank; hit rate "
              f"{r['hit_rate_epochs_2_on']:.4f} vs bound {r['bound']:.4f}"
              + (f"; torch {t['peak_B_per_sample']:.1f} B/sample, {max(t['seconds_per_epoch']):.2f} s/epoch"
                 if t else ""), flush=True)
    write_text_atomic(a.out, json.dumps({"machine": os.uname().machine, "runs": runs}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
