"""A pass of the read-ahead: a group of steps loaded together, and what its failures become.

``SolarBatchSampler`` cuts its steps into groups (:func:`in_groups`) and hands each to a
:class:`PassFetcher` on the prefetch thread (or the MPI thread): one ``H5Dataset.fetch_steps``
call per pass, with what the plan says to keep and evict, split back into one
:class:`~solar.fetch.StepBatch` per step.
"""

from __future__ import annotations

import itertools
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, NamedTuple

import numpy as np

from solar.decoded import copies_for, decode_pass
from solar.errors import SolarError
from solar.failfast import abort_out_of_step, is_agreed
from solar.fetch import LaidOut, PassLayout, StepBatch
from solar.schedule import owner_of

__all__ = ["PassFetcher", "PassGeometry", "in_groups", "drop_frame_locals", "raise_failed"]

#: what a failed pass is retried for: a data failure (a bad index, a damaged sample, a failed
#: read). Not any ValueError: a plain bug raised in the pass is raised as it is, not handed out
#: as a failed step
DATA_ERRORS = (IndexError, OSError, SolarError)
#: samples the first pass of an iteration holds at most, in whole steps (NOTE [ First batch ])
FIRST_SAMPLES = 32
#: a pass decoded ahead is decoded step by step, in parallel, from steps of this many samples
#: (NOTE [ Decoding ahead in parallel ])
DECODE_STEP_SAMPLES = 16


class PassGeometry(NamedTuple):
    """World size, this rank, per-rank batch and buffer capacity of the iteration."""

    world_size: int
    rank: int
    batch_size: int
    capacity: int


def drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames an error from a fetch passed through.

    Why: fetch code keeps errors in locals (``problem = exc``, then ``backend.agree(problem)``
    raises it on every rank), so the error's traceback reaches the error again: a reference
    cycle. torch's worker iterator, whose ``__init__`` or ``__next__`` frame the error passes
    through next, would then live until the garbage collector broke the cycle, and close its
    worker queues from there while their feeder threads close them too: "Exception in thread
    QueueFeederThread ... Bad file descriptor" tracebacks after the real error. Without the
    cycle the iterator goes when the error is handled, and shuts its workers down as torch does.
    The frames below this one are done; only their locals (for a post-mortem debugger) are lost.
    """
    traceback.clear_frames(exc.__traceback__)


def in_groups(steps: Iterator, size: int) -> Iterator[list]:
    """``steps`` in lists of ``size`` (the last one shorter), the first lists smaller (NOTE
    [ First batch ]). When taking a step raises (a sampler that fails), the steps taken before
    it are a last, shorter group, and the error is raised after it: the read-ahead then hands
    out every batch before the failing one, as torch's loader does, instead of losing up to two
    passes of them.

    NOTE [ First batch ]: an iteration's first batch waits for the first pass. With passes of
    ``size`` steps from the start it waited for ``size`` steps' reads (the whole first 8-step
    pass), where torch's loader waits for one batch's. So the first pass holds as many whole
    steps as fit in ``FIRST_SAMPLES`` samples (one step at least), and each next pass twice as
    many, up to ``size``: each is read while the consumer works through the one before it,
    which is half its size. The sizes depend only on ``size`` and the steps' lengths, so every
    rank of a collective backend cuts its passes alike. The pass avoids numpy's set functions
    (``np.setdiff1d``, ``np.union1d``): their first call imports ``numpy.ma``, which cost the
    first batch more than its reads."""
    first = next(steps, None)
    if first is None:
        return
    steps = itertools.chain([first], steps)
    grow = max(1, min(size, FIRST_SAMPLES // max(1, len(first[0]))))
    while True:
        group: list = []
        n, grow = min(grow, size), grow * 2
        try:
            for _ in range(n):
                group.append(next(steps))
        except StopIteration:
            if group:
                yield group
            return
        except Exception:
            if not group:
                raise
            yield group
            raise
        yield group


def _minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.setdiff1d(a, b)``: the sorted distinct values of ``a`` not in ``b``. (numpy's set
    functions check for masked arrays, and the first check imports ``numpy.ma``: tens of ms,
    hundreds on a loaded machine, paid by the first pass: NOTE [ First batch ].)"""
    a = np.sort(a)
    a = a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a
    if not len(b) or not len(a):
        return a
    b = np.sort(b)
    return a[b[np.minimum(np.searchsorted(b, a), len(b) - 1)] != a]


def raise_failed(batch: Any) -> None:
    """Raise the error a failed step carries, taking it off the step first: the step stays in
    a local of the iteration's frame, which the error's traceback holds (a reference cycle that
    kept torch's worker iterator alive: see :func:`drop_frame_locals`)."""
    error, batch.error = batch.error, None
    raise error


class PassFetcher:
    """Loads one pass (a group of ``(indices, keep, evict, (step, twin))`` steps) into batches.

    When the pass fails on data, its steps are read again one at a time, and a step that fails
    alone carries its error to the dataset's ``__getitems__``, which raises it in the consumer's
    (or the worker's) fetch of that batch: so the batches around a bad one come out as torch's
    loader hands them out (with workers it is raised on the loader's side, when the consumer
    reaches it: torch's iterator, which takes batches ahead for its workers, may raise it a few
    batches early). Every rank retries alike (a pass's failure on a collective backend is
    agreed), so collective calls stay in step. The pass changed no buffer before its reads
    failed (NOTE [ One agreement per pass ] in solar/collective.py); a failed decode did put its
    kept misses, which the retried steps then hit.

    ``must_agree`` (a pass every rank of two or more makes together): an error that was not
    agreed (a bug, a MemoryError, a data error met by this rank alone) leaves this rank's
    remaining collective calls unmade while the others wait in them, so it ends the job (NOTE
    [ Fail fast ] in solar/failfast.py).
    """

    def __init__(self, dataset: Any, buffer: Any, geometry: PassGeometry, *, shared: bool, in_step: bool,
                 decode: bool, must_agree: bool) -> None:
        self.dataset, self.buffer, self.geometry = dataset, buffer, geometry
        self.shared, self.in_step, self.decode, self.must_agree = shared, in_step, decode, must_agree

    def __call__(self, group: list[tuple]) -> list[StepBatch]:
        if not self.must_agree:
            return self._with_retry(group)
        try:
            return self._with_retry(group)
        except BaseException as exc:
            if not is_agreed(exc):
                abort_out_of_step(exc, "in a collective pass of the loader's read-ahead")
            raise

    def _with_retry(self, group: list[tuple]) -> list[StepBatch]:
        try:
            return self._load(group)
        except DATA_ERRORS as exc:
            if self.must_agree and not is_agreed(exc):
                raise  # left the pass on this rank alone: see the class docstring
            if len(group) < 2:
                return [_failed(group[0], exc)]
            drop_frame_locals(exc)
        out: list[StepBatch] = []
        for g in group:
            try:
                out += self._load([g])
            except DATA_ERRORS as exc:
                if self.must_agree and not is_agreed(exc):
                    raise
                out.append(_failed(g, exc))
        return out

    def _decode_by_step(self, lengths: tuple) -> bool:
        """NOTE [ Decoding ahead in parallel ]: without workers a compressed pass is decoded on
        the read-ahead thread, off the training thread. One ``decode_batch`` of the whole pass
        runs on one core; where the process may use several, a pass of steps of at least
        ``DECODE_STEP_SAMPLES`` samples each is decoded step by step on as many threads (the
        codec's CPU kernel releases the GIL), each step's tensors its own. Not on a backend
        whose ranks agree on a damaged blob (every rank must raise it at the same pass: there
        fetch_steps decodes, and agrees, as before), and not for smaller steps, where a
        thread's hand-off costs more than it saves."""
        return (not self.must_agree and len(lengths) > 1 and min(lengths) >= DECODE_STEP_SAMPLES
                and _cores() > 1)

    def _keep(self, group: list[tuple]):
        """``(keep(miss) -> bool mask, samples to evict)`` for the pass. Schedule mode: what the
        plan says this rank keeps and evicts (ownership moves: see
        NOTE [ Rebalancing with the next epoch's order ] in solar/schedule.py); passthrough: it
        keeps what it owns, and never evicts."""
        if group[0][1] is None:
            P, rank, b, C = self.geometry

            def owned(miss: np.ndarray) -> np.ndarray:
                return owner_of(miss, P, b, C) == rank
            return owned, None
        evict = np.concatenate([g[2] for g in group])
        # a group spans steps: what the buffer must hold after them is (kept - evicted)
        wanted = _minus(np.concatenate([g[1] for g in group]), evict)

        def keep(miss: np.ndarray) -> np.ndarray:  # np.isin, by binary search in the sorted
            # ``wanted`` (it is asked once per file of a pass: isin sorted both)
            at = np.minimum(np.searchsorted(wanted, miss), max(len(wanted) - 1, 0))
            return wanted[at] == miss if len(wanted) else np.zeros(len(miss), bool)
        return keep, evict

    def _load(self, group: list[tuple]) -> list[StepBatch]:
        keep, evict = self._keep(group)
        steps = [g[0] for g in group]
        # the plan gives each sample of a step to one rank, so the ranks' reads of a pass are
        # disjoint unless the pass holds a sample twice (DistributedSampler's padding repeats
        # the epoch's head at its tail); only disjoint reads may be collective (NOTE
        # [ Disjoint collective reads ] in io_backends/base.py). Every rank decides alike.
        tag = group[0][3]
        disjoint = tag is not None and max(g[3][1] for g in group) < tag[0]
        # in step only over a DistributedSampler (every rank gets as many batches); with any
        # other sampler ranks may differ, or one rank may iterate alone (a validation loop)
        lengths = tuple(len(s) for s in steps)
        by_step = self.decode and self._decode_by_step(lengths)  # NOTE [ Decoding ahead in parallel ]
        # NOTE [ Decoded copies ] in solar/decoded.py: not on passes the ranks agree on
        copies = copies_for(self.buffer, self.dataset, self.geometry.capacity) \
            if self.decode and not self.must_agree else None
        one = self.decode and not by_step and copies is None  # decoded in fetch_steps: the pass as one batch
        keep = LaidOut(keep, PassLayout((sum(lengths),) if one else lengths, self.shared))
        stored = self.dataset.fetch_steps(steps, buffer=self.buffer, keep=keep, shared=self.shared, evict=evict,
                                          disjoint=disjoint, lockstep=self.in_step,
                                          **({"decode": True} if one else {}))
        if copies is not None:
            decode_pass(self.dataset, stored, copies, self.buffer, _decode_pool().map if by_step else None)
        elif by_step:
            pool = _decode_pool()
            for st, dec in zip(stored, list(pool.map(self.dataset.decode, stored))):
                st.decoded = dec
        out = [StepBatch(indices) for indices in steps]
        for batch, st in zip(out, stored):
            batch.stored = st
        return out


def _decode_pool() -> ThreadPoolExecutor:
    """The process's threads for decoding passes step by step (NOTE [ Decoding ahead in parallel ]);
    a forked child makes its own."""
    global _DECODE_POOL
    if _DECODE_POOL is None or _DECODE_POOL[0] != os.getpid():
        _DECODE_POOL = (os.getpid(), ThreadPoolExecutor(_cores(), thread_name_prefix="solar-decode"))
    return _DECODE_POOL[1]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_DECODE_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _failed(step: tuple, exc: BaseException) -> StepBatch:
    """The batch of a step whose read failed: it carries the error to ``__getitems__``."""
    drop_frame_locals(exc)
    batch = StepBatch(step[0])
    batch.error = exc
    return batch
