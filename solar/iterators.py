"""The iterators ``solar.DataLoader`` hands out, around torch's.

:class:`TrackedIter` wraps torch's iterator for the consumer (batches received, the wait, the
epoch's record); :class:`SkipOnce` skips a resumed epoch's first batches of a plain dataset;
:func:`in_process_iterator` runs an iteration without worker processes where workers would
have nothing to do (NOTE [ Workers with nothing to do ]).

NOTE [ Workers with nothing to do ]
    With ``num_workers > 0`` torch sends every step to a worker process and the batch back. On a
    storage-backed dataset the reads, the buffer and the read-ahead are in the loader's process
    (NOTE [ Buffer and workers ] in solar/sampler.py); what a worker adds is the per-sample
    work: decoding compressed fields, a ``transform``, a subclass's ``__getitem__``, a user's
    ``collate_fn``. Where there is none (``H5Dataset.plain_batches()``, the loader's own
    collate, no pinning thread) and no ``worker_init_fn`` asks for worker processes to exist,
    the workers would only pass each step's placeholders back and forth (two queue hand-offs,
    a pickle each way, per step) for a batch made in this process anyway. The loader then
    iterates in this process, as with ``num_workers=0``: the same batches from the same read
    -ahead thread, the same ``base_seed`` drawn from the generator, ``timeout=`` still bounding
    the wait for a pass. With a ``worker_init_fn`` the workers run, and the batches stay in this
    process while they make their placeholders (NOTE [ Batches that stay ] in solar/fetch.py).

    In this process, with or without workers, a plain batch is its step's columns as they were
    loaded (:class:`_ColumnsFetcher`): what the loader's collate returns, without a view per
    sample made and checked on the consumer's thread (a millisecond per batch of 32).
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any

import torch.utils.data.dataloader as tud_loader

from solar.fetch import Held, StoredBatch
from solar.stats import EpochMeter

__all__ = ["TrackedIter", "SkipOnce", "in_process_iterator", "InProcessIter"]


class TrackedIter:
    """Delegates to torch's iterator, counts the batches the consumer actually received and
    the time it waited for them, and records the epoch at its end (solar/stats.py)."""

    def __init__(self, it: Any, loader: Any, meter: EpochMeter) -> None:
        self._it = it
        self._loader = loader
        self._meter: EpochMeter | None = meter  # None once the epoch is recorded

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._next()
        except StopIteration:
            meter, self._meter = self._meter, None
            if meter is not None:
                meter.wait += time.perf_counter() - t0
                self._loader._record(meter)
            raise
        finally:
            if self._meter is not None:
                self._meter.wait += time.perf_counter() - t0

    def __iter__(self) -> "TrackedIter":
        return self

    def _next(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self._loader._progress["done"] = True
            # where the next epoch's sampler will draw from: a state saved after the loop resumes there
            self._loader._progress["next_rng"] = self._loader._rng_state()
            raise
        self._loader._progress["batches"] += 1
        if isinstance(batch, Held):  # made in a worker, its bytes here: NOTE [ Batches that stay ]
            loader = self._loader
            batch = loader.collate_fn(loader.dataset.__getitems__(batch.take()))
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class SkipOnce:
    """An index sampler that skips its first ``skip`` items once (a resumed epoch), then passes through."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)


class _NoWorkers:
    """The loader as torch's single-process iterator reads it: no workers, no timeout of its
    own (the read-ahead's wait keeps the loader's ``timeout=``); everything else is the loader's."""

    def __init__(self, loader: Any) -> None:
        self.__dict__["_loader"] = loader

    num_workers = 0
    timeout = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_loader"], name)


class _ColumnsFetcher:
    """torch's fetcher for plain batches (NOTE [ Workers with nothing to do ]): a step's batch
    is its columns, what the loader's :func:`~solar.fetch.collate` returns for the samples
    ``__getitems__`` makes of them, without making a view per sample and checking it again on
    the consumer's thread. Anything but a step loaded ahead goes to torch's own fetcher."""

    def __init__(self, dataset: Any, fallback: Any) -> None:
        self.dataset, self.fallback = dataset, fallback

    def fetch(self, index: Any) -> Any:
        stored = getattr(index, "stored", None)  # a failed step raises its error, as __getitems__ does
        if not isinstance(stored, StoredBatch):
            return self.fallback.fetch(index)
        ds = self.dataset
        tensors = stored.decoded if stored.decoded is not None else ds.decode(stored)
        made = ds._samples(tensors, 0)  # (no samples: the columns, in the order __getitems__ gives them)
        return made.columns[0] if made.single else list(made.columns)


class InProcessIter(tud_loader._SingleProcessDataLoaderIter):
    """torch's single-process iterator over a loader whose batches are plain, with no workers
    or with workers that would have nothing to do (NOTE [ Workers with nothing to do ]); a
    persistent loader reuses it as it would its workers' iterator.

    With workers it takes steps from the batch sampler as far ahead as they would (``depth`` =
    ``prefetch_factor * num_workers`` steps out, and one more per batch returned), so the
    sampler, and where an early stop leaves the read-ahead (NOTE [ Early stop ] in
    solar/sampler.py), see what they see with workers. Taking a step from SOLAR's batch sampler
    waits for its pass to be read, so the first batch is taken alone (NOTE [ First batch ] in
    solar/passes.py) and the steps ahead with the second."""

    def __init__(self, loader: Any, depth: int) -> None:
        super().__init__(_NoWorkers(loader))
        self._dataset_fetcher = _ColumnsFetcher(self._dataset, self._dataset_fetcher)
        self._depth = depth
        self._ahead: collections.deque = collections.deque()
        self._drawn_all = False
        self._given = 0

    def _next_index(self) -> Any:
        if not self._depth:
            return super()._next_index()
        want = 1 if not self._given else self._depth + 1  # (the step returned now, and those out)
        while len(self._ahead) < want and not self._drawn_all:
            try:
                self._ahead.append(next(self._sampler_iter))
            except StopIteration:
                self._drawn_all = True
        if not self._ahead:
            raise StopIteration
        self._given += 1
        return self._ahead.popleft()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(_NoWorkers(loader), first_iter)
        self._ahead.clear()
        self._drawn_all, self._given = False, 0


def in_process_iterator(loader: Any) -> InProcessIter:
    """An iteration of ``loader`` in this process (NOTE [ Workers with nothing to do ])."""
    return InProcessIter(loader, (loader.prefetch_factor or 2) * loader.num_workers)
