"""How one field's wanted rows become few large storage requests, and are checked.

``H5Dataset`` (and the views over it) read through :class:`RowReads`: rows are coalesced into
runs, runs are merged across small gaps (sieving), a run list is read with one ``read_ranges``
call per field, split over request threads where the backend is not collective, and the rows
read are checked against the file's xxh3 checksums. The mixin needs ``backend``, ``path``,
``num_samples``, ``verify``, ``sieve_bytes``, ``io_threads``, ``stats`` and the caches set up by
``H5Dataset.__init__`` (``_pool``, ``_pool_lock``, ``_pool_pid``, ``_offsets``, ``_checksums``,
``_has_checksum``).
"""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from solar.collective import agree
from solar.errors import CorruptDataError
from solar.layout import FieldSpec, checksum_key, sample_checksum

__all__ = ["RowReads", "PickedRows", "coalesce", "SPLIT_BYTES"]

#: Smallest piece a range is cut into to spread one read over several request threads.
SPLIT_BYTES = 64 << 10


def coalesce(sorted_rows: np.ndarray) -> np.ndarray:
    """``(k, 2)`` ``[start, stop)`` runs of a sorted, duplicate-free row array."""
    rows = np.asarray(sorted_rows, dtype=np.int64)
    if not len(rows):
        return np.empty((0, 2), dtype=np.int64)
    brk = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.r_[0, brk]]
    stops = rows[np.r_[brk - 1, len(rows) - 1]] + 1
    return np.stack([starts, stops], axis=1)


def _picked(buf: np.ndarray, runs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The ``rows`` (sorted, unique) of ``buf``, the concatenated rows of ``runs`` that cover them."""
    return buf if len(buf) == len(rows) else buf[_places(runs, rows)]


def _places(runs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where each of ``rows`` (sorted, unique) lies in the concatenated rows of ``runs``."""
    run_of = np.searchsorted(runs[:, 1], rows, side="right")
    base = np.r_[0, np.cumsum(runs[:, 1] - runs[:, 0])][:-1]
    return base[run_of] + rows - runs[run_of, 0]


class PickedRows:
    """The wanted rows of a sieved read, left where they were read (``buf[at[j]]`` is wanted row
    ``j``): picking them out into an array of their own would copy every byte once more before
    the batch's layout copies it again (NOTE [ One copy into the batch ] in solar/fetch.py)."""

    __slots__ = ("buf", "at", "dtype")

    def __init__(self, buf: np.ndarray, at: np.ndarray) -> None:
        self.buf, self.at, self.dtype = buf, at, buf.dtype

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.buf[self.at[j]]

    def astype(self, dtype) -> "PickedRows":
        return PickedRows(self.buf.astype(dtype), self.at)



class RowReads:
    """Range planning, threaded range reads and checksums of a storage-backed dataset."""


    #: Stored checksums of a field up to this size are read whole once; above, each pass reads
    #: its rows' checksums (NOTE [ Checksums are read with the rows ]).
    WHOLE_CHECKSUMS_BYTES = 16 << 20

    def _forget_forked_pool(self) -> None:
        """In a forked child (a torch worker of a plain DataLoader), the parent's request threads
        do not exist and its lock may have been held at the fork: start over with none. Without
        this, the first split read waited forever on futures no thread would run."""
        if self.__dict__.get("_pool_pid") != os.getpid():
            self._pool_lock = threading.Lock()
            self._pool = None
            self.__dict__.pop("_clones", None)
            self._pool_pid = os.getpid()

    def _offsets_of(self, spec: FieldSpec) -> np.ndarray:
        off = self._offsets.get(spec.name)
        if off is None:
            off = self.backend.read_all(spec.offsets_key).astype(np.int64)
            self._check_offsets(spec, off)
            self._offsets[spec.name] = off
        return off

    def _check_offsets(self, spec: FieldSpec, off: np.ndarray) -> None:
        """A compressed field's offsets start at 0, never decrease and end inside its data.

        Why: they carry no checksum, and a damaged one would read as a byte range past the data
        (the backend's ``IndexError``, which ``for s in ds`` takes for the end of the data, so it
        stops early, silently) or a backward range (a bare ``ValueError``), depending on the
        batch."""
        size = int(self.backend.info(spec.data_key).shape[0])
        bad = None
        if len(off) != self.num_samples + 1 or (len(off) and off[0] != 0):
            bad = 0
        elif len(off):
            step = np.flatnonzero(np.diff(off) < 0)
            past = np.flatnonzero(off[1:] > size)
            hits = [int(a[0]) for a in (step, past) if a.size]
            bad = min(hits) if hits else None
        if bad is not None:
            raise CorruptDataError(
                f"{self.path}: field {spec.name!r}: the offsets index of its compressed samples is damaged at "
                f"sample {bad} ({len(off)} offsets for {self.num_samples} samples, {size} bytes of data); "
                "re-create the file (solar ingest)")

    def _runs(self, spec: FieldSpec, rows: np.ndarray) -> np.ndarray:
        """Row runs to request: coalesced, then merged across gaps of at most ``sieve_bytes``.

        NOTE [ No sieving in collective reads ]: a collective backend reads exactly the wanted
        rows. The schedule can then promise that its ranks' requests are disjoint (each sample of
        a global batch goes to one rank), which the collective transfer needs: gap reads would
        overlap other ranks' rows, and Open MPI 4.1's default MPI-IO returns zeros for parts of
        overlapping collective reads (NOTE [ Disjoint collective reads ] in io_backends/base.py).
        Sieving also buys nothing there: the two-phase collective read already merges the ranks'
        scattered rows into large contiguous reads at its aggregators.
        """
        runs = coalesce(rows)
        if len(runs) < 2 or not self.sieve_bytes or getattr(self.backend, "collective", False):
            return runs
        if spec.kind == "raw":
            gap = (runs[1:, 0] - runs[:-1, 1]) * (int(np.prod(spec.sample_shape, dtype=np.int64)) * spec.dtype.itemsize)
        else:
            off = self._offsets_of(spec)
            gap = off[runs[1:, 0]] - off[runs[:-1, 1]]
        brk = np.flatnonzero(gap > self.sieve_bytes) + 1
        return np.stack([runs[np.r_[0, brk], 0], runs[np.r_[brk - 1, len(runs) - 1], 1]], axis=1)

    def _read(self, key: str, ranges: np.ndarray, disjoint: bool = False, split: bool = True) -> np.ndarray:
        """One logical ``read_ranges`` per field and fetch; split over ``io_threads`` concurrent
        requests when the backend is not collective (each thread reads its share of the ranges
        straight into its slice of the output).

        The shares are equal in rows (bytes), cutting a range in two where needed: a sieved pass
        is often one long range, which one request stream would read at one reader's bandwidth.
        Pieces stay at least ``SPLIT_BYTES`` long unless the ranges are already that many.
        ``split=False`` reads in this thread (a caller that reads several files at once), and
        so does a key whose reads take h5py's lock (NOTE [ Reads outside h5py's lock ] in
        io_backends/hdf5.py): split, they only took turns.
        """
        total = int((ranges[:, 1] - ranges[:, 0]).sum()) if len(ranges) else 0
        shares = self._shares(key, ranges, total, disjoint, split)
        if shares is None:
            return self.backend.read_ranges(key, ranges, disjoint=disjoint)
        info = self.backend.info(key)
        out = np.empty((total, *info.row_shape), dtype=info.dtype)
        self._on_threads([(lambda b, p=p, a=a, z=z: b.read_ranges(key, p, out[a:z])) for p, a, z in shares])
        return out

    def _read_to(self, key: str, ranges: np.ndarray, dests: list, disjoint: bool = False, split: bool = True,
                 meanwhile: Callable[[], None] | None = None) -> None:
        """:meth:`_read`, each row straight into its own place (``dests``: one row array per
        row of ``ranges``; :meth:`HDF5Backend.read_rows_to`), split over the request threads
        alike; ``meanwhile()`` runs on this thread while they read (after the read, unsplit)."""
        total = len(dests)
        shares = self._shares(key, ranges, total, disjoint, split)
        if shares is None:
            self.backend.read_rows_to(key, ranges, dests)
            if meanwhile is not None:
                meanwhile()
            return
        self._on_threads([(lambda b, p=p, a=a, z=z: b.read_rows_to(key, p, dests[a:z])) for p, a, z in shares],
                         meanwhile)

    def _shares(self, key: str, ranges: np.ndarray, total: int, disjoint: bool, split: bool):
        """How one read of ``ranges`` (``total`` rows) is split over the request threads: a list
        of ``(ranges, first row, end row)`` per thread, or None to read it in this thread."""
        if (self.io_threads <= 1 or self.backend.collective or total <= 1 or not split
                or self.backend.serializes_reads(key)):  # threads would take turns under h5py's lock
            return None
        starts = np.r_[0, np.cumsum(ranges[:, 1] - ranges[:, 0])]
        info = self.backend.info(key)
        row_bytes = int(np.prod(info.row_shape, dtype=np.int64)) * info.dtype.itemsize
        t = min(self.io_threads, total, max(len(ranges), total * row_bytes // SPLIT_BYTES))
        if t <= 1:
            return None
        cut = np.linspace(0, total, t + 1).round().astype(np.int64)  # output rows of each thread
        edges = np.sort(np.concatenate([starts, cut]))  # pieces: the ranges, cut where a thread's share ends
        edges = edges[np.r_[True, edges[1:] != edges[:-1]]]  # (np.union1d: NOTE [ First batch ] in passes.py)
        lo, hi = edges[:-1], edges[1:]
        r = np.searchsorted(starts, lo, side="right") - 1
        pieces = np.stack([ranges[r, 0] + lo - starts[r], ranges[r, 0] + hi - starts[r]], axis=1)
        first = np.searchsorted(lo, cut)  # each thread's first piece
        return [(pieces[a:b], int(cut[i]), int(cut[i + 1])) for i, (a, b) in enumerate(zip(first[:-1], first[1:]))
                if b > a]

    def _on_threads(self, calls: list, meanwhile: Callable[[], None] | None = None) -> None:
        """Run ``calls[i](backend)`` on request thread ``i``, each with its own backend clone
        (and ``meanwhile()`` on this thread while they run).

        One split read at a time per dataset: the clones' handles (an fsspec file's position)
        must not be shared by two readers, e.g. two loaders or iterators over one dataset."""
        self._forget_forked_pool()
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="solar-io")
                # One backend per request thread (unpickled copies open their own handles): handles
                # and per-backend counters are then never shared between threads.
                self._clones = [pickle.loads(pickle.dumps(self.backend)) for _ in range(self.io_threads)]
            futs = [self._pool.submit(call, self._clones[i]) for i, call in enumerate(calls)]
            try:
                if meanwhile is not None:
                    meanwhile()
                for f in futs:
                    f.result()
            finally:  # the clones' counters belong to ds.backend.stats
                for clone in self._clones:
                    self.backend.stats.absorb(clone.stats)

    def _read_field(self, spec: FieldSpec, rows: np.ndarray, disjoint: bool = False,
                    split: bool = True) -> list[np.ndarray] | np.ndarray:
        """Read sorted unique ``rows`` of one field with one ``read_ranges`` call (maybe empty).
        ``disjoint``: see :meth:`fetch_stored`; ``split``: see :meth:`_read`.

        Returns the rows (raw: an array in ``rows`` order, or :class:`PickedRows` of a sieved
        read; codec: a list of blobs).
        """
        runs = self._runs(spec, rows)
        if spec.kind == "raw":
            want = runs
        else:
            off = self._offsets_of(spec)
            want = np.stack([off[runs[:, 0]], off[runs[:, 1]]], axis=1) if len(runs) else runs
        problem = None
        try:
            buf = self._read(spec.data_key, want, disjoint, split)
        except (OSError, CorruptDataError) as exc:  # e.g. a damaged chunk on one rank: every rank
            problem = exc                           # raises (in lockstep), none waits in the next call
        agree(self.backend, problem, later=True)
        if problem is not None:  # agreed at the pass's end: go on with zeros, in step with the
            info = self.backend.info(spec.data_key)  # other ranks (NOTE [ One agreement per pass ])
            buf = np.zeros((int((want[:, 1] - want[:, 0]).sum()), *info.row_shape), info.dtype)
        self.stats.read_calls += len(want)
        self.stats.bytes_in += int(buf.nbytes)
        # where each wanted row starts in the concatenated buffer
        run_of = np.searchsorted(runs[:, 1], rows, side="right") if len(rows) else rows
        if spec.kind == "raw":
            data = buf if len(buf) == len(rows) else PickedRows(buf, _places(runs, rows))
        else:
            lengths = want[:, 1] - want[:, 0] if len(want) else np.zeros(0, np.int64)
            base = np.r_[0, np.cumsum(lengths)][:-1]
            first_byte = off[runs[:, 0]] if len(runs) else runs
            start = base[run_of] + off[rows] - first_byte[run_of] if len(rows) else rows
            sizes = off[rows + 1] - off[rows]
            data = [buf[a:a + n] for a, n in zip(start.tolist(), sizes.tolist())]
        self._checked(spec, rows, data, runs, disjoint, split)
        if spec.kind == "raw" and not data.dtype.isnative:  # torch holds native byte order only
            data = data.astype(data.dtype.newbyteorder("="))
        return data

    def reads_to_places(self, spec: FieldSpec) -> bool:
        """Whether :meth:`_read_rows_to` reads a raw field's rows straight into their places: an
        independent backend that reads rows as plain bytes in the dtype torch holds."""
        scatter = getattr(self.backend, "scatter_ready", None)
        return (spec.kind == "raw" and spec.dtype.isnative and not self.backend.collective and callable(scatter)
                and bool(scatter(spec.data_key)))

    def _read_rows_to(self, spec: FieldSpec, rows: np.ndarray, dests: list, disjoint: bool = False,
                      split: bool = True, meanwhile: Callable[[], None] | None = None) -> None:
        """Raw field ``spec``'s sorted unique ``rows`` straight into ``dests`` (one row array each,
        in ``rows`` order; :meth:`reads_to_places`): sieved and split over the request threads as
        :meth:`_read_field` reads, checked against the checksums in place. Rows read through
        sieved gaps land in one scratch row. ``meanwhile``: see :meth:`_read_to`."""
        runs = self._runs(spec, rows)
        total = int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0
        every = list(dests)
        if total != len(rows):
            every = [np.empty(spec.sample_shape, spec.dtype)] * total
            for j, at in enumerate(_places(runs, rows).tolist()):
                every[at] = dests[j]
        problem = None
        try:
            self._read_to(spec.data_key, runs, every, disjoint, split, meanwhile)
        except (OSError, CorruptDataError) as exc:  # agreed at the pass's end, as _read_field's
            problem = exc
        agree(self.backend, problem, later=True)
        self.stats.read_calls += len(runs)
        self.stats.bytes_in += total * int(np.prod(spec.sample_shape, dtype=np.int64)) * spec.dtype.itemsize
        if problem is None:
            self._checked(spec, rows, dests, runs, disjoint, split)

    def _checked(self, spec: FieldSpec, rows: np.ndarray, data, runs: np.ndarray, disjoint: bool,
                 split: bool) -> None:
        """:meth:`_verify` where the field has checksums; a failure is agreed at the pass's end."""
        if self.verify and self._has_checksum[spec.name] and (len(rows) or self.backend.collective):
            # checksums are of the stored bytes; on a collective backend every rank reads them in
            # the same fetch (a collective read), whether or not it has rows to check; a damaged
            # sample (or a failed checksum read) on one rank stops every rank here, before the
            # next collective read
            problem = None
            try:
                self._verify(spec, rows, data, runs, disjoint, split)
            except (OSError, CorruptDataError) as exc:
                problem = exc
            agree(self.backend, problem, later=True)

    def _verify(self, spec: FieldSpec, rows: np.ndarray, data, runs: np.ndarray, disjoint: bool,
                split: bool = True) -> None:
        """Check ``data`` (the stored rows of ``rows``, read through ``runs``) against the file's checksums.

        NOTE [ Checksums are read with the rows ]: a file of up to ``WHOLE_CHECKSUMS_BYTES``
        (16 MiB, 2e6 samples) of checksums per field is read whole once: one request instead of
        one range per data run every pass, which would double the read calls. Above that, each
        pass reads the checksums of exactly the runs its data read (8 bytes per row read, in as
        many ranges as the data, not sieved: at 8 bytes a row sieving merges nearly every gap,
        and a random pass would read almost the whole array every pass): reading them whole
        would make every rank load 8 bytes per sample and field at its first fetch, O(N) memory
        per rank and P times the whole array from the parallel file system at start-up (4096
        ranks, 10^8 samples: 3.3 TB), to check N/P samples each."""
        key = checksum_key(spec.name)
        sums = self._checksums.get(spec.name)
        if sums is None and self.num_samples * 8 <= self.WHOLE_CHECKSUMS_BYTES:
            sums = self._checksums[spec.name] = self.backend.read_all(key)
        sums = sums[rows] if sums is not None else _picked(self._read(key, runs, disjoint, split), runs, rows)
        for j, i in enumerate(rows.tolist()):
            if sample_checksum(data[j]) != int(sums[j]):
                raise CorruptDataError(
                    f"{self.path}: field {spec.name!r} sample {i} fails its xxh3 checksum; the file is "
                    "damaged: re-create it (solar ingest) or pass verify=False to read it anyway")
