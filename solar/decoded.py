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
    - A step's samples that have a copy are copied from it: the bits the decoder gave them when
      the copy was made, so batches are bit-identical with and without copies. Only the others
      are decoded, by the dataset's own ``decode`` (a subclass's too).
    - Which samples: under DistributedSampler's orders every resident sample is asked for once
      per epoch, so each is reused as often as any other; copies are made first come while room
      is left, and kept while their sample stays resident (no copy is replaced by another: a
      replacement costs a copy and saves none in a later epoch).
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
    (compressed or raw) samples, bytes and count of decoded copies (NOTE [ Decoded copies ]),
    steps' samples served from copies so far, and the byte budget (None: counted in samples)."""

    stored_bytes: int
    decoded_bytes: int
    decoded_samples: int
    decoded_hits: int
    budget_bytes: int | None


class DecodedCopies:
    """Decoded copies of up to ``rows`` samples, one slab per field (NOTE [ Decoded copies ]).

    The slabs are allocated at the first copy and their pages are touched row by row as copies
    are made; :attr:`nbytes` counts the rows held."""

    def __init__(self, budget: int, specs: Sequence[Any], capacity: int) -> None:
        self.capacity = capacity  # the plan's samples per rank this store was sized for
        self.shapes = {s.name: ((*s.sample_shape,), torch_dtype(s.dtype)) for s in specs}
        self.row_bytes = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in self.shapes.values())
        self.rows = max(0, int(budget) // self.row_bytes) if self.row_bytes else 0
        self._slabs: dict[str, torch.Tensor] = {}
        self._slot: dict[int, int] = {}  # buffer key -> row of the slabs
        self._free = list(range(self.rows - 1, -1, -1))
        self._lock = threading.Lock()
        self._seen = -1  # the buffer's evictions at the last sync
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return len(self._slot) * self.row_bytes

    def __len__(self) -> int:
        return len(self._slot)

    def sync(self, buffer: Any, first: str) -> None:
        """Drop the copies of samples no longer in ``buffer`` (``first``: its first field)."""
        evictions = buffer.stats.evictions
        if evictions == self._seen and len(buffer):
            return
        with self._lock:
            self._seen = evictions
            for key in [k for k in self._slot if (first, k) not in buffer]:
                self._free.append(self._slot.pop(key))

    def take(self, keys: Sequence[int], out: dict[str, torch.Tensor]) -> np.ndarray:
        """Copy the rows of ``keys`` that have copies into their places of ``out``; the mask of
        those places."""
        with self._lock:
            slots = np.fromiter((self._slot.get(k, -1) for k in keys), np.int64, len(keys))
            hit = slots >= 0
            if hit.any():
                at, src = np.flatnonzero(hit), slots[hit]
                for name, t in out.items():
                    copy_rows(self._slabs[name], src, t, at)
                self.hits += len(at)
        return hit

    def admit(self, keys: Sequence[int], decoded: dict[str, torch.Tensor], rows: np.ndarray,
              resident: Callable[[int], bool]) -> None:
        """Keep copies of resident samples without one while rows are free: sample ``keys[j]`` is
        row ``rows[j]`` of ``decoded``'s tensors."""
        if not self._free:
            return
        with self._lock:
            take, slots = [], []
            for j, k in enumerate(keys):
                if len(slots) == len(self._free):
                    break
                if k not in self._slot and resident(k):
                    self._slot[k] = self._free[-1 - len(slots)]
                    take.append(rows[j])
                    slots.append(self._slot[k])
            if not take:
                return
            del self._free[len(self._free) - len(slots):]
            if not self._slabs:
                self._slabs = {name: torch.empty((self.rows, *shape), dtype=dt)
                               for name, (shape, dt) in self.shapes.items()}
            src, at = np.array(take, np.int64), np.array(slots, np.int64)
            for name, slab in self._slabs.items():
                copy_rows(decoded[name], src, slab, at)


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
            sizes = np.sort(np.asarray(dataset.sample_nbytes(), dtype=np.int64))[::-1]
            reserve = int(sizes[:max(0, capacity)].sum())
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
    """The steps' tensors: their samples' copies, the rest decoded in one call (and copied while
    room is left); for one step of H5Dataset's own decode, straight into the step's rows."""
    outs, misses = [], []
    for st in steps:
        out = {name: torch.empty((st.n, *shape), dtype=dt) for name, (shape, dt) in copies.shapes.items()}
        outs.append(out)
        misses.append(np.flatnonzero(~copies.take(st.indices, out)))
    if not any(len(m) for m in misses):
        return outs
    whole = len(steps) == 1 and len(misses[0]) == steps[0].n  # nothing copied: the step as it is
    sub = steps[0] if whole else _part(dataset, steps, misses)
    if len(steps) == 1 and dataset.decodes_into():
        dataset.decode_into(sub, outs[0], misses[0])
        copies.admit(sub.indices, outs[0], misses[0], resident)
        return outs
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


def _part(dataset: Any, steps: list[StoredBatch], places: list[np.ndarray]) -> StoredBatch:
    """The samples at ``places[k]`` of each ``steps[k]`` (codec fields), their blobs copied
    together in that order."""
    out = StoredBatch(sum(len(p) for p in places),
                      indices=[st.indices[j] for st, p in zip(steps, places) for j in p.tolist()])
    for spec in dataset.specs:
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
                       len(store) if store else 0, store.hits if store else 0,
                       getattr(buffer, "capacity_bytes", None))
