"""Which torch ``Subset`` / ``ConcatDataset`` trees SOLAR drives, and their stored views.

``solar.DataLoader`` hands its dataset to :func:`stored_subset` or :func:`stored_concat`; each
returns the :class:`~solar.subset.StoredSubset` or :class:`~solar.concat.StoredConcat` that
replaces it, or None when the tree holds anything SOLAR cannot drive (the loader then runs as
torch's). The two are mutually recursive (a ``Subset`` of a ``ConcatDataset`` of ``Subset`` s
...), so they live here, above the two view classes, which import neither.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, Subset

from solar.concat import StoredConcat
from solar.dataset import H5Dataset
from solar.errors import ConfigError
from solar.subset import StoredSubset, chain_indices, drivable

__all__ = ["stored_subset", "stored_concat", "refresh"]


def stored_subset(dataset: Any, memo: dict | None = None) -> StoredSubset | None:
    """``dataset`` as a :class:`StoredSubset` when it is a torch ``Subset`` (maybe of ``Subset`` s)
    of an :class:`H5Dataset` (or of a ``ConcatDataset`` of them, NOTE [ Several files ] in
    ``solar/concat.py``) with integer indices; else None (the loader then runs as torch's). Only
    torch's own classes are replaced, not subclasses (they may make their items otherwise), and
    only datasets that are :func:`drivable`. ``memo``: see :func:`stored_concat`.

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


def stored_concat(dataset: Any, memo: dict | None = None) -> StoredConcat | None:
    """``dataset`` as a :class:`StoredConcat` when it is a ``ConcatDataset`` whose members are
    H5Datasets, Subsets of them or ConcatDatasets of those (torch's own classes, and
    :func:`~solar.subset.drivable` files), with one set of field names and all read collectively
    or none; else None (the loader then runs as torch's, with a warning).

    ``memo`` (one per build): each ``ConcatDataset`` object is converted once, and members that
    select from the same one (``ConcatDataset([train, val])`` of one ``random_split``) share its
    parts instead of adding them again (twice the read calls, and no disjoint reads)."""
    if type(dataset) is not ConcatDataset:  # torch's own: a subclass may make its items otherwise
        return None
    memo = {} if memo is None else memo
    if id(dataset) in memo:
        return memo[id(dataset)][1]
    parts: list[tuple[H5Dataset, np.ndarray | None]] = []
    places: list[np.ndarray] = []  # per member: where its positions are in the parts
    placed: dict[int, int] = {}  # inner StoredConcat -> where its parts start
    size = 0  # of the parts so far
    for d in dataset.datasets:
        if type(d) is Subset:
            d = stored_subset(d, memo)
        if drivable(d) or (isinstance(d, StoredSubset) and isinstance(d.base, H5Dataset)):
            part = (d, None) if drivable(d) else (d.base, d.rows)
            n = len(d)
            parts.append(part)
        elif isinstance(d, StoredSubset) or isinstance(d, StoredConcat) or type(d) is ConcatDataset:
            inner = d.base if isinstance(d, StoredSubset) else d if isinstance(d, StoredConcat) else \
                stored_concat(d, memo)
            if not isinstance(inner, StoredConcat):
                return None
            at = np.arange(len(inner), dtype=np.int64) if inner.perm is None else inner.perm
            if isinstance(d, StoredSubset):  # a Subset of a ConcatDataset: positions in the inner one
                at = at[d.rows]
            if id(inner) not in placed:
                placed[id(inner)] = size
                parts += inner.parts
                size += int(inner.bounds[-1])
            places.append(placed[id(inner)] + at)
            continue
        else:
            return None
        places.append(np.arange(size, size + n, dtype=np.int64))
        size += n
    if not parts:
        return None
    names = {tuple(s.name for s in ds.specs) for ds, _ in parts}
    collective = {bool(ds.backend.collective) for ds, _ in parts}
    if len(names) != 1 or len(collective) != 1:
        return None
    perm = np.concatenate(places)
    out = StoredConcat(dataset.datasets, parts, None if np.array_equal(perm, np.arange(size)) else perm)
    memo[id(dataset)] = (dataset, out)  # (the dataset kept alive: its id stays its own)
    return out


def refresh(view: StoredSubset) -> bool:
    """Recompose ``view``'s rows if the watched ``Subset``'s indices (at any level) changed since
    they were last composed; True if they did (NOTE [ Subsets ]).

    Raises:
        IndexError: a new index out of range, as :func:`stored_subset` (torch raises it at the
            first batch that reaches it).
        ConfigError: the indices are no longer integers.
    """
    source = view.__dict__.get("source")
    if source is None:
        return False
    seen = chain_indices(source)
    if len(seen) == len(view._seen) and all(a.shape == b.shape and np.array_equal(a, b)
                                            for a, b in zip(seen, view._seen)):
        return False
    new = stored_subset(source)
    if new is None:
        raise ConfigError(f"{view.base.path}: the Subset's indices changed to something other than integers "
                          "(or its dataset to one SOLAR cannot drive); build a new DataLoader for it")
    # the base stays (a ConcatDataset's own view is rebuilt by stored_subset, with the same
    # positions while its datasets are the same)
    view.dataset, view.indices, view.rows, view.distinct = new.dataset, new.indices, new.rows, new.distinct
    view._seen = seen
    return True
