"""The write side of ``solar ingest``: ``OUT.tmp``'s datasets, the collective writes of raw rows
and compressed blobs, and the run itself (:func:`ingest`, :class:`_Run`).

See NOTE [ Ingest phases ] (phases 3 to 5) and NOTE [ Ingest crash safety ] in :mod:`solar.ingest`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from solar import __version__, codec
from solar.cache.disk import fsync_path
from solar.dist import comm_or_serial, share
from solar.errors import ConfigError, CorruptDataError, InputError, MissingDependencyError
from solar.ingest.failures import abort_job, as_storage_error, close_quietly, min_op, write_errors
from solar.ingest.journal import (JOURNAL_SUFFIX, TMP_SUFFIX, OutputLock, check_inputs_unchanged, finished_by,
                                  journal_record, read_journal, redact_argv, redact_url, refuse_to_discard,
                                  resume_point, write_journal)
from solar.ingest.plan import FieldPlan, Plan, bound_pass, scatter_plan, validate, where
from solar.ingest.verify import verify_file
from solar.layout import FORMAT, checksum_key, sample_checksum

__all__ = ["ingest", "IngestReport", "DATA_CHUNK"]

DATA_CHUNK = 1 << 20


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
        the report of an already complete OUT), never ``inf``, which ``--json`` would write as
        ``Infinity`` (JSON parsers reject it)."""
        if not self.stored_bytes:
            return float("inf") if self.input_bytes else 1.0
        return self.input_bytes / self.stored_bytes


# -- OUT.tmp and its collective writes -------------------------------------------------------------
def _write_rows(dset, start: int, data: np.ndarray, dxpl) -> None:
    """Write ``data`` at rows ``[start, start + len(data))``; a rank with no rows still joins."""
    import h5py  # heavy; imported when a file is written

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


def _create_tmp(tmp: str, plan: Plan, kw: dict, need: int):
    """Create ``OUT.tmp`` with every dataset; a storage failure becomes a :class:`StorageError`
    naming it (HDF5 reports a failed first flush as a RuntimeError)."""
    import h5py  # heavy; imported when a file is written

    f = None
    try:
        with write_errors(f"creating {tmp}", tmp, need):
            f = h5py.File(tmp, "w", **kw)
            _create(f, plan)
            f.flush()
        return f
    except Exception:
        if f is not None:
            close_quietly(f, quiet=True)
        raise


def _read_input(plan: Plan, name: str, lo: int, hi: int) -> np.ndarray:
    """``plan.read``, with a storage failure naming the input (an HDF5 read error does not)."""
    with write_errors(f"reading {where(plan, lo)}", None):
        return plan.read(name, lo, hi)


def _write_compressed(f, fpl: FieldPlan, rows: np.ndarray, lo: int, size: int, comm, dxpl):
    """Encode this rank's samples, place the blobs after every lower rank's, write collectively."""
    blobs = [codec.encode(r, abs_error=fpl.abs_error) for r in rows]
    lens = np.fromiter((len(x) for x in blobs), np.int64, len(blobs))
    mine = int(lens.sum())
    base = size + ((comm.exscan(mine) or 0) if comm.size > 1 else 0)  # the lower ranks' bytes
    new_size = size + comm.allreduce(mine)
    g = f[fpl.name]
    g["data"].resize((new_size,))  # collective: the same size on every rank
    payload = np.frombuffer(b"".join(blobs), np.uint8) if blobs else np.empty(0, np.uint8)
    _write_rows(g["data"], base, payload, dxpl)
    _write_rows(g["offsets"], lo, base + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
                if len(lens) else np.empty(0, np.int64), dxpl)
    if blobs:
        fpl.descriptor = codec.header_info(blobs[0]).descriptor
    return new_size, [sample_checksum(x) for x in blobs]


def _finish(f, plan: Plan, sizes: dict[str, int], comm, dxpl) -> None:
    """Offsets' ends and codec attributes (collective); :func:`_stamp` follows."""
    n = plan.num_samples
    for fpl in plan.fields:
        if fpl.compress:
            end = np.asarray([sizes[fpl.name]], np.int64) if comm.rank == 0 else np.empty(0, np.int64)
            _write_rows(f[fpl.name]["offsets"], n, end, dxpl)
            g = f[fpl.name]
            # a resumed run may not have encoded anything on some rank: take any rank's answer
            descriptor = next((d for d in comm.allgather(fpl.descriptor) if d), None)
            if descriptor is None:
                descriptor = codec.header_info(codec.encode(np.zeros(1, np.float32), abs_error=0.0)).descriptor
            g.attrs["codec"] = descriptor
            g.attrs["codec_config"] = json.dumps({"abs_error": fpl.abs_error, "rel_error": plan.rel_error,
                                                  "rel_error_range": "field" if plan.rel_error is not None else None})
    f.flush()


def _stamp(tmp: str, plan: Plan, world_size: int, fp: str) -> None:
    """Provenance and ``complete=True``, written by rank 0 alone once every rank has closed
    ``tmp``: the provenance lists every input, which rank 0 alone holds (``scatter_plan``); a
    collective attribute write would need it on every rank."""
    import h5py  # heavy; imported when a file is written

    provenance = {
        "tool": f"solar {__version__} ingest",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": redact_argv(sys.argv),
        "world_size": world_size,
        "fingerprint": fp,
        "inputs": [{"url": redact_url(s.url), "samples": s.n, "first_sample": st, "fields": s.keys,
                    "one_sample_per_file": s.per_file}
                   for s, st in zip(plan.sources, plan.starts)],
        "bounds": {fpl.name: fpl.abs_error for fpl in plan.fields if fpl.compress},
    }
    with write_errors(f"writing {tmp}", tmp), h5py.File(tmp, "r+") as f:
        f.attrs["provenance"] = json.dumps(provenance)
        f.attrs["complete"] = True


class _Progress:
    """Rank 0's progress bar: samples/s and input MB/s."""

    def __init__(self, total: int, done: int, row_bytes: int, enabled: bool) -> None:
        self.row_bytes, self.t0, self.samples = row_bytes, time.perf_counter(), 0
        self.bar = None
        if enabled:
            from tqdm import tqdm  # only rank 0 with a progress bar needs it

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
def ingest(inputs: list[str], output: str, *, fields: list[str] | None = None, abs_error: float | None = None,
           rel_error: float | None = None, resume: bool = False, overwrite: bool = False, verify: bool = False,
           batch_size: int = 256, samples: str = "auto", comm: Any = "auto", progress: bool = True,
           storage_options: dict[str, Any] | None = None, commit_interval: float = 2.0,
           on_batch_written: Callable[[int, bool], None] | None = None) -> IngestReport:
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
        samples: ``"auto"``, ``"file"`` or ``"axis0"``, see :mod:`solar.ingest.sources`.
        comm: an mpi4py communicator, ``"auto"`` or ``None`` (serial).
        progress: show the progress bar on rank 0.
        storage_options: for fsspec input URLs (e.g. S3 credentials and endpoint).
        commit_interval: seconds between commits (flush + journal); a crash loses at most the
            batches written since the last commit. ``0`` commits every batch.
        on_batch_written: called on every rank as ``on_batch_written(batch, committed)`` after
            each batch is written (and committed, when ``committed``); an exception it raises
            fails the run like a failed write.

    Raises:
        InputError / ConfigError: before anything is written, naming the input.
        InputError: also, without ``resume`` or ``overwrite``, when ``OUT.tmp`` holds batches that
            an unfinished run committed (they are kept: ``resume`` continues them, ``overwrite``
            discards them).
        MissingDependencyError: an input URL's protocol lacks its package (e.g. pyarrow for hdfs).
        CorruptDataError: ``verify`` found a mismatch (the output is then not created).
        InputError: also when another run is writing ``output`` (``OUT.ingest.lock``).
    """
    comm, parallel = comm_or_serial(comm)
    t0 = time.perf_counter()
    plan, err, lock = None, None, None
    if comm.rank == 0:
        try:
            plan = validate(inputs, output, fields, abs_error, rel_error, resume, overwrite, batch_size,
                            samples, storage_options)
            lock = OutputLock(plan.output)
            lock.acquire()  # before looking at OUT.tmp: a run still writing it is named as such
            if not (resume or overwrite):
                refuse_to_discard(plan.output)
        except (InputError, ConfigError, MissingDependencyError) as exc:
            err = exc
            if lock is not None:
                lock.release()
                lock = None
    err = comm.bcast(err, root=0)  # every rank raises the verdict of rank 0
    if err is not None:
        raise err
    plan = scatter_plan(plan, comm)  # each rank the inputs of its rows (rank 0 all of them)
    options = _Options(resume, overwrite, verify, progress, commit_interval, on_batch_written)
    try:
        return _Run(plan, comm, parallel, options, t0).run()
    finally:
        if lock is not None:
            lock.release()


@dataclass(frozen=True)
class _Options:
    """What :func:`ingest` was asked beyond the plan."""

    resume: bool
    overwrite: bool
    verify: bool
    progress: bool
    commit_interval: float
    on_batch_written: Callable[[int, bool], None] | None


class _Run:
    """:func:`ingest` once the plan is agreed (and rank 0 holds the output's lock).

    Every rank makes the same collective calls in the same order: whatever decides whether one
    is made (resume point, reopen, commit) is decided on rank 0 or all-reduced first.
    """

    def __init__(self, plan: Plan, comm, parallel: bool, opts: _Options, t0: float) -> None:
        self.plan, self.comm, self.parallel, self.opts, self.t0 = plan, comm, parallel, opts, t0
        self.out = plan.output
        self.tmp, self.journal = self.out + TMP_SUFFIX, self.out + JOURNAL_SUFFIX
        self.need = plan.row_bytes * plan.batch_size  # what one batch may add to OUT.tmp (raw size)
        self.ids: list[list] | None = None  # rank 0's input identities, taken before any pass reads them
        self.fp = ""  # the job's fingerprint, the same on every rank
        self.start = 0  # the first batch this run writes
        self.sizes: dict[str, int] = {}  # bytes in each compressed field's `data` so far
        self.committed = 0  # batches the journal names as done
        self.last_commit = 0.0  # time.monotonic() of the last commit
        self.f = None  # OUT.tmp, open for writing
        self.dxpl = None  # collective transfer property list (parallel runs)

    def run(self) -> IngestReport:
        self._prepare()
        if self._finished_output() == "done":
            return self._already_complete()
        self._find_resume_point()
        self._open_tmp()
        self._write_all()
        self._check_and_rename()
        return self._report()

    def _prepare(self) -> None:
        """Notes, the inputs' identities, the bound pass and the fingerprint."""
        plan, comm = self.plan, self.comm
        if comm.rank == 0:
            for note in plan.notes:
                print(f"solar ingest: {note}", file=sys.stderr)
        # one rank stats the inputs and reads a sample of each (see Source.identity), before any pass
        # reads them: the end of the run compares them again (check_inputs_unchanged)
        self.ids = plan.input_identities() if comm.rank == 0 else None
        bound_pass(plan, comm)
        self.fp = comm.bcast(plan.fingerprint(self.ids) if comm.rank == 0 else None, root=0)

    def _finished_output(self) -> str | None:
        """With ``--resume`` and an existing OUT (see NOTE [ Ingest crash safety ]): ``"done"``
        when this very job wrote it (it may have died between the rename and removing the
        journal), nothing to redo; written by another job, refused unless ``--overwrite``: a
        finished file is never replaced without it."""
        comm, existing = self.comm, None
        if comm.rank == 0 and self.opts.resume and os.path.exists(self.out):
            existing = finished_by(self.out, self.fp, self.plan.legacy_fingerprint(self.ids))
        existing = comm.bcast(existing, root=0)
        if existing == "other" and not self.opts.overwrite:
            raise InputError(f"{self.out} already exists and was written by a different job (other inputs or "
                             "options than this run's), so --resume will not replace it; pass --overwrite to "
                             "replace it, or choose another -o")
        return existing

    def _already_complete(self) -> IngestReport:
        plan, comm = self.plan, self.comm
        if comm.rank == 0 and os.path.exists(self.journal) and not os.path.exists(self.tmp):
            os.remove(self.journal)
        if self.opts.verify:
            verify_file(self.out, plan=plan, comm=comm)
        return IngestReport(self.out, plan.num_samples, [x.name for x in plan.fields], 0, 0,
                            time.perf_counter() - self.t0, plan.num_batches, self.opts.verify, comm.size,
                            already_complete=True)

    def _find_resume_point(self) -> None:
        plan, comm = self.plan, self.comm
        start, sizes = 0, {f.name: 0 for f in plan.fields if f.compress}
        if comm.rank == 0 and self.opts.resume:
            start, kept, note = resume_point(read_journal(self.journal), self.fp, plan.legacy_fingerprint(self.ids),
                                             self.ids, self.journal, self.tmp)
            sizes = kept if kept is not None else sizes
            if note:
                print(f"solar ingest: {note}", file=sys.stderr)
        self.start, self.sizes = comm.bcast((start, sizes), root=0)

    def _open_tmp(self) -> None:
        """Reopen ``OUT.tmp`` to resume, or create it (and a journal with no batch done)."""
        import h5py  # heavy; imported when a file is written

        kw = {"driver": "mpio", "comm": self.comm} if self.parallel else {}
        if self.start > 0:
            self.f = self._reopen(kw)
        if self.f is None:
            self.f = _create_tmp(self.tmp, self.plan, kw, self.need)
            if self.comm.rank == 0:
                write_journal(self.journal, journal_record(self.fp, self.ids, 0, self.sizes, self.out, 0))
        if self.parallel:
            self.dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
            self.dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)

    def _reopen(self, kw: dict):
        """``OUT.tmp`` cut back to the committed batches, or None (on every rank) to start over."""
        import h5py  # heavy; imported when a file is written

        comm, f = self.comm, None
        try:
            f = h5py.File(self.tmp, "r+", **kw)
            for name, size in self.sizes.items():
                plist = f[name]["data"].id.get_create_plist
                if self.parallel and plist().get_alloc_time() != h5py.h5d.ALLOC_TIME_EARLY:
                    # made by a serial run: its chunks are allocated as written, and parallel HDF5
                    # cannot grow such a dataset (MPI_ERR_TYPE on one rank, a hang on the others)
                    raise ValueError("it was started by a serial run; resume it without mpirun to keep its batches")
                f[name]["data"].resize((size,))
        except (OSError, KeyError, ValueError) as exc:
            if f is not None:
                f.close()
            f = None
            if comm.rank == 0:
                print(f"solar ingest: cannot resume from {self.tmp} ({exc}); starting over", file=sys.stderr)
        if not comm.allreduce(int(f is not None), op=min_op(self.parallel)):
            if f is not None:
                f.close()
                f = None
            self.start, self.sizes = 0, {k: 0 for k in self.sizes}
        return f

    def _write_all(self) -> None:
        """Every batch from :attr:`start` on, then :func:`_finish`; ``OUT.tmp`` is closed after."""
        plan, opts = self.plan, self.opts
        self.last_commit = time.monotonic()
        bar = _Progress(plan.num_samples, min(plan.num_samples, self.start * plan.batch_size), plan.row_bytes,
                        opts.progress and self.comm.rank == 0)
        self.committed, finished = self.start, False
        try:
            for b in range(self.start, plan.num_batches):
                g0, g1 = self._batch(b)
                self._write_batch(g0, g1)
                committed = self._commit(b, g1)
                bar.update(g1 - g0)
                if opts.on_batch_written is not None:
                    opts.on_batch_written(b, committed)
            _finish(self.f, plan, self.sizes, self.comm, self.dxpl)
            finished = True
        except BaseException as exc:
            failure = self._failed(exc)
            if failure is not None:
                raise failure from exc
            raise
        finally:
            bar.close()
            close_quietly(self.f, quiet=not finished)

    def _batch(self, b: int) -> tuple[int, int]:
        """Global samples ``[g0, g1)`` of batch ``b``."""
        return b * self.plan.batch_size, min(self.plan.num_samples, (b + 1) * self.plan.batch_size)

    def _write_batch(self, g0: int, g1: int) -> None:
        """This rank's share of samples ``[g0, g1)``: every field and its checksums (collective)."""
        f, dxpl = self.f, self.dxpl
        lo, hi = share(g0, g1, self.comm.rank, self.comm.size)
        for fpl in self.plan.fields:
            rows = _read_input(self.plan, fpl.name, lo, hi)
            if fpl.compress:
                self.sizes[fpl.name], sums = _write_compressed(f, fpl, rows, lo, self.sizes[fpl.name], self.comm, dxpl)
            else:
                _write_rows(f[fpl.name], lo, rows, dxpl)
                sums = [sample_checksum(r) for r in rows]
            _write_rows(f[checksum_key(fpl.name)], lo, np.asarray(sums, np.uint64), dxpl)

    def _commit(self, b: int, g1: int) -> bool:
        """Commit batch ``b`` (see NOTE [ Ingest crash safety ]) when it is the last one or
        ``commit_interval`` has passed since the last commit: an mpio flush is a collective
        MPI_File_sync, too dear for every batch. Rank 0 decides, so that every rank
        makes the same collective calls. Returns whether it committed."""
        comm, now = self.comm, time.monotonic()
        commit = comm.bcast(b + 1 == self.plan.num_batches or now - self.last_commit >= self.opts.commit_interval,
                            root=0)
        if commit:
            self.f.flush()  # collective: every rank's bytes up to this batch are in the file now
            self.last_commit = now
            if comm.rank == 0:
                write_journal(self.journal, journal_record(self.fp, self.ids, b + 1, self.sizes, self.out, g1))
            self.committed = b + 1  # every rank knows: the commit decision was broadcast
        return commit

    def _failed(self, exc: BaseException):
        """The :class:`StorageError` to raise for ``exc`` (or None: raise ``exc``). Under mpirun
        this rank failed between collective writes: the others wait in the next one, and the
        collective close would hang this rank too, so the whole job ends here, saying why (the
        journal keeps every committed batch for ``--resume``)."""
        failure = as_storage_error(exc, f"writing {getattr(exc, 'filename', None) or self.tmp}", self.tmp, self.need)
        if self.parallel and self.comm.size > 1 and not isinstance(exc, KeyboardInterrupt):
            abort_job(self.comm, failure or exc, self.tmp, self.committed)
        return failure

    def _check_and_rename(self) -> None:
        """``--verify``, the inputs' identities again, then ``OUT.tmp`` -> ``OUT`` (durably)."""
        plan, comm = self.plan, self.comm
        comm.Barrier()  # every rank has closed OUT.tmp
        err = None
        if comm.rank == 0:
            try:
                _stamp(self.tmp, plan, comm.size, self.fp)
            except Exception as exc:  # noqa: BLE001 - raised on every rank, below
                err = exc
        err = comm.bcast(err, root=0)
        if err is not None:
            raise err
        for s in plan.sources:
            s.close()
        mismatch = None
        if self.opts.verify:
            try:
                verify_file(self.tmp, plan=plan, comm=comm)
            except CorruptDataError as exc:  # raised on every rank; an input that changed explains it better
                mismatch = exc
        check_inputs_unchanged(plan, self.ids, comm, self.tmp, self.journal)
        if mismatch is not None:
            raise mismatch
        if comm.rank == 0:
            if not self.parallel:
                # The mpio path's flush is an MPI_File_sync; h5py's serial flush only hands the bytes
                # to the OS. Without this fsync a power loss after the rename could leave an OUT
                # whose name survived but whose data did not.
                fsync_path(self.tmp)
            os.replace(self.tmp, self.out)
            fsync_path(os.path.dirname(os.path.abspath(self.out)), directory=True)  # the rename itself, durably
            if os.path.exists(self.journal):
                os.remove(self.journal)
        comm.Barrier()

    def _report(self) -> IngestReport:
        import h5py  # heavy; imported when a file is written

        plan, comm = self.plan, self.comm
        stored = 0
        if comm.rank == 0:
            with h5py.File(self.out, "r") as h:
                for fpl in plan.fields:
                    stored += h[fpl.name]["data"].shape[0] if fpl.compress else h[fpl.name].nbytes
        stored = comm.bcast(stored, root=0)
        return IngestReport(self.out, plan.num_samples, [x.name for x in plan.fields],
                            plan.row_bytes * plan.num_samples,
                            stored, time.perf_counter() - self.t0, self.start, self.opts.verify, comm.size)
