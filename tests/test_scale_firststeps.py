"""The epoch's plan is submitted to the MPI thread after every pass of the head's steps (NOTE
[ First steps ] in solar/schedule.py), so no head step waits for it; a step after the head does."""

from __future__ import annotations

import pytest

from solar.firststeps import Rest, rest_after_head
from solar.passes import in_groups


class _Recorded(Rest):
    """A Rest that records how many passes the read-ahead had taken when it was submitted."""

    def __init__(self, head: int, taken: list) -> None:
        super().__init__(None, 0, 0, head)
        self.taken = taken
        self.submitted_after: int | None = None
        self.future = None

    def submit(self) -> None:
        assert self.future is None, "submitted twice"
        self.submitted_after = len(self.taken)
        self.future = self  # submitted (nothing runs)


def _steps(n: int, b: int):
    # (indices, keep, evict, (step, twin)), as the sampler's steps
    return iter([(list(range(k * b, (k + 1) * b)), None, None, (k, -1)) for k in range(n)])


@pytest.mark.parametrize("b, size, head, want", [
    (32, 8, 3, 2),  # passes of 1, 2, 4 steps: the head is the first two
    (8, 8, 12, 2),  # 4, 8: the first two
    (1, 64, 96, 2),  # 32, 64
    (32, 1, 3, 3),  # one step a pass: the plan after the third
    (5, 8, 19, 3),  # 6, 8, 8: the head ends inside the third pass, which takes the plan itself
])
def test_the_plan_is_submitted_after_the_heads_passes(b, size, head, want):
    taken: list = []
    rest = _Recorded(head, taken)
    for group in rest_after_head(in_groups(_steps(200, b), size), lambda: rest):
        taken.append(group)
    # submitted when the pass after the one that ends the head was asked for, not before
    assert rest.submitted_after == want
    assert taken[want - 1][-1][-1][0] >= head - 1 > taken[want - 2][-1][-1][0]
    # then an empty group, which the read-ahead takes before it hands out the head's last pass
    assert taken[want] == [] and all(taken[:want]) and all(taken[want + 1:])
    assert [s[0] for g in taken for s in g] == [list(range(k * b, (k + 1) * b)) for k in range(200)]


def test_no_rest_no_submission():
    groups = list(rest_after_head(in_groups(_steps(10, 4), 8), lambda: None))
    assert sum(len(g) for g in groups) == 10
