"""``StoredSubset``: a torch ``Subset`` of an :class:`~solar.dataset.H5Dataset` that SOLAR can drive.

NOTE [ Subsets ]
    Training scripts split one file with ``torch.utils.data.random_split`` (PtychoNN's does), or
    pick samples with ``Subset(ds, indices)``. torch's ``Subset.__getitems__`` hands its dataset a
    new list of indices, so the stored bytes the loader's read-ahead attached to the batch
    (:class:`~solar.fetch.StepBatch`) would be lost, and the wrapper hides ``fetch_stored``:
    the loader ran as torch's, without schedule, buffer or read-ahead.

    ``solar.DataLoader`` therefore replaces such a ``Subset`` (nested ones too) by a
    ``StoredSubset`` over the same ``dataset`` and ``indices``; ``loader.dataset`` is that
    object. Its samples are the file's stored rows ``rows[i]`` (the indices composed through
    every level), and everything the loader plans with is a position ``i`` in the subset: the
    schedule, the buffer's keys, ``keep`` and ``evict``. Only the read maps positions to rows
    (:meth:`H5Dataset.fetch_stored` ``rows=``), sorting and coalescing the rows as usual, so a
    split's reads are as few and as large as the whole file's. Errors name the file's sample.

    A subset that repeats a row has two samples with one row: both may be buffered, and its
    passes are not promised disjoint to a collective backend (two ranks could read the row in
    one collective read; NOTE [ Disjoint collective reads ] in ``io_backends/base.py``).
    A ``ConcatDataset`` of several files is driven too (NOTE [ Several files ] in
    ``solar/concat.py``), and so is a ``Subset`` of one: its rows are positions in the
    concatenation.

    The loader follows a ``Subset`` whose indices change between iterations, as torch's does
    (an active-learning pool that grows, a curriculum): :meth:`StoredSubset.refresh` compares
    each level's indices with the ones it last composed (a copy: ``indices[:] = ...`` changes the
    list in place) when an iteration starts, and recomposes the rows if they differ; the loader
    then starts its schedule and buffer over, since a position now names another sample.
    Subsets *inside* a ``ConcatDataset`` are composed once, when the loader is built.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from torch.utils.data import ConcatDataset, Subset

from solar.dataset import H5Dataset

__all__ = ["StoredSubset", "stored_subset", "drivable"]


class StoredSubset(Subset):
    """A ``Subset`` (same ``dataset`` and ``indices`` as the one it replaces) whose samples the
    loader reads through its base :class:`H5Dataset`; see NOTE [ Subsets ]. Build it with
    :func:`stored_subset`."""

    def __init__(self, dataset: Any, indices: Sequence[int], base: Any, rows: np.ndarray) -> None:
        super().__init__(dataset, indices)
        self.base = base  # an H5Dataset, or a StoredConcat (a split of several files)
        self.rows = rows
        #: every position a distinct stored row: passes may be collective (disjoint) reads
        self.distinct = distinct_rows(rows, len(base)) and getattr(base, "distinct", True)

    def __repr__(self) -> str:
        return f"StoredSubset({len(self.rows)} of {self.base!r})"

    def watch(self, source: Subset) -> None:
        """Follow ``source`` (the user's ``Subset`` this one replaces): see :meth:`refresh`."""
        self.source = source
        self._seen = _chain_indices(source)

    def refresh(self) -> bool:
        """Recompose the rows if the watched ``Subset``'s indices (at any level) changed since
        they were last composed; True if they did (NOTE [ Subsets ]).

        Raises:
            IndexError: a new index out of range, as :func:`stored_subset` (torch raises it at the
                first batch that reaches it).
            ConfigError: the indices are no longer integers.
        """
        source = self.__dict__.get("source")
        if source is None:
            return False
        seen = _chain_indices(source)
        if len(seen) == len(self._seen) and all(a.shape == b.shape and np.array_equal(a, b)
                                                for a, b in zip(seen, self._seen)):
            return False
        new = stored_subset(source)
        if new is None:
            from solar.errors import ConfigError

            raise ConfigError(f"{self.base.path}: the Subset's indices changed to something other than integers "
                              "(or its dataset to one SOLAR cannot drive); build a new DataLoader for it")
        # the base stays (a ConcatDataset's own view is rebuilt by stored_subset, with the same
        # positions while its datasets are the same)
        self.dataset, self.indices, self.rows, self.distinct = new.dataset, new.indices, new.rows, new.distinct
        self._seen = seen
        return True

    # -- what the loader drives (the storage-backed protocol of H5Dataset) ----------------------
    def fetch_stored(self, indices: Sequence[int], **kw) -> Any:
        return self.base.fetch_stored(indices, rows=self.rows, **kw)

    def fetch_steps(self, steps: Sequence[Sequence[int]], **kw) -> list:
        kw["disjoint"] = bool(kw.get("disjoint", False)) and self.distinct
        return self.base.fetch_steps(steps, rows=self.rows, **kw)

    def sample_nbytes(self, block: int = 1) -> np.ndarray:
        return self.base.sample_nbytes(block)[self.rows]

    def decode(self, stored) -> dict:
        return self.base.decode(stored)

    def __getitems__(self, indices: Sequence[int]) -> list:
        return self.base._getitems(indices, self.rows)

    def __getattr__(self, name: str) -> Any:
        # backend, path, specs, compressed, fields, stats, close, ... are the base dataset's (an
        # H5Dataset's or a StoredConcat's)
        if name in ("base", "rows", "distinct", "dataset", "indices", "source", "_seen") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


def _chain_indices(subset: Subset) -> list[np.ndarray]:
    """A copy of every level's indices of ``subset`` (nested torch Subsets), outermost first."""
    out = []
    d = subset
    while type(d) is Subset:
        out.append(np.array(d.indices, copy=True))
        d = d.dataset
    return out


def distinct_rows(rows: np.ndarray, n: int) -> bool:
    """No row of ``[0, n)`` twice in ``rows``: one byte per row, O(n), once per loader (2.3 s at
    9e7 rows here, where numpy 2.4's ``np.unique`` took 155 s)."""
    if len(rows) > n:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[rows] = True
    return int(np.count_nonzero(seen)) == len(rows)


def drivable(ds: Any) -> bool:
    """An :class:`H5Dataset` whose batches are made by H5Dataset's own methods. The wrappers read
    and build samples through those (and through ``decode``/``transform`` and ``__getitem__``,
    which a subclass may change: NOTE [ Subclass items ] in solar/dataset.py); a subclass with
    its own ``__getitems__`` is left to torch, which calls it."""
    t = type(ds)
    return isinstance(ds, H5Dataset) and all(getattr(t, m) is getattr(H5Dataset, m) for m in _ITEM_METHODS)


_ITEM_METHODS = ("__getitems__", "_getitems", "_items", "_samples")


def stored_subset(dataset: Any, memo: dict | None = None) -> StoredSubset | None:
    """``dataset`` as a :class:`StoredSubset` when it is a torch ``Subset`` (maybe of ``Subset`` s)
    of an :class:`H5Dataset` (or of a ``ConcatDataset`` of them, NOTE [ Several files ] in
    ``solar/concat.py``) with integer indices; else None (the loader then runs as torch's). Only
    torch's own classes are replaced, not subclasses (they may make their items otherwise), and
    only datasets that are :func:`drivable`. ``memo``: see :func:`solar.concat.stored_concat`.

    Raises:
        IndexError: an index out of range for the dataset it selects from (torch would raise it
            at the first batch that reaches it), naming the index and the file.
    """
    chain = []
    d = dataset
    while type(d) is Subset:  # torch's own: a subclass may make its items otherwise
        chain.append(d.indices)
        d = d.dataset
    if isinstance(d, StoredSubset):
        base, rows = d.base, d.rows
    elif drivable(d) and chain:
        base, rows = d, np.arange(len(d), dtype=np.int64)
    elif isinstance(d, ConcatDataset) and chain:
        from solar.concat import StoredConcat, stored_concat

        base = d if isinstance(d, StoredConcat) else stored_concat(d, memo)
        if base is None:
            return None
        rows = np.arange(len(base), dtype=np.int64)
    else:
        return None
    for indices in reversed(chain):
        sel = np.asarray(indices)
        if sel.size == 0:
            sel = sel.astype(np.int64)
        if sel.ndim != 1 or sel.dtype.kind not in "iu":
            return None
        sel = sel.astype(np.int64)
        bad = (sel < -len(rows)) | (sel >= len(rows))
        if bad.any():
            raise IndexError(
                f"{base.path}: Subset index {int(sel[bad][0])} out of range for the {len(rows)} samples it "
                f"selects from (at position {int(np.flatnonzero(bad)[0])} of its indices); check the "
                "indices given to Subset")
        rows = rows[sel]
    return StoredSubset(dataset.dataset, dataset.indices, base, rows)
