"""``solar plan --rank R``: one rank's view of a sharded plan (NOTE [ Sharded planning ]).

Under ``mpirun`` with ``--world-size`` ranks every rank plans only its share (its private memory
O(N/P + C), the order once per node in a shared window, or none with ``--order feistel``) and
rank R prints. Without mpirun (or on one rank) every rank's share is planned in this process
(:func:`solar.exchange.run_together`: the same code, the exchanges replaced by their results),
so this process holds the whole job's state; the figures of rank R are still its own. Why every
share: rank R's plan of an epoch depends on every home's residency, which every rank's plan of
the epoch before changed. From ``SPILL_FROM`` samples on, each exchange round's records go to a
file in the temporary directory (``run_together(spill=)``) instead of memory, and the other
ranks' plans are dropped once counted: at N = 1e8, P = 4096 this process then needs some
``SPILL_BYTES`` per sample (bench/plan/scale.json) and as much free disk.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
import tracemalloc

import numpy as np

from solar.dist import collective_call, mpi_comm, private_comm
from solar.errors import ConfigError
from solar.exchange import run_mpi, run_together
from solar.nodeshare import NodeOrder
from solar.schedule import PlanConfig
from solar.shardplan import LocalOrder, RankPlan, ShardPlanner

__all__ = ["rank_view", "simulated_ranks", "spill_dir", "simulation_bytes", "SPILL_FROM"]

#: From this many samples on, the in-process simulation spills each exchange round to a file
SPILL_FROM = 1 << 22
#: Peak bytes of the in-process simulation per sample, and per simulated rank, with exchanges
#: spilled (bench/plan/scale.py: sim_peak_rss_bytes at N = 1e7 and 1e8, P = 4096)
SPILL_BYTES, SPILL_RANK_BYTES = 48, 320 << 10
#: Peak bytes per sample of the round files on disk (the largest round and the next one)
SPILL_DISK_BYTES = 56
#: Peak bytes per sample with the exchanges in memory (bench/plan/scale.py measured 200 at
#: N = 1e7, P = 4096)
SIM_BYTES = 250


def _plan_bytes(plan: RankPlan) -> int:
    return sum(a.nbytes for a in (plan.pos, plan.samples, plan.flags, plan.evict_step, plan.evict_sample,
                                  plan.release_sample, plan.release_step, plan.twins))


def _read_calls(plan: RankPlan) -> int:
    """Coalesced range reads of the rank's misses: runs of consecutive indices per step."""
    miss = (plan.flags & 1) == 0
    step, s = plan.pos[miss] // plan.global_batch, plan.samples[miss]
    o = np.lexsort((s, step))
    step, s = step[o], s[o]
    return int(len(s) and 1 + np.count_nonzero((step[1:] != step[:-1]) | (s[1:] > s[:-1] + 1)))


def _epochs_mpi(cfg: PlanConfig, epochs: int, comm):
    """Every rank plans its share; yields (plan, job-wide hits, rank CPU seconds, private bytes)."""
    pcomm = private_comm(comm)
    feistel = cfg.order == "feistel" and cfg.shuffle
    order = None if feistel else collective_call(NodeOrder, cfg, pcomm)
    planner = ShardPlanner(cfg, pcomm.rank, order, exchange=functools.partial(run_mpi, comm=pcomm))
    try:
        for e in range(epochs):
            t = time.process_time()
            plan = collective_call(planner.plan, e)
            seconds = time.process_time() - t
            yield plan, pcomm.allreduce(plan.hits), seconds, planner.nbytes() + _plan_bytes(plan)
    finally:
        if order is not None:
            collective_call(order.close)


def _epochs_here(cfg: PlanConfig, epochs: int, rank: int):
    """Every rank's share in this process; the same tuples for ``rank``."""
    order = LocalOrder(cfg) if not (cfg.order == "feistel" and cfg.shuffle) else None
    planners = [ShardPlanner(cfg, q, order) for q in range(cfg.world_size)]
    spill = spill_dir(cfg)
    for e in range(epochs):
        tracemalloc.start()
        plans, costs = run_together([p.plan_steps(e) for p in planners], measure=lambda q: q == rank, spill=spill)
        tracemalloc.stop()
        plan, hits = plans[rank], sum(p.hits for p in plans)
        del plans
        for p in planners:
            p.settle()  # nothing is rewound here: the other ranks' plans go now
        kept = planners[rank].nbytes() + _plan_bytes(plan)
        yield plan, hits, costs[rank].seconds, max(kept, costs[rank].peak_bytes)


def spill_dir(cfg: PlanConfig) -> str | None:
    """Where the in-process simulation spills its exchanges (None: in memory)."""
    return tempfile.gettempdir() if cfg.num_samples >= SPILL_FROM else None


def simulation_bytes(cfg: PlanConfig) -> tuple[int, int]:
    """(memory, disk) the in-process simulation of every rank's share needs at its peak."""
    n, P = cfg.num_samples, cfg.world_size
    if spill_dir(cfg) is None:
        return SIM_BYTES * n, 0
    return SPILL_BYTES * n + SPILL_RANK_BYTES * P, SPILL_DISK_BYTES * n


def simulated_ranks(world_size: int) -> int:
    """How many ranks' shares this process plans: one under an mpirun job of ``world_size``
    ranks, else all of them."""
    comm = mpi_comm()
    return 1 if comm is not None and comm.size > 1 and comm.size == world_size else world_size


def rank_view(args: argparse.Namespace, cfg: PlanConfig) -> dict | None:
    """Rank ``args.rank``'s report (None on the other ranks of an mpirun job)."""
    R, P = args.rank, cfg.world_size
    if not 0 <= R < P:
        raise ConfigError(f"--rank {R} is outside --world-size {P}")
    comm = mpi_comm()
    if comm is not None and comm.size > 1:
        if comm.size != P:
            raise ConfigError(f"under mpirun, --world-size must be the job's size ({comm.size}), got {P}")
        runs = _epochs_mpi(cfg, args.epochs, comm)
        me = comm.rank
    else:
        runs = _epochs_here(cfg, args.epochs, R)
        me = R
    epochs, seconds, private = [], [], 0
    for e, (plan, job_hits, cpu, nbytes) in enumerate(runs):
        seconds.append(cpu)
        private = max(private, nbytes)
        epochs.append({"epoch": e, "hit_rate": job_hits / cfg.epoch_length, "steps": plan.num_steps,
                       "rank_samples": len(plan.pos), "rank_hits": plan.hits, "rank_misses": len(plan.pos) - plan.hits,
                       "rank_read_calls": _read_calls(plan)})
    if me != R:
        return None
    later = [x["hit_rate"] for x in epochs[1:]]
    return {"rank": R, "hit_rate": sum(later) / len(later) if later else None, "bound": cfg.bound, "policy": "solar",
            "order": cfg.order, "samples": cfg.num_samples, "world_size": P, "batch_size": cfg.batch_size,
            "buffer": cfg.capacity, "seed": cfg.seed, "rank_private_bytes": private,
            "plan_seconds_per_epoch": max(seconds) if seconds else 0.0, "epochs": epochs}
