"""SOLAR's exception types.

Every error also subclasses the built-in a caller would naturally catch (``ValueError``,
``LookupError``, ``ImportError`` ...), so code written against torch/h5py/fsspec keeps working,
while ``except solar.SolarError`` catches everything SOLAR raises on purpose.
Messages say what went wrong, name the file/sample/tensor involved, and say what to do.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Callable, Iterator

__all__ = [
    "SolarError",
    "ConfigError",
    "MissingDependencyError",
    "BackendNotFoundError",
    "MPIUnavailableError",
    "DatasetFormatError",
    "CorruptDataError",
    "CheckpointError",
    "CheckpointLockedError",
    "InputError",
    "StorageError",
    "MissingKeyError",
    "NotHDF5Error",
    "UnknownCodecError",
    "TierFullError",
    "UnsafePathError",
    "UnsafeLockFileError",
    "CheckpointVersionRemovedError",
    "NotACheckpointRootError",
    "CheckpointReadOnlyError",
    "UntrustedPickleError",
    "storage_errors",
]


class SolarError(Exception):
    """Base class of every error SOLAR raises on purpose."""


class ConfigError(SolarError, ValueError):
    """An argument or option is invalid; the message says which and what to change."""


class InputError(SolarError, ValueError):
    """Bad user input (missing file, mismatched shapes ...); nothing was written."""


class MissingDependencyError(SolarError, ImportError):
    """An optional dependency is missing; the message names the package or extra to install."""


class BackendNotFoundError(SolarError, LookupError):
    """No implementation is registered under the requested name."""


class MPIUnavailableError(SolarError, RuntimeError):
    """MPI or MPI-enabled h5py was requested but is not available in this process."""


class DatasetFormatError(SolarError, ValueError):
    """A file does not have the layout SOLAR expects (e.g. fields without a sample axis)."""


class CorruptDataError(SolarError, ValueError):
    """Stored bytes fail a checksum or cannot be decoded; never returned as silent garbage."""


class StorageError(SolarError, OSError):
    """Storage refused or could not serve a request (an HTTP status, an unreachable endpoint, a
    server that ignores byte-range requests); the message names the URL and what to check."""


class CheckpointError(SolarError, RuntimeError):
    """A checkpoint cannot be written, read or verified."""


class CheckpointLockedError(CheckpointError):
    """Another writer holds the lock on a checkpoint root."""


class MissingKeyError(SolarError, KeyError):
    """A named array, dataset or group is not in the container; the message names the file and
    the keys there are. (A ``KeyError``, so ``except KeyError`` keeps working; printed without
    the quotes ``KeyError`` puts around its message.)"""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotHDF5Error(DatasetFormatError, OSError):
    """A file that h5py cannot open as HDF5 (an ``OSError`` too, as h5py raises it)."""


class UnknownCodecError(ConfigError, LookupError):
    """``codec=`` names no registered codec: a bad argument (``ConfigError``, a ``ValueError``, as
    docs/codec.md says of every bad argument) and a failed lookup (the registry's ``LookupError``)."""


class TierFullError(SolarError, MemoryError):
    """A value does not fit in the tier's byte budget."""


class UnsafePathError(SolarError, OSError):
    """A key's file is reached through a symlink out of the tier's root, or is a symlink or not a
    regular file (a FIFO, a device): a root someone else prepared. Nothing was read or written
    through it."""


class UnsafeLockFileError(OSError):
    """The lock file's name holds something a lock never is (a symlink, a hard link to another
    file, a FIFO, a file that is no owner record); it was not written."""


class CheckpointVersionRemovedError(CheckpointError, FileNotFoundError):
    """The version being read was removed meanwhile, by a writer's ``keep_last`` retention (or a
    ``gc``). Nothing is corrupt: load a newer version, or keep more versions."""


class NotACheckpointRootError(CheckpointError, FileNotFoundError):
    """An existing directory given as a checkpoint root holds no checkpoint (a parent of the
    root, a mistyped sibling, a rank's root before its first save). Raised so that ``verify``
    never reports OK having checked nothing and ``gc`` never leaves a ``.lock`` there."""


class CheckpointReadOnlyError(CheckpointError, PermissionError):
    """The checkpoint root cannot be written here (read-only mount, missing permissions), so
    saving, ``gc`` and ``verify --repair`` cannot run; reading it still works."""


class UntrustedPickleError(CheckpointError, pickle.UnpicklingError):
    """A pickled value in a checkpoint names a global off the allow-list of safe ones, so loading it
    by default (``weights_only=True``) refuses it instead of running code its author chose."""


@contextlib.contextmanager
def storage_errors(classify: Callable[[Exception], Exception | None]) -> Iterator[None]:
    """Re-raise an exception from the block as what ``classify`` makes of it (a
    :class:`StorageError` naming the file, what was being done and what to check), chained to
    the original; one it returns None for passes unchanged.

    The one translator of storage failures: each storage layer brings its classifier, because
    each knows its own transport (``io_backends/hdf5.py``: h5py's read failures;
    ``io_backends/fsspec_common.py``: HTTP statuses, S3 endpoints, permissions; ``solar/ingest/
    failures.py``: errnos of writes, a full disk)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - classified, else re-raised as is
        err = classify(exc)
        if err is None:
            raise
        raise err from exc

