"""An epoch's first steps before its plan: the plan of the rest, made behind the head's passes.

Where a sharded epoch was not planned ahead (the first epoch, a resumed run), the sampler hands
out the epoch's head (``ShardPlanner.plan_head``: NOTE [ First steps ] in solar/schedule.py)
and the rest of the epoch from its whole plan, which :class:`Rest` makes on the MPI thread.
That thread runs SOLAR's collective calls in the order they are submitted, the same on every
rank (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py), so where the plan is submitted decides
what waits for it: :func:`rest_after_head` submits it once the read-ahead has submitted
every pass of the head's steps, whose batches then come without waiting for the plan; a step
after the head waits for it (NOTE [ First steps ]).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from solar.dist import mpi_executor

__all__ = ["Rest", "rest_after_head"]


class Rest:
    """The whole plan of ``epoch`` from ``start`` on ``planner`` (a ShardPlanner, collective),
    whose first ``head`` steps were handed out from the head's plan, submitted to the MPI thread
    at most once: by :func:`rest_after_head` once the passes of the head's steps are submitted,
    else by :meth:`take` (a step after the head in a pass that also holds head steps, or the
    next iteration settling one that stopped before: on every rank alike)."""

    def __init__(self, planner: Any, epoch: int, start: int, head: int) -> None:
        self.planner, self.epoch, self.start, self.head = planner, epoch, start, head
        self.future = None

    def submit(self) -> None:
        if self.future is None:
            self.future = mpi_executor().submit(self.planner.plan, self.epoch, self.start)

    def take(self):
        """The plan (waits for it)."""
        self.submit()
        return self.future.result()


def rest_after_head(groups: Iterator[list], rest: Callable[[], Rest | None]) -> Iterator[list]:
    """``groups`` (an iteration's passes of steps, each step's last item ``(step, twin)``),
    submitting the :class:`Rest` that ``rest()`` returns, if any, when the read-ahead asks for
    the pass after the one that ends the head: by then it has submitted that one (solar/prefetch.py
    takes the next item after submitting the last), so the MPI thread reads every pass of the
    head before it plans the rest. The passes' sizes are the same on every rank, so every rank
    submits the plan between the same two passes.

    Then an empty group: the read-ahead takes the next group before it hands out the last one it
    submitted, and the group after the head waits for the plan (its steps come from it), so
    without the empty one the head's last pass would wait for the plan too. The sampler reads
    nothing for it (no collective: on the MPI thread it returns at once, behind the plan)."""
    for group in groups:
        yield group
        pending = rest()
        if pending is not None and pending.future is None and group and group[-1][-1][0] + 1 >= pending.head:
            pending.submit()
            yield []
