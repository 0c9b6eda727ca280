"""Invariants of the SOLAR schedule (solar/schedule.py), checked against torch's DistributedSampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from solar.errors import ConfigError
from solar.schedule import (PlanConfig, Planner, capacity_for_bytes, global_order, index_dtype, owner_of,
                            sampler_num_samples)
from solar.testing.baselines import BaselinePlanner, make_planner
from solar.testing.plans import PlanViolation, check_dump


def torch_global_batches(n, P, b, seed, epoch, shuffle, drop_last, drop_last_batch):
    """Global mini-batches as torch forms them: rank r's k-th DataLoader batch of DistributedSampler."""
    per = []
    for r in range(P):
        s = DistributedSampler(range(n), num_replicas=P, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        per.append(list(s))
    m = len(per[0])
    steps = m // b if drop_last_batch else -(-m // b)
    return [sorted(x for r in range(P) for x in per[r][k * b:(k + 1) * b]) for k in range(steps)]


def replay_buffers(plan, kept, capacity, steps=None):
    """What each rank's buffer does at run time: per step, hits must be held; then it evicts and
    keeps what the plan says; it may never hold more than ``capacity`` samples. ``steps``: only
    the first ``steps`` steps (an iteration stopped early)."""
    actions = [plan.rank_actions(r) for r in range(plan.world_size)]
    for k in range(plan.num_steps if steps is None else steps):
        sl = plan.step_slice(k)
        for r in range(plan.world_size):
            mine = plan.rank[sl] == r
            for sample in plan.samples[sl][mine & plan.hit[sl]].tolist():
                assert sample in kept[r], f"step {k} rank {r}: planned hit {sample} is not in the buffer"
            keep, evict = actions[r][k]
            kept[r] -= set(evict.tolist())
            kept[r] |= set(keep.tolist())
            assert len(kept[r]) <= capacity, f"step {k} rank {r}: {len(kept[r])} samples kept > {capacity}"


configs = st.builds(
    lambda n, P, b, frac, seed, shuffle, dl, dlb: (n, P, b, frac, seed, shuffle, dl, dlb),
    st.integers(1, 160), st.integers(1, 6), st.integers(1, 9), st.floats(0, 1), st.integers(0, 2**31),
    st.booleans(), st.booleans(), st.booleans())


def make_config(n, P, b, frac, seed, shuffle, dl, dlb, policy="solar"):
    if dl and n < P:
        dl = False
    per = sampler_num_samples(n, P, dl)
    b = max(1, min(b, per))
    C = int(frac * n / P)
    return PlanConfig(n, P, b, C, seed, shuffle, dl, dlb, policy)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.sampled_from(["solar", "solar", "lru", "fifo"]))
def test_plan_keeps_torch_global_batches_balances_ranks_and_only_claims_valid_hits(cfg, policy):
    c = make_config(*cfg, policy=policy)
    planner = make_planner(c)
    dump = {"epochs": []}
    kept = [set() for _ in range(c.world_size)]
    for e in range(3):
        plan = planner.plan(e)
        want = torch_global_batches(c.num_samples, c.world_size, c.batch_size, c.seed, e, c.shuffle, c.drop_last,
                                    c.drop_last_batch)
        batches = [plan.rank_steps(r) for r in range(c.world_size)]
        assert plan.num_steps == len(want) == c.steps_per_epoch()
        for k, g in enumerate(want):
            sizes = {len(batches[r][k]) for r in range(c.world_size)}
            assert len(sizes) == 1, f"step {k}: unequal per-rank sizes {sizes}"
            if k < len(want) - 1:
                assert sizes == {c.batch_size}
            assert sorted(np.concatenate([batches[r][k] for r in range(c.world_size)]).tolist()) == g
        dump["epochs"].append(plan.to_dump())
        if policy == "solar":
            replay_buffers(plan, kept, c.capacity)
    stats = check_dump(dump, c.capacity, c.batch_size)
    assert stats["max_kept"] <= c.capacity
    if c.capacity == 0:
        assert stats["hits"] == 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 2), st.floats(0, 1))
def test_rewind_leaves_exactly_the_residency_of_the_executed_steps(cfg, stop_epoch, where):
    """An iteration stopped after ``s`` steps: the rewound planner believes each rank holds what
    its buffer holds after those steps (the run-time model), and later epochs plan only hits that
    are really held."""
    c = make_config(*cfg)
    planner = Planner(c)
    kept = [set() for _ in range(c.world_size)]

    owned0 = np.bincount(planner.owners(np.arange(c.num_samples)) + 1, minlength=c.world_size + 1)

    def held():
        owners = planner.owners(np.arange(c.num_samples))
        # rebalancing swaps ownership one for one: each rank owns as many samples as at the start
        assert np.array_equal(np.bincount(owners + 1, minlength=c.world_size + 1), owned0)
        return [set(np.flatnonzero(planner._resident & (owners == r)).tolist()) for r in range(c.world_size)]

    for e in range(stop_epoch):
        replay_buffers(planner.plan(e), kept, c.capacity)
        assert held() == kept
    plan = planner.plan(stop_epoch)
    s = round(where * plan.num_steps)
    replay_buffers(plan, kept, c.capacity, steps=s)
    planner.rewind(plan, s)
    assert held() == kept
    for e in range(stop_epoch + 1, stop_epoch + 3):
        replay_buffers(planner.plan(e), kept, c.capacity)
        assert held() == kept


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 2))
def test_twin_steps_find_every_pass_that_reads_a_sample_twice(cfg, epoch):
    """A pass over steps k0..k1 may be read collectively only if no sample occurs twice in it."""
    c = make_config(*cfg)
    plan = Planner(c).plan(epoch)
    twin = plan.twin_steps()
    steps = [plan.samples[plan.step_slice(k)].tolist() for k in range(plan.num_steps)]
    for k0 in range(plan.num_steps):
        for k1 in range(k0, min(plan.num_steps, k0 + 4)):
            flat = [i for k in range(k0, k1 + 1) for i in steps[k]]
            assert (len(set(flat)) < len(flat)) == (twin[k0:k1 + 1].max() >= k0), (k0, k1)


def _twin_steps_by_full_sort(samples, G, num_steps):
    """The former twin_steps: a stable argsort of the whole epoch."""
    out = np.full(num_steps, -1, dtype=np.int64)
    order = np.argsort(samples, kind="stable")
    same = np.flatnonzero(samples[order][1:] == samples[order][:-1])
    if len(same):
        np.maximum.at(out, order[same + 1] // G, order[same] // G)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=120), st.integers(1, 9))
def test_twin_steps_equal_the_full_sort(samples, G):
    """twin_steps sorts only the positions of repeated samples (any number of repeats)."""
    from types import SimpleNamespace

    from solar.schedule import EpochPlan

    a = np.asarray(samples, dtype=np.int32)
    k = -(-len(a) // G)
    got = EpochPlan.twin_steps(SimpleNamespace(samples=a, global_batch=G, num_steps=k))
    assert np.array_equal(got, _twin_steps_by_full_sort(a, G, k))


def test_rewind_lets_epochs_cut_short_fill_the_buffer():
    """Every epoch stopped after a quarter of its steps: each quarter adds its reads to the
    buffer, so the hit rate climbs towards the bound P*C/N (before rewinding existed, the
    buffer started empty every epoch: no hits at all)."""
    n, P, b, C = 4096, 4, 16, 512
    planner = Planner(PlanConfig(n, P, b, C, seed=1))
    rates = []
    for e in range(10):
        plan = planner.plan(e)
        s = plan.num_steps // 4
        rates.append(float(plan.hit[:s * plan.global_batch].mean()))
        planner.rewind(plan, s)
    assert rates[0] == 0 and all(b > a for a, b in zip(rates[:7], rates[1:7]))
    assert rates[-1] > 0.85 * P * C / n


def test_pinned_policy_reaches_the_bound_and_beats_the_baselines():
    n, P, b = 8192, 8, 32
    for frac in (0.1, 0.25, 0.5):
        C = int(frac * n / P)
        rates = {}
        for policy in ("solar", "lru", "fifo"):
            planner = make_planner(PlanConfig(n, P, b, C, seed=7, policy=policy))
            rates[policy] = np.mean([planner.plan(e).hit_rate for e in range(3)][1:])
        bound = P * C / n
        assert rates["solar"] >= 0.97 * bound, (frac, rates)
        assert rates["solar"] > 1.5 * max(rates["lru"], rates["fifo"]), (frac, rates)


def test_rebalancing_recovers_the_overflow_of_small_batches():
    n, P, b, C = 16384, 16, 4, 512  # P*C/N = 0.5 with 4 samples per rank and step
    rates = {}
    for rebalance in (False, True):
        planner = Planner(PlanConfig(n, P, b, C, seed=3))
        planner.rebalance = rebalance
        rates[rebalance] = [planner.plan(e).hit_rate for e in range(4)]
    assert rates[False][-1] < 0.97 * 0.5  # a fixed owner per sample overflows
    assert rates[True][-1] >= 0.99 * 0.5 and rates[True][-1] > rates[False][-1]


def test_fill_epoch_has_no_hits_and_world_size_one_keeps_torch_order():
    c = PlanConfig(100, 1, 10, 40, seed=3)
    planner = Planner(c)
    p0 = planner.plan(0)
    assert p0.hit.sum() == 0 and p0.keep.sum() == 40
    order = global_order(100, 1, 3, 1)
    p1 = planner.plan(1)
    assert np.concatenate(p1.rank_steps(0)).tolist() == order.tolist()
    assert p1.hit.sum() == 40


def test_global_order_is_distributed_samplers():
    for n, P, dl in ((10, 3, False), (10, 3, True), (2, 5, False), (12, 4, True)):
        order = global_order(n, P, seed=11, epoch=2, drop_last=dl)
        for r in range(P):
            s = DistributedSampler(range(n), num_replicas=P, rank=r, seed=11, drop_last=dl)
            s.set_epoch(2)
            assert order[r::P].tolist() == list(s)
        # the order owns exactly its own memory: it is kept for the epoch (a padded order was a
        # view of a twice-as-long tiled array, 8 bytes per sample more on every rank)
        assert order.base is None or order.base.nbytes <= order.nbytes + 8 * P


@given(st.integers(1, 64), st.integers(1, 9), st.integers(0, 50))
def test_every_rank_owns_exactly_capacity_samples(P, b, C):
    own = owner_of(np.arange(P * C + 17), P, b, C)
    assert (own[P * C:] == -1).all()
    assert np.bincount(own[own >= 0], minlength=P).tolist() == [C] * P


def _capacity_by_owner_of(sizes, budget, P, b):
    """The reference: the same bisection over C, each C's owned bytes summed by owner_of over
    every index (the implementation before the prefix sums)."""
    def fits(c):
        m = min(len(sizes), P * c)
        per_rank = np.bincount(owner_of(np.arange(m), P, b, c), weights=sizes[:m], minlength=P)
        return per_rank.max(initial=0) <= budget

    lo, hi = 0, -(-len(sizes) // P)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=2, max_size=300), st.integers(1, 9), st.integers(1, 12),
       st.integers(0, 20000))
def test_capacity_for_bytes_is_the_largest_capacity_that_fits(sizes, P, b, budget):
    """The prefix-sum search gives exactly what owner_of over every index defines (it replaced
    that brute force, which took 17-36 s at N = 10^7 in a scaling audit)."""
    sizes = np.array(sizes, np.int64)
    if sizes.min() == sizes.max():
        sizes[0] += 1  # the varying-size path
    assert capacity_for_bytes(sizes, budget, world_size=P, batch_size=b) == _capacity_by_owner_of(sizes, budget, P, b)


def test_capacity_for_bytes_fits_every_rank():
    rng = np.random.default_rng(0)
    sizes = rng.integers(10, 100, size=1000)
    C = capacity_for_bytes(sizes, 5000, world_size=4, batch_size=8)
    own = owner_of(np.arange(1000), 4, 8, C)
    per = np.bincount(own[own >= 0], weights=sizes[own >= 0], minlength=4)
    assert per.max() <= 5000
    own2 = owner_of(np.arange(1000), 4, 8, C + 1)
    assert np.bincount(own2[own2 >= 0], weights=sizes[own2 >= 0], minlength=4).max() > 5000
    assert capacity_for_bytes(np.full(100, 10), 10**9, 4, 8) == 25


def test_resume_position_continues_the_global_order_with_another_world_size():
    n = 240
    a = Planner(PlanConfig(n, 2, 6, 30, seed=1)).plan(4)
    b = Planner(PlanConfig(n, 4, 3, 15, seed=1)).plan(4, start=5 * 12)
    assert b.samples.tolist() == a.samples[60:].tolist()
    for k in range(b.num_steps):
        assert sorted(b.samples[b.step_slice(k)]) == sorted(a.samples[a.step_slice(k + 5)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 60), p_old=st.integers(1, 4), b_old=st.integers(1, 4), p_new=st.integers(1, 6),
       b_new=st.integers(1, 4), done=st.integers(0, 30), drop_last_batch=st.booleans(), capacity=st.integers(0, 8))
def test_resumed_tail_gives_every_rank_the_same_nonempty_batches(n, p_old, b_old, p_new, b_new, done,
                                                                 drop_last_batch, capacity):
    """NOTE [ Resumed tail ]: a position saved under another global batch never leaves a rank an
    empty (or, with DataLoader's drop_last, a partial) batch; the remaining order is kept."""
    try:
        old = PlanConfig(n, p_old, b_old, 0, seed=3)
        new = PlanConfig(n, p_new, b_new, capacity, seed=3, drop_last_batch=drop_last_batch)
    except ConfigError:
        return
    start = min(done * old.global_batch, old.epoch_length, new.epoch_length)
    plan = Planner(new).plan(2, start)
    steps = [plan.rank_steps(r) for r in range(p_new)]
    assert {len(s) for s in steps} == {plan.num_steps}
    for k in range(plan.num_steps):
        sizes = {len(steps[r][k]) for r in range(p_new)}
        assert len(sizes) == 1 and sizes != {0}, (k, sizes)
        if drop_last_batch:
            assert sizes == {b_new}
    # replayed on per-rank buffers, a sample its rank kept at an earlier step is a hit there: the
    # added padding may repeat DistributedSampler's, and a repeat planned as a miss would make the
    # buffers' hit counts differ from the plan's
    held = [set() for _ in range(p_new)]
    for k in range(plan.num_steps):
        sl = plan.step_slice(k)
        for s, r, h in zip(plan.samples[sl].tolist(), plan.rank[sl].tolist(), plan.hit[sl].tolist()):
            assert h == (s in held[r]), (k, s, r, h)
        gone = plan.evict_step == k
        for s, r in zip(plan.evict_sample[gone].tolist(), plan.evict_rank[gone].tolist()):
            held[r].discard(s)  # after the step's hits, before its keeps
        for s, r, kp in zip(plan.samples[sl].tolist(), plan.rank[sl].tolist(), plan.keep[sl].tolist()):
            if kp:
                held[r].add(s)
    rest = global_order(n, p_new, 3, 2)[start:new.epoch_length]
    m = min(len(rest), len(plan.samples))
    assert plan.samples[:m].tolist() == rest[:m].tolist()
    if not drop_last_batch:  # nothing dropped; at most P - 1 samples of padding
        assert len(rest) <= len(plan.samples) < len(rest) + p_new


def test_plans_hold_int32_arrays_without_overflowing_their_sort_keys():
    """index_dtype: a planner's per-sample arrays are int32 below about 2**31 samples (half the memory
    on every rank), and the unowned samples' per-step index-order key (step * N + index, 5e9 here)
    is formed in int64: wrapped in int32 it would hand the larger index of a step to rank 0."""
    n = 70_000
    plan = Planner(PlanConfig(n, 2, 1, 0, seed=5)).plan(0)
    assert plan.samples.dtype == np.int32 and plan.rank.dtype == np.int32
    assert Planner(PlanConfig(n, 2, 1, 10, seed=5)).owners(np.arange(n)).dtype == np.int32
    pairs = plan.samples.reshape(-1, 2)
    ranks = plan.rank.reshape(-1, 2)
    assert np.array_equal(ranks[np.arange(len(pairs)), pairs.argmin(axis=1)], np.zeros(len(pairs)))
    assert index_dtype(2**31) is np.int64
    # a capacity far past N (P*C > 2**31) with int32 indices: everything owned, no OverflowError
    huge = owner_of(np.arange(10, dtype=np.int32), 4, 2, 2**30)
    assert np.array_equal(huge, owner_of(np.arange(10), 4, 2, 2**30)) and (huge >= 0).all()
    assert np.array_equal(owner_of(np.arange(10, dtype=np.int16), 2, 40000, 80000), np.zeros(10))


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_owner_of_narrow_indices_match_int64(dtype):
    """owner_of on int32/uint32 indices gives what int64 ones give: at the dtype's maximum (was -1,
    from bounds clipped to the maximum) and with b or P past it (was an OverflowError)."""
    top = int(np.iinfo(dtype).max)
    for idx, P, b, C in [([top - 1, top], 2, 1, 2**40), ([top], 1, 1, top + 1), ([0, 1, 2, 3], 1, top + 1, top + 1),
                         ([0, 1, 2, 3], top + 1, 1, 1), ([5, top], 3, 4, 7)]:
        want = owner_of(np.array(idx, np.int64), P, b, C)
        assert np.array_equal(owner_of(np.array(idx, dtype), P, b, C), want), (idx, P, b, C)
    assert list(owner_of(np.array([top - 1, top], dtype), 2, 1, 2**40)) == [0, 1]
    assert index_dtype(2**31 - 2**20 - 10, world_size=1) is np.int32
    assert index_dtype(2**31 - 2**20 - 10, world_size=2**20) is np.int64  # padded positions reach N + 2P


def test_read_calls_count_coalesced_runs():
    planner = Planner(PlanConfig(64, 1, 64, 0, shuffle=False))
    assert planner.plan(0).read_calls() == 1  # one step, indices 0..63 contiguous


def test_checker_rejects_invalid_hits_and_overfull_buffers():
    with pytest.raises(PlanViolation, match="never accessed"):
        check_dump({"epochs": [{"epoch": 0, "steps": [[[[1, True]]]]}]}, capacity=5)
    dump = {"epochs": [{"epoch": 0, "steps": [[[[1, False], [2, False]]], [[[1, True], [2, True]]]]}]}
    assert check_dump(dump, capacity=2)["hits"] == 2
    with pytest.raises(PlanViolation, match="capacity 1"):
        check_dump(dump, capacity=1)
    with pytest.raises(PlanViolation, match="different batch sizes"):
        check_dump({"epochs": [{"epoch": 0, "steps": [[[[1, False]], []]]}]}, capacity=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"capacity": -1}, "buffer capacity"),
    ({"batch_size": 200}, "larger than the dataset"),
    ({"batch_size": 200, "drop_last_batch": True}, "drop them all"),
    ({"world_size": 0}, "world_size"),
    ({"policy": "belady"}, "policy"),
])
def test_nonsense_configs_raise_value_error(kwargs, match):
    args = {"num_samples": 100, "world_size": 1, "batch_size": 10, "capacity": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        PlanConfig(**args)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_planner_plans_solar_only_and_points_to_the_baselines(policy):
    config = PlanConfig(100, 2, 10, 10, policy=policy)
    with pytest.raises(ConfigError, match="solar.testing.baselines.BaselinePlanner"):
        Planner(config)
    assert isinstance(make_planner(config), BaselinePlanner) and make_planner(config).plan(0).num_steps == 5


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 2))
def test_dump_groups_each_step_by_rank_in_position_order(cfg, epoch):
    """EpochPlan.to_dump (solar plan --dump) sorts each step by rank once; it must give what a
    mask per rank gave: each rank's (sample, hit) pairs in position order."""
    plan = Planner(make_config(*cfg)).plan(epoch)
    want = []
    for k in range(plan.num_steps):
        sl = plan.step_slice(k)
        r, s, h = plan.rank[sl], plan.samples[sl], plan.hit[sl]
        want.append([[[int(i), bool(x)] for i, x in zip(s[r == q], h[r == q])] for q in range(plan.world_size)])
    assert plan.to_dump() == {"epoch": epoch, "steps": want}
