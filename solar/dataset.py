"""``solar.H5Dataset``: a storage-backed map-style dataset whose batched fetch reads coalesced ranges.

A sample is a tuple of tensors, one per field (a single tensor when ``fields`` is a string), like
``TensorDataset``. Used with a plain ``torch.utils.data.DataLoader`` it works as any dataset
(``__getitems__`` still coalesces each batch's reads); with :class:`solar.DataLoader` the loader
drives :meth:`H5Dataset.fetch_stored` from its prefetch thread, with the rank's buffer, and
hands the loaded bytes to ``__getitems__`` inside the batch it yields.

NOTE [ Stored vs decoded ]
    What moves from storage and what the buffer keeps is a field's *stored* representation:
    a raw sample's row (its dtype and shape) or, for a compressed field, the codec blob of
    ``solar-h5/1`` (``solar/layout.py``). Decoding is one per-batch step (:meth:`decode`, with
    ``device=``) done where the batch is assembled (a DataLoader worker or the main process), so a
    byte budget holds ratio-times more compressed samples and decoding can run on the GPU.
    Without workers, :meth:`fetch_steps` decodes a whole prefetch pass at once on the prefetch
    thread (``decode=True``): one ``decode_batch`` call per field for several steps amortizes
    the codec's per-call cost (about 1.6x faster per sample on the CPU at 256 vs 32 samples) and
    overlaps decoding with the training step; the buffer still holds only compressed bytes.

NOTE [ Subclass items ]
    A subclass that overrides ``__getitem__`` (normalization, log-scaling, an extra target: a
    common pattern) expects it called for every sample, as torch calls it for any map-style
    dataset. But torch's fetcher calls ``__getitems__`` when a dataset has one (so does torch's
    ``Subset``), and SOLAR's loader hands each step's loaded bytes to ``__getitems__``: the
    override was bypassed by both loaders. So ``__getitems__`` (and the loader's ``Subset`` and
    ``ConcatDataset`` views) first makes the batch's samples with H5Dataset's own methods, from
    one coalesced read or the bytes the loader loaded (buffer hits included), then calls the
    override once per sample in batch order, with the index torch would pass it (the file's
    sample number, through a view). While it runs, ``super().__getitem__(i)`` returns the sample
    already made for ``i`` (a copy if another place already had it), and reads ``i`` alone only
    when the batch lacks it. The batch is kept per thread, so two threads' batches never mix.
    One difference from torch: a ``transform`` runs once per place of the batch, so an override
    that asks for another sample of its batch gets that sample's transformed copy, not a second
    draw of a random transform. A subclass that overrides ``__getitems__`` itself is called as any
    dataset is (the loader's views leave it to torch: ``solar.subset.drivable``).

NOTE [ Collective-safe reads ]
    :meth:`fetch_stored` calls ``backend.read_ranges`` exactly once per field, in field order,
    whatever it has to read (an empty range list when everything hit). On a collective backend
    (parallel HDF5, ``collective = True``) every rank therefore makes the same calls in the same
    order in every step, as MPI-IO requires.
"""

from __future__ import annotations

import operator
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from solar.cache import TierStats
from solar.errors import ConfigError, CorruptDataError, InputError
from solar.collective import agree, agreement_at_end
from solar.collective import lockstep as _lockstep
from solar.layout import FieldSpec, checksum_key, describe_fields, sample_checksum

__all__ = ["H5Dataset", "StoredBatch", "StepBatch", "coalesce"]

#: Smallest piece a range is cut into to spread one read over several request threads.
SPLIT_BYTES = 64 << 10


def as_indices(indices: Sequence[int], path: str, n: int) -> np.ndarray:
    """``indices`` (a batch's sample indices) as a 1-D int64 array.

    Why: a cast alone read floats as their integer part, a boolean mask as 0s and 1s and a nested
    list flattened, so a buggy sampler got wrong samples silently, where ``ds[1.7]`` and torch's
    per-item fetch refuse them.

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
    if len(buf) == len(rows):
        return buf
    run_of = np.searchsorted(runs[:, 1], rows, side="right")
    base = np.r_[0, np.cumsum(runs[:, 1] - runs[:, 0])][:-1]
    return buf[base[run_of] + rows - runs[run_of, 0]]


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
class _Pending:
    """One fetch between its phases (:meth:`H5Dataset.fetch_stored`): the batch being built,
    its indices and unique samples (``inv``), the buffer's hits (``held``), the misses, which of
    them to keep, the stored rows to ``read`` and each miss's place in them (``at``; ``mrank``
    per unique sample, -1 for a hit), and the read data once loaded."""

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


_MISSING = object()

#: Per thread, the batches whose samples a subclass's ``__getitem__`` is being called for
#: (``stack``, innermost last): NOTE [ Subclass items ].
_SERVING = threading.local()


class _BatchItems:
    """One batch's samples as H5Dataset makes them, which ``H5Dataset.__getitem__`` serves to a
    subclass's override while the batch calls it (NOTE [ Subclass items ]).

    ``rows``: the file's sample number of each place; ``place``: the place being made now.
    Each place's sample is handed out as it is once, to its own place's first request; any
    other request for it gets a copy of its tensors, so an override that changes its sample
    in place does not change the copy another place asked for."""

    def __init__(self, dataset: "H5Dataset", rows: list[int], samples: list) -> None:
        self.dataset, self.rows, self.samples = dataset, rows, samples
        self.place = 0
        self._handed: set[int] = set()
        self._first: dict[int, int] | None = None

    def get(self, row: int) -> Any:
        """The sample of the file's sample ``row`` (normalized), or ``_MISSING`` if the batch lacks it."""
        if self.rows[self.place] == row and self.place not in self._handed:
            self._handed.add(self.place)
            return self.samples[self.place]
        if self._first is None:
            self._first = {}
            for p, r in enumerate(self.rows):
                self._first.setdefault(int(r), p)
        p = self._first.get(row)
        return _MISSING if p is None else _fresh(self.samples[p])


def _fresh(sample: Any) -> Any:
    """``sample`` with its tensors cloned (in tuples, lists and dicts, as samples come)."""
    if isinstance(sample, torch.Tensor):
        return sample.clone()
    if isinstance(sample, (tuple, list)):
        items = [_fresh(s) for s in sample]
        return type(sample)(*items) if hasattr(sample, "_fields") else type(sample)(items)
    if isinstance(sample, dict):
        return type(sample)((k, _fresh(v)) for k, v in sample.items())
    return sample


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of ``dtype``'s values; a big-endian field becomes the native one (rows
    are converted when read, see :meth:`H5Dataset._read_field`)."""
    return torch.from_numpy(np.empty(0, np.dtype(dtype).newbyteorder("="))).dtype


class H5Dataset(Dataset):
    """Samples of an HDF5 file (any file whose fields have a leading sample axis, or ``solar-h5/1``).

    Args:
        path: file path or URL (``file://``, ``http://``, ``s3://`` ... through the backend).
        fields: field names; a tuple/list gives samples as tuples, a string gives one tensor,
            ``None`` (default) every field of the file, as tuples: in the order h5py lists them
            (alphabetical unless the file tracks creation order), a SOLAR file's in ingest order.
        backend: ``"auto"`` (``mpi-hdf5`` under mpirun, ``fsspec`` for URLs, else ``hdf5``), a
            registry name, or a :class:`solar.io_backends.Backend` instance.
        transform: optional per-sample callable applied to the sample (tuple or tensor).
        device: where batches are built (``"cpu"``, ``"cuda"`` ...): compressed fields are decoded
            there, raw fields are moved there.
        decode_compile: decode compressed fields with the ``torch.compile``-d decoder graph
            (:mod:`solar.codec.fused`): up to about 2x faster per batch once compiled (1.0-1.3x
            per epoch in ``bench/loader``), at a one-time compile of seconds per sample shape; None
            (default) follows ``SOLAR_CODEC_COMPILE``.
        verify: check stored xxh3 checksums of read samples when the file has them (default True).
        sieve_bytes: read through gaps of at most this many bytes between two runs of wanted rows
            (one request instead of two; ROMIO's data sieving). Worth it while the gap costs less
            than a request's round trip: about latency x bandwidth per reader (1 ms x 64 MB/s =
            64 KiB, the default); 0 reads exactly the wanted rows, as collective backends always
            do (NOTE [ No sieving in collective reads ]).
        io_threads: concurrent range requests per field on non-collective backends (requests
            overlap their latency, as a PFS client's outstanding requests do); 1 reads serially.
        backend_options: extra options for the backend.
    """

    #: Stored checksums of a field up to this size are read whole once; above, each pass reads
    #: its rows' checksums (NOTE [ Checksums are read with the rows ]).
    WHOLE_CHECKSUMS_BYTES = 16 << 20

    def __init__(self, path: str | os.PathLike, fields: str | Sequence[str] | None = None, *,
                 backend: Any = "auto", transform: Callable | None = None, device: str | torch.device = "cpu",
                 verify: bool = True, sieve_bytes: int = 64 << 10, io_threads: int = 4,
                 backend_options: dict | None = None, decode_compile: bool | None = None) -> None:
        from solar.io_backends import open_backend

        self.path = os.fspath(path) if not isinstance(path, str) else path
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():  # say so now, not at the first batch
            raise ConfigError(f"{self.path}: device={device!r}, but torch sees no CUDA device here; pass "
                              "device='cpu' (or run where a GPU is visible)")
        self._single = isinstance(fields, str)
        self.backend = open_backend(self.path, backend, **(backend_options or {}))
        self.num_samples, self.specs = describe_fields(self.backend, fields)
        self.fields = tuple(s.name for s in self.specs)
        self.transform = transform
        self.decode_compile = decode_compile
        self.verify = verify
        if sieve_bytes < 0 or io_threads < 1:
            raise InputError(f"{self.path}: sieve_bytes must be >= 0 and io_threads >= 1, "
                             f"got sieve_bytes={sieve_bytes}, io_threads={io_threads}")
        self.sieve_bytes = int(sieve_bytes)
        self.io_threads = int(io_threads)
        self._pool = None
        self._pool_lock = threading.Lock()
        self._pool_pid = os.getpid()
        self._offsets: dict[str, np.ndarray] = {}
        self._checksums: dict[str, np.ndarray | None] = {}
        keys = set(self.backend.keys())
        self._has_checksum = {s.name: checksum_key(s.name) in keys for s in self.specs}
        if any(s.kind == "codec" for s in self.specs):
            import solar.codec  # noqa: F401  (fail early with a clear error if it is missing)
        self.stats = FetchStats()

    def __repr__(self) -> str:
        return f"H5Dataset({self.path!r}, fields={self.fields}, samples={self.num_samples})"

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads do not cross processes; a worker makes its own if it reads
        state.pop("_clones", None)
        state.pop("_pool_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool_lock = threading.Lock()
        self._pool_pid = os.getpid()

    def close(self) -> None:
        """Close this process's storage handles (collective on parallel HDF5: call it on every rank):
        the backend's, and those of the request threads' clones, whose threads end too."""
        self._forget_forked_pool()
        with self._pool_lock:
            pool, clones = self._pool, self.__dict__.get("_clones") or []
            self._pool, self._clones = None, []
            for clone in clones:
                clone.close()
            if pool is not None:
                pool.shutdown(wait=True)
        self.backend.close()

    def _forget_forked_pool(self) -> None:
        """In a forked child (a torch worker of a plain DataLoader), the parent's request threads
        do not exist and its lock may have been held at the fork: start over with none. Without
        this, the first split read waited forever on futures no thread would run."""
        if self.__dict__.get("_pool_pid") != os.getpid():
            self._pool_lock = threading.Lock()
            self._pool = None
            self.__dict__.pop("_clones", None)
            self._pool_pid = os.getpid()

    # -- sizes --------------------------------------------------------------------------------
    def _offsets_of(self, spec: FieldSpec) -> np.ndarray:
        off = self._offsets.get(spec.name)
        if off is None:
            off = self.backend.read_all(spec.offsets_key).astype(np.int64)
            self._check_offsets(spec, off)
            self._offsets[spec.name] = off
        return off

    def _check_offsets(self, spec: FieldSpec, off: np.ndarray) -> None:
        """A compressed field's offsets start at 0, never decrease and end inside its data.

        Why: they carry no checksum, and a damaged one read as a byte range past the data (the
        backend's ``IndexError``, which ``for s in ds`` took for the end of the data and stopped
        early, silently) or a backward range (a bare ``ValueError``), depending on the batch."""
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

    def sample_nbytes(self, block: int = 1) -> np.ndarray:
        """Stored bytes of every sample (all fields): what one buffer entry costs; with ``block``,
        each field rounded up to whole blocks (what it costs as one file on disk)."""
        total = np.zeros(self.num_samples, dtype=np.int64)
        for s in self.specs:
            if s.kind == "raw":
                size = int(np.prod(s.sample_shape, dtype=np.int64)) * s.dtype.itemsize
                total += -(-size // block) * block
            else:
                total += -(-np.diff(self._offsets_of(s)) // block) * block
        return total

    # -- reading ------------------------------------------------------------------------------
    def _check_index(self, idx: np.ndarray, n: int | None = None) -> None:
        """Reject indices outside ``[-n, n)`` (``n``: ``num_samples``, or the length of a
        subset's rows); on a collective backend every rank raises if any rank's indices are bad
        (see NOTE [ Collective request checks ] in ``solar/collective.py``), so no rank is left
        waiting in the collective read."""
        of = "" if n is None else " of a Subset"
        n = self.num_samples if n is None else n
        problem = None
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            bad = idx[(idx < -n) | (idx >= n)][0]
            valid = f"valid: -{n}..{n - 1}" if n else "the dataset is empty"
            problem = IndexError(f"{self.path}: sample index {int(bad)}{of} out of range for {n} "
                                 f"samples ({valid}); check the sampler or the indices passed")
        agree(self.backend, problem)

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
        lengths = ranges[:, 1] - ranges[:, 0]
        starts = np.r_[0, np.cumsum(lengths)]
        total = int(starts[-1])
        if (self.io_threads <= 1 or self.backend.collective or total <= 1 or not split
                or self.backend.serializes_reads(key)):  # threads would take turns under h5py's lock
            return self.backend.read_ranges(key, ranges, disjoint=disjoint)
        info = self.backend.info(key)
        row_bytes = int(np.prod(info.row_shape, dtype=np.int64)) * info.dtype.itemsize
        t = min(self.io_threads, total, max(len(ranges), total * row_bytes // SPLIT_BYTES))
        if t <= 1:
            return self.backend.read_ranges(key, ranges)
        out = np.empty((total, *info.row_shape), dtype=info.dtype)
        cut = np.linspace(0, total, t + 1).round().astype(np.int64)  # output rows of each thread
        edges = np.union1d(starts, cut)  # pieces: the ranges, cut where a thread's share ends
        lo, hi = edges[:-1], edges[1:]
        r = np.searchsorted(starts, lo, side="right") - 1
        pieces = np.stack([ranges[r, 0] + lo - starts[r], ranges[r, 0] + hi - starts[r]], axis=1)
        first = np.searchsorted(lo, cut)  # each thread's first piece
        # One split read at a time per dataset: the clones' handles (an fsspec file's position)
        # must not be shared by two readers, e.g. two loaders or iterators over one dataset.
        self._forget_forked_pool()
        with self._pool_lock:
            if self._pool is None:
                import pickle
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="solar-io")
                # One backend per request thread (unpickled copies open their own handles): handles
                # and per-backend counters are then never shared between threads.
                self._clones = [pickle.loads(pickle.dumps(self.backend)) for _ in range(self.io_threads)]
            futs = [self._pool.submit(self._clones[i].read_ranges, key, pieces[a:b], out[cut[i]:cut[i + 1]])
                    for i, (a, b) in enumerate(zip(first[:-1], first[1:])) if b > a]
            try:
                for f in futs:
                    f.result()
            finally:  # the clones' counters belong to ds.backend.stats
                for clone in self._clones:
                    self.backend.stats.absorb(clone.stats)
        return out

    def _read_field(self, spec: FieldSpec, rows: np.ndarray, disjoint: bool = False,
                    split: bool = True) -> list[np.ndarray] | np.ndarray:
        """Read sorted unique ``rows`` of one field with one ``read_ranges`` call (maybe empty).
        ``disjoint``: see :meth:`fetch_stored`; ``split``: see :meth:`_read`.

        Returns the rows (raw: an array in ``rows`` order; codec: a list of blobs).
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
            data = _picked(buf, runs, rows)
        else:
            lengths = want[:, 1] - want[:, 0] if len(want) else np.zeros(0, np.int64)
            base = np.r_[0, np.cumsum(lengths)][:-1]
            first_byte = off[runs[:, 0]] if len(runs) else runs
            start = base[run_of] + off[rows] - first_byte[run_of] if len(rows) else rows
            sizes = off[rows + 1] - off[rows]
            data = [buf[a:a + n] for a, n in zip(start.tolist(), sizes.tolist())]
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
        if spec.kind == "raw" and not data.dtype.isnative:  # torch holds native byte order only
            data = data.astype(data.dtype.newbyteorder("="))
        return data

    def _verify(self, spec: FieldSpec, rows: np.ndarray, data, runs: np.ndarray, disjoint: bool,
                split: bool = True) -> None:
        """Check ``data`` (the stored rows of ``rows``, read through ``runs``) against the file's checksums.

        NOTE [ Checksums are read with the rows ]: a file of up to ``WHOLE_CHECKSUMS_BYTES``
        (16 MiB, 2e6 samples) of checksums per field is read whole once: one request instead of
        one range per data run every pass (twice the read calls; 3 s against 1.5 s for a local
        file in the page cache, in the review's measurement). Above that,
        each pass reads the checksums of exactly the runs its data read (8 bytes per row read,
        in as many ranges as the data; sieving them again at 8 bytes a row merged nearly every
        gap, and a random pass read almost the whole array, every pass):
        reading them whole made every rank load 8 bytes per sample and field at its first fetch,
        O(N) memory per rank and P times the whole array from the parallel file system at
        start-up (4096 ranks, 10^8 samples: 3.3 TB), to check N/P samples each."""
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

    def fetch_stored(self, indices: Sequence[int], buffer=None, keep: Callable[[np.ndarray], np.ndarray] | None = None,
                     shared: bool = False, evict: Sequence[int] | None = None, disjoint: bool = False,
                     rows=None) -> StoredBatch:
        """Load the stored bytes of ``indices`` (batch order; repeats allowed).

        Hits come from ``buffer`` (a :class:`solar.cache.Tier` keyed by ``(field, index)``);
        misses are sorted, coalesced into runs and read with one ``read_ranges`` call per field
        (see NOTE [ Collective-safe reads ]). Misses for which ``keep(indices)`` is true are put
        in ``buffer``, after the samples in ``evict`` left it (hits are taken first).
        ``shared=True`` allocates raw outputs in shared memory (for workers). ``disjoint=True``
        promises that no other rank reads any of these samples in this call, which lets a
        collective backend use its collective transfer (NOTE [ Disjoint collective reads ] in
        io_backends/base.py); only the loader's schedule can know that.

        ``rows``: sample ``i`` is the stored row ``rows[i]`` (a ``Subset``'s view, NOTE [ Subsets ]
        in ``solar/subset.py``; anything with ``len`` and integer-array indexing): ``indices``,
        ``keep``, ``evict`` and the buffer's keys are then positions in ``rows``; reads are of
        the rows, sorted and coalesced as usual.

        The work is four phases (:meth:`_gather`, :meth:`_load`, :meth:`_evict`, :meth:`_finish`)
        so that a pass over several files (NOTE [ Several files ] in ``solar/concat.py``) takes
        every file's hits before any eviction and evicts before any put, as one file does.
        """
        pending = self._gather(indices, buffer, keep, rows)
        with agreement_at_end(self.backend):  # before anything leaves or enters the buffer
            self._load(pending, disjoint)
        self._evict(buffer, evict)
        return self._finish(pending, buffer, shared)

    def _gather(self, indices: Sequence[int], buffer, keep, rows, checked: bool = False) -> "_Pending":
        """Check ``indices`` (unless the caller has, on every rank: ``checked``), take the
        buffer's hits, and decide which misses to keep."""
        n = self.num_samples if rows is None else len(rows)
        idx = as_indices(indices, self.path, n)
        if not checked:
            self._check_index(idx, None if rows is None else n)
        idx = np.where(idx < 0, idx + n, idx)
        uniq, inv = np.unique(idx, return_inverse=True)
        resident = np.zeros(len(uniq), dtype=bool)
        held: dict[int, dict[str, Any]] = {}  # u -> every field's buffered value
        if buffer is not None:
            # A sample is a hit only when *every* field is in the buffer, read here, before this
            # step evicts or puts anything: a put the budget refused for one field, or another
            # iterator's thread evicting between two gets, then makes it a miss (read again),
            # never a batch with a missing field.
            first = self.specs[0].name
            for u in np.flatnonzero([(first, int(i)) in buffer for i in uniq.tolist()]).tolist():
                vals = {}
                for spec in self.specs:
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
        return _Pending(out, idx, inv, held, miss, kept, read, at, mrank)

    def _load(self, pending: "_Pending", disjoint: bool, split: bool = True) -> None:
        """Read the pending misses' rows: one ``read_ranges`` per field, in field order
        (``split=False``: in this thread, see :meth:`_read`)."""
        pending.datas = {spec.name: self._read_field(spec, pending.read, disjoint, split) for spec in self.specs}

    def _evict(self, buffer, evict: Sequence[int] | None) -> None:
        if buffer is not None:
            for i in (evict if evict is not None else ()):
                for spec in self.specs:
                    buffer.delete((spec.name, int(i)))

    def _finish(self, pending: "_Pending", buffer, shared: bool) -> StoredBatch:
        """Put the kept misses in ``buffer`` and lay the batch out in batch order."""
        p, datas, kept = pending, pending.datas, pending.kept
        if buffer is not None:
            for j in np.flatnonzero(kept).tolist():
                keys = [(spec.name, int(p.miss[j])) for spec in self.specs]
                for n_put, key in enumerate(keys):
                    if not buffer.put(key, np.array(datas[key[0]][p.at[j]], copy=True)):
                        # all fields of a sample or none: a refused field (byte budget) takes
                        # back the ones already put, so no budget is spent on a half sample
                        for k in keys[:n_put]:
                            buffer.delete(k)
                        kept[j] = False
                        break
        out = p.out
        for spec in self.specs:
            hits = {u: vals[spec.name] for u, vals in p.held.items()}
            out.fields[spec.name] = self._assemble(spec, datas[spec.name], hits, p.mrank, p.inv, shared)
        self.stats.hits += out.hits
        self.stats.misses += len(p.idx) - out.hits
        self.stats.kept += int(kept.sum())
        self.stats.steps += 1
        return out

    @property
    def compressed(self) -> bool:
        """True when some field is stored as codec blobs (batches then need :meth:`decode`)."""
        return any(s.kind == "codec" for s in self.specs)

    def fetch_steps(self, steps: Sequence[Sequence[int]], buffer=None, keep=None, shared: bool = False,
                    evict: Sequence[int] | None = None, decode: bool = False, disjoint: bool = False,
                    lockstep: bool = True, rows: np.ndarray | None = None) -> list[StoredBatch]:
        """:meth:`fetch_stored` for several steps in one pass (one ``read_ranges`` per field for all
        of them, so runs and sieving span steps), split back into one batch per step.

        ``decode=True`` also decodes the whole pass with one :meth:`decode` (one ``decode_batch``
        per field) and gives each step its share as ``decoded`` (views; see NOTE [ Stored vs
        decoded ]); the steps then carry no stored bytes.

        ``lockstep=True``: every rank calls this alike (the loader does over a
        ``DistributedSampler``), so on a collective backend its checks agree across ranks and a
        failure on one rank raises on all. ``False`` (any other sampler: ranks may make different
        passes, or only one rank may iterate) reads and checks on this rank alone, as direct reads
        (:meth:`fetch_stored`, ``ds[i]``) do. ``rows``: as in :meth:`fetch_stored`.
        """
        if lockstep or disjoint:  # a disjoint pass is a collective read: every rank makes it
            with _lockstep():  # NOTE [ Collective request checks ]
                return self._fetch_steps(steps, buffer, keep, shared, evict, decode, disjoint, rows)
        return self._fetch_steps(steps, buffer, keep, shared, evict, decode, disjoint, rows)

    def _fetch_steps(self, steps, buffer, keep, shared, evict, decode, disjoint, rows) -> list[StoredBatch]:
        lengths = [len(s) for s in steps]
        flat = [int(i) for s in steps for i in s]
        whole = self.fetch_stored(flat, buffer=buffer, keep=keep, shared=shared, evict=evict, disjoint=disjoint,
                                  rows=rows)
        bounds = np.r_[0, np.cumsum(lengths)].tolist()
        problem = tensors = None
        try:
            tensors = self._ready(whole, decode)
        except CorruptDataError as exc:  # one rank's damaged blob stops every rank (collective reads)
            problem = exc
        agree(self.backend, problem)
        return [whole.part(a, b, tensors) for a, b in zip(bounds[:-1], bounds[1:])]

    def _ready(self, whole: StoredBatch, decode: bool) -> dict[str, torch.Tensor] | None:
        """A pass made ready on the prefetch thread: decoded (``decode=True``; returns the
        tensors), or else, on a collective backend, its codec blobs verified (headers and
        checksums, :func:`solar.codec.verify`; returns None).

        NOTE [ Damaged blobs stop every rank ]: the caller agrees on the raised
        ``CorruptDataError`` across ranks (``backend.agree``), so a damaged blob stops every rank
        at the same pass. Batches decoded in DataLoader workers would raise on one rank alone,
        after its prefetch thread had moved on, and the other ranks would wait forever in the
        next pass's collective calls; so blobs bound for workers are verified here first (xxh3
        of compressed bytes, far cheaper than decoding them)."""
        if decode:
            return self.decode(whole)
        if self.backend.collective and self.compressed:
            from solar.codec import verify

            for spec in self.specs:
                if spec.kind == "codec":
                    blobs, names = self._blobs(whole, spec)
                    for blob, name in zip(blobs, names or [None] * len(blobs)):
                        self._check_layout(spec, verify(blob, name=name), name)
        return None

    def _check_layout(self, spec: FieldSpec, h, name) -> None:
        """A blob (its header ``h``: :func:`solar.codec.header_info`) decodes to the field's
        declared sample shape and dtype, or it is damage.

        Why: a file whose blobs disagree with their field's attributes (hand-made, or damaged
        where no checksum reaches) gave batches of the blobs' shape, an empty batch of the
        declared one, and blobs of two shapes a bare ``torch.stack`` error naming nothing."""
        if h.shape != tuple(spec.sample_shape) or h.dtype != spec.dtype:
            what = f"sample {name}" if name is not None else f"a sample of field {spec.name!r}"
            raise CorruptDataError(
                f"{what} decodes to {h.dtype} {h.shape}, but field {spec.name!r} of {self.path} declares "
                f"{spec.dtype} {tuple(spec.sample_shape)}; the file is damaged or was not written by solar "
                "ingest: re-create it")

    def _blobs(self, stored: StoredBatch, spec: FieldSpec) -> tuple[list[np.ndarray], list[str] | None]:
        """A codec field's blobs in ``stored`` (views: the codec reads arrays in place) and the
        names its errors give them (the file's sample number, file and field)."""
        flat, off = stored.fields[spec.name]
        fa, oa = flat.numpy(), off.numpy().tolist()
        names = [f"{i} of {self.path}:{spec.name}" for i in stored.indices] if stored.indices else None
        return [fa[a:b] for a, b in zip(oa[:-1], oa[1:])], names

    def _assemble(self, spec: FieldSpec, data, hits: dict, mrank: np.ndarray, inv: np.ndarray, shared: bool):
        """Lay read rows (``data``, sorted-miss order) and buffer hits out in batch order."""
        if spec.kind == "raw":
            t = torch.empty((len(inv), *spec.sample_shape), dtype=_torch_dtype(spec.dtype))
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

    def decode(self, stored: StoredBatch) -> dict[str, torch.Tensor]:
        """Per-batch decode: ``{field: tensor (n, *sample_shape)}`` on :attr:`device`."""
        out: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            val = stored.fields[spec.name]
            if spec.kind == "raw":
                out[spec.name] = val if self.device.type == "cpu" else val.to(self.device, non_blocking=True)
            else:
                from solar.codec import decode_batch

                blobs, names = self._blobs(stored, spec)
                dec = decode_batch(blobs, device=self.device, names=names,
                                                compile=self.decode_compile) if blobs else torch.empty(
                    (0, *spec.sample_shape), dtype=_torch_dtype(spec.dtype))
                if not isinstance(dec, torch.Tensor) or tuple(dec.shape[1:]) != tuple(spec.sample_shape) \
                        or dec.dtype != _torch_dtype(spec.dtype):  # (checked blob by blob only then)
                    from solar.codec import header_info

                    for blob, name in zip(blobs, names or [None] * len(blobs)):
                        self._check_layout(spec, header_info(blob), name)
                out[spec.name] = dec
        return out

    def _samples(self, tensors: dict[str, torch.Tensor], n: int) -> list:
        cols = [tensors[f] for f in self.fields]
        samples = [cols[0][i] if self._single else tuple(c[i] for c in cols) for i in range(n)]
        if self.transform is not None:
            samples = [self.transform(s) for s in samples]
        return samples

    # -- Dataset protocol ---------------------------------------------------------------------
    def __getitems__(self, indices: Sequence[int]) -> list:
        """A batch of samples; torch's fetcher calls this once per batch (one coalesced read).
        A subclass's ``__getitem__`` is applied to each (NOTE [ Subclass items ])."""
        return self._getitems(indices)

    def _getitems(self, indices: Sequence[int], rows: np.ndarray | None = None) -> list:
        stored = getattr(indices, "stored", None)
        if stored is None:
            stored = self.fetch_stored(indices, rows=rows)
        tensors = stored.decoded if stored.decoded is not None else self.decode(stored)
        return self._items(stored, tensors, indices if rows is None else None)

    def _items(self, stored: StoredBatch, tensors: dict[str, torch.Tensor], asked: Sequence[int] | None = None) -> list:
        """The samples of ``stored`` (``tensors``: its decoded fields): H5Dataset's own, or what a
        subclass's ``__getitem__`` makes of them, called with ``asked`` (the indices the caller
        gave) or else the file's sample numbers (NOTE [ Subclass items ])."""
        samples = self._samples(tensors, stored.n)
        if type(self).__getitem__ is H5Dataset.__getitem__:
            return samples
        stack = _SERVING.__dict__.setdefault("stack", [])
        if stack and stack[-1].dataset is self:  # the override itself asked for a batch
            return samples  # (super().__getitems__([i])): H5Dataset's own, or it recursed for ever
        keys = stored.indices if asked is None else [operator.index(i) for i in asked]
        served = _BatchItems(self, stored.indices, samples)
        stack.append(served)
        try:
            out = []
            for place, i in enumerate(keys):
                served.place = place
                out.append(self.__getitem__(i))
            return out
        finally:
            stack.pop()

    def __getitem__(self, index: int):
        try:  # ints, numpy integers, 0-d integer tensors and arrays (as TensorDataset takes them)
            i = operator.index(index)
        except TypeError:
            raise InputError(f"{self.path}: H5Dataset indices are integers, got {type(index).__name__}") from None
        for served in reversed(_SERVING.__dict__.get("stack", ())):
            if served.dataset is self:  # a subclass's override inside a batch: NOTE [ Subclass items ]
                sample = served.get(i + self.num_samples if i < 0 else i)
                if sample is not _MISSING:
                    return sample
                break
        if type(self).__getitem__ is H5Dataset.__getitem__:
            return self.__getitems__([i])[0]
        # reached through a subclass's override (super().__getitem__) outside a batch, or for a
        # sample its batch lacks: H5Dataset's own sample, read alone (its __getitems__ would
        # call the override again)
        stored = self.fetch_stored([i])
        return self._samples(self.decode(stored), 1)[0]

    def __iter__(self):
        """Every sample in order. Without it ``for s in ds`` used the old sequence protocol,
        which ends at the first ``IndexError`` from anywhere inside, silently."""
        for i in range(len(self)):
            yield self[i]
