"""One fetch of stored samples, phase by phase, and the batches it hands on.

``H5Dataset.fetch_stored`` is a :class:`FetchPass`: gather (buffer hits, which misses to keep),
load (the misses' rows, through :class:`solar.reads.RowReads`), evict, finish (buffer puts, the
batch laid out in batch order as a :class:`StoredBatch`). The loader carries each step's
:class:`StoredBatch` to ``__getitems__`` inside a :class:`StepBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from solar.cache import TierStats
from solar.errors import InputError
from solar.layout import FieldSpec

__all__ = ["FetchPass", "FetchStats", "StoredBatch", "StepBatch", "as_indices", "evict_samples", "torch_dtype"]


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

    def part(self, a: int, b: int, decoded: dict[str, torch.Tensor] | None = None) -> "StoredBatch":
        """Samples ``[a, b)`` (views): of the stored fields, or of ``decoded`` (this batch's
        decoded tensors), which the part then carries instead of stored bytes."""
        out = StoredBatch(b - a, indices=self.indices[a:b])
        if decoded is not None:
            out.decoded = {name: t[a:b] for name, t in decoded.items()}
            return out
        for name, val in self.fields.items():
            if isinstance(val, tuple):
                blobs, off = val
                out.fields[name] = (blobs[int(off[a]):int(off[b])], off[a:b + 1] - off[a])
            else:
                out.fields[name] = val[a:b]
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
        return cls(ds, out, idx, inv, held, miss, kept, read, at, mrank)

    def load(self, disjoint: bool, split: bool = True) -> None:
        """Read the misses' rows: one ``read_ranges`` per field, in field order (``split=False``:
        in this thread, see :meth:`solar.reads.RowReads._read`)."""
        ds = self.dataset
        self.datas = {spec.name: ds._read_field(spec, self.read, disjoint, split) for spec in ds.specs}

    def finish(self, buffer, shared: bool) -> StoredBatch:
        """Put the kept misses in ``buffer`` and lay the batch out in batch order."""
        p, datas, kept, ds = self, self.datas, self.kept, self.dataset
        if buffer is not None:
            for j in np.flatnonzero(kept).tolist():
                keys = [(spec.name, int(p.miss[j])) for spec in ds.specs]
                for n_put, key in enumerate(keys):
                    if not buffer.put(key, np.array(datas[key[0]][p.at[j]], copy=True)):
                        # all fields of a sample or none: a refused field (byte budget) takes
                        # back the ones already put, so no budget is spent on a half sample
                        for k in keys[:n_put]:
                            buffer.delete(k)
                        kept[j] = False
                        break
        out = p.out
        for spec in ds.specs:
            hits = {u: vals[spec.name] for u, vals in p.held.items()}
            out.fields[spec.name] = _assemble(spec, datas[spec.name], hits, p.mrank, p.inv, shared)
        ds.stats.hits += out.hits
        ds.stats.misses += len(p.idx) - out.hits
        ds.stats.kept += int(kept.sum())
        ds.stats.steps += 1
        return out


def evict_samples(ds: Any, buffer, evict: Sequence[int] | None) -> None:
    """Take the samples ``evict`` (every field) out of ``buffer``."""
    if buffer is not None:
        for i in (evict if evict is not None else ()):
            for spec in ds.specs:
                buffer.delete((spec.name, int(i)))


def _assemble(spec: FieldSpec, data, hits: dict, mrank: np.ndarray, inv: np.ndarray, shared: bool):
    """Lay read rows (``data``, sorted-miss order) and buffer hits out in batch order."""
    if spec.kind == "raw":
        t = torch.empty((len(inv), *spec.sample_shape), dtype=torch_dtype(spec.dtype))
        if shared:
            t.share_memory_()
        a = t.numpy()
        src = mrank[inv]
        m = src >= 0
        if m.all():
            np.take(data, src, axis=0, out=a)
        else:
            a[m] = data[src[m]]
            for j in np.flatnonzero(~m).tolist():
                a[j] = hits[int(inv[j])]
        return t
    blobs = [data[mrank[u]] if mrank[u] >= 0 else hits[int(u)] for u in inv.tolist()]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    flat = torch.empty(int(offsets[-1]), dtype=torch.uint8)
    if shared:
        flat.share_memory_()
    if len(blobs):
        np.concatenate(blobs, out=flat.numpy())
    return flat, torch.from_numpy(offsets)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of ``dtype``'s values; a big-endian field becomes the native one (rows
    are converted when read, see :meth:`H5Dataset._read_field`)."""
    return torch.from_numpy(np.empty(0, np.dtype(dtype).newbyteorder("="))).dtype
