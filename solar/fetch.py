"""One fetch of stored samples, phase by phase, and the batches it hands on.

``H5Dataset.fetch_stored`` is a :class:`FetchPass`: gather (buffer hits, which misses to keep),
load (the misses' rows, through :class:`solar.reads.RowReads`), evict, finish (buffer puts, the
batch laid out in batch order as a :class:`StoredBatch`). The loader carries each step's
:class:`StoredBatch` to ``__getitems__`` inside a :class:`StepBatch`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate

from solar.cache import TierStats
from solar.cache.arena import RowArena, arena_for
from solar.errors import InputError
from solar.layout import FieldSpec
from solar.slots import DeferredRows, DeferredStep, SlotPool, SlotRows, StepRows, deferred_fields

__all__ = ["FetchPass", "FetchStats", "PassLayout", "LaidOut", "StoredBatch", "StepBatch", "StepRows", "SlotPool",
           "Samples", "Stay", "Held", "as_indices", "collate", "empty", "evict_samples", "forget_held", "torch_dtype"]

# NOTE [ Batches that stay ]
#     With DataLoader workers, each step's batch travels to a worker inside its StepBatch and
#     comes back collated: for every step two shared-memory hand-offs (a descriptor passed
#     through multiprocessing's resource sharer each way, per tensor) and a fresh mapping the
#     consumer faults in. When the worker has nothing to do on the bytes (every field raw, on
#     the CPU, H5Dataset's own samples, the loader's own :func:`collate`: ``plain_batches()``),
#     the loader fetches with ``shared=Stay(key)``: the batch is laid out in this process's
#     memory and stays here. Pickled for a worker, its StepBatch carries a token instead
#     (:func:`hold`); the worker's ``__getitems__`` and :func:`collate` run as always, on a
#     batch of placeholders, and give back a :class:`Held`; the loader's iterator takes the
#     batch back by its token and collates it here (the same columns). Workers still draw the
#     same steps at the same time; no byte of the batch is copied or mapped for them.
_HELD: dict[int, tuple[Any, "StepBatch"]] = {}
_HELD_LOCK = threading.Lock()
_TOKENS = itertools.count()


class Stay:
    """``shared=`` of a fetch whose batches stay in this process (NOTE [ Batches that stay ]);
    true, as ``shared=True`` is for workers. ``key``: the loader's, which drops its leftovers."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class Held:
    """A batch held in the loader's process, by its token (NOTE [ Batches that stay ]): what a
    worker gets in place of the bytes and gives back in place of the collated batch."""

    token: int
    n: int

    def take(self) -> "StepBatch":
        """The StepBatch held under this token (in the process that holds it), once."""
        with _HELD_LOCK:
            entry = _HELD.pop(self.token, None)
        if entry is None:
            raise RuntimeError(f"solar.DataLoader: batch {self.token} came back from a worker, but its bytes are "
                               "no longer held (its iteration ended); iterate the loader again")
        return entry[1]


def hold(step: "StepBatch", key: Any) -> Held:
    """Keep ``step`` in this process under a new token (NOTE [ Batches that stay ])."""
    token = next(_TOKENS)
    with _HELD_LOCK:
        _HELD[token] = (key, step)
    return Held(token, len(step))


def forget_held(key: Any) -> None:
    """Drop what the iterations of the loader ``key`` left held (steps its workers never returned)."""
    with _HELD_LOCK:
        for token in [t for t, (k, _) in _HELD.items() if k is key]:
            del _HELD[token]


def as_indices(indices: Sequence[int], path: str, n: int) -> np.ndarray:
    """``indices`` (a batch's sample indices) as a 1-D int64 array.

    Why: a cast alone would read floats as their integer part, a boolean mask as 0s and 1s and a
    nested list flattened, so a buggy sampler would get wrong samples silently, where ``ds[1.7]``
    and torch's per-item fetch refuse them.

    Raises:
        InputError: not a flat sequence of integers.
        IndexError: an integer beyond int64 (out of range for any dataset).
    """
    a = np.asarray(indices)
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype == object and a.ndim == 1 and all(isinstance(i, int) and not isinstance(i, bool) for i in a.tolist()):
        big = max(a.tolist(), key=abs)
        raise IndexError(f"{path}: sample index {big} out of range for {n} samples")
    if a.ndim != 1 or a.dtype.kind not in "iu":
        what = f"{a.ndim}-D" if a.ndim != 1 else a.dtype.name
        raise InputError(f"{path}: a batch's sample indices must be a flat sequence of integers, got {what} "
                         "values; check the sampler or batch_sampler")
    if a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
        raise IndexError(f"{path}: sample index {int(a.max())} out of range for {n} samples")
    return a.astype(np.int64, copy=False)


@dataclass
class FetchStats(TierStats):
    """Sample-level counters of one rank's fetches: ``hits``/``misses`` count samples (not
    fields), ``kept`` samples put in the buffer, ``steps`` fetch calls."""

    kept: int = 0
    steps: int = 0
    read_calls: int = 0  # storage requests (ranges after coalescing and sieving); bytes_in: bytes read
    decode_s: float = 0.0  # seconds H5Dataset.decode spent in the codec, in this process


@dataclass
class StoredBatch:
    """The stored bytes of one batch, in batch order.

    ``fields[name]`` is a tensor ``(n, *sample_shape)`` for a raw field, or ``(blobs, offsets)``
    (uint8 tensor of concatenated codec blobs, int64 tensor of ``n + 1`` offsets) for a
    compressed field. Tensors pickle through DataLoader queues via shared memory.
    """

    n: int
    fields: dict[str, Any] = field(default_factory=dict)
    hits: int = 0
    indices: list[int] = field(default_factory=list)  # for error messages
    decoded: dict[str, torch.Tensor] | None = None  # already decoded (fetch_steps(decode=True))
    stay: Stay | None = None  # stays in this process while workers make it (NOTE [ Batches that stay ])

    def part(self, a: int, b: int, decoded: dict[str, torch.Tensor] | None = None) -> "StoredBatch":
        """Samples ``[a, b)`` (views): of the stored fields, or of ``decoded`` (this batch's
        decoded tensors), which the part then carries instead of stored bytes."""
        out = StoredBatch(b - a, indices=self.indices[a:b], stay=self.stay)
        if decoded is not None:
            out.decoded = {name: t[a:b] for name, t in decoded.items()}
            return out
        for name, val in self.fields.items():
            if isinstance(val, tuple):
                blobs, off = val
                out.fields[name] = (blobs[int(off[a]):int(off[b])], off[a:b + 1] - off[a])
            else:
                out.fields[name] = val[a:b]
        out.fields = deferred_fields(out.fields)
        return out


class StepBatch(list):
    """A rank's batch of sample indices carrying its already-loaded :class:`StoredBatch`.

    It is a ``list`` so samplers, ``len()`` and user code treat it like torch's batch; the
    ``stored`` attribute rides along to ``H5Dataset.__getitems__`` (in a worker or not). A step
    whose read failed carries its ``error`` instead, which reading ``stored`` raises: the
    dataset's ``__getitems__`` then fails for that batch alone, where torch's would.
    """

    _stored: StoredBatch | None = None
    error: BaseException | None = None

    @property
    def stored(self) -> StoredBatch | None:
        if self.error is not None:
            raise self.error
        return self._stored

    @stored.setter
    def stored(self, value: StoredBatch | None) -> None:
        self._stored = value

    def __reduce_ex__(self, protocol):
        stored = self._stored
        stay = getattr(stored, "stay", None)  # (a concatenation's batches are always sent)
        if self.error is None and stay is not None:
            return _held_step, (list(self), hold(self, stay.key))  # NOTE [ Batches that stay ]
        return super().__reduce_ex__(protocol)


def _held_step(indices: list, held: Held) -> StepBatch:
    """A worker's StepBatch whose bytes stay in the loader's process: ``stored`` is a :class:`Held`."""
    batch = StepBatch(indices)
    batch.stored = held
    return batch


@dataclass
class FetchPass:
    """One fetch of a dataset's samples, between its phases: :meth:`gather` (check the indices,
    take the buffer's hits, decide which misses to keep), :meth:`load` (read the misses),
    :func:`evict_samples` (the pass's evictions, for all its files at once), :meth:`finish` (put
    the kept misses, lay the batch out). ``H5Dataset.fetch_stored`` runs them in a row; a
    concatenation of files (``solar/concat.py``) runs each phase over all its files first.

    Holds the batch being built, its indices and unique samples (``inv``), the buffer's hits
    (``held``), the misses, which of them to keep, the stored rows to ``read`` and each miss's
    place in them (``at``; ``mrank`` per unique sample, -1 for a hit), and the read data."""

    dataset: Any
    out: StoredBatch
    idx: np.ndarray
    inv: np.ndarray
    held: dict
    miss: np.ndarray
    kept: np.ndarray
    read: np.ndarray
    at: np.ndarray
    mrank: np.ndarray
    datas: dict = field(default_factory=dict)
    layout: "PassLayout | None" = None  # the batches the pass is laid out in, where known
    stable: set = field(default_factory=set)  # fields whose read rows the buffer keeps as they are

    @classmethod
    def gather(cls, ds: Any, indices: Sequence[int], buffer, keep, rows, checked: bool = False) -> "FetchPass":
        """Check ``indices`` (unless the caller has, on every rank: ``checked``), take the
        buffer's hits, and decide which misses to keep."""
        n = ds.num_samples if rows is None else len(rows)
        idx = as_indices(indices, ds.path, n)
        if not checked:
            ds._check_index(idx, None if rows is None else n)
        idx = np.where(idx < 0, idx + n, idx)
        uniq, inv = np.unique(idx, return_inverse=True)
        resident = np.zeros(len(uniq), dtype=bool)
        held: dict[int, dict[str, Any]] = {}  # u -> every field's buffered value
        if buffer is not None:
            # A sample is a hit only when *every* field is in the buffer, read here, before this
            # step evicts or puts anything: a put the budget refused for one field, or another
            # iterator's thread evicting between two gets, then makes it a miss (read again),
            # never a batch with a missing field.
            first = ds.specs[0].name
            for u in np.flatnonzero([(first, int(i)) in buffer for i in uniq.tolist()]).tolist():
                vals = {}
                for spec in ds.specs:
                    v = buffer.get((spec.name, int(uniq[u])))
                    if v is None:
                        break
                    vals[spec.name] = v
                else:
                    held[u] = vals
            resident[list(held)] = True
        miss = uniq[~resident]
        kept = np.array(keep(miss), dtype=bool) if (keep is not None and buffer is not None and len(miss)) \
            else np.zeros(len(miss), bool)
        if rows is None:
            read, at = miss, np.arange(len(miss))
        else:  # the stored rows to read (a Subset may repeat one), and where each miss's row is
            read, at = np.unique(np.asarray(rows[miss], dtype=np.int64), return_inverse=True)
        out = StoredBatch(len(idx), hits=int(resident[inv].sum()),  # indices: the file's sample numbers
                          indices=(idx if rows is None else np.asarray(rows[idx], dtype=np.int64)).tolist())
        mrank = np.full(len(uniq), -1, dtype=np.int64)
        mrank[~resident] = at
        layout = getattr(keep, "layout", None)  # (a part of a concatenation's pass has none)
        layout = layout if layout is not None and sum(layout.steps) == len(idx) else None
        return cls(ds, out, idx, inv, held, miss, kept, read, at, mrank, layout=layout)

    def load(self, disjoint: bool, split: bool = True) -> None:
        """Read the misses' rows: one ``read_ranges`` per field, in field order (``split=False``:
        in this thread, see :meth:`solar.reads.RowReads._read`); a raw field of a pass whose
        layout is known, straight into its batch slots (:meth:`_to_slots`)."""
        ds = self.dataset
        self.datas = {spec.name: self._to_slots(spec, disjoint, split)
                      if self.layout is not None and ds.reads_to_places(spec)
                      else ds._read_field(spec, self.read, disjoint, split) for spec in ds.specs}

    def _deferred(self, spec: FieldSpec) -> DeferredRows | None:
        """NOTE [ Rows copied when the batch is taken ] (solar/slots.py): raw field ``spec``'s
        step tensors as :class:`DeferredStep`, each row's source a view of the file's map (its
        misses) or the buffer's value (its hits); None where the field is read now instead."""
        ds, (steps, shared) = self.dataset, self.layout
        rows_of = getattr(ds.backend, "mapped_rows", None)
        if (rows_of is None or (shared and not isinstance(shared, Stay))
                or (ds.verify and ds._has_checksum.get(spec.name))):
            return None
        runs = ds._runs(spec, self.read)  # (sieved as the read would be: the same counters)
        got = rows_of(spec.data_key, runs)
        if got is None:
            return None
        views = got.views
        if getattr(got.check, "stable", False):  # NOTE [ Kept rows in an arena ] in cache/arena.py
            self.stable.add(spec.name)
        ds.stats.read_calls += len(runs)
        ds.stats.bytes_in += len(views) * int(np.prod(spec.sample_shape, dtype=np.int64)) * spec.dtype.itemsize
        if len(views) != len(self.read):  # rows read through sieved gaps: none is copied
            lengths = runs[:, 1] - runs[:, 0]
            k = np.searchsorted(runs[:, 1], self.read, side="right")
            at = (np.cumsum(lengths) - lengths)[k] + self.read - runs[k, 0]
            views = [views[i] for i in at.tolist()]
        src, name, held = self.mrank[self.inv], spec.name, self.held
        sources = [views[r] if r >= 0 else held[u][name] for r, u in zip(src.tolist(), self.inv.tolist())]
        bounds = np.r_[0, np.cumsum(steps, dtype=np.int64)].tolist()
        dtype, pool = torch_dtype(spec.dtype), ds.__dict__.setdefault("_slot_pool", SlotPool())
        parts = [DeferredStep((b - a, *spec.sample_shape), dtype, pool, sources[a:b], got.check)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return DeferredRows(parts, bounds, views)

    def _to_slots(self, spec: FieldSpec, disjoint: bool, split: bool) -> "SlotRows | DeferredRows":
        """NOTE [ One copy into the batch ]: the pass's step tensors of raw field ``spec``, made
        now, each row read straight into the first batch slot that wants it, and the hits copied
        from the buffer into theirs on this thread while the request threads read (the slots of
        samples the pass holds twice are filled by :meth:`finish`); or, for a mapped file, filled
        when the batch is taken (:meth:`_deferred`)."""
        deferred = self._deferred(spec)
        if deferred is not None:
            return deferred
        steps, shared = self.layout
        bounds = np.r_[0, np.cumsum(steps, dtype=np.int64)]
        dtype, in_shm = torch_dtype(spec.dtype), bool(shared) and not isinstance(shared, Stay)
        pool = None if in_shm else self.dataset.__dict__.setdefault("_slot_pool", SlotPool())
        tensors = [pool.empty((int(b - a), *spec.sample_shape), dtype) if pool is not None else
                   empty((int(b - a), *spec.sample_shape), dtype, in_shm) for a, b in zip(bounds[:-1], bounds[1:])]
        arrays = [t.numpy() for t in tensors]
        src = self.mrank[self.inv]  # each slot's row in `read`; -1: a hit
        wanting = np.flatnonzero(src >= 0)
        _, first = np.unique(src[wanting], return_index=True)  # every row of `read`, in order
        first = wanting[first]
        step = np.searchsorted(bounds, first, side="right") - 1
        # (a row of a 1-D field is a number: its place is a 0-d view, writable as rows are)
        dests = [arrays[s][k:k + 1].reshape(spec.sample_shape)
                 for s, k in zip(step.tolist(), (first - bounds[step]).tolist())]
        hit_at = np.flatnonzero(src < 0)
        hit_step = np.searchsorted(bounds, hit_at, side="right") - 1
        name, held, inv = spec.name, self.held, self.inv

        def copy_hits() -> None:  # on this thread, while the request threads read the misses
            for s, j, u in zip(hit_step.tolist(), (hit_at - bounds[hit_step]).tolist(), inv[hit_at].tolist()):
                arrays[s][j] = held[u][name]
        self.dataset._read_rows_to(spec, self.read, dests, disjoint, split, meanwhile=copy_hits)
        return SlotRows(tensors, bounds.tolist(), dests, first, in_shm)

    def finish(self, buffer, shared: bool, steps: Sequence[int] | None = None) -> StoredBatch:
        """Put the kept misses in ``buffer`` and lay the batch out in batch order (``steps``: the
        lengths of the steps the batch is made of, each laid out in memory of its own: see
        :class:`StepRows`)."""
        p, datas, kept, ds = self, self.datas, self.kept, self.dataset
        if buffer is not None and kept.any():
            arenas = {spec.name: arena_for(buffer, spec.sample_shape, spec.dtype)
                      if spec.kind == "raw" and spec.name not in self.stable else None for spec in ds.specs}
            for j in np.flatnonzero(kept).tolist():
                keys = [(spec.name, int(p.miss[j])) for spec in ds.specs]
                for n_put, key in enumerate(keys):
                    row = datas[key[0]][p.at[j]]
                    if not buffer.put(key, row if key[0] in self.stable else _kept_row(row, arenas[key[0]])):
                        # all fields of a sample or none: a refused field (byte budget) takes
                        # back the ones already put, so no budget is spent on a half sample
                        for k in keys[:n_put]:
                            buffer.delete(k)
                        kept[j] = False
                        break
        out = p.out
        out.stay = shared if isinstance(shared, Stay) else None
        for spec in ds.specs:
            hits = {u: vals[spec.name] for u, vals in p.held.items()}
            out.fields[spec.name] = _assemble(spec, datas[spec.name], hits, p.mrank, p.inv, shared, steps)
        out.fields = deferred_fields(out.fields)
        ds.stats.hits += out.hits
        ds.stats.misses += len(p.idx) - out.hits
        ds.stats.kept += int(kept.sum())
        ds.stats.steps += 1
        return out


def _kept_row(row: np.ndarray, arena: RowArena | None) -> np.ndarray:
    """A copy of ``row`` for the buffer: in a slot of ``arena`` where its shape and dtype are
    the arena's (NOTE [ Kept rows in an arena ] in cache/arena.py), else an array of its own."""
    if arena is None or getattr(row, "shape", None) != arena.shape or row.dtype != arena.dtype:
        return np.array(row, copy=True)
    out = arena.row()
    out[...] = row
    return out


def evict_samples(ds: Any, buffer, evict: Sequence[int] | None) -> None:
    """Take the samples ``evict`` (every field) out of ``buffer``."""
    if buffer is not None:
        for i in (evict if evict is not None else ()):
            for spec in ds.specs:
                buffer.delete((spec.name, int(i)))


def empty(shape: tuple, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialized contiguous tensor, in shared memory when ``shared`` (allocated there at
    once: ``share_memory_()`` on a new tensor would copy its garbage into the shared pages)."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    n = int(np.prod(shape, dtype=np.int64))
    storage = torch.UntypedStorage._new_shared(n * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


class Samples(list):
    """A batch's samples as ``H5Dataset`` makes them (a list, as torch's fetcher expects), with
    ``columns``: one tensor per field whose rows the samples are, in sample order.

    NOTE [ One copy into the batch ]: a sample of field ``f`` is row ``i`` of ``columns[f]``, a
    view. torch's ``default_collate`` would stack those rows into a new tensor: a second copy
    of every byte of the batch (and, in a worker, a fresh shared-memory tensor the main process
    maps and faults in). :func:`collate` returns the columns themselves, which hold exactly what
    stacking would give; ``solar.DataLoader`` uses it when no ``collate_fn`` is given."""

    single: bool = False
    held: Held | None = None  # placeholders of a batch held in the loader's process
    _columns: tuple = ()
    _made: list | None = None  # the items as they were when the columns were attached

    @property
    def columns(self) -> tuple:
        return self._columns

    @columns.setter
    def columns(self, cols: tuple) -> None:
        self._columns, self._made = cols, list(self)


def collate(batch: Any) -> Any:
    """``torch.utils.data.default_collate``, except for :class:`Samples` still holding their
    columns' rows (NOTE [ One copy into the batch ]): the columns, as a list (tuple samples, as
    ``default_collate`` gives) or the one tensor (single-field samples)."""
    held = getattr(batch, "held", None)
    if held is not None:
        return held
    cols = getattr(batch, "columns", ())
    if not cols or not _rows_of(batch, cols):
        return default_collate(batch)
    return cols[0] if batch.single else list(cols)


def _rows_of(batch: "Samples", cols: tuple) -> bool:
    """Whether ``batch`` still holds, at every place, that place's rows of ``cols`` (a caller
    that changed the list gets ``default_collate``).

    The items the list held when its columns were attached (``Samples.columns``), the same
    objects at the same places, are those rows: a check per object (a per-row comparison of
    data pointers made a view of every row again, each batch, on the consumer's thread)."""
    n = len(batch)
    if not n or any(len(c) != n for c in cols):
        return False
    made = batch._made
    if made is not None and len(made) == n and all(a is b for a, b in zip(batch, made)):
        return True
    for i in range(n):
        items = (batch[i],) if batch.single else batch[i]
        if type(items) is not tuple and not batch.single or len(items) != len(cols):
            return False
        for t, c in zip(items, cols):
            if not isinstance(t, torch.Tensor) or t.data_ptr() != c[i].data_ptr() or t.shape != c.shape[1:]:
                return False
    return True


class PassLayout(NamedTuple):
    """The batches a pass is laid out in, as the caller that cut it knows them: the ``steps``'
    lengths (one step: the pass as one batch) and ``shared``, where they go (``fetch_stored``'s
    ``shared=``). It reaches :meth:`FetchPass.gather` on the ``keep`` it is handed
    (:class:`LaidOut`), so the raw fields' misses are read into their batch slots."""

    steps: tuple
    shared: Any


class LaidOut:
    """``keep=`` of a fetch (which misses to keep) that also carries the pass's :class:`PassLayout`."""

    def __init__(self, keep: Any, layout: PassLayout) -> None:
        self.keep, self.layout = keep, layout

    def __call__(self, miss: np.ndarray) -> np.ndarray:
        return self.keep(miss)


def _assemble(spec: FieldSpec, data, hits: dict, mrank: np.ndarray, inv: np.ndarray, shared: bool,
              steps: Sequence[int] | None = None):
    """Lay read rows (``data``, sorted-miss order) and buffer hits out in batch order: a raw
    field as one tensor, or with ``steps`` (step lengths) as :class:`StepRows`."""
    if spec.kind == "raw":
        if isinstance(data, (SlotRows, DeferredRows)):
            filled = data.fill(hits, mrank, inv, steps, shared and not isinstance(shared, Stay))
            if filled is not None:
                return filled
            data = np.stack(data.dests) if data.dests else np.empty((0, *spec.sample_shape), spec.dtype)
        src = mrank[inv]
        buf = getattr(data, "buf", data)  # a sieved read's rows stay in its buffer (PickedRows)
        if buf is not data:
            src = np.where(src >= 0, data.at[np.maximum(src, 0)], -1)
        bounds = [0, len(inv)] if steps is None else np.r_[0, np.cumsum(steps)].tolist()
        tensors = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            t = empty((b - a, *spec.sample_shape), torch_dtype(spec.dtype), shared and not isinstance(shared, Stay))
            _rows_into(t.numpy(), buf, src[a:b], inv[a:b], hits)
            tensors.append(t)
        return tensors[0] if steps is None else StepRows(tensors, bounds)
    blobs = [data[mrank[u]] if mrank[u] >= 0 else hits[int(u)] for u in inv.tolist()]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    flat = empty((int(offsets[-1]),), torch.uint8, shared and not isinstance(shared, Stay))
    if len(blobs):
        np.concatenate(blobs, out=flat.numpy())
    return flat, torch.from_numpy(offsets)


def _rows_into(out: np.ndarray, buf: np.ndarray, src: np.ndarray, inv: np.ndarray, hits: dict) -> None:
    """``out[j]`` = row ``src[j]`` of ``buf``, or the buffer hit of unique sample ``inv[j]``
    where ``src[j] < 0``: one copy per row (a fancy-indexed assignment copies the misses twice)."""
    if (src >= 0).all():
        np.take(buf, src, axis=0, out=out)
        return
    for j, (r, u) in enumerate(zip(src.tolist(), inv.tolist())):
        out[j] = buf[r] if r >= 0 else hits[u]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of ``dtype``'s values; a big-endian field becomes the native one (rows
    are converted when read, see :meth:`H5Dataset._read_field`)."""
    return torch.from_numpy(np.empty(0, np.dtype(dtype).newbyteorder("="))).dtype
