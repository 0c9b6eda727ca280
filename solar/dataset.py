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
    the codec's per-call cost (a larger batch decodes faster per sample) and
    overlaps decoding with the training step; the buffer still holds only compressed bytes.

NOTE [ Subclass items ]
    A subclass that overrides ``__getitem__`` (normalization, log-scaling, an extra target: a
    common pattern) expects it called for every sample, as torch calls it for any map-style
    dataset. But torch's fetcher calls ``__getitems__`` when a dataset has one (so does torch's
    ``Subset``), and SOLAR's loader hands each step's loaded bytes to ``__getitems__``: both
    loaders would bypass the override. So ``__getitems__`` (and the loader's ``Subset`` and
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

import glob
import operator
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from solar.errors import ConfigError, CorruptDataError, InputError
from solar.codec import decode_batch, header_info
from solar.codec import verify as verify_blob
from solar.collective import agree, agreement_at_end
from solar.collective import lockstep as _lockstep
from solar.layout import FieldSpec, checksum_key, describe_fields
from solar.fetch import FetchPass, FetchStats, Held, Samples, StepRows, StoredBatch, evict_samples, torch_dtype
from solar.io_backends import open_backend
from solar.reads import RowReads

__all__ = ["H5Dataset"]

_MISSING = object()

#: the methods a subclass leaves alone for its batches to be plain (:meth:`H5Dataset.plain_batches`)
_PLAIN_METHODS = ("__getitem__", "__getitems__", "_getitems", "_items", "_samples", "decode")

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


def _file_list(path: Any) -> list[str] | None:
    """The files ``path`` names when it names several: a list or tuple of paths, or a glob pattern
    of local files (sorted); None for one path or URL (a name with ``*?[`` that exists is one file)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise InputError("H5Dataset: the list of files is empty; pass a path, a list of paths or a glob")
        return [os.fspath(p) for p in path]
    if isinstance(path, str) and glob.has_magic(path) and "://" not in path and not os.path.exists(path):
        found = sorted(glob.glob(path))
        if not found:
            raise InputError(f"{path}: no file matches this pattern; check the directory and the pattern "
                             "(H5Dataset takes a path, a list of paths or a glob of local files)")
        return found
    return None


def _open_files(cls: type, paths: list[str], fields: Any, options: dict[str, Any]) -> ConcatDataset:
    """One ``cls`` per file with the same arguments, joined: NOTE [ Several files ] in solar/concat.py."""
    backend = options.get("backend", "auto")
    if not isinstance(backend, str):
        raise ConfigError(f"H5Dataset over {len(paths)} files: backend={backend!r} is an instance, which reads one "
                          "file; pass a registry name (or 'auto'), and backend_options= for its options")
    members: list[H5Dataset] = []
    try:
        for p in paths:
            members.append(cls(p, fields, **options))
        first = members[0]
        for ds in members[1:]:
            if ds.fields != first.fields:
                raise ConfigError(f"{ds.path} has the fields {list(ds.fields)}, {first.path} has {list(first.fields)}: "
                                  "the files of one H5Dataset need the same fields; pass fields= to pick them")
            if bool(ds.backend.collective) != bool(first.backend.collective):
                raise ConfigError(f"{ds.path} and {first.path} are read one collectively and one not; the files of one "
                                  "H5Dataset are read alike (the same backend for all)")
    except BaseException:
        for ds in members:
            ds.close()
        raise
    return ConcatDataset(members)


class H5Dataset(RowReads, Dataset):
    """Samples of an HDF5 file (any file whose fields have a leading sample axis, or ``solar-h5/1``),
    or of several files.

    Samples (``ds[i]``, and what ``__getitems__`` lists):

    - ``fields`` a string (one field's name): a tensor;
    - ``fields`` a tuple or list, or None: a tuple of tensors in ``fields`` order (the file's order
      for None), also for one field (a 1-tuple);
    - with ``transform``: whatever it returns for that tensor or tuple.

    A DataLoader batches them with its ``collate_fn``; the default makes one batched tensor of
    tensors, and a **list** of batched tensors of tuples (torch's ``default_collate``, as for
    ``TensorDataset``).

    Several files: ``path`` a list of paths, or a glob pattern of local files (``"runs/*.h5"``,
    sorted by name), makes a torch ``ConcatDataset`` of one ``H5Dataset`` per file, each made with
    the other arguments, in that order, instead of an ``H5Dataset`` (``ds.datasets`` are the files;
    close each). Their fields must have the same names. ``solar.DataLoader`` plans and reads such
    a concatenation as one dataset (one schedule, buffer and read-ahead over all files: NOTE
    [ Several files ] in solar/concat.py); torch's DataLoader reads it sample by sample, as any
    ``ConcatDataset``.

    Args:
        path: file path or URL (``file://``, ``http://``, ``s3://`` ... through the backend); a list
            of them, or a glob of local files (above).
        fields: field names; a tuple/list gives samples as tuples, a string gives one tensor,
            ``None`` (default) every field of the file, as tuples: in the order h5py lists them
            (alphabetical unless the file tracks creation order), a SOLAR file's in ingest order.
        backend: ``"auto"`` (``mpi-hdf5`` under mpirun, ``fsspec`` for URLs, else ``hdf5``), a
            registry name, or a :class:`solar.io_backends.Backend` instance.
        transform: optional per-sample callable applied to the sample (tuple or tensor).
        device: where batches are built (``"cpu"``, ``"cuda"`` ...): compressed fields are decoded
            there, raw fields are moved there.
        decode_compile: decode compressed fields with the ``torch.compile``-d decoder graph
            (:mod:`solar.codec.fused`): faster per batch once compiled (``bench/loader`` measures
            by how much), at a one-time compile of seconds per sample shape; None
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

    #: the loader may keep decoded copies of its resident samples (NOTE [ Decoded copies ] in
    #: solar/decoded.py): a batch's ``indices`` are its buffer keys
    keeps_decoded_copies = True

    def __new__(cls, path: Any = None, fields: Any = None, **options: Any):
        """An H5Dataset, or for several files (a list or a glob) a ``ConcatDataset`` of them; with no
        ``path`` (pickle, ``copy``) an empty instance, as ``object.__new__``."""
        paths = _file_list(path)
        if paths is None:
            return super().__new__(cls)
        return _open_files(cls, paths, fields, options)

    def __init__(self, path: str | os.PathLike, fields: str | Sequence[str] | None = None, *,
                 backend: Any = "auto", transform: Callable | None = None, device: str | torch.device = "cpu",
                 verify: bool = True, sieve_bytes: int = 64 << 10, io_threads: int = 4,
                 backend_options: dict | None = None, decode_compile: bool | None = None) -> None:
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
        self.stats = FetchStats()

    def __repr__(self) -> str:
        return f"H5Dataset({self.path!r}, fields={self.fields}, samples={self.num_samples})"

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None  # threads do not cross processes; a worker makes its own if it reads
        state.pop("_clones", None)
        state.pop("_slot_pool", None)  # (this process's batch memory: NOTE [ Reused batch memory ])
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
        self.__dict__.pop("_slot_pool", None)
        self.backend.close()

    # -- sizes --------------------------------------------------------------------------------
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

    def fetch_stored(self, indices: Sequence[int], buffer=None, keep: Callable[[np.ndarray], np.ndarray] | None = None,
                     shared: bool = False, evict: Sequence[int] | None = None, disjoint: bool = False,
                     rows=None, steps: Sequence[int] | None = None) -> StoredBatch:
        """Load the stored bytes of ``indices`` (batch order; repeats allowed).

        Hits come from ``buffer`` (a :class:`solar.cache.Tier` keyed by ``(field, index)``);
        misses are sorted, coalesced into runs and read with one ``read_ranges`` call per field
        (see NOTE [ Collective-safe reads ]). Misses for which ``keep(indices)`` is true are put
        in ``buffer``, after the samples in ``evict`` left it (hits are taken first).
        ``shared=True`` allocates raw outputs in shared memory (for workers). ``disjoint=True``
        promises that no other rank reads any of these samples in this call, which lets a
        collective backend use its collective transfer (NOTE [ Disjoint collective reads ] in
        io_backends/base.py); only the loader's schedule can know that.

        ``steps``: the lengths of the steps ``indices`` is made of (:meth:`fetch_steps`): raw
        fields are then laid out step by step (:class:`solar.fetch.StepRows`).

        ``rows``: sample ``i`` is the stored row ``rows[i]`` (a ``Subset``'s view, NOTE [ Subsets ]
        in ``solar/subset.py``; anything with ``len`` and integer-array indexing): ``indices``,
        ``keep``, ``evict`` and the buffer's keys are then positions in ``rows``; reads are of
        the rows, sorted and coalesced as usual.

        The work is the four phases of a :class:`~solar.fetch.FetchPass` (gather, load, evict,
        finish) so that a pass over several files (NOTE [ Several files ] in ``solar/concat.py``)
        takes every file's hits before any eviction and evicts before any put, as one file does.
        """
        pending = FetchPass.gather(self, indices, buffer, keep, rows)
        with agreement_at_end(self.backend):  # before anything leaves or enters the buffer
            pending.load(disjoint)
        evict_samples(self, buffer, evict)
        return pending.finish(buffer, shared, steps)

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
                                  rows=rows, steps=None if decode else lengths)  # (decoded: as one tensor)
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
            for spec in self.specs:
                if spec.kind == "codec":
                    blobs, names = self._blobs(whole, spec)
                    for blob, name in zip(blobs, names or [None] * len(blobs)):
                        self._check_layout(spec, verify_blob(blob, name=name), name)
        return None

    def _check_layout(self, spec: FieldSpec, h, name) -> None:
        """A blob (its header ``h``: :func:`solar.codec.header_info`) decodes to the field's
        declared sample shape and dtype, or it is damage.

        Why: a file whose blobs disagree with their field's attributes (hand-made, or damaged
        where no checksum reaches) would otherwise give batches of the blobs' shape, an empty
        batch of the declared one, and for blobs of two shapes a bare ``torch.stack`` error naming
        nothing."""
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

    def decode(self, stored: StoredBatch) -> dict[str, torch.Tensor]:
        """Per-batch decode: ``{field: tensor (n, *sample_shape)}`` on :attr:`device`."""
        out: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            val = stored.fields[spec.name]
            val = val.whole() if isinstance(val, StepRows) else val  # (a pass laid out step by step)
            if spec.kind == "raw":
                out[spec.name] = val if self.device.type == "cpu" else val.to(self.device, non_blocking=True)
            else:
                blobs, names = self._blobs(stored, spec)
                t0 = time.perf_counter()
                dec = decode_batch(blobs, device=self.device, names=names,
                                   compile=self.decode_compile) if blobs else torch.empty(
                    (0, *spec.sample_shape), dtype=torch_dtype(spec.dtype))
                self.stats.decode_s += time.perf_counter() - t0
                if not isinstance(dec, torch.Tensor) or tuple(dec.shape[1:]) != tuple(spec.sample_shape) \
                        or dec.dtype != torch_dtype(spec.dtype):  # (checked blob by blob only then)
                    for blob, name in zip(blobs, names or [None] * len(blobs)):
                        self._check_layout(spec, header_info(blob), name)
                out[spec.name] = dec
        return out

    def decodes_into(self) -> bool:
        """Whether :meth:`decode_into` may stand for :meth:`decode`: H5Dataset's own ``decode``,
        every field compressed, decoded on the CPU."""
        return (type(self).decode is H5Dataset.decode and self.device.type == "cpu"
                and all(s.kind == "codec" for s in self.specs))

    def decode_into(self, stored: StoredBatch, out: dict[str, torch.Tensor], at: np.ndarray) -> dict[str, float]:
        """:meth:`decode` of ``stored``'s fields that ``out`` names (compressed fields) straight
        into rows ``at`` of ``out``'s tensors (on :attr:`device`): sample ``i`` into row ``at[i]``.
        Returns each field's decode seconds."""
        took = {}
        for spec in self.specs:
            if spec.name not in out:
                continue
            blobs, names = self._blobs(stored, spec)
            t0 = time.perf_counter()
            try:
                decode_batch(blobs, device=self.device, names=names, compile=self.decode_compile,
                             out=out[spec.name], at=at)
            except ConfigError:  # blobs that do not decode to the field's rows: say which, as decode does
                for blob, name in zip(blobs, names or [None] * len(blobs)):
                    self._check_layout(spec, header_info(blob), name)
                raise
            finally:
                took[spec.name] = time.perf_counter() - t0
                self.stats.decode_s += took[spec.name]
        return took

    def plain_batches(self) -> bool:
        """Whether a batch is its loaded rows as they are, with no per-sample work: every field
        raw, on the CPU, no ``transform``, H5Dataset's own ``__getitem__`` and batch methods
        (NOTE [ Workers with nothing to do ] in solar/loader.py)."""
        t = type(self)
        return (self.transform is None and self.device.type == "cpu" and not self.compressed
                and all(getattr(t, m) is getattr(H5Dataset, m) for m in _PLAIN_METHODS))

    def _samples(self, tensors: dict[str, torch.Tensor], n: int) -> list:
        """The ``n`` samples of the decoded ``tensors``: rows (views), as :class:`Samples` that
        carry their columns (NOTE [ One copy into the batch ] in solar/fetch.py), or what
        ``transform`` makes of each."""
        cols = tuple(tensors[f] for f in self.fields)
        rows = [c.unbind(0) if len(c) == n else c[:n].unbind(0) for c in cols] if n else [()] * len(cols)
        samples = Samples(rows[0] if self._single else zip(*rows))  # (unbind: every row's view in one call)
        if self.transform is not None:
            return [self.transform(s) for s in samples]
        samples.columns, samples.single = cols, self._single
        return samples

    # -- Dataset protocol ---------------------------------------------------------------------
    def __getitems__(self, indices: Sequence[int]) -> list:
        """A batch of samples; torch's fetcher calls this once per batch (one coalesced read).
        A subclass's ``__getitem__`` is applied to each (NOTE [ Subclass items ])."""
        return self._getitems(indices)

    def _getitems(self, indices: Sequence[int], rows: np.ndarray | None = None) -> list:
        stored = getattr(indices, "stored", None)
        if isinstance(stored, Held):  # a worker's batch whose bytes stay with the loader
            samples = Samples([None] * stored.n)  # (NOTE [ Batches that stay ] in solar/fetch.py)
            samples.held = stored
            return samples
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
        """Every sample in order. Without it ``for s in ds`` would use the sequence protocol,
        which ends silently at the first ``IndexError`` from anywhere inside."""
        for i in range(len(self)):
            yield self[i]
