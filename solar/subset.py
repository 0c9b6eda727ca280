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
    (an active-learning pool that grows, a curriculum): :func:`solar.views.refresh` compares
    each level's indices with the ones it last composed (a copy: ``indices[:] = ...`` changes the
    list in place) when an iteration starts, and recomposes the rows if they differ; the loader
    then starts its schedule and buffer over, since a position now names another sample.
    Subsets *inside* a ``ConcatDataset`` are composed once, when the loader is built.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from torch.utils.data import Subset

from solar.dataset import H5Dataset

__all__ = ["StoredSubset", "drivable", "distinct_rows", "chain_indices"]


class StoredSubset(Subset):
    """A ``Subset`` (same ``dataset`` and ``indices`` as the one it replaces) whose samples the
    loader reads through its base :class:`H5Dataset`; see NOTE [ Subsets ]. Build it with
    :func:`solar.views.stored_subset`."""

    def __init__(self, dataset: Any, indices: Sequence[int], base: Any, rows: np.ndarray) -> None:
        super().__init__(dataset, indices)
        self.base = base  # an H5Dataset, or a StoredConcat (a split of several files)
        self.rows = rows
        #: every position a distinct stored row: passes may be collective (disjoint) reads
        self.distinct = distinct_rows(rows, len(base)) and getattr(base, "distinct", True)

    def __repr__(self) -> str:
        return f"StoredSubset({len(self.rows)} of {self.base!r})"

    def watch(self, source: Subset) -> None:
        """Follow ``source`` (the user's ``Subset`` this one replaces): see :func:`solar.views.refresh`."""
        self.source = source
        self._seen = chain_indices(source)

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


def chain_indices(subset: Subset) -> list[np.ndarray]:
    """A copy of every level's indices of ``subset`` (nested torch Subsets), outermost first."""
    out = []
    d = subset
    while type(d) is Subset:
        out.append(np.array(d.indices, copy=True))
        d = d.dataset
    return out


def distinct_rows(rows: np.ndarray, n: int) -> bool:
    """No row of ``[0, n)`` twice in ``rows``: one byte per row, O(n), once per loader
    (``np.unique`` would sort a copy of the rows: O(n log n))."""
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
