"""One rank's share of a sharded plan (NOTE [ Sharded planning ] in solar/shardplan.py): the
positions an epoch's plan covers (:class:`Layout`) and what the rank does in each step
(:class:`RankPlan`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from solar.errors import ConfigError

__all__ = ["Layout", "RankPlan"]

_HIT, _KEEP = 1, 2  # assignment flags


class Layout(NamedTuple):
    """The positions an epoch's plan covers (the Planner's ``_tail``), the same on every rank."""

    epoch: int
    start: int  # first position of the epoch's order
    length: int  # positions planned (the resumed tail evened out: NOTE [ Resumed tail ])
    order_length: int  # the epoch's order (epoch_length)
    first_dup: int  # where DistributedSampler's padding starts, relative to start
    pad_at: int  # where the padding added for a resumed tail starts (== length: none)

    def steps(self, G: int) -> int:
        return -(-self.length // G)

    def parts(self, G: int) -> list[tuple[int, int]]:
        """Runs of positions planned one after the other (a repeat sees the keeps before it)."""
        n = self.length
        cuts = sorted({0, n} | {(d // G) * G for d in (self.first_dup, self.pad_at) if 0 <= d < n})
        return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


class RankPlan:
    """One rank's part of an :class:`~solar.schedule.EpochPlan`: its positions, in order, and
    its buffer's evictions; the same answers as the EpochPlan gives for that rank."""

    def __init__(self, layout: Layout, G: int, P: int, rank: int, pos: np.ndarray, samples: np.ndarray,
                 flags: np.ndarray) -> None:
        self.layout, self.epoch, self.start = layout, layout.epoch, layout.start
        self.global_batch, self.world_size, self.rank = G, P, rank
        self.pos, self.samples, self.flags = pos, samples, flags
        self.evict_step = self.evict_sample = self.release_sample = self.release_step = np.empty(0, np.int64)
        self.twins: np.ndarray = np.empty(0, np.int64)
        self.undo: tuple | None = None  # (this rank's held set before the plan), see ShardPlanner.rewind

    @property
    def num_steps(self) -> int:
        return self.layout.steps(self.global_batch)

    @property
    def hits(self) -> int:
        return int(np.count_nonzero(self.flags & _HIT))

    def rank_steps(self, rank: int) -> list[np.ndarray]:
        return [step for step, _ in self.iter_steps(rank)]

    def rank_actions(self, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """As ``EpochPlan.rank_actions``: per step, (samples held after reading, samples evicted)."""
        return [actions for _, actions in self.iter_steps(rank)]

    def iter_steps(self, rank: int, first: int = 0):
        """Per step from ``first`` on, as asked for: ``(samples, (held after reading, evicted))``,
        what :meth:`rank_steps` and :meth:`rank_actions` list. The first step comes without the
        O(steps) work of listing them all (156,250 steps at N = 2e7 on 4 ranks, seconds of
        Python before the first batch)."""
        self._mine(rank)
        S = self.num_steps
        cuts = np.concatenate([[0], np.searchsorted(self.pos, np.arange(1, S) * self.global_batch), [len(self.pos)]])
        o = np.argsort(self.evict_step, kind="stable")
        e_sample = self.evict_sample[o]
        e_cuts = np.concatenate([[0], np.searchsorted(self.evict_step[o], np.arange(1, S)), [len(o)]])
        for k in range(first, S):
            step = self.samples[cuts[k]:cuts[k + 1]]
            keep = step[(self.flags[cuts[k]:cuts[k + 1]] & (_HIT | _KEEP)) != 0]
            e = e_sample[e_cuts[k]:e_cuts[k + 1]]
            # a hit may be the step's eviction (served first, then dropped): not held afterwards
            yield step, (np.setdiff1d(keep, e) if len(e) else keep, e)

    def twin_steps(self) -> np.ndarray:
        return self.twins

    def _mine(self, rank: int) -> None:
        if rank != self.rank:
            raise ConfigError(f"this plan is rank {self.rank}'s share; rank {rank}'s is planned on rank {rank}")
