"""``solar ingest``: build one SOLAR HDF5 file (``solar-h5/1``) from many inputs, in parallel.

Under ``mpirun -n P`` every rank converts (and compresses) its share of each batch and writes it
into the same file through parallel HDF5 with collective I/O; without mpirun the same code runs
serially and writes a byte-identical data layout. See ``docs/storage.md`` for the file layout.

NOTE [ Ingest phases ]
    1. validate (rank 0): every input is opened and described; a missing file, a field whose
       sample shape/dtype differs between inputs, an output that already exists, ... stop the job
       *before anything is written*, on every rank (the verdict is broadcast). Rank 0 also decides
       which float fields a bound compresses: one whose samples are no larger than the codec's
       smallest blob stays raw (:func:`_keep_tiny_fields_raw`; by shape and dtype only).
    2. bound pass (only for ``--rel-error`` or a codec that cannot keep NaN): every rank scans its
       share; min/max are all-reduced so the relative bound means the same for every sample of a
       field (it is relative to the **field's** value range, max - min over all its samples).
    3. write: the samples are cut into global batches of ``batch_size``; each batch is split
       evenly across ranks. Raw rows are written with one collective hyperslab write per field;
       compressed samples are encoded, their blob lengths all-gathered to get offsets, the
       ``data`` dataset grown collectively and every rank writes its bytes at its offset.
    4. commit (after the batch that ends a ``commit_interval``, and the last one): a collective
       flush, then rank 0 replaces the journal (``OUT.ingest.json``) naming the batches done.
       See NOTE [ Ingest crash safety ].
    5. finish: offsets end, root attributes, ``complete=True``; ``--verify`` re-reads every sample
       (checksums; decoded values against the inputs within the bound, raw ones exactly); rank 0
       takes the inputs' identities again, and a changed input stops the job on every rank
       (:func:`_check_inputs_unchanged`); then the rename.

NOTE [ Ingest crash safety ]
    Everything is written to ``OUT.tmp``; ``OUT`` appears only by ``os.replace`` after the file is
    complete (and verified when asked). If any rank dies (SIGKILL), ``OUT`` is untouched.
    ``--resume`` reopens ``OUT.tmp``, checks the journal's fingerprint (inputs with their size,
    mtime and a digest of a sample of their bytes, fields, bounds, batch size) and continues
    after the last committed batch, rewriting anything a dead batch left half-written; a changed
    input (the journal names it) starts the run over. The world size may differ between the
    runs: a batch is a global unit (a file a serial run started is restarted under mpirun:
    parallel HDF5 cannot grow its chunked datasets). Under mpirun, an error on one rank inside
    the write loop aborts the job with its message (the others would wait in the next collective
    write); committed batches stay. A storage failure (disk full, an input server gone) prints
    the lines the serial run prints (what failed, which file, the ``--resume`` hint) and aborts
    with ``EXIT_STORAGE`` (4), which mpirun returns as the job's exit code.
    If ``OUT.tmp`` cannot be opened any more, the run starts over. Serially, ``OUT.tmp`` is
    fsynced before the rename (under MPI the collective flush is an ``MPI_File_sync``) and the
    directory after it. A finished ``OUT`` is only ever replaced with ``--overwrite``: ``--resume``
    reports one with this job's fingerprint (provenance) as already complete and writes nothing,
    and refuses one written by a different job (or not by ``solar ingest``). Committed batches
    are only ever discarded with ``--overwrite``: a run without ``--resume`` or ``--overwrite``
    that finds ``OUT.tmp`` with committed batches in its journal stops before writing anything
    and says how to go on (:func:`_refuse_to_discard`). One run writes an output at a time
    (``OUT.ingest.lock``, :class:`_OutputLock`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np

from solar.cache.disk import fsync_path
from solar.errors import (ConfigError, CorruptDataError, DatasetFormatError, InputError, MissingDependencyError,
                          MPIUnavailableError, SolarError, StorageError)
from solar.ingest_sources import Source, open_sources
from solar.ingest_verify import verify_file
from solar.layout import FORMAT, checksum_key, sample_checksum

__all__ = ["ingest", "IngestReport", "verify_file"]

JOURNAL_SUFFIX = ".ingest.json"
TMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".ingest.lock"
DATA_CHUNK = 1 << 20
FINGERPRINT_PREFIX = "v2-"  # fingerprints that include a content digest of each input
EXIT_STORAGE = 4  # `solar ingest`'s exit code (and MPI_Abort code) for a storage failure mid-run
EXIT_INPUT = 2  # ... for bad input (also an input that a read finds unusable mid-run)


# -- a communicator that also works without MPI ----------------------------------------------------
class _Serial:
    rank, size = 0, 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def allreduce(self, obj, op=None):
        return obj

    def Barrier(self):
        pass


def _world(comm):
    if comm is None:
        return _Serial(), False
    if comm == "auto":
        from solar.dist import mpi_comm

        comm = mpi_comm()
        if comm is None or comm.size == 1:
            return _Serial(), False
        import h5py

        if not h5py.get_config().mpi:
            raise MPIUnavailableError(
                f"solar ingest runs on {comm.size} MPI ranks but h5py was built without MPI support, so the "
                "ranks cannot write one file together; build h5py against parallel HDF5 (`make setup`) or run "
                "without mpirun")
    return comm, True


# -- plan ------------------------------------------------------------------------------------------
@dataclass
class FieldPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    compress: bool
    abs_error: float | None = None  # resolved absolute bound (compressed fields)
    descriptor: str | None = None  # the codec's versioned descriptor, known after the first blob


@dataclass
class Plan:
    output: str
    sources: list[Source]
    fields: list[FieldPlan]
    num_samples: int
    batch_size: int
    rel_error: float | None
    abs_error: float | None
    starts: list[int] = field(default_factory=list)  # first global sample of each source
    notes: list[str] = field(default_factory=list)  # decisions rank 0 prints (fields kept raw)
    _released: int = 0  # sources below this index are closed (reads move forward)

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def input_identities(self) -> list[list]:
        """``[url, size, modification stamp, content digest]`` of every input
        (:meth:`Source.identity`). Stats every input and reads a sample of its bytes: call it on
        one rank. The journal keeps them, so a refused resume can name the input that changed."""
        return [[s.url, *s.identity()] for s in self.sources]

    def fingerprint(self, ids: list[list]) -> str:
        """The job's identity for ``--resume``: inputs (with their size, modification stamp and
        content digest, ``ids`` from :meth:`input_identities`), fields, bounds and batch size.
        Prefixed ``v2-``: a fingerprint without the prefix is a :meth:`legacy_fingerprint`."""
        return FINGERPRINT_PREFIX + self._digest([i[1:] for i in ids])

    def legacy_fingerprint(self, ids: list[list]) -> str:
        """The fingerprint solar ingest wrote before it sampled input contents (size and
        modification stamp only), to recognise a journal or an output written by that version:
        see :func:`_resume_point`."""
        return self._digest([i[1:3] for i in ids])

    def _digest(self, stamps: list[list]) -> str:
        desc = {"inputs": [(s.url, s.n, s.per_file, s.keys, st) for s, st in zip(self.sources, stamps)],
                "fields": [self._fingerprinted(f) for f in self.fields], "batch_size": self.batch_size}
        return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _fingerprinted(self, f: FieldPlan) -> dict:
        """``f`` as the fingerprint records it: as solar ingest did before raw fields lost their
        bound, when a field stored raw for its dtype (ints, complex, float16) carried
        ``--abs-error`` too. Why: the fields are part of the fingerprint, and a journal or an
        output of that version must still be recognised by ``--resume`` (as this job's)."""
        d = asdict(f)
        if not f.compress and self.abs_error is not None and not _compressible(np.dtype(f.dtype)):
            d["abs_error"] = self.abs_error
        return d

    def _release_before(self, i: int) -> None:
        """Close the inputs a forward pass has left behind: thousands of inputs must not hold
        thousands of open files. A later pass (verification) reopens them lazily."""
        for k in range(self._released, i):
            self.sources[k].close()
        self._released = i

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Global samples ``[lo, hi)`` of field ``name``, across input boundaries."""
        f = next(f for f in self.fields if f.name == name)
        parts = []
        i = max(0, int(np.searchsorted(self.starts, lo, side="right")) - 1)
        self._release_before(i)
        while lo < hi and i < len(self.sources):
            s0 = self.starts[i]
            stop = min(hi, s0 + self.sources[i].n)
            if stop > lo:
                parts.append(self.sources[i].read(name, lo - s0, stop - s0))
            lo, i = max(lo, stop), i + 1
        if not parts:
            return np.empty((0, *f.shape), np.dtype(f.dtype))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class IngestReport:
    output: str
    num_samples: int
    fields: list[str]
    input_bytes: int
    stored_bytes: int
    seconds: float
    resumed_from_batch: int
    verified: bool
    world_size: int
    already_complete: bool = False  # --resume found OUT finished by this same job: nothing written

    @property
    def ratio(self) -> float:
        """Input bytes per stored byte; 1.0 ("as is") when nothing was read or stored (0 samples,
        the report of an already complete OUT): ``inf`` printed as ``(xinf)``, and ``--json``
        wrote it as ``Infinity``, which JSON parsers reject."""
        if not self.stored_bytes:
            return float("inf") if self.input_bytes else 1.0
        return self.input_bytes / self.stored_bytes


def _codec_keeps_nan() -> bool:
    from solar import codec

    x = np.array([np.nan, 1.0, 2.0, 3.0], np.float32)
    return bool(np.isnan(codec.decode(codec.encode(x, abs_error=0.1)).numpy()[0]))


def _compressible(dtype: np.dtype) -> bool:
    """Whether a bound compresses a field of ``dtype``: float32 and float64 (the codec's types);
    the others (ints, bools, complex, float16) are stored raw, exactly."""
    return dtype.kind == "f" and dtype.itemsize in (4, 8)


#: Raw samples above this size are compressed without asking the codec: its fixed overhead per blob
#: (header, codec metadata: ~150 B, at most a few KiB) is far smaller.
_PROBE_BYTES = 1 << 16


def _smallest_blob(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of the smallest blob the codec writes for one sample of ``shape`` and ``dtype``.

    Why: every blob carries a fixed header (magic, descriptor, shape, bound, checksums) and codec
    metadata, ~150 B; a float per sample (4 B) would be stored as a 140 B blob. An all-zero
    sample compresses to that overhead alone, so a raw sample no larger than its blob can only
    grow when compressed. Depends on shape, dtype and the codec only (not on values, timing or
    rank): the decision is the same for every world size and on ``--resume``."""
    from solar import codec

    return len(codec.encode(np.zeros(shape, np.dtype(dtype)), abs_error=1.0))


def _keep_tiny_fields_raw(plans: list[FieldPlan]) -> list[str]:
    """Store raw the float fields whose samples are too small to gain from compression (see
    :func:`_smallest_blob`); returns one note per such field, for rank 0 to print."""
    notes = []
    for p in plans:
        if not p.compress:
            continue
        raw = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
        if raw > _PROBE_BYTES:
            continue
        blob = _smallest_blob(p.shape, p.dtype)
        if raw <= blob:
            p.compress, p.abs_error = False, None
            notes.append(f"field {p.name!r} is stored raw, not compressed: one sample (shape {p.shape}, "
                         f"{np.dtype(p.dtype).name}) is {raw} B, and the codec's smallest blob for it is {blob} B "
                         "(its fixed header), so compressing would only make it larger")
    return notes


def _samples_auto_note(sources: list[Source]) -> list[str]:
    """The note rank 0 prints when ``samples="auto"`` took each ``.npy``/``.npz`` file as one
    sample: runs of equal length look the same as equal-shape samples, so say which was chosen."""
    whole = [s for s in sources if s.per_file]
    if not whole:
        return []
    shapes = {n: f.shape for n, f in whole[0].fields.items()}
    shape = str(next(iter(shapes.values()))) if len(shapes) == 1 else str(shapes)
    return [f"{len(whole)} inputs of equal shape {shape}: each file is one sample (--samples file); pass "
            "--samples axis0 to take their leading axis as samples"]


def _validate(inputs, output, fields, abs_error, rel_error, resume, overwrite, batch_size, samples,
              storage_options) -> Plan:
    if abs_error is not None and rel_error is not None:
        raise ConfigError("give --abs-error or --rel-error, not both")
    for name, v in (("abs-error", abs_error), ("rel-error", rel_error)):
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"--{name} must be a finite number >= 0, got {v}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if "://" in output and not output.startswith("file://"):
        raise ConfigError(f"{output}: the output must be a local (or parallel file system) path, not a URL")
    output = output[len("file://"):] if output.startswith("file://") else output
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise InputError(f"{output}: the output directory {parent} does not exist; create it first")
    if os.path.isdir(output):  # else the whole job ran, then the rename failed (and so did every --resume)
        raise InputError(f"{output} is a directory: -o must name a file, not a directory (e.g. "
                         f"{os.path.join(output, 'train.h5')})")
    if os.path.exists(output) and not overwrite:
        if not resume:
            raise InputError(f"{output} already exists; pass --overwrite to replace it or --resume to finish a run")
        if _finished_fingerprint(output) is None:
            # --resume continues *this* job's OUT.tmp; it never replaces a file it did not write
            # (the fingerprint check against this job follows in ingest(), once bounds are known)
            raise InputError(f"{output} already exists and is not a finished `solar ingest` output, so --resume "
                             "has nothing to continue into it; pass --overwrite to replace it, or choose another -o")
    sources, infos = open_sources(list(inputs), fields=fields, samples=samples, storage_options=storage_options)
    bound = abs_error is not None or rel_error is not None
    plans = []
    for n, fi in infos.items():
        # only a compressed field has a bound: --verify compares every other field exactly
        compress = bound and _compressible(fi.dtype)
        plans.append(FieldPlan(n, tuple(fi.shape), fi.dtype.str, compress, abs_error if compress else None))
    deep = [p for p in plans if p.compress and len(p.shape) > 4]  # every field, before anything is written
    if deep:
        raise ConfigError(f"field {deep[0].name!r} has {len(deep[0].shape)}-D samples {deep[0].shape}; the codec "
                          "handles samples of up to 4 dimensions: reshape them, or ingest this field without "
                          "--abs-error/--rel-error")
    notes = _samples_auto_note(sources) if samples == "auto" else []
    notes += _keep_tiny_fields_raw(plans)
    starts = np.concatenate([[0], np.cumsum([s.n for s in sources])]).astype(int).tolist()
    return Plan(output, sources, plans, starts[-1], batch_size, rel_error, abs_error, starts[:-1], notes)


def _share(lo: int, hi: int, rank: int, size: int) -> tuple[int, int]:
    n = hi - lo
    return lo + rank * n // size, lo + (rank + 1) * n // size


def _bound_pass(plan: Plan, comm) -> None:
    """Resolve relative bounds over each field's global range; reject NaN the codec cannot keep."""
    todo = [f for f in plan.fields if f.compress]
    need_range = plan.rel_error is not None
    check_nan = todo and not _codec_keeps_nan()
    if not todo or not (need_range or check_nan):
        return
    lo, hi = _share(0, plan.num_samples, comm.rank, comm.size)
    local: dict[str, list[float]] = {f.name: [np.inf, -np.inf, 0.0] for f in todo}
    bad: str | None = None
    for s in range(lo, hi, plan.batch_size):
        e = min(hi, s + plan.batch_size)
        for f in todo:
            a = plan.read(f.name, s, e)
            finite = a[np.isfinite(a)]
            if finite.size:
                local[f.name][0] = min(local[f.name][0], float(finite.min()))
                local[f.name][1] = max(local[f.name][1], float(finite.max()))
            if check_nan and bad is None and np.isnan(a).any():
                i = s + int(np.argwhere(np.isnan(a.reshape(len(a), -1)).any(1))[0, 0])
                bad = f"sample {i} of field {f.name!r} ({_where(plan, i)}) contains NaN, which the codec cannot keep"
    bads = [b for b in comm.allgather(bad) if b]
    if bads:
        raise InputError(bads[0] + "; clean the input or store the field raw (no --abs-error/--rel-error)")
    gathered = comm.allgather(local)
    for f in todo:
        mn = min(g[f.name][0] for g in gathered)
        mx = max(g[f.name][1] for g in gathered)
        if need_range:
            f.abs_error = _rel_bound(f.name, plan.rel_error, mn, mx)


def _rel_bound(name: str, rel: float, mn: float, mx: float) -> float:
    """``rel * (mx - mn)``; ``rel*mx - rel*mn`` when ``mx - mn`` overflows (float64 values
    beyond +-9e307; the first form otherwise, so that bounds stay bit-identical to earlier
    runs'). Every rank calls it with the same all-reduced range, so a bound that is still not
    finite raises the same :class:`InputError` everywhere, before ``OUT.tmp`` is made (the codec
    refused it mid-run, naming neither the field nor --rel-error)."""
    if mx < mn:  # no finite value
        return 0.0
    bound = rel * (mx - mn) if math.isfinite(mx - mn) else rel * mx - rel * mn
    if not math.isfinite(bound):
        raise InputError(f"field {name!r}: --rel-error {rel:g} of its value range [{mn:g}, {mx:g}] is not a finite "
                         "number (the range is beyond float64); give an absolute bound with --abs-error, or store "
                         "the field raw (no --abs-error/--rel-error)")
    return bound


def _where(plan: Plan, i: int) -> str:
    k = max(0, int(np.searchsorted(plan.starts, i, side="right")) - 1)
    return f"input {plan.sources[k].url}, sample {i - plan.starts[k]}"


# -- low-level collective writes -------------------------------------------------------------------
def _write_rows(dset, start: int, data: np.ndarray, dxpl) -> None:
    """Write ``data`` at rows ``[start, start + len(data))``; a rank with no rows still joins."""
    import h5py

    tail = tuple(dset.shape[1:])
    fspace = dset.id.get_space()
    if len(data) == 0:
        fspace.select_none()
        mspace = h5py.h5s.create_simple((1, *tail))
        mspace.select_none()
        buf = np.zeros((1, *tail), dset.dtype)
    else:
        fspace.select_hyperslab((start, *(0,) * len(tail)), (len(data), *tail))
        buf = np.ascontiguousarray(data, dtype=dset.dtype)
        mspace = h5py.h5s.create_simple(buf.shape)
    dset.id.write(mspace, fspace, buf, dxpl=dxpl)


def _create(f, plan: Plan) -> None:
    """Create every dataset (collective under MPI: all ranks make the same calls)."""
    n = plan.num_samples
    for fp in plan.fields:
        if fp.compress:
            g = f.create_group(fp.name)
            # Chunks are allocated whole: 1 MiB, or less for a small field (raw size / 16, >= 4 KiB).
            raw = n * int(np.prod(fp.shape, dtype=np.int64)) * np.dtype(fp.dtype).itemsize
            chunk = int(min(DATA_CHUNK, max(4096, 1 << max(0, (raw // 16).bit_length() - 1))))
            g.create_dataset("data", shape=(0,), maxshape=(None,), chunks=(chunk,), dtype=np.uint8)
            g.create_dataset("offsets", shape=(n + 1,), dtype=np.int64, fill_time="never")
            g.attrs["sample_shape"] = np.asarray(fp.shape, np.int64)
            g.attrs["dtype"] = np.dtype(fp.dtype).name
            g.attrs["abs_error"] = float(fp.abs_error)
        else:
            f.create_dataset(fp.name, shape=(n, *fp.shape), dtype=np.dtype(fp.dtype), fill_time="never")
        f.create_dataset(checksum_key(fp.name), shape=(n,), dtype=np.uint64, fill_time="never")
    f.attrs["solar_format"] = FORMAT
    f.attrs["num_samples"] = n
    f.attrs["fields"] = json.dumps([fp.name for fp in plan.fields])
    f.attrs["complete"] = False


def _journal_write(path: str, record: dict) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _journal_read(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class _Progress:
    """Rank 0's progress bar: samples/s and input MB/s."""

    def __init__(self, total: int, done: int, row_bytes: int, enabled: bool) -> None:
        self.row_bytes, self.t0, self.samples = row_bytes, time.perf_counter(), 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="sample", desc="ingest", file=sys.stderr,
                            dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.samples += n
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.samples * self.row_bytes / dt / 1e6:.1f} MB/s", refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the job ---------------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """``url`` without credentials: user info and the query string (presigned URLs carry their
    signature there) are replaced by ``<redacted>``. Provenance goes into files meant to be shared."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(url)
    except ValueError:
        return url
    if not u.scheme or u.scheme == "file":
        return url
    netloc = u.netloc if "@" not in u.netloc else "<redacted>@" + u.netloc.rpartition("@")[2]
    return urlunsplit((u.scheme, netloc, u.path, "<redacted>" if u.query else "", u.fragment))


def redact_argv(argv: list[str]) -> list[str]:
    """The command line as provenance may record it: ``--storage-options`` keeps its keys only
    (their values are credentials: S3 key and secret, tokens), URLs lose user info and queries."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append(_redact_options(a))
            hide = False
        elif a == "--storage-options":
            out.append(a)
            hide = True
        elif a.startswith("--storage-options="):
            out.append("--storage-options=" + _redact_options(a.partition("=")[2]))
        else:
            out.append(redact_url(a) if "://" in a else a)
    return out


def _redact_options(text: str) -> str:
    try:
        keys = list(json.loads(text))
    except (ValueError, TypeError):
        return "<redacted>"
    return json.dumps({str(k): "<redacted>" for k in keys})


class _OutputLock:
    """Rank 0's lock on ``OUT`` for the whole run: ``OUT.ingest.lock``, held with ``flock``.

    Why: of two runs to one output (a job resubmitted while the first still runs, two shells),
    the second failed with HDF5's "unable to lock file" on ``OUT.tmp``, or, with
    ``HDF5_USE_FILE_LOCKING=FALSE`` (which HPC sites set for file systems without locks), wrote
    the first's ``OUT.tmp`` and journal too. The second run now stops before it writes
    anything, naming the first. A crashed holder's lock goes with it (the kernel drops
    ``flock`` locks), so ``--resume`` never has a stale lock to clear; the file stays until
    the next run ends. Where the file system has no ``flock`` (Lustre mounted without it) or
    the lock file cannot be made, the run goes on unlocked: the lock guards against a mistake,
    it is not needed for a correct run.
    """

    def __init__(self, output: str) -> None:
        self.path = output + LOCK_SUFFIX
        self.fd: int | None = None

    def acquire(self) -> None:
        import socket

        from solar.fileio import flock_or_holder

        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _attempt in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                return  # e.g. a read-only directory: writing OUT.tmp there reports it
            try:
                holder = flock_or_holder(fd, owner)
            except OSError:
                os.close(fd)
                return
            if holder is not None:
                raise InputError(f"{self.path[:-len(LOCK_SUFFIX)]} is being written by another solar ingest "
                                 f"({holder}); wait for it to finish, or write to another -o")
            try:  # the file locked must still be the one named (a finishing run removes it)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still held: a run waiting on this inode sees it gone
            os.close(self.fd)
            self.fd = None


def ingest(inputs: list[str], output: str, *, fields: list[str] | None = None, abs_error: float | None = None,
           rel_error: float | None = None, resume: bool = False, overwrite: bool = False, verify: bool = False,
           batch_size: int = 256, samples: str = "auto", comm: Any = "auto", progress: bool = True,
           storage_options: dict[str, Any] | None = None, commit_interval: float = 2.0) -> IngestReport:
    """Build ``output`` from ``inputs``; collective over ``comm`` (default: MPI world under mpirun).

    Args:
        inputs: ``.npy``/``.npz``/HDF5 paths or fsspec URLs, in sample order.
        output: the SOLAR HDF5 file to create (local or parallel file system path).
        fields: keep/rename fields (``["x"]``, ``["img=data/images"]``); for ``.npy`` the field name.
        abs_error: compress float fields with this absolute error bound.
        rel_error: compress float fields with ``rel_error * (max - min)`` of each field's values.
            With either, a float field whose raw sample is no larger than the codec's smallest
            blob for it (e.g. one float per sample) is stored raw instead, with a note on stderr.
        resume: continue an interrupted run (see NOTE [ Ingest crash safety ]).
        overwrite: replace an existing ``output`` (atomically, at the end).
        verify: read everything back before the rename: checksums, and decoded values against
            the inputs within the bound.
        batch_size: samples written per collective step; commits happen at batch ends.
        samples: ``"auto"``, ``"file"`` or ``"axis0"``, see :mod:`solar.ingest_sources`.
        comm: an mpi4py communicator, ``"auto"`` or ``None`` (serial).
        progress: show the progress bar on rank 0.
        storage_options: for fsspec input URLs (e.g. S3 credentials and endpoint).
        commit_interval: seconds between commits (flush + journal); a crash loses at most the
            batches written since the last commit. ``0`` commits every batch.

    Raises:
        InputError / ConfigError: before anything is written, naming the input.
        InputError: also, without ``resume`` or ``overwrite``, when ``OUT.tmp`` holds batches that
            an unfinished run committed (they are kept: ``resume`` continues them, ``overwrite``
            discards them).
        MissingDependencyError: an input URL's protocol lacks its package (e.g. pyarrow for hdfs).
        CorruptDataError: ``verify`` found a mismatch (the output is then not created).
        InputError: also when another run is writing ``output`` (``OUT.ingest.lock``).
    """
    comm, parallel = _world(comm)
    t0 = time.perf_counter()
    plan, err, lock = None, None, None
    if comm.rank == 0:
        try:
            plan = _validate(inputs, output, fields, abs_error, rel_error, resume, overwrite, batch_size,
                             samples, storage_options)
            lock = _OutputLock(plan.output)
            lock.acquire()  # before looking at OUT.tmp: a run still writing it is named as such
            if not (resume or overwrite):
                _refuse_to_discard(plan.output)
        except (InputError, ConfigError, MissingDependencyError) as exc:
            err = exc
            if lock is not None:
                lock.release()
                lock = None
    plan, err = comm.bcast((plan, err), root=0)  # every rank raises the verdict of rank 0
    if err is not None:
        raise err
    try:
        return _ingest_run(plan, comm, parallel, t0, inputs, resume, overwrite, verify, progress, commit_interval)
    finally:
        if lock is not None:
            lock.release()


def _ingest_run(plan, comm, parallel, t0, inputs, resume, overwrite, verify, progress, commit_interval) -> IngestReport:
    """:func:`ingest` once the plan is agreed (and rank 0 holds the output's lock)."""
    import h5py

    if comm.rank == 0:
        for note in plan.notes:
            print(f"solar ingest: {note}", file=sys.stderr)
    # one rank stats the inputs and reads a sample of each (see Source.identity), before any pass
    # reads them: the end of the run compares them again (_check_inputs_unchanged)
    ids = plan.input_identities() if comm.rank == 0 else None
    _bound_pass(plan, comm)
    out, tmp, journal = plan.output, plan.output + TMP_SUFFIX, plan.output + JOURNAL_SUFFIX
    fp = comm.bcast(plan.fingerprint(ids) if comm.rank == 0 else None, root=0)

    # --resume when OUT exists (see NOTE [ Ingest crash safety ]): written by this very job (same
    # fingerprint; it may have died between the rename and removing the journal) -> nothing to
    # redo; written by another job -> refused unless --overwrite: a finished file is never
    # replaced without it
    existing = None
    if comm.rank == 0 and resume and os.path.exists(out):
        existing = _finished_by(out, fp, plan.legacy_fingerprint(ids))
    existing = comm.bcast(existing, root=0)
    if existing == "other" and not overwrite:
        raise InputError(f"{out} already exists and was written by a different job (other inputs or options "
                         "than this run's), so --resume will not replace it; pass --overwrite to replace it, "
                         "or choose another -o")
    if existing == "done":
        if comm.rank == 0 and os.path.exists(journal) and not os.path.exists(tmp):
            os.remove(journal)
        if verify:
            verify_file(out, plan=plan, comm=comm)
        return IngestReport(out, plan.num_samples, [x.name for x in plan.fields], 0, 0,
                            time.perf_counter() - t0, plan.num_batches, verify, comm.size, already_complete=True)
    # where to start
    start, sizes = 0, {f.name: 0 for f in plan.fields if f.compress}
    if comm.rank == 0 and resume:
        start, kept, note = _resume_point(_journal_read(journal), fp, plan.legacy_fingerprint(ids), ids, journal, tmp)
        sizes = kept if kept is not None else sizes
        if note:
            print(f"solar ingest: {note}", file=sys.stderr)
    start, sizes = comm.bcast((start, sizes), root=0)
    kw = {"driver": "mpio", "comm": comm} if parallel else {}
    f = None
    if start > 0:
        try:
            f = h5py.File(tmp, "r+", **kw)
            for name, size in sizes.items():
                if parallel and f[name]["data"].id.get_create_plist().get_alloc_time() != h5py.h5d.ALLOC_TIME_EARLY:
                    # made by a serial run: its chunks are allocated as written, and parallel HDF5
                    # cannot grow such a dataset (MPI_ERR_TYPE on one rank, a hang on the others)
                    raise ValueError("it was started by a serial run; resume it without mpirun to keep its batches")
                f[name]["data"].resize((size,))
        except (OSError, KeyError, ValueError) as exc:
            if f is not None:
                f.close()
            f = None
            if comm.rank == 0:
                print(f"solar ingest: cannot resume from {tmp} ({exc}); starting over", file=sys.stderr)
        ok = comm.allreduce(int(f is not None), op=_min_op(parallel))
        if not ok:
            if f is not None:
                f.close()
                f = None
            start, sizes = 0, {k: 0 for k in sizes}
    row_bytes = sum(int(np.prod(fp_.shape, dtype=np.int64)) * np.dtype(fp_.dtype).itemsize for fp_ in plan.fields)
    need = row_bytes * plan.batch_size  # what one batch may add to OUT.tmp (raw size)
    if f is None:
        f = _create_tmp(tmp, plan, kw, need)
        if comm.rank == 0:
            _journal_write(journal, _journal_record(fp, ids, 0, sizes, out, 0))
    dxpl = None
    if parallel:
        dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)

    last_commit = time.monotonic()
    bar = _Progress(plan.num_samples, min(plan.num_samples, start * plan.batch_size), row_bytes,
                    progress and comm.rank == 0)
    committed, finished = start, False
    try:
        for b in range(start, plan.num_batches):
            g0, g1 = b * plan.batch_size, min(plan.num_samples, (b + 1) * plan.batch_size)
            lo, hi = _share(g0, g1, comm.rank, comm.size)
            for fpl in plan.fields:
                rows = _read_input(plan, fpl.name, lo, hi)
                if fpl.compress:
                    sizes[fpl.name], sums = _write_compressed(f, fpl, rows, lo, sizes[fpl.name], comm, dxpl)
                else:
                    _write_rows(f[fpl.name], lo, rows, dxpl)
                    sums = [sample_checksum(r) for r in rows]
                _write_rows(f[checksum_key(fpl.name)], lo, np.asarray(sums, np.uint64), dxpl)
            # Commit (see NOTE [ Ingest crash safety ]) at most every commit_interval seconds: an
            # mpio flush is a collective MPI_File_sync, ~0.1 s here, too dear for every batch.
            # Rank 0 decides so that every rank makes the same collective calls.
            now = time.monotonic()
            commit = comm.bcast(b + 1 == plan.num_batches or now - last_commit >= commit_interval, root=0)
            if commit:
                f.flush()  # collective: every rank's bytes up to this batch are in the file now
                last_commit = now
                if comm.rank == 0:
                    _journal_write(journal, _journal_record(fp, ids, b + 1, sizes, out, g1))
                committed = b + 1  # every rank knows: the commit decision was broadcast
            bar.update(g1 - g0)
            if os.environ.get("SOLAR_INGEST_TEST_DELAY"):  # lets the crash test kill a rank mid-run
                time.sleep(float(os.environ["SOLAR_INGEST_TEST_DELAY"]))
        _finish(f, plan, sizes, inputs, comm, dxpl, fp)
        finished = True
    except BaseException as exc:
        failure = _storage_failure(exc, f"writing {getattr(exc, 'filename', None) or tmp}", tmp, need)
        if parallel and comm.size > 1 and not isinstance(exc, KeyboardInterrupt):
            # One rank failed between collective writes: the others wait in the next one, and the
            # collective close below would hang this rank too. Say why, then end the whole job
            # (the journal keeps every committed batch for --resume).
            _abort_job(comm, failure or exc, tmp, committed)
        if failure is not None:
            raise failure from exc
        raise
    finally:
        bar.close()
        _close(f, quiet=not finished)
    comm.Barrier()
    for s in plan.sources:
        s.close()
    mismatch = None
    if verify:
        try:
            verify_file(tmp, plan=plan, comm=comm)
        except CorruptDataError as exc:  # raised on every rank; an input that changed explains it better
            mismatch = exc
    _check_inputs_unchanged(plan, ids, comm, tmp, journal)
    if mismatch is not None:
        raise mismatch
    if comm.rank == 0:
        if not parallel:
            # The mpio path's flush is an MPI_File_sync; h5py's serial flush only hands the bytes
            # to the OS. Without this fsync a power loss after the rename could leave an OUT
            # whose name survived but whose data did not.
            fsync_path(tmp)
        os.replace(tmp, out)
        fsync_path(os.path.dirname(os.path.abspath(out)), directory=True)  # make the rename itself durable
        if os.path.exists(journal):
            os.remove(journal)
    comm.Barrier()
    stored = row_stored = 0
    if comm.rank == 0:
        with h5py.File(out, "r") as h:
            for fpl in plan.fields:
                stored += h[fpl.name]["data"].shape[0] if fpl.compress else h[fpl.name].nbytes
        row_stored = stored
    row_stored = comm.bcast(row_stored, root=0)
    return IngestReport(out, plan.num_samples, [x.name for x in plan.fields], row_bytes * plan.num_samples,
                        row_stored, time.perf_counter() - t0, start, verify, comm.size)


def _check_inputs_unchanged(plan: Plan, ids: list[list] | None, comm, tmp: str, journal: str) -> None:
    """Raise :class:`InputError` on every rank if an input's identity (rank 0's ``ids``, taken
    at the start of this run) differs now; rank 0 then removes ``tmp`` and ``journal``.

    Why: every read of a ``.npy`` input opens it anew, so an input regenerated while the run
    read it gave rows of both versions and exited 0, with a provenance fingerprint of the old
    one. ``tmp`` may mix both versions, so nothing of it is kept: without a journal ``--resume``
    starts over (as it would for the changed fingerprint; also should the input change back)."""
    changed, err = None, None
    if comm.rank == 0:
        try:
            changed = _changed_inputs(ids, plan.input_identities(), "while this run read it")
        except OSError as exc:  # e.g. an input deleted: OUT.tmp and the journal stay for --resume
            err = StorageError(f"checking that the inputs did not change while this run read them failed "
                               f"({_one_line(exc)}), so {plan.output} was not created")
        if changed:
            for path in (tmp, journal):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
    changed, err = comm.bcast((changed, err), root=0)
    if err is not None:
        raise err
    if changed:
        raise InputError(f"{'; '.join(changed)}: the rows written may mix old and new contents, so "
                         f"{plan.output} was not created (and {tmp} was removed); run the job again once the "
                         "inputs stay unchanged (--resume starts over)")


def _finished_fingerprint(path: str) -> str | None:
    """The job fingerprint of ``path`` if it is a complete file written by ``solar ingest``, else None."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if not bool(f.attrs.get("complete", False)):
                return None
            fp = json.loads(f.attrs.get("provenance", "{}")).get("fingerprint")
            return fp if isinstance(fp, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _finished_by(out: str, fp: str, legacy_fp: str) -> str:
    """Who finished the existing ``out``: ``"done"`` (this job; also when an older solar
    ingest finished it and its fingerprint matches this job's :meth:`Plan.legacy_fingerprint`,
    with a note, for the reasons given in :func:`_resume_point`) or ``"other"``."""
    got = _finished_fingerprint(out)
    if got == fp:
        return "done"
    if got == legacy_fp:
        print(f"solar ingest: {_legacy_note(f'{out} was finished', 'it is reported complete')}", file=sys.stderr)
        return "done"
    return "other"


def _legacy_note(subject: str, outcome: str) -> str:
    """What ``--resume`` says when it accepts a journal or output of a solar ingest that recorded
    the inputs by size and modification time only (see :func:`_resume_point` for why it does)."""
    return (f"{subject} by an older solar ingest, which recorded the inputs by size and modification time only "
            f"(not a sample of their contents); they match, so {outcome}. If an input may have been rewritten "
            "since (e.g. copied back with cp -p or rsync -a), rerun with --overwrite instead; --verify compares "
            "every sample with the inputs before the output is created")


def _resume_point(rec: dict | None, fp: str, legacy_fp: str, ids: list[list], journal: str,
                  tmp: str) -> tuple[int, dict | None, str | None]:
    """Where ``--resume`` continues: ``(batches_done, data_bytes or None, note for stderr)``.

    * the journal's fingerprint is this job's: continue after its committed batches;
    * it is this job's :meth:`Plan.legacy_fingerprint` (written by a solar ingest that did not
      sample input contents): continue too, with a note. Why not start over: the inputs match
      on everything that version recorded, so the user who upgraded between the crash and the
      resume keeps the guarantee the run was started with and does not lose its committed
      batches; the note says how to be sure (``--overwrite``, or ``--verify``, which compares
      every sample with the inputs before ``OUT`` is created). From the next commit on the
      journal carries the new fingerprint;
    * anything else is another job: start over, naming the inputs that changed when the
      journal recorded them (a regenerated input must never be mixed into its old rows)."""
    if not rec:
        return 0, None, None
    got = rec.get("fingerprint")
    if got in (fp, legacy_fp):
        if not os.path.exists(tmp):
            return 0, None, None
        done, kept = int(rec["batches_done"]), dict(rec["data_bytes"])
        if got == fp:
            return done, kept, None
        return done, kept, _legacy_note(f"{journal} was written", f"the run resumes at batch {done}")
    changed = _changed_inputs(rec.get("inputs"), ids)
    if changed:
        return 0, None, (f"cannot resume {tmp}: {'; '.join(changed)}; starting over, so that the output does not mix "
                         "rows of the old and the new input")
    return 0, None, f"{journal} belongs to a different job (inputs/options changed); starting over"


def _changed_inputs(old: Any, ids: list[list], when: str = "since that run") -> list[str]:
    """One phrase per input whose ``[url, size, stamp, digest]`` differs from the journal's
    record ``old`` (a journal of an older version has none: then nothing can be named);
    ``when`` says since when (``"since that run"``). A part that is unknown on either side
    (``None``: no metadata, unreadable bytes) is no evidence of a change."""
    if not isinstance(old, list):
        return []
    before = {o[0]: list(o[1:4]) for o in old if isinstance(o, list) and len(o) == 4}
    out = []
    for url, *now in ids:
        was = before.get(url)
        if was is None:
            continue
        differs = [a is not None and b is not None and a != b for a, b in zip(was, now)]
        if not any(differs):
            continue
        if any(differs[:2]):
            out.append(f"input {url} changed {when} (its size or modification time differs)")
        else:
            out.append(f"input {url} changed {when} (same size and modification time, other contents: "
                       "rewritten, e.g. regenerated and copied back with cp -p or rsync -a)")
    return out


def _journal_record(fp: str, ids: list[list] | None, batches_done: int, sizes: dict, out: str,
                    samples_done: int | None = None) -> dict:
    """The journal: what ``--resume`` continues (NOTE [ Ingest crash safety ]); ``inputs`` lets
    it name an input that changed since (:func:`_changed_inputs`); ``samples_done`` (the samples
    of the committed batches) lets a run that would discard them say how many
    (:func:`_refuse_to_discard`)."""
    return {"fingerprint": fp, "batches_done": batches_done, "samples_done": samples_done, "data_bytes": sizes,
            "output": out, "inputs": ids}


def _refuse_to_discard(out: str) -> None:
    """Raise :class:`InputError` when ``OUT.tmp`` holds batches that a run which did not finish
    committed (its journal says how many), naming them and how to go on; called by rank 0 for a
    run with neither ``--resume`` nor ``--overwrite``, which would otherwise recreate ``OUT.tmp``.

    Why: a rerun of the same command that only forgot ``--resume`` would throw away every
    committed batch (hours of work on a large ingest) without a word. ``OUT.tmp`` without a
    journal, or a journal with no committed batch, has nothing to keep: the run starts over."""
    tmp, journal = out + TMP_SUFFIX, out + JOURNAL_SUFFIX
    rec = _journal_read(journal)
    if not isinstance(rec, dict) or not os.path.exists(tmp):
        return
    try:
        done = int(rec.get("batches_done") or 0)
    except (TypeError, ValueError):
        return
    if done <= 0:
        return
    samples = rec.get("samples_done")
    count = f"{done} committed batch(es)" + (f" ({samples} samples)" if isinstance(samples, int) else "")
    ids = rec.get("inputs")  # [[url, size, stamp, digest], ...]; absent from older journals
    urls = [str(i[0]) for i in ids if isinstance(i, list) and i] if isinstance(ids, list) else []
    inputs = ""
    if urls:
        shown = ", ".join(redact_url(u) for u in urls[:3])
        inputs = f" of {shown}" + (f" and {len(urls) - 3} more input(s)" if len(urls) > 3 else "")
    raise InputError(f"{tmp} holds {count}{inputs} from an earlier run that did not finish ({journal}); rerun "
                     "the same command with --resume to continue from there, or with --overwrite to discard them "
                     "and start over")


# -- storage failures (NOTE [ Ingest crash safety ]) -----------------------------------------------
#: HDF5 reports some I/O failures (a flush, a close) as a RuntimeError naming the failed call.
_HDF5_IO = re.compile(r"file (?:write|read) failed|unable to extend file|errno = \d+", re.IGNORECASE)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _is_storage_failure(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or isinstance(exc, RuntimeError) and bool(_HDF5_IO.search(str(exc)))


def _errno_of(exc: BaseException) -> int | None:
    """``exc.errno``, or the ``errno = N`` HDF5's sec2 driver writes into its message. The
    MPI-IO driver's messages have neither ("Can't write data (file write failed)")."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code:
        return code
    m = re.search(r"errno = (\d+)", str(exc))
    return int(m.group(1)) if m else None


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; HDF5's sec2 details (time, descriptor, buffer address...)
    are dropped once the errno has been read from them."""
    text = re.sub(r"(failed): time = [^)]*", r"\1", " ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text}"


def storage_error(exc: BaseException, doing: str, path: str | None, need: int = 0) -> StorageError:
    """The :class:`StorageError` for a failed read or write: ``"{doing} failed: {why} [{exc}]"``.

    ``why`` comes from the errno; without one (MPI-IO drops it) and when the file system of
    ``path`` has less than ``need`` bytes (one batch) + 1 MiB free, it is "No space left on
    device", said to be inferred. Why: under mpirun the bare "Can't write data (file write
    failed)" named neither the file nor the cause of the commonest failure, a full disk."""
    code = _errno_of(exc)
    free = _free_bytes(path) if path else None
    room = f"its file system has {free / 1e6:.1f} MB free" if free is not None else None
    if code is None and free is not None and free < need + (1 << 20):
        code, why = errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (inferred: the error gives no reason, and {room})"
    elif code in _NO_SPACE:
        why = f"{os.strerror(code)} (errno {code}{f'; {room}' if room else ''})"
    else:
        why = f"{os.strerror(code)} (errno {code})" if code else None
    err = StorageError(f"{doing} failed: {why} [{_one_line(exc)}]" if why else f"{doing} failed: {_one_line(exc)}")
    err.errno = code
    return err


def _storage_failure(exc: BaseException, doing: str, path: str | None, need: int = 0) -> StorageError | None:
    """The :class:`StorageError` to raise instead of ``exc``, or None: ``exc`` is no storage
    failure, or already names its file (a :class:`SolarError`, e.g. an input server's answer)."""
    if isinstance(exc, SolarError) or not _is_storage_failure(exc):
        return None
    return storage_error(exc, doing, path, need)


@contextlib.contextmanager
def _storage_errors(doing: str, path: str | None, need: int = 0) -> Iterator[None]:
    """Re-raise a storage failure inside the block as :func:`storage_error` (``doing`` names the
    file); anything else passes unchanged."""
    try:
        yield
    except Exception as exc:
        failure = _storage_failure(exc, doing, path, need)
        if failure is None:
            raise
        raise failure from exc


def _read_input(plan: Plan, name: str, lo: int, hi: int) -> np.ndarray:
    """``plan.read``, with a storage failure naming the input (an HDF5 read error does not)."""
    with _storage_errors(f"reading {_where(plan, lo)}", None):
        return plan.read(name, lo, hi)


def _create_tmp(tmp: str, plan: Plan, kw: dict, need: int):
    """Create ``OUT.tmp`` with every dataset; a storage failure becomes a :class:`StorageError`
    naming it (HDF5 reports a failed first flush as a RuntimeError)."""
    import h5py

    f = None
    try:
        with _storage_errors(f"creating {tmp}", tmp, need):
            f = h5py.File(tmp, "w", **kw)
            _create(f, plan)
            f.flush()
        return f
    except Exception:
        if f is not None:
            _close(f, quiet=True)
        raise


def _close(f, quiet: bool) -> None:
    """Close ``f``; ``quiet``: while another error propagates, a close that fails for the same
    reason (HDF5 flushes on close: "Can't decrement id ref count (file write failed ...)")
    must not replace that error."""
    try:
        f.close()
    except Exception:
        if not quiet:
            raise


def resume_hint(tmp: str, batches: int, exc: BaseException | None = None) -> str:
    """The second line of a storage failure: what ``--resume`` will continue from."""
    when = ("there is free space on its file system again" if exc is not None and _errno_of(exc) in _NO_SPACE
            else "the storage answers again")
    return (f"{tmp} keeps the {batches} batch(es) committed so far; once {when}, rerun the same command with "
            "--resume to continue from there")


def failure_lines(exc: BaseException, tmp: str, batches: int, rank: int | None = None) -> list[str]:
    """What ``solar ingest`` prints for a storage failure, serially (``rank=None``) or under
    mpirun (by the failing rank): one line naming what failed, and the :func:`resume_hint` once
    batches were committed."""
    what = str(exc) if isinstance(exc, SolarError) else " ".join(f"{type(exc).__name__}: {exc}".split())
    lines = [what if rank is None else f"rank {rank}: {what}"]
    if batches:
        lines.append(resume_hint(tmp, batches, exc))
    return lines


def _abort_job(comm, exc: BaseException, tmp: str, committed: int) -> None:
    """End the MPI job after ``exc`` on this rank alone (the others wait in a collective call).
    A storage failure prints :func:`failure_lines` and aborts with :data:`EXIT_STORAGE`, which
    mpirun returns as the job's exit code, as the serial run does; an input a read finds
    unusable (:class:`DatasetFormatError`) with :data:`EXIT_INPUT`; anything else exits 1."""
    if isinstance(exc, OSError):
        lines, code = failure_lines(exc, tmp, committed, comm.rank), EXIT_STORAGE
    elif isinstance(exc, DatasetFormatError):  # an input a read finds unusable: as the serial CLI says it
        lines, code = [f"rank {comm.rank}: {exc}"], EXIT_INPUT
    else:
        lines, code = [f"rank {comm.rank} failed: {type(exc).__name__}: {exc}; aborting the job "
                       "(resume with --resume)"], 1
    for line in lines:
        print(f"solar ingest: {line}", file=sys.stderr, flush=True)
    comm.Abort(code)


def _min_op(parallel: bool):
    if not parallel:
        return None
    from mpi4py import MPI

    return MPI.MIN


def _write_compressed(f, fpl: FieldPlan, rows: np.ndarray, lo: int, size: int, comm, dxpl):
    """Encode this rank's samples, place the blobs after every lower rank's, write collectively."""
    from solar import codec

    blobs = [codec.encode(r, abs_error=fpl.abs_error) for r in rows]
    lens = np.fromiter((len(x) for x in blobs), np.int64, len(blobs))
    totals = comm.allgather(int(lens.sum()))
    base = size + sum(totals[:comm.rank])
    new_size = size + sum(totals)
    g = f[fpl.name]
    g["data"].resize((new_size,))  # collective: the same size on every rank
    payload = np.frombuffer(b"".join(blobs), np.uint8) if blobs else np.empty(0, np.uint8)
    _write_rows(g["data"], base, payload, dxpl)
    _write_rows(g["offsets"], lo, base + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
                if len(lens) else np.empty(0, np.int64), dxpl)
    if blobs:
        fpl.descriptor = codec.header_info(blobs[0]).descriptor
    return new_size, [sample_checksum(x) for x in blobs]


def _finish(f, plan: Plan, sizes: dict[str, int], inputs, comm, dxpl, fp: str) -> None:
    from solar import __version__

    n = plan.num_samples
    for fpl in plan.fields:
        if fpl.compress:
            end = np.asarray([sizes[fpl.name]], np.int64) if comm.rank == 0 else np.empty(0, np.int64)
            _write_rows(f[fpl.name]["offsets"], n, end, dxpl)
            g = f[fpl.name]
            # a resumed run may not have encoded anything on some rank: take any rank's answer
            descriptor = next((d for d in comm.allgather(fpl.descriptor) if d), None)
            if descriptor is None:
                from solar import codec

                descriptor = codec.header_info(codec.encode(np.zeros(1, np.float32), abs_error=0.0)).descriptor
            g.attrs["codec"] = descriptor
            g.attrs["codec_config"] = json.dumps({"abs_error": fpl.abs_error, "rel_error": plan.rel_error,
                                                  "rel_error_range": "field" if plan.rel_error is not None else None})
    provenance = {
        "tool": f"solar {__version__} ingest",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": redact_argv(sys.argv),
        "world_size": comm.size,
        "fingerprint": fp,
        "inputs": [{"url": redact_url(s.url), "samples": s.n, "first_sample": st, "fields": s.keys, "one_sample_per_file": s.per_file}
                   for s, st in zip(plan.sources, plan.starts)],
        "bounds": {fpl.name: fpl.abs_error for fpl in plan.fields if fpl.compress},
    }
    provenance = comm.bcast(provenance, root=0)  # attribute writes must carry the same value everywhere
    f.attrs["provenance"] = json.dumps(provenance)
    f.attrs["complete"] = True
    f.flush()
