"""SOLAR's exception types.

Every error also subclasses the built-in a caller would naturally catch (``ValueError``,
``LookupError``, ``ImportError`` ...), so code written against torch/h5py/fsspec keeps working,
while ``except solar.SolarError`` catches everything SOLAR raises on purpose.
Messages say what went wrong, name the file/sample/tensor involved, and say what to do.
"""

from __future__ import annotations

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
