"""The baselines SOLAR is measured against: what training scripts do today.

:class:`PerSampleH5` is a map-style dataset that reads one sample per ``__getitem__`` (one read
request per field), through any :class:`solar.io_backends.Backend` opened lazily in the process
that reads (so with ``num_workers > 0`` every worker opens the file itself). Its request and byte
counters live in shared memory, so they count the reads of every DataLoader worker.

:class:`BaselinePlanner` simulates the buffer policies the schedule is compared with, step by
step in Python (slow; ``solar plan --policy lru|fifo`` and ``bench/plan``): ``lru``, an LRU buffer
per rank with every hit remapped to its holder in every step, and ``fifo``, SOLAR's released
code (a FIFO buffer per rank, hits remapped only in the first ``P*C // G`` steps of an epoch).
Its plans are :class:`solar.schedule.EpochPlan` of the same global batches as the ``solar``
policy's; they never evict by plan and have no undo record.
"""

from __future__ import annotations

import collections
import multiprocessing
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from solar.schedule import EpochPlan, PlanConfig, Planner

__all__ = ["PerSampleH5", "BaselinePlanner", "make_planner"]


class PerSampleH5(Dataset):
    """Per-sample reads of ``fields`` from ``backend``; ``calls``/``bytes`` count them across workers."""

    def __init__(self, backend, fields: Sequence[str] = ("x", "y")) -> None:
        self.backend = backend
        self.fields = tuple(fields)
        self.n = backend.info(self.fields[0]).shape[0]
        backend.close()  # opened only to read the length; workers reopen lazily
        self._calls = multiprocessing.Value("q", 0)
        self._bytes = multiprocessing.Value("q", 0)

    def __len__(self) -> int:
        return self.n

    @property
    def calls(self) -> int:
        return self._calls.value

    @property
    def bytes(self) -> int:
        return self._bytes.value

    def __getitem__(self, i: int):
        out = tuple(torch.from_numpy(self.backend.read_ranges(f, [(i, i + 1)])[0]) for f in self.fields)
        with self._calls.get_lock():
            self._calls.value += len(self.fields)
        with self._bytes.get_lock():
            self._bytes.value += sum(t.numel() * t.element_size() for t in out)
        return out


def make_planner(config: PlanConfig) -> Planner:
    """The planner of ``config.policy``: :class:`solar.schedule.Planner` for ``solar``, else the
    baselines' simulator."""
    return Planner(config) if config.policy == "solar" else BaselinePlanner(config)


class BaselinePlanner(Planner):
    """Plans epochs with the ``lru`` or ``fifo`` baseline (see the module docstring).

    The epoch's positions (resumed tails included) are the :class:`~solar.schedule.Planner`'s;
    only who gets which sample, and what each rank's buffer keeps, is simulated here.
    """

    policies = ("lru", "fifo")

    def reset(self) -> None:
        super().reset()
        self._planned = 0  # plans made so far: the first one of a fifo run fills the buffers
        self._caches = [collections.OrderedDict() for _ in range(self.config.world_size)]
        self._holder: dict[int, int] = {}  # sample -> the rank whose buffer holds it

    def _plan_epoch(self, epoch: int, start: int, samples: np.ndarray) -> EpochPlan:
        c = self.config
        rank, hit, keep = self._simulate(samples, c.global_batch, c.world_size)
        self._planned += 1
        return EpochPlan(epoch, start, c.global_batch, c.world_size, samples, rank, hit, keep)

    def _simulate(self, samples: np.ndarray, G: int, P: int):
        """Per position: rank, hit, keep. Steps are simulated in order, each from the buffers
        the earlier ones left."""
        c = self.config
        caches, holder, C = self._caches, self._holder, c.capacity
        n = len(samples)
        rank = np.empty(n, dtype=np.int64)
        hit = np.zeros(n, dtype=bool)
        first_epoch = self._planned == 0
        remap_steps = (P * C) // G
        for k, lo in enumerate(range(0, n, G)):
            batch = samples[lo:lo + G].tolist()
            q = len(batch) // P
            quota = [q + (1 if r < len(batch) % P else 0) for r in range(P)]
            remap = c.policy == "lru" or (not first_epoch and k < remap_steps)
            if remap:
                cnt = [0] * P
                rest = []
                for j, s in enumerate(batch):
                    r = holder.get(s)
                    if r is not None and cnt[r] < quota[r]:
                        cnt[r] += 1
                        rank[lo + j] = r
                        hit[lo + j] = True
                    else:
                        rest.append((s, j))
                rest.sort()
                free = [r for r in range(P) for _ in range(quota[r] - cnt[r])]
                for (s, j), r in zip(rest, free):
                    rank[lo + j] = r
            else:
                for j, s in enumerate(batch):
                    r = j % P
                    rank[lo + j] = r
                    hit[lo + j] = holder.get(s) == r
            if c.policy == "lru":  # hits were served at the step's start: refresh them first
                for j, s in enumerate(batch):
                    if hit[lo + j]:
                        caches[int(rank[lo + j])].move_to_end(s)
            for j, s in enumerate(batch):
                if hit[lo + j] or C == 0:
                    continue
                r = int(rank[lo + j])
                cache = caches[r]
                old = holder.get(s)
                if old is not None and old != r:
                    caches[old].pop(s, None)
                cache[s] = True
                cache.move_to_end(s)
                holder[s] = r
                while len(cache) > C:
                    v, _ = cache.popitem(last=False)
                    if holder.get(v) == r:
                        del holder[v]
        keep = ~hit if C else np.zeros(n, dtype=bool)
        return rank, hit, keep
