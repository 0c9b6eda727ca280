"""Sharded planning under a real ``mpirun`` (NOTE [ Sharded planning ] in solar/shardplan.py):
each rank plans its share over SOLAR's private communicator, reading the order from its node's
shared window (NOTE [ One order per node ] in solar/nodeshare.py), and gets the Planner's plan
for it. Run with ``SOLAR_NODE_RANKS=2`` on 4 ranks, the job has two "nodes", two windows."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

from solar.dist import collective_call, private_comm
from solar.exchange import run_mpi
from solar.nodeshare import NODE_RANKS_ENV, NodeOrder
from solar.order import global_order
from solar.schedule import PlanConfig, Planner
from solar.shardplan import ShardPlanner


def _planner(comm, c: PlanConfig) -> ShardPlanner:
    pcomm = private_comm(comm)
    order = collective_call(NodeOrder, c, pcomm)
    return ShardPlanner(c, pcomm.rank, order, exchange=functools.partial(run_mpi, comm=pcomm))


@pytest.mark.mpi
@pytest.mark.parametrize("n,b,frac,shuffle", [(997, 4, 0.5, True), (1200, 8, 0.9, True), (500, 3, 0.3, False)])
def test_each_rank_plans_its_share_from_its_nodes_window(comm, monkeypatch, n, b, frac, shuffle):
    monkeypatch.setenv(NODE_RANKS_ENV, "2")
    P, q = comm.size, comm.rank
    c = PlanConfig(n, P, b, int(frac * n / P), seed=3, shuffle=shuffle)
    planner, ref = _planner(comm, c), Planner(c)
    order = planner.order
    leaders = set(comm.allgather(comm.rank - order.node.rank))
    assert order.node.size == (2 if q < P - P % 2 else 1) and len(leaders) == -(-P // 2)
    hits = 0
    for e in range(3):
        plan = collective_call(planner.plan, e)
        want = ref.plan(e)
        # both nodes' windows hold DistributedSampler's order of the epochs a plan reads
        digests = comm.allgather([zlib.crc32(order.slots[order.epochs.index(x)].tobytes()) for x in (e, e + 1)])
        assert all(d == [zlib.crc32(global_order(n, 1, 3, x, shuffle).tobytes()) for x in (e, e + 1)]
                   for d in digests)
        assert [s.tolist() for s in plan.rank_steps(q)] == [s.tolist() for s in want.rank_steps(q)]
        assert [(k.tolist(), v.tolist()) for k, v in plan.rank_actions(q)] == \
            [(k.tolist(), v.tolist()) for k, v in want.rank_actions(q)]
        assert np.array_equal(planner.holds(np.arange(n), q), ref.holds(np.arange(n), q))
        # every step's union over the ranks is DistributedSampler's global batch
        steps = comm.allgather([s.tolist() for s in plan.rank_steps(q)])
        torch_order = global_order(n, P, 3, e, shuffle)
        G = P * b
        for k in range(plan.num_steps):
            got = sorted(x for r in range(P) for x in steps[r][k])
            assert got == sorted(torch_order[k * G:(k + 1) * G].tolist()), f"epoch {e} step {k}"
        hits += comm.allreduce(plan.hits)
        assert comm.allreduce(plan.hits) == int(want.hit.sum())
    collective_call(planner.rewind, plan, 1)
    ref.rewind(want, 1)
    assert np.array_equal(planner.holds(np.arange(n), q), ref.holds(np.arange(n), q))
    again = collective_call(planner.plan, 3)
    assert [s.tolist() for s in again.rank_steps(q)] == [s.tolist() for s in ref.plan(3).rank_steps(q)]
    collective_call(order.close)



@pytest.mark.mpi
def test_solar_plan_for_one_rank_plans_each_share_on_its_own_rank(comm, capsys):
    """``mpirun -n P solar plan --world-size P --rank R``: every rank plans its share, rank R
    prints its view, which is its part of the Planner's plan."""
    import json

    from solar.cli import main

    P, R, n = comm.size, comm.size - 1, 997
    C = n // 2 // P
    rc = main(["plan", "--samples", str(n), "--epochs", "3", "--world-size", str(P), "--batch-size", "4",
               "--buffer", str(C), "--seed", "2", "--json", "--rank", str(R)])
    out = capsys.readouterr().out
    assert rc == 0
    if comm.rank != R:
        assert out == ""
        return
    view = json.loads(out)
    planner = Planner(PlanConfig(n, P, 4, C, seed=2))
    for e in view["epochs"]:
        plan = planner.plan(e["epoch"])
        mine = plan.rank == R
        assert (e["rank_samples"], e["rank_hits"]) == (int(mine.sum()), int(plan.hit[mine].sum()))
        assert e["hit_rate"] == pytest.approx(plan.hit_rate)
