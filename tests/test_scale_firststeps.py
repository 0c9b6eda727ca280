"""An epoch's head in pieces, then its whole plan, all on the planning thread (NOTE [ First steps ]
in solar/schedule.py): each piece is the plan's own steps, the hit rate keeps its bound, and the
pieces and the plan are submitted at once, in one order on every rank."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from solar.exchange import run_together
from solar.firststeps import Head
from solar.rankplan import Layout, RankPlan
from solar.schedule import PlanConfig, Planner
from test_scale import assert_same, plan_all, shard_planners


def _pieces(planners, epoch, start, cuts):
    return [run_together([p.plan_head(epoch, start, lo, hi) for p in planners])[0] for lo, hi in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("n,P,b,frac", [(20_000, 16, 8, 0.5), (9_973, 7, 5, 0.3), (30_000, 4, 4, 0.5)])
def test_a_long_head_in_pieces_is_the_plans_first_eighth_and_keeps_the_bound(n, P, b, frac):
    c = PlanConfig(n, P, b, int(frac * n / P), seed=11, long_head=True)
    assert c.head_steps == c.steps_per_epoch() // 8 > c.first_steps
    ref, planners = Planner(c), shard_planners(c)
    rates = []
    for e, start in ((0, 0), (1, 0), (2, 0), (3, c.epoch_length // 3)):
        cuts = planners[0].head_cuts(e, start)
        assert cuts[:2] == [0, c.first_steps] and len(cuts) >= 3  # two pieces or more
        assert all(hi == min(cuts[-1], 4 * lo) for lo, hi in zip(cuts[1:], cuts[2:]))
        pieces = _pieces(planners, e, start, cuts)
        want = ref.plan(e, start)
        plans = plan_all(planners, e, start)
        assert_same(want, ref, plans, planners)
        for q in range(P):
            got = [(s.tolist(), sorted(k.tolist()), sorted(v.tolist()))
                   for (lo, _), piece in zip(zip(cuts, cuts[1:]), pieces) for s, (k, v) in piece[q].iter_steps(q, lo)]
            assert got == [(s.tolist(), sorted(k.tolist()), sorted(v.tolist()))
                           for s, (k, v) in plans[q].iter_steps(q)][:cuts[-1]], f"rank {q}, epoch {e}"
        # the rebalancing evicts and releases nothing in the head
        assert (want.evict_step >= cuts[-1]).all() and (want.release_step >= cuts[-1]).all()
        rates.append(want.hit_rate)
    assert min(rates[1:3]) >= 0.97 * c.bound


def test_a_plan_without_a_long_head_has_one_piece():
    c = PlanConfig(20_000, 16, 8, 625, seed=11)
    assert shard_planners(c)[0].head_cuts(0) == [0, c.first_steps] == [0, c.head_steps]


class _Recording:
    """A planner whose head pieces and plan record which thread made them, in which order."""

    def __init__(self, cuts):
        self.cuts, self.calls, self.gate = cuts, [], threading.Event()

    def head_cuts(self, epoch, start):
        return self.cuts

    def _note(self, what):
        self.calls.append((what, threading.current_thread().name))

    def head(self, epoch, start, lo, hi):
        self.gate.wait(5)  # nothing runs until every piece and the plan were submitted
        self._note(("head", lo, hi))
        lay = Layout(epoch, start, hi * 2, 100, 100, hi * 2)
        pos = np.arange(lo * 2, hi * 2)
        return RankPlan(lay, 2, 1, 0, pos, pos + 1000, np.zeros(len(pos), np.uint8))

    def plan(self, epoch, start):
        self._note(("plan",))
        return "the whole plan"


def test_the_pieces_and_the_plan_are_submitted_at_once_and_made_in_order_on_the_planning_thread():
    planner = _Recording([0, 3, 12, 20])
    head = Head(planner, 5, 0)
    planner.gate.set()
    assert head and head.num_steps == 20
    steps = [(k, s.tolist()) for k, (s, _) in head.iter_steps(0)]
    assert [k for k, _ in steps] == list(range(20))
    assert steps[4] == (4, [1008, 1009])
    assert head.take() == "the whole plan"
    assert [w for w, _ in planner.calls] == [("head", 0, 3), ("head", 3, 12), ("head", 12, 20), ("plan",)]
    assert {t for _, t in planner.calls} == {planner.calls[0][1]} and planner.calls[0][1].startswith("solar-plan")


def test_no_head_submits_only_the_plan():
    planner = _Recording([])
    head = Head(planner, 0, 0)
    assert not head and head.num_steps == 0 and head.take() == "the whole plan"
    assert [w for w, _ in planner.calls] == [("plan",)]
