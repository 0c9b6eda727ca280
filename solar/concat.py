"""``StoredConcat``: a torch ``ConcatDataset`` of H5Datasets (several files) that SOLAR can drive.

NOTE [ Several files ]
    Data sets that arrive as shards (one file per run, per year, per 10^4 samples) are joined in
    training scripts with ``ConcatDataset([H5Dataset(f) for f in files])``, maybe split again with
    ``random_split``. ``solar.DataLoader`` replaces such a ``ConcatDataset`` by a ``StoredConcat``
    over the same ``datasets`` (``loader.dataset`` is that object), so the schedule, the buffer and
    the read-ahead span all files: one index space of ``sum(len)`` samples, planned as one.

    A pass (the steps the read-ahead loads together) is split by file: each file reads its own
    samples with its own coalesced ``read_ranges`` per field, the files always in the same order
    (so every rank makes the same collective calls, also for a file only other ranks read from:
    NOTE [ Collective-safe reads ] in ``solar/dataset.py``; one allreduce per pass first tells
    every rank which files some rank reads, and the others are skipped). On a collective backend
    each file a pass reads costs a few collective calls (an ``H5Dread`` and an agreement per
    field), and each file of a pass costs Python work of its own: with hundreds of files of a few
    samples each, a pass pays more for them than for its bytes (``bench/loader/files.py``;
    bench/loader/files.json and files-1rank.json, against torch's per-sample serial h5py
    reads). Other backends read the files of a pass side by side on one lasting pool of
    request threads, each file in one thread. The buffer's keys stay the positions in the
    concatenation. A pass runs in the four phases of one file's fetch, across all files:
    every file's hits are taken, then every file is read, then the pass's evictions leave the
    buffer, then the kept misses are put (so a hit is never evicted before it is taken, and a put
    never waits on an eviction of a later file). Each file decodes and transforms its own samples
    (its ``device``, ``transform``, errors naming its path), placed back in batch order.

    Every file must have the same field names; all of them must be read collectively or none
    (one parallel-HDF5 file beside an http URL would put the ranks out of step), else the loader
    warns and runs as torch's. A concatenation that holds one stored row twice (two Subsets of
    one file that overlap) does not promise disjoint reads to a collective backend (NOTE
    [ Subsets ] in ``solar/subset.py``).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import fields as _fields
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import ConcatDataset

from solar.collective import agree, agreement_at_end, union
from solar.collective import lockstep as _lockstep
from solar.dataset import H5Dataset
from solar.fetch import FetchPass, StoredBatch, as_indices, evict_samples
from solar.subset import distinct_rows
from solar.errors import CorruptDataError

__all__ = ["StoredConcat"]


class _Rows:
    """Positions -> one file's stored rows, ``local[perm[outer[p]] - offset]`` (``outer``: a
    Subset of the concatenation; ``perm``: its positions in part order, see
    :class:`StoredConcat`; ``local``: the file's own Subset; each optional), in the form
    ``H5Dataset.fetch_stored`` takes as ``rows=`` (``len`` and integer-array indexing), without
    an O(N) array per file."""

    def __init__(self, n: int, offset: int, outer=None, local: np.ndarray | None = None,
                 perm: np.ndarray | None = None) -> None:
        self.n, self.offset, self.outer, self.local, self.perm = n, offset, outer, local, perm

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx) -> np.ndarray:
        p = np.asarray(idx, dtype=np.int64)
        if self.outer is not None:
            p = np.asarray(self.outer[p], dtype=np.int64)
        if self.perm is not None:
            p = self.perm[p]
        p = p - self.offset
        return p if self.local is None else self.local[p]


class _ConcatStored:
    """One step's stored data over several files: ``parts`` of ``(file, slots, StoredBatch)``,
    ``slots`` being the places in the batch of that file's samples. Pickles (shared-memory
    tensors inside) to a worker like a :class:`~solar.fetch.StoredBatch`."""

    def __init__(self, n: int, parts: list[tuple[int, np.ndarray, StoredBatch]]) -> None:
        self.n = n
        self.parts = parts
        self.hits = sum(st.hits for _, _, st in parts)


class StoredConcat(ConcatDataset):
    """A ``ConcatDataset`` (same ``datasets`` as the one it replaces) whose files the loader
    reads as one index space; see NOTE [ Several files ]. Built by :func:`solar.views.stored_concat`."""

    def __init__(self, datasets: Sequence[Any], parts: list[tuple[H5Dataset, np.ndarray | None]],
                 perm: np.ndarray | None = None) -> None:
        super().__init__(datasets)
        self.parts = parts  # per part: its file's dataset and the part's rows (None: all); nested
        # ConcatDatasets are flattened, so parts and members may differ
        self.bounds = np.r_[0, np.cumsum([len(ds) if r is None else len(r) for ds, r in parts])].astype(np.int64)
        # A member that is a Subset of a ConcatDataset interleaves files: its positions cannot be
        # one run of a part. Then every part of its concatenation joins the parts, and ``perm``
        # maps each position of this concatenation to its place in the parts (None: the same).
        self.perm = perm
        self.distinct = _distinct(parts) and (perm is None or distinct_rows(perm, int(self.bounds[-1])))

    def __repr__(self) -> str:
        return f"StoredConcat({len(self)} samples in {len(self.parts)} parts of {self.path})"

    # -- what the loader reads of it ------------------------------------------------------------
    @property
    def backend(self):
        return self.parts[0][0].backend

    @property
    def path(self) -> str:
        paths = list(dict.fromkeys(ds.path for ds, _ in self.parts))
        return paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more files"

    @property
    def specs(self):
        return self.parts[0][0].specs

    @property
    def compressed(self) -> bool:
        return any(ds.compressed for ds, _ in self.parts)

    def sample_nbytes(self, block: int = 1) -> np.ndarray:
        sizes = np.concatenate([ds.sample_nbytes(block) if rows is None else ds.sample_nbytes(block)[rows]
                                for ds, rows in self.parts] or [np.zeros(0, np.int64)])
        return sizes if self.perm is None else sizes[self.perm]

    def fetch_stored(self, indices: Sequence[int], buffer=None, keep=None, shared: bool = False,
                     evict: Sequence[int] | None = None, disjoint: bool = False, rows=None) -> _ConcatStored:
        return self.fetch_steps([indices], buffer=buffer, keep=keep, shared=shared, evict=evict,
                                disjoint=disjoint, lockstep=False, rows=rows)[0]

    def fetch_steps(self, steps: Sequence[Sequence[int]], buffer=None, keep=None, shared: bool = False,
                    evict: Sequence[int] | None = None, decode: bool = False, disjoint: bool = False,
                    lockstep: bool = True, rows=None) -> list:
        """:meth:`H5Dataset.fetch_steps` over the files (NOTE [ Several files ]); ``rows``: as
        there (a ``Subset`` of this concatenation)."""
        n = len(self) if rows is None else len(rows)
        lengths = [len(s) for s in steps]
        flat = as_indices([i for s in steps for i in s], self.path, n)
        disjoint = disjoint and self.distinct
        with _lockstep() if (lockstep or disjoint) else contextlib.nullcontext():
            bad = (flat < -n) | (flat >= n)
            agree(self.backend, None if not bad.any() else IndexError(  # every rank raises, or none
                f"{self.path}: sample index {int(flat[bad][0])} out of range for {n} samples "
                f"({f'valid: -{n}..{n - 1}' if n else 'the dataset is empty'}); check the sampler or the "
                "indices passed"), where=self.path)
            flat = np.where(flat < 0, flat + n, flat)
            where = flat if rows is None else np.asarray(rows[flat], dtype=np.int64)
            if self.perm is not None:
                where = self.perm[where]
            member = np.searchsorted(self.bounds, where, side="right") - 1
            by_member = np.argsort(member, kind="stable")  # each part's places in the pass, in order
            cut = np.searchsorted(member[by_member], np.arange(len(self.parts) + 1))
            places = [by_member[cut[k]:cut[k + 1]] for k in range(len(self.parts))]
            # the parts some rank reads in this pass: in lockstep on a collective backend every
            # rank makes the calls of each (one allreduce), elsewhere this rank's own
            busy = np.flatnonzero(union(self.backend, np.diff(cut) > 0)).tolist()
            pending = {}
            for k in busy:  # 1. every file's hits (the same order on every rank)
                ds, local = self.parts[k]
                pending[k] = FetchPass.gather(ds, flat[places[k]], buffer, keep,
                                              _Rows(n, int(self.bounds[k]), rows, local, self.perm),
                                              checked=True)  # (agreed above; a part's positions map into it)
            with agreement_at_end(self.backend, self.path):  # 2. every file's reads, their
                self._load(busy, pending, disjoint)  # failures agreed once (NOTE [ One agreement per pass ])
            evict_samples(self.parts[0][0], buffer, evict)  # 3. the pass's evictions (keys: positions)
            whole = {k: pending[k].finish(buffer, shared) for k in busy}  # 4. puts
            problem, decoded = None, {}
            try:  # each file's pass decoded at once (one decode_batch per field), or verified
                decoded = {k: self.parts[k][0]._ready(w, decode) for k, w in whole.items() if w.n}
            except CorruptDataError as exc:  # one rank's damaged blob stops every rank
                problem = exc
            agree(self.backend, problem, where=self.path)
        edges = np.r_[0, np.cumsum(lengths)]
        out: list = [[] for _ in steps]
        for k, at in enumerate(places):
            # steps are ranges of the pass, so each step's samples of part k are a range of `at`
            step_cut = np.searchsorted(at, edges)
            for s in np.flatnonzero(np.diff(step_cut)).tolist():
                a, b = int(step_cut[s]), int(step_cut[s + 1])
                out[s].append((k, at[a:b] - edges[s], whole[k].part(a, b, decoded.get(k))))
        return [_ConcatStored(length, parts) for length, parts in zip(lengths, out)]

    def _load(self, busy: list[int], pending: dict, disjoint: bool) -> None:
        """Read the pass's files: one after another on a collective backend (every rank in the
        same order), else several at once on one pool of ``max(io_threads)`` threads, each file
        in one thread (``split=False``): files of a few samples each gave every file its own pool
        of ``io_threads`` (400 threads for 100 files, 4x slower than one thread), and reading
        files side by side overlaps their latency as the split of one file's ranges does."""
        if self.backend.collective or len(busy) < 2:
            for k in busy:
                pending[k].load(disjoint)
            return
        def read(ks: list[int]) -> None:
            for k in ks:
                pending[k].load(disjoint, False)

        # one task per thread, each a share of the files (a task per file cost a Future and a
        # queue round trip per file of the pass)
        n = max(ds.io_threads for ds, _ in self.parts)
        pool = self._io_pool(n)
        futs = [pool.submit(read, busy[i::n]) for i in range(min(n, len(busy)))]
        wait(futs)  # every file read (or failed) before the pass goes on or raises
        for f in futs:
            f.result()

    def _io_pool(self, threads: int):
        """This process's pool of ``threads`` threads for side-by-side file reads, kept across
        passes: a pool per pass started its threads again every pass (with hundreds of files of a
        few samples, thread starts were a tenth of the pass). No lock: two iterators that make a
        pool at once leave one of them to end with its last task, and a lock held at a fork
        would hang a forked worker's first pass."""
        pool = self.__dict__.get("_pool")
        if pool is None or self.__dict__.get("_pool_pid") != os.getpid():  # none yet, or forked
            pool = ThreadPoolExecutor(threads, thread_name_prefix="solar-io")
            self._pool, self._pool_pid = pool, os.getpid()
        return pool

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_pool", None)  # threads do not cross processes
        state.pop("_pool_pid", None)
        return state

    # -- what a dataset offers its user -----------------------------------------------------------
    @property
    def fields(self) -> tuple[str, ...]:
        return self.parts[0][0].fields

    @property
    def num_samples(self) -> int:
        return len(self)

    @property
    def stats(self):
        """The files' counters summed (each file's own: ``ds.stats``)."""
        files = list({id(ds): ds for ds, _ in self.parts}.values())
        total = type(files[0].stats)()
        for f in _fields(total):
            setattr(total, f.name, sum(getattr(ds.stats, f.name) for ds in files))
        return total

    def close(self) -> None:
        """Close every file (collective on parallel HDF5: call it on every rank)."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None and self.__dict__.get("_pool_pid") == os.getpid():
            pool.shutdown(wait=True)
        for ds in {id(ds): ds for ds, _ in self.parts}.values():
            ds.close()

    # -- the Dataset protocol ---------------------------------------------------------------------
    def __getitems__(self, indices: Sequence[int]) -> list:
        return self._getitems(indices)

    def _getitems(self, indices: Sequence[int], rows=None) -> list:
        stored = getattr(indices, "stored", None)
        if stored is None:
            stored = self.fetch_stored(indices, rows=rows)
        samples: list = [None] * stored.n
        for k, slots, part in stored.parts:
            ds = self.parts[k][0]
            tensors = part.decoded if part.decoded is not None else ds.decode(part)
            for j, sample in zip(slots.tolist(), ds._items(part, tensors)):  # its own __getitem__
                samples[j] = sample
        return samples

    def decode(self, stored: _ConcatStored) -> dict[str, torch.Tensor]:
        """Every file's part decoded and placed in batch order: ``{field: (n, *shape)}``."""
        out: dict[str, torch.Tensor] = {}
        for k, slots, part in stored.parts:
            tensors = part.decoded if part.decoded is not None else self.parts[k][0].decode(part)
            for name, t in tensors.items():
                if name not in out:
                    out[name] = torch.empty((stored.n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                out[name][torch.from_numpy(slots)] = t
        return out


def _distinct(parts: list[tuple[H5Dataset, np.ndarray | None]]) -> bool:
    """No stored row of any file twice in the concatenation."""
    by_file: dict[int, tuple[H5Dataset, list]] = {}
    for ds, rows in parts:
        by_file.setdefault(id(ds), (ds, []))[1].append(np.arange(len(ds)) if rows is None else rows)
    return all(distinct_rows(np.concatenate(rows), len(ds)) for ds, rows in by_file.values())
