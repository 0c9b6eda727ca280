"""Decoded copies of resident samples, in the rank buffer's bytes that the plan leaves unused.

NOTE [ Decoded copies ]
    The rank buffer keeps a compressed field's codec blobs (NOTE [ Stored vs decoded ] in
    solar/dataset.py), so once the buffer holds the samples an epoch asks for, the epoch costs
    their decode. Where the buffer's byte budget has room left after the most compressed bytes
    the plan can keep (its ``capacity`` largest samples: the *reserve*), that room holds decoded
    copies of resident samples, as Seneca (FAST'26) splits its cache by form. The rules:

    - A copy is another form of a sample the buffer holds: one is made only of a sample
      resident in the buffer when its pass is decoded, and it goes when the sample leaves the
      buffer (:meth:`DecodedCopies.sync`, before each pass). The plan's keeps, evictions, hits and
      misses, and the buffer's puts, are what they are without copies: copies never take a
      byte a compressed sample may need (compressed bytes <= the reserve, copies <= budget -
      reserve, so together they stay within ``buffer=``).
    - A step's rows that have a copy are copied from it: the bits the decoder gave them when
      the copy was made, so batches are bit-identical with and without copies. Only the others
      are decoded: by H5Dataset's own decode field by field, straight into the step's rows
      (``decode_into``); by a subclass's ``decode`` a sample at a time, whole.
    - Which copies: under DistributedSampler's orders every resident sample is asked for once
      per epoch, so each is reused as often as any other, and what a copy saves is its field's
      decode time. So the room goes field by field, to the field whose rows cost the most
      decode time per byte first (measured on the first step decoded), up to every resident
      sample, then to the next (:meth:`DecodedCopies.note`); a subclass's decode gives whole
      samples' copies. Copies are made first come while a field's rows are free, and kept while
      their sample stays resident (none is replaced by another: a replacement costs a copy and
      saves none in a later epoch).
    - Where: passes decoded ahead on the read-ahead thread (no workers: workers decode their
      own batches, and shipping decoded copies to them would cost ratio-times the shared
      memory), on the CPU, of an ``H5Dataset`` whose fields are all compressed, with a byte
      budget in memory (no spill). Not on passes every rank must agree on (a collective
      backend with several ranks), which decode and agree as before.
      ``SOLAR_DECODED_COPIES=0`` turns copies off.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from solar.cache import MemoryTier
from solar.codec import copy_rows
from solar.fetch import StoredBatch, torch_dtype

__all__ = ["BufferUsage", "DecodedCopies", "copies_for", "decode_pass", "usage"]

#: the decoded copies of each buffer (a new buffer starts without any)
_STORES: "weakref.WeakKeyDictionary[Any, DecodedCopies]" = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


class BufferUsage(NamedTuple):
    """What a rank buffer holds (``SolarBatchSampler.buffer_usage()``): bytes of stored
    (compressed or raw) samples; bytes of decoded copies (NOTE [ Decoded copies ]), the samples
    with a copy of some field and the copied rows (a sample's field each); the rows steps took from
    copies so far; the byte budget (None: counted in samples)."""

    stored_bytes: int
    decoded_bytes: int
    decoded_samples: int
    decoded_rows: int
    decoded_hits: int
    budget_bytes: int | None


class _Field:
    """One field's copies: a slab of ``rows`` rows (allocated at the first copy, its pages touched
    row by row as copies are made), the row of each sample that has one, and the free rows."""

    def __init__(self, shape: tuple, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.rows = 0
        self.slab: torch.Tensor | None = None
        self.slot: dict[int, int] = {}  # buffer key -> row of the slab
        self.free: list[int] = []
        self.seconds = self.decoded = 0.0  # decode time of this field's rows, and how many rows

    def size(self, rows: int) -> None:
        self.rows, self.free = rows, list(range(rows - 1, -1, -1))


class DecodedCopies:
    """Decoded copies in ``budget`` bytes, field by field (NOTE [ Decoded copies ]).

    Which fields: where the decode time per row of each field is known (``note``: H5Dataset's own
    decode, field by field), the budget goes first to the field whose rows cost the most decode
    time per byte, up to ``capacity`` rows (every resident sample), then to the next; otherwise
    (or until then) every field gets as many rows as the budget holds whole samples."""

    def __init__(self, budget: int, specs: Sequence[Any], capacity: int) -> None:
        self.capacity = capacity  # the plan's samples per rank this store was sized for
        self.budget = max(0, int(budget))
        self.fields = {s.name: _Field((*s.sample_shape,), torch_dtype(s.dtype)) for s in specs}
        sample = sum(f.row_bytes for f in self.fields.values())
        self.rows = self.budget // sample if sample else 0  # whole samples the budget holds
        for f in self.fields.values():
            f.size(self.rows)
        self.sized_by_cost = False
        self._lock = threading.Lock()
        self._seen = -1  # the buffer's evictions at the last sync
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return sum(len(f.slot) * f.row_bytes for f in self.fields.values())

    def __len__(self) -> int:
        """Samples with a copy of some field."""
        return len(set().union(*(f.slot for f in self.fields.values())))

    @property
    def copied_rows(self) -> int:
        return sum(len(f.slot) for f in self.fields.values())

    def note(self, name: str, seconds: float, rows: int) -> None:
        """``rows`` rows of field ``name`` took ``seconds`` to decode; once every field has a
        figure and no copy is held yet, the budget is split by them (see the class docstring)."""
        f = self.fields[name]
        f.seconds += seconds
        f.decoded += rows
        if self.sized_by_cost or any(not g.decoded for g in self.fields.values()):
            return
        with self._lock:
            if self.sized_by_cost or any(g.slot for g in self.fields.values()):
                return
            left = self.budget
            for g in sorted(self.fields.values(), key=lambda g: -g.seconds / g.decoded / g.row_bytes):
                g.size(min(self.capacity, left // g.row_bytes))
                left -= g.rows * g.row_bytes
            self.sized_by_cost = True

    def sync(self, buffer: Any, first: str) -> None:
        """Drop the copies of samples no longer in ``buffer`` (``first``: its first field)."""
        evictions = buffer.stats.evictions
        if evictions == self._seen and len(buffer):
            return
        with self._lock:
            self._seen = evictions
            for f in self.fields.values():
                for key in [k for k in f.slot if (first, k) not in buffer]:
                    f.free.append(f.slot.pop(key))

    def take(self, keys: Sequence[int], out: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Copy the rows of ``keys`` that have copies into their places of ``out``; per field,
        the mask of those places."""
        hits = {}
        with self._lock:
            for name, t in out.items():
                f = self.fields[name]
                slots = np.fromiter((f.slot.get(k, -1) for k in keys), np.int64, len(keys)) if f.slot else None
                hit = hits[name] = slots >= 0 if slots is not None else np.zeros(len(keys), bool)
                if slots is not None and hit.any():
                    at = np.flatnonzero(hit)
                    copy_rows(f.slab, slots[hit], t, at)
                    self.hits += len(at)
        return hits

    def admit(self, keys: Sequence[int], decoded: dict[str, torch.Tensor], rows: np.ndarray,
              resident: Callable[[int], bool]) -> None:
        """Keep copies of resident samples' fields without one while rows are free: sample
        ``keys[j]`` is row ``rows[j]`` of ``decoded``'s tensors (the fields it has)."""
        with self._lock:
            for name, t in decoded.items():
                f = self.fields[name]
                take, slots = [], []
                for j, k in enumerate(keys):
                    if len(slots) == len(f.free):
                        break
                    if k not in f.slot and resident(k):
                        f.slot[k] = f.free[-1 - len(slots)]
                        take.append(rows[j])
                        slots.append(f.slot[k])
                if not take:
                    continue
                del f.free[len(f.free) - len(slots):]
                if f.slab is None or len(f.slab) != f.rows and len(f.slot) == len(slots):  # (resized, none held)
                    f.slab = torch.empty((f.rows, *f.shape), dtype=f.dtype)
                copy_rows(t, np.array(take, np.int64), f.slab, np.array(slots, np.int64))


def _enabled() -> bool:
    return os.environ.get("SOLAR_DECODED_COPIES", "1").strip() not in ("0", "false", "no", "off")


def copies_for(buffer: Any, dataset: Any, capacity: int) -> DecodedCopies | None:
    """The decoded copies of ``buffer`` (made at the first call), or None where there are none:
    copies off, a dataset or buffer they do not apply to, or no room left after the reserve
    (NOTE [ Decoded copies ])."""
    if not _enabled() or type(buffer) is not MemoryTier or buffer.capacity_bytes is None:
        return None
    if not getattr(type(dataset), "keeps_decoded_copies", False):  # (a type's: views delegate attributes)
        return None
    specs = getattr(dataset, "specs", ())
    if not specs or any(s.kind != "codec" for s in specs) or torch.device(dataset.device).type != "cpu":
        return None
    with _STORES_LOCK:
        store = _STORES.get(buffer)
        if store is None or store.capacity != capacity:
            sizes = np.asarray(dataset.sample_nbytes(), dtype=np.int64)
            k = min(max(0, capacity), len(sizes))  # the reserve: the k largest (a partition, not a sort)
            reserve = int(np.partition(sizes, len(sizes) - k)[len(sizes) - k:].sum()) if 0 < k < len(sizes) \
                else int(sizes.sum()) if k else 0
            store = _STORES[buffer] = DecodedCopies(buffer.capacity_bytes - reserve, specs, capacity)
    return store if store.rows else None


def decode_pass(dataset: Any, steps: list[StoredBatch], copies: DecodedCopies, buffer: Any,
                mapper: Callable | None = None) -> None:
    """Decode a pass's ``steps`` with ``copies``, giving each its ``decoded``: step by step over
    ``mapper`` (a thread pool's ``map``), or with None the whole pass's misses in one ``decode``
    (as a pass decoded ahead without copies is)."""
    first = dataset.specs[0].name
    copies.sync(buffer, first)
    work = functools.partial(_decode_steps, dataset, copies, functools.partial(_resident, buffer, first))
    done = [d for ds in mapper(work, [[st] for st in steps]) for d in ds] if mapper is not None else work(steps)
    for st, dec in zip(steps, done):
        st.decoded = dec


def _resident(buffer: Any, first: str, key: int) -> bool:
    return (first, key) in buffer


def _decode_steps(dataset: Any, copies: DecodedCopies, resident: Callable, steps: list[StoredBatch]) -> list[dict]:
    """The steps' tensors: their samples' copies, the rest decoded (and copied while room is
    left). One step of H5Dataset's own decode: field by field, each field's misses straight into
    their rows; else a sample that misses a field is decoded whole, in one call for the steps."""
    outs, hits = [], []
    for st in steps:
        out = {name: torch.empty((st.n, *f.shape), dtype=f.dtype) for name, f in copies.fields.items()}
        outs.append(out)
        hits.append(copies.take(st.indices, out))
    if len(steps) == 1 and dataset.decodes_into():
        st, out, made = steps[0], outs[0], []
        for name, hit in hits[0].items():
            miss = np.flatnonzero(~hit)
            if len(miss):
                sub = st if len(miss) == st.n else _part(dataset, [st], [miss], (name,))
                copies.note(name, dataset.decode_into(sub, {name: out[name]}, miss)[name], len(miss))
                made.append((name, sub.indices, miss))
        for name, keys, miss in made:  # (after every field's note: the budget is split before any copy)
            copies.admit(keys, {name: out[name]}, miss, resident)
        return outs
    misses = [np.flatnonzero(~np.logical_and.reduce(list(h.values()))) for h in hits]
    if not any(len(m) for m in misses):
        return outs
    whole = len(steps) == 1 and len(misses[0]) == steps[0].n  # nothing copied: the step as it is
    sub = steps[0] if whole else _part(dataset, steps, misses)
    dec = dataset.decode(sub)
    if whole:
        outs[0] = dec
    else:
        a = 0
        for out, m in zip(outs, misses):
            for name, t in out.items():
                copy_rows(dec[name], np.arange(a, a + len(m)), t, m)
            a += len(m)
    copies.admit(sub.indices, dec, np.arange(sub.n), resident)
    return outs


def _part(dataset: Any, steps: list[StoredBatch], places: list[np.ndarray], fields: tuple = ()) -> StoredBatch:
    """The samples at ``places[k]`` of each ``steps[k]`` (codec fields; ``fields``: only these),
    their blobs copied together in that order."""
    out = StoredBatch(sum(len(p) for p in places),
                      indices=[st.indices[j] for st, p in zip(steps, places) for j in p.tolist()])
    for spec in dataset.specs:
        if fields and spec.name not in fields:
            continue
        pieces = []
        for st, p in zip(steps, places):
            flat, off = st.fields[spec.name]
            fa, oa = flat.numpy(), off.numpy()
            pieces += [fa[a:b] for a, b in zip(oa[p].tolist(), oa[p + 1].tolist())]
        offsets = np.zeros(len(pieces) + 1, np.int64)
        np.cumsum([len(b) for b in pieces], out=offsets[1:])
        blobs = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
        out.fields[spec.name] = (torch.from_numpy(blobs), torch.from_numpy(offsets))
    return out


def usage(buffer: Any) -> BufferUsage:
    """What ``buffer`` holds, its decoded copies included (:class:`BufferUsage`)."""
    with _STORES_LOCK:
        store = _STORES.get(buffer) if buffer is not None else None
    return BufferUsage(int(getattr(buffer, "nbytes", 0) or 0), store.nbytes if store else 0,
                       len(store) if store else 0, store.copied_rows if store else 0, store.hits if store else 0,
                       getattr(buffer, "capacity_bytes", None))
