"""An epoch's first steps before its plan: the plan of the rest, made behind the first pass.

Where a sharded epoch was not planned ahead (the first epoch, a resumed run), the sampler hands
out the epoch's head (``ShardPlanner.plan_head``: NOTE [ First steps ] in solar/schedule.py)
and the rest of the epoch from its whole plan, which :class:`Rest` makes on the MPI thread.
That thread runs SOLAR's collective calls in the order they are submitted, the same on every
rank (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py), so where the plan is submitted decides
what waits for it: :func:`rest_after_first_pass` submits it once the read-ahead has submitted
the iteration's first pass, whose batches then come without waiting for the plan.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from solar.dist import mpi_executor

__all__ = ["Rest", "rest_after_first_pass"]


class Rest:
    """The whole plan of ``epoch`` from ``start`` on ``planner`` (a ShardPlanner, collective),
    submitted to the MPI thread at most once: by :func:`rest_after_first_pass` where the
    iteration reaches its second pass, else by :meth:`take` (the steps after the head, or the
    next iteration settling one that stopped before: on every rank alike)."""

    def __init__(self, planner: Any, epoch: int, start: int) -> None:
        self.planner, self.epoch, self.start = planner, epoch, start
        self.future = None

    def submit(self) -> None:
        if self.future is None:
            self.future = mpi_executor().submit(self.planner.plan, self.epoch, self.start)

    def take(self):
        """The plan (waits for it)."""
        self.submit()
        return self.future.result()


def rest_after_first_pass(groups: Iterator[list], rest: Callable[[], Rest | None]) -> Iterator[list]:
    """``groups`` (an iteration's passes of steps), submitting the :class:`Rest` that ``rest()``
    returns, if any, when the read-ahead asks for the second: by then it has submitted the first
    (solar/prefetch.py takes the next item after submitting the last), so the MPI thread reads
    the first pass before it plans the rest."""
    for group in groups:
        yield group
        pending = rest()
        if pending is not None:
            pending.submit()
