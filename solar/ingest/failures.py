"""Storage failures of ``solar ingest``: an ``OSError`` (or HDF5's ``RuntimeError`` for a failed
write) becomes one :class:`StorageError` naming what failed, which file and why; under mpirun a
failure on one rank ends the whole job with the exit code the serial run returns.

See NOTE [ Ingest crash safety ] in :mod:`solar.ingest`.
"""

from __future__ import annotations

import errno
import os
import re
import sys

from solar.errors import DatasetFormatError, SolarError, StorageError, storage_errors

__all__ = ["EXIT_STORAGE", "EXIT_INPUT", "storage_error", "as_storage_error", "write_errors", "close_quietly",
           "resume_hint", "failure_lines", "abort_job", "min_op", "one_line"]

EXIT_STORAGE = 4  # `solar ingest`'s exit code (and MPI_Abort code) for a storage failure mid-run
EXIT_INPUT = 2  # ... for bad input (also an input that a read finds unusable mid-run)

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


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; HDF5's sec2 details (time, descriptor, buffer address...)
    are dropped once the errno has been read from them."""
    text = re.sub(r"(failed): time = [^)]*", r"\1", " ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text}"


def storage_error(exc: BaseException, doing: str, path: str | None, need: int = 0) -> StorageError:
    """The :class:`StorageError` for a failed read or write: ``"{doing} failed: {why} [{exc}]"``.

    ``why`` comes from the errno; without one (MPI-IO drops it) and when the file system of
    ``path`` has less than ``need`` bytes (one batch) + 1 MiB free, it is "No space left on
    device", said to be inferred: the commonest failure, a full disk, must be named even when
    the driver's message ("Can't write data (file write failed)") names neither file nor cause."""
    code = _errno_of(exc)
    free = _free_bytes(path) if path else None
    room = f"its file system has {free / 1e6:.1f} MB free" if free is not None else None
    if code is None and free is not None and free < need + (1 << 20):
        code, why = errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (inferred: the error gives no reason, and {room})"
    elif code in _NO_SPACE:
        why = f"{os.strerror(code)} (errno {code}{f'; {room}' if room else ''})"
    else:
        why = f"{os.strerror(code)} (errno {code})" if code else None
    err = StorageError(f"{doing} failed: {why} [{one_line(exc)}]" if why else f"{doing} failed: {one_line(exc)}")
    err.errno = code
    return err


def as_storage_error(exc: BaseException, doing: str, path: str | None, need: int = 0) -> StorageError | None:
    """The :class:`StorageError` to raise instead of ``exc``, or None: ``exc`` is no storage
    failure, or already names its file (a :class:`SolarError`, e.g. an input server's answer)."""
    if isinstance(exc, SolarError) or not _is_storage_failure(exc):
        return None
    return storage_error(exc, doing, path, need)


def write_errors(doing: str, path: str | None, need: int = 0):
    """Re-raise a storage failure inside the block as :func:`storage_error` (``doing`` names the
    file), through :func:`solar.errors.storage_errors`; anything else passes unchanged."""
    return storage_errors(lambda exc: as_storage_error(exc, doing, path, need))


def close_quietly(f, quiet: bool) -> None:
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


def abort_job(comm, exc: BaseException, tmp: str, committed: int) -> None:
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


def min_op(parallel: bool):
    """The ``op`` of an ``allreduce`` to the minimum: ``MPI.MIN``, or None for a serial world."""
    if not parallel:
        return None
    from mpi4py import MPI  # optional (the mpi extra); only a parallel run gets here

    return MPI.MIN
