"""Sharded planning (NOTE [ Sharded planning ] in solar/shardplan.py): every rank's share, made
with O(N/P + C) per rank and all-to-all exchanges, is the Planner's plan for that rank, bit for bit.

The ranks run in one process (solar.exchange.run_together: the same code, each exchange replaced
by what it delivers); tests/test_scale_mpi.py runs them under mpirun."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solar import exchange
from solar.errors import ConfigError
from solar.exchange import run_together
from solar.nodeshare import NODE_RANKS_ENV
from solar.order import global_order, permutation_into
from solar.permute import FeistelOrder
from solar.schedule import PlanConfig, Planner
from solar.shardplan import LocalOrder, ShardPlanner
from test_schedule import configs, make_config



def shard_planners(c: PlanConfig) -> list[ShardPlanner]:
    order = LocalOrder(c)  # one copy for every simulated rank, as one node's window
    return [ShardPlanner(c, q, order) for q in range(c.world_size)]


def plan_all(planners, epoch, start=0):
    plans, _ = run_together([p.plan_steps(epoch, start) for p in planners])
    return plans


def assert_same(ref_plan, ref: Planner, plans, planners):
    P = ref_plan.world_size
    twins = ref_plan.twin_steps()
    for q in range(P):
        mine = plans[q]
        assert mine.num_steps == ref_plan.num_steps
        want, got = ref_plan.rank_steps(q), mine.rank_steps(q)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], f"rank {q}: batches differ"
        want_a, got_a = ref_plan.rank_actions(q), mine.rank_actions(q)
        assert [(sorted(k.tolist()), sorted(e.tolist())) for k, e in got_a] == \
            [(sorted(k.tolist()), sorted(e.tolist())) for k, e in want_a], f"rank {q}: buffer actions differ"
        assert mine.twin_steps().tolist() == twins.tolist()
        everything = np.arange(ref.config.num_samples)
        assert np.array_equal(planners[q].holds(everything, q), ref.holds(everything, q)), f"rank {q}: residency"
    assert sum(p.hits for p in plans) == int(ref_plan.hit.sum())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 3))
def test_every_rank_gets_the_planners_plan_for_it(cfg, epoch0):
    c = make_config(*cfg)
    ref, planners = Planner(c), shard_planners(c)
    for e in range(epoch0, epoch0 + 3):
        want = ref.plan(e)
        assert_same(want, ref, plan_all(planners, e), planners)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 2), st.floats(0, 1), st.booleans())
def test_resume_and_rewind_match_the_planner(cfg, stop_epoch, where, resume):
    """A resumed epoch (start > 0, a tail evened out for another world size) and an early stop
    rewound on every rank leave each rank with the Planner's plans and residency."""
    c = make_config(*cfg)
    ref, planners = Planner(c), shard_planners(c)
    for e in range(stop_epoch):
        assert_same(ref.plan(e), ref, plan_all(planners, e), planners)
    start = round(where * c.epoch_length) if resume else 0
    want = ref.plan(stop_epoch, start)
    plans = plan_all(planners, stop_epoch, start)
    assert_same(want, ref, plans, planners)
    s = round(where * want.num_steps)
    ref.rewind(want, s)
    run_together([p.rewind_steps(plan, s) for p, plan in zip(planners, plans)])
    for q in range(c.world_size):
        everything = np.arange(c.num_samples)
        assert np.array_equal(planners[q].holds(everything, q), ref.holds(everything, q))
    for e in range(stop_epoch + 1, stop_epoch + 3):
        assert_same(ref.plan(e), ref, plan_all(planners, e), planners)


@pytest.mark.parametrize("n,P,b,frac", [(20_000, 16, 8, 0.5), (9_973, 7, 5, 0.3), (12_000, 64, 16, 0.5)])
def test_larger_plans_match_and_reach_the_bound(n, P, b, frac):
    c = PlanConfig(n, P, b, int(frac * n / P), seed=11)
    ref, planners = Planner(c), shard_planners(c)
    rates = []
    for e in range(3):
        want = ref.plan(e)
        plans = plan_all(planners, e)
        assert_same(want, ref, plans, planners)
        rates.append(sum(p.hits for p in plans) / want.hit.size)
    assert min(rates[1:]) >= 0.97 * c.bound


def assert_head(heads, plans, ref_plan):
    """Each rank's head (NOTE [ First steps ] in solar/schedule.py) is its plan's first steps:
    batches, buffer actions and twins; the rebalancing evicts and releases nothing there."""
    k = heads[0].num_steps
    for q, (head, plan) in enumerate(zip(heads, plans)):
        assert head.num_steps == k and head.twin_steps().tolist() == plan.twin_steps().tolist()
        assert [a.tolist() for a in head.rank_steps(q)] == [a.tolist() for a in plan.rank_steps(q)[:k]]
        assert [(sorted(a.tolist()), sorted(e.tolist())) for a, e in head.rank_actions(q)] == \
            [(sorted(a.tolist()), sorted(e.tolist())) for a, e in plan.rank_actions(q)[:k]], f"rank {q}"
    assert (ref_plan.evict_step >= k).all() and (ref_plan.release_step >= k).all()


@pytest.mark.parametrize("n,P,b,frac,bound", [(20_000, 16, 8, 0.5, True), (9_973, 7, 5, 0.3, True),
                                              (4_000, 4, 1, 0.25, False)])  # (b = 1 overflows, head or not)
def test_the_head_of_an_epoch_is_its_plans_first_steps_and_changes_nothing(n, P, b, frac, bound):
    """``plan_head`` gives every rank the first ``head_steps`` of the epoch's plan (fresh,
    planned after other epochs, resumed, after a rewind), and the plans made after it are the
    Planner's, with evictions (the rebalancing still runs) and hits at the bound."""
    c = PlanConfig(n, P, b, int(frac * n / P), seed=11)
    ref, planners = Planner(c), shard_planners(c)
    evicted, rates, want, plans = 0, [], None, []
    for e, start in ((0, 0), (1, 0), (2, 0), (3, c.epoch_length // 3), (4, 0)):
        if e == 4:  # after a rewind
            ref.rewind(want, 7)
            run_together([p.rewind_steps(plan, 7) for p, plan in zip(planners, plans)])
        heads, _ = run_together([p.plan_head(e, start) for p in planners])
        assert heads[0].num_steps == c.head_steps > 0
        want = ref.plan(e, start)
        plans = plan_all(planners, e, start)
        assert_same(want, ref, plans, planners)
        assert_head(heads, plans, want)
        evicted += len(want.evict_sample) + len(want.release_sample)
        rates.append(want.hit_rate)
    assert evicted > 0 and (min(rates[1:3]) >= 0.97 * c.bound or not bound)


def test_an_epoch_of_few_steps_has_no_head():
    c = PlanConfig(100, 2, 5, 10)  # 10 steps: a head of an eighth would be one step; none below 8 steps x 3
    assert c.head_steps == 1
    c = PlanConfig(60, 2, 5, 10)  # 6 steps
    assert c.head_steps == 0
    assert run_together([p.plan_head(0) for p in shard_planners(c)])[0] == [None, None]


@pytest.mark.parametrize("chunk", [1, 4096, 1 << 30])
def test_exchanges_spilled_to_files_deliver_the_same_records(tmp_path, monkeypatch, chunk):
    """run_together(spill=): each round's posts in a file, read back ``chunk`` bytes of records
    at a time (at least one destination each): the Planner's plans, over a rewind too."""
    monkeypatch.setattr(exchange, "SPILL_CHUNK", chunk)
    c = PlanConfig(9_973, 16, 4, 9_973 // 3 // 16, seed=5)
    ref, planners = Planner(c), shard_planners(c)
    for e in range(3):
        want = ref.plan(e)
        plans, _ = run_together([p.plan_steps(e) for p in planners], spill=str(tmp_path))
        assert_same(want, ref, plans, planners)
    ref.rewind(want, 3)
    run_together([p.rewind_steps(plan, 3) for p, plan in zip(planners, plans)], spill=str(tmp_path))
    assert_same(ref.plan(3), ref, plan_all(planners, 3), planners)
    assert list(tmp_path.iterdir()) == []  # every round's file is gone


def test_ranks_out_of_step_are_reported(tmp_path):
    def one(q):
        yield exchange.Post(np.zeros((1, 1), np.int32), np.eye(2, dtype=np.int64)[q])
        if q == 0:
            yield exchange.Post(np.zeros((0, 1), np.int32), np.zeros(2, np.int64))

    for spill in (None, str(tmp_path)):
        with pytest.raises(RuntimeError, match="out of step"):
            run_together([one(0), one(1)], spill=spill)


def test_each_rank_plans_a_share_and_holds_only_its_homes():
    """Private state is O(N/P + C): a rank's homes, its held set and its own positions."""
    n, P, b = 40_000, 32, 8
    c = PlanConfig(n, P, b, n // 2 // P, seed=2)
    planners = shard_planners(c)
    for e in range(2):
        plans = plan_all(planners, e)
    for q in (0, P - 1):
        assert planners[q].nbytes() <= 6 * (-(-n // P)) + planners[q].dtype(0).nbytes * c.capacity
        assert len(plans[q].pos) == c.epoch_length // P


def test_a_plan_is_one_ranks_share_only():
    c = PlanConfig(100, 2, 5, 10)
    planners = shard_planners(c)
    plans = plan_all(planners, 0)
    with pytest.raises(ConfigError, match="rank 0's share"):
        plans[0].rank_steps(1)
    with pytest.raises(ConfigError, match="no exchange"):
        planners[0].plan(1)
    run_together([p.rewind_steps(plan, 1) for p, plan in zip(planners, plans)])
    with pytest.raises(ConfigError, match="only the last plan"):
        next(planners[0].rewind_steps(plans[0], 1))


@pytest.mark.parametrize("n,shuffle", [(1, True), (1000, True), (3 << 20, False), ((1 << 20) + 7, True)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_permutation_written_in_place_is_distributed_samplers(n, shuffle, dtype):
    out = permutation_into(np.empty(n, dtype), 5, 3, shuffle)
    assert np.array_equal(out, global_order(n, 1, 5, 3, shuffle))


SCALE_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_job.py")


def _scale_job(monkeypatch, point: str):
    """``mpirun -n 4 tests/scale_job.py`` on two "nodes", launched, timed out and cleaned up as
    tests/test_failfast.py does its jobs."""
    import test_failfast

    monkeypatch.setattr(test_failfast, "JOB", SCALE_JOB)
    monkeypatch.setenv(NODE_RANKS_ENV, "2")
    return test_failfast.run_job("-", point, 4, 3)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("point,says", [("raise", "injected failure on rank 3 before planning epoch 1"),
                                        ("exit", "rank 3 has ended"), ("kill", "rank 3")])
def test_a_rank_dying_between_plans_aborts_the_job_naming_it(monkeypatch, point, says):
    """Four ranks on two "nodes" (NOTE [ One order per node ]): a rank that dies while the others
    wait in a planning exchange or a window's barrier ends the job, never hangs it."""
    res = _scale_job(monkeypatch, point)
    assert res.returncode != 0, f"{point}: the job ended with 0\n{res.stderr[-3000:]}"
    assert says in res.stderr, f"{point}: stderr lacks {says!r}\n{res.stderr[-4000:]}"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_a_sharded_job_on_two_nodes_ends_cleanly(monkeypatch):
    res = _scale_job(monkeypatch, "none")
    assert res.returncode == 0 and res.stdout.count("done") == 4, res.stderr[-3000:]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_the_sharded_loader_on_four_ranks_and_two_nodes():
    """tests/test_scale_loader_mpi.py under ``mpirun -n 4`` on two "nodes" (SOLAR_NODE_RANKS=2):
    every step's union over the ranks is DistributedSampler's global batch, the buffers serve the
    planned hits, and both nodes' windows hold torch's order (the MPI suite runs on 2 and 3)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, NODE_RANKS_ENV: "2", "SOLAR_EXPECT_WORLD": "4", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    res = subprocess.run(["mpirun", "-n", "4", "--bind-to", "none", "bash", "scripts/mpi-pytest.sh", "-m", "mpi", "-q",
                          "tests/test_scale_loader_mpi.py"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-4000:] + res.stderr[-3000:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 2))
def test_the_feistel_order_plans_alike_with_no_order_materialized(cfg, epoch0):
    """NOTE [ Feistel order ]: ShardPlanner reads it position by position (no LocalOrder, no
    window) and gets the Planner's plan of the same order."""
    c = PlanConfig(**{**make_config(*cfg).__dict__, "order": "feistel"})
    ref = Planner(c)
    planners = [ShardPlanner(c, q) for q in range(c.world_size)]
    assert all(isinstance(p.order, FeistelOrder) for p in planners) or not c.shuffle
    for e in range(epoch0, epoch0 + 2):
        assert_same(ref.plan(e), ref, plan_all(planners, e), planners)


def test_the_feistel_order_is_a_padded_permutation_but_not_torchs():
    n, P = 1003, 4
    c = PlanConfig(n, P, 5, 0, seed=3, order="feistel")
    order = Planner(c).order(2)
    assert np.array_equal(np.sort(order[:n]), np.arange(n))
    assert order[n:].tolist() == order[:len(order) - n].tolist()  # DistributedSampler's padding
    assert not np.array_equal(order, global_order(n, P, 3, 2))
    f = FeistelOrder(n, 3)
    assert np.array_equal(f.position_of(2, f.perm(2)), np.arange(n))
    with pytest.raises(ConfigError, match="'torch' or 'feistel'"):
        PlanConfig(n, P, 5, 0, order="random")
