"""A pass's batch tensors: the memory they reuse, their rows read into them, and the rows of a
mapped file copied into them when the batch is taken.

:class:`SlotPool` (NOTE [ Reused batch memory ]) hands out step tensors; :class:`StepRows` is a
raw field of a pass laid out one tensor per step; :class:`SlotRows`, its misses read straight into
their slots by the read-ahead (NOTE [ One copy into the batch ] in solar/fetch.py); and
:class:`DeferredRows`, the rows of a mapped file and the buffer's hits copied into a step's tensor
only when its batch is taken (NOTE [ Rows copied when the batch is taken ]).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["SlotPool", "StepRows", "SlotRows", "DeferredRows", "DeferredStep", "DeferredFields", "deferred_fields"]

# NOTE [ Rows copied when the batch is taken ]
#     A raw field read from a mapped local file (NOTE [ Mapped reads ] in io_backends/mapped.py)
#     is memory already: its "read" is one copy, at memory speed. Made by the read-ahead a pass
#     ahead, that copy filled a pass's step tensors (8 steps of 6 MiB in bench/loader/local.py)
#     one pass before the consumer touched them: 16 step tensors in flight, more than the
#     last-level cache, so every byte went to DRAM when copied and came back from DRAM when the
#     consumer read it, and the copy wrote into lines it first had to fetch. So for such a field
#     the pass does everything but the copy: which rows, which hits, what to keep and evict, the
#     size check of the file; each step's rows (views of the map) and hits (the buffer's arrays,
#     held by reference: a buffer never changes a value it holds, it replaces or drops it) wait in
#     a :class:`DeferredStep`, and a tensor is taken from the pool and filled when the batch's
#     field is read (``StoredBatch.fields[name]``: the consumer's ``__getitems__``, or the
#     read-ahead's own decode; read again, it is made again). The batch keeps no reference to
#     it (the read-ahead holds a pass's batches until the consumer is past them all), so it is
#     the pool's again as soon as the consumer drops it: the next step gets the tensor dropped a
#     step or two ago (the pool hands out the most recently used free tensor first), the copy
#     writes lines still in cache, and the consumer reads what was just written. Each byte is still copied once:
#     a miss from the map straight into its slot (a miss the buffer keeps, from the map into the
#     buffer too, as before), a hit from the buffer into its slot. The counters (rows, bytes,
#     requests, sieved gaps) are those the read would have counted. Not for fields with checksums
#     to verify (verified where read, by the read-ahead), batches bound for workers' shared
#     memory, or files that are not mapped: those are read by the read-ahead as before. The file
#     is checked again (one ``fstat``) before each step's copy: a file cut shorter meanwhile raises
#     ``StorageError`` from that batch instead of killing the process with ``SIGBUS``. The copy
#     is the consumer's own: a thread filling the next step meanwhile needs a core the process
#     may not have, and costs CPU (hand-offs, both threads on the rows) where it has none. The
#     read-ahead asks the kernel to read the pass's rows into the page cache
#     (``MappedFile.populate``), so the copy waits for no storage on a cold cache.


#: how many of a storage's users a tensor that nobody else references counts (itself and the
#: storage object asked); None where torch does not say (then nothing is reused)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class SlotPool:
    """NOTE [ Reused batch memory ]: the step tensors of a dataset's earlier passes, reused for
    later ones once nobody references them (neither the tensor nor any view of its memory).

    Why: a pass's step tensors (megabytes each) are freed by the consumer batch by batch, and
    glibc hands such blocks back to the kernel or moves its threshold for them, so new ones came
    as fresh pages: a fault and the zeroing of every 4 KiB before the first copy, 10-20 thousand
    faults per epoch of bench/loader/local.py. A tensor is free when the pool's list holds its
    only reference and its storage has no other user (a slice, a ``numpy()`` view, a batch kept
    by the consumer all count). Of the free ones, the most recently handed out comes back first:
    its lines are the likeliest still in cache (NOTE [ Rows copied when the batch is taken ]).
    It remembers at most ``LIMIT`` tensors of ``LIMIT_BYTES`` in all (in use or free; the oldest
    go): a few passes' worth, what the read-ahead has in flight, so that what it keeps free
    between epochs stays bounded."""

    LIMIT = 64
    LIMIT_BYTES = 256 << 20

    def __init__(self) -> None:
        self._out: list[torch.Tensor] = []
        self._bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``dtype``: a free one of the pool, or new."""
        shape = torch.Size(shape)
        with self._lock:
            out = self._out
            for i in range(len(out) - 1, -1, -1):
                if out[i].shape == shape and out[i].dtype == dtype and self._free(out, i):
                    out.append(out.pop(i))
                    return out[-1]
            out.append(torch.empty(shape, dtype=dtype))
            self._bytes += out[-1].nbytes
            while len(out) > 1 and (len(out) > self.LIMIT or self._bytes > self.LIMIT_BYTES):
                self._bytes -= out.pop(0).nbytes
            return out[-1]

    @staticmethod
    def _free(out: list, i: int) -> bool:
        # (references to out[i]: the list's and getrefcount's argument; users of its storage:
        # the tensor and the storage object made here)
        return (_USE_COUNT is not None and sys.getrefcount(out[i]) == 2
                and _USE_COUNT(out[i].untyped_storage()._cdata) == 2)


class StepRows:
    """A raw field of a pass of several steps, each step's rows in a tensor of its own.

    Why: one tensor for a whole pass (tens of MB) is above glibc's mmap threshold, so every pass
    got fresh pages from the kernel and paid a page fault and a zeroing per 4 KiB before its
    first copy: several times the copy itself. A step's tensor is small enough to be reused
    from the heap pass after pass. ``rows[a:b]`` (a step's bounds) is that step's tensor."""

    def __init__(self, tensors: list[torch.Tensor], bounds: list[int]) -> None:
        self.tensors, self.bounds = tensors, bounds

    def __len__(self) -> int:
        return self.bounds[-1]

    def __getitem__(self, part: slice) -> torch.Tensor:
        k = self._step(part)
        return self.tensors[k] if k >= 0 else self.whole()[part]

    def _step(self, part: slice) -> int:
        """The step whose bounds ``part`` is, or -1."""
        a, b = part.start or 0, len(self) if part.stop is None else part.stop
        k = self.bounds.index(a) if a in self.bounds else -1
        return k if k >= 0 and k + 1 < len(self.bounds) and self.bounds[k + 1] == b else -1

    def whole(self) -> torch.Tensor:
        """Every row in one tensor (a copy)."""
        return torch.cat(self.tensors)


class SlotRows:
    """A raw field's misses read into the pass's step tensors (``FetchPass._to_slots``):
    ``rows[j]`` (``dests[j]``) is read row ``j`` in the first slot that wanted it, at pass
    position ``first[j]``."""

    def __init__(self, tensors: list, bounds: list, dests: list, first: np.ndarray, in_shm: bool) -> None:
        self.tensors, self.bounds, self.dests, self.first, self.in_shm = tensors, bounds, dests, first, in_shm
        self.dtype = dests[0].dtype if dests else None

    def __len__(self) -> int:
        return len(self.dests)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.dests[j]

    def fill(self, hits: dict, mrank: np.ndarray, inv: np.ndarray, steps, in_shm: bool):
        """The batch laid out as ``finish`` asks (``steps``, ``in_shm``): the repeats copied from
        their first slot (the hits were copied from the buffer while the misses were read); None
        when it asks for another layout than the one read into."""
        bounds = _bounds(steps, len(inv))
        if bounds != self.bounds or in_shm != self.in_shm:
            return None
        src = mrank[inv]
        rest = src >= 0  # (the hits are in)
        rest[self.first] = False
        arrays = [t.numpy() for t in self.tensors]
        ks = np.flatnonzero(rest)
        ss = np.searchsorted(np.asarray(bounds), ks, side="right") - 1
        for s, j, r, u in zip(ss.tolist(), (ks - np.asarray(bounds)[ss]).tolist(), src[ks].tolist(), inv[ks].tolist()):
            arrays[s][j] = self.dests[r] if r >= 0 else hits[u]
        return self.tensors[0] if steps is None else StepRows(self.tensors, bounds)


def _bounds(steps, n: int) -> list[int]:
    """Where each step of a pass of ``n`` rows starts (and the end), ``steps`` its step lengths
    (None: one step)."""
    return [0, n] if steps is None else np.r_[0, np.cumsum(steps)].tolist()


class DeferredStep:
    """One step's tensor of a raw field, made and filled by :meth:`make` (NOTE [ Rows copied
    when the batch is taken ]): ``sources[j]`` (a view of the map, or a buffered value) is row
    ``j``; ``check()`` raises if the map's file no longer holds its rows."""

    __slots__ = ("shape", "dtype", "pool", "sources", "check")

    def __init__(self, shape: tuple, dtype: torch.dtype, pool: SlotPool, sources: list,
                 check: Callable[[], None]) -> None:
        self.shape, self.dtype, self.pool, self.sources, self.check = shape, dtype, pool, sources, check

    def make(self) -> torch.Tensor:
        """A tensor of the step's rows, made now (each call a new one: the step keeps none, so
        that its memory goes back to the pool when the consumer drops it)."""
        self.check()
        t = self.pool.empty(self.shape, self.dtype)
        rows = t.numpy()
        for j, src in enumerate(self.sources):
            rows[j] = src
        return t


class DeferredRows(StepRows):
    """A raw field of a pass whose rows are copied step by step when taken (:class:`DeferredStep`
    each): ``rows[a:b]`` of a step's bounds is its :class:`DeferredStep`, ``rows[j]`` read row
    ``j`` (a view of the map, for the buffer's puts), ``dests`` all of them."""

    def __init__(self, steps: list[DeferredStep], bounds: list[int], dests: list) -> None:
        self.bounds, self.steps, self.dests = bounds, steps, dests
        self.dtype = dests[0].dtype if dests else None

    def whole(self) -> torch.Tensor:
        return torch.cat([s.make() for s in self.steps])

    def __getitem__(self, part):
        if not isinstance(part, slice):
            return self.dests[part]
        k = self._step(part)
        return self.steps[k] if k >= 0 else self.whole()[part]

    def fill(self, hits: dict, mrank: np.ndarray, inv: np.ndarray, steps, in_shm: bool):
        """As :meth:`SlotRows.fill`: itself (or its one step) where ``finish`` asks for the layout
        it was cut in, None otherwise."""
        bounds = _bounds(steps, len(inv))
        if bounds != self.bounds or in_shm:
            return None
        return self.steps[0] if steps is None else self


class DeferredFields(dict):
    """A :class:`~solar.fetch.StoredBatch`'s fields where some are :class:`DeferredStep`: reading
    one makes a tensor of it, which the fields do not keep (NOTE [ Rows copied when the batch is
    taken ]); pickled, every one is made."""

    def __getitem__(self, key: str) -> Any:
        val = dict.__getitem__(self, key)
        return val.make() if isinstance(val, DeferredStep) else val

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> list:  # type: ignore[override]
        return [self[k] for k in self]

    def items(self) -> list:  # type: ignore[override]
        return [(k, self[k]) for k in self]

    def copy(self) -> dict:
        return dict(self.items())

    def __reduce__(self):
        return dict, (dict(self.items()),)


def deferred_fields(fields: dict) -> dict:
    """``fields`` as :class:`DeferredFields` where a value is deferred, else as it is."""
    deferred = any(isinstance(v, (DeferredStep, DeferredRows)) for v in dict.values(fields))
    return DeferredFields(fields) if deferred and not isinstance(fields, DeferredFields) else fields
