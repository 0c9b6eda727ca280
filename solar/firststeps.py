"""An epoch's first steps before its plan: the head in pieces, the whole plan behind them.

Where a sharded epoch was not planned ahead (the first epoch, a resumed run), the sampler hands
out the epoch's head piece by piece (``ShardPlanner.plan_head``: NOTE [ First steps ] in
solar/schedule.py) and the rest of the epoch from its whole plan. :class:`Head` submits every
piece and then the whole plan to the planning thread at once (``solar.dist.plan_executor``,
over the planner's own communicator: NOTE [ SOLAR's own MPI traffic ] in solar/dist.py), from
the training loop's thread, at the same point of every rank's program. That thread makes them
in order while the loader reads and trains, so a step waits only for its own piece (the first
one, before the first batch) or, after the head, for the whole plan.
"""

from __future__ import annotations

from typing import Iterator

from solar.dist import plan_executor

__all__ = ["Head"]


class Head:
    """The pieces of ``epoch``'s head (from ``start``) and its whole plan, all submitted to the
    planning thread when made (collective: every rank makes its Head at the same point). Falsy
    where the epoch has no head: then only the whole plan is submitted."""

    def __init__(self, planner, epoch: int, start: int) -> None:
        cuts = planner.head_cuts(epoch, start)
        thread = plan_executor()
        self.pieces = [(lo, thread.submit(planner.head, epoch, start, lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
        self.rest = thread.submit(planner.plan, epoch, start)
        self.num_steps = cuts[-1] if cuts else 0

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def first(self):
        """The first piece's plan (waits for it): what the iteration shows before the rest."""
        return self.pieces[0][1].result()

    def iter_steps(self, rank: int) -> Iterator[tuple[int, tuple]]:
        """``(step, (samples, (held after reading, evicted)))`` for every step of the head, each
        piece waited for when its first step is asked for."""
        for lo, piece in self.pieces:
            for k, step in enumerate(piece.result().iter_steps(rank, lo), lo):
                yield k, step

    def take(self):
        """The whole plan (waits for it)."""
        return self.rest.result()
