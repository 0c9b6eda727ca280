"""SOLAR: fast, scalable data loading and I/O for distributed deep learning on scientific data."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BackendNotFoundError,
    CheckpointError,
    CheckpointLockedError,
    ConfigError,
    CorruptDataError,
    DatasetFormatError,
    InputError,
    MissingDependencyError,
    MPIUnavailableError,
    SolarError,
    StorageError,
)

__all__ = [
    "__version__",
    "SolarError",
    "ConfigError",
    "InputError",
    "MissingDependencyError",
    "BackendNotFoundError",
    "MPIUnavailableError",
    "DatasetFormatError",
    "CorruptDataError",
    "StorageError",
    "CheckpointError",
    "CheckpointLockedError",
]

# Heavy parts (torch, h5py) load on first use, so `solar --help` and `solar info` stay fast.
_LAZY = {
    "DataLoader": "solar.loader",
    "H5Dataset": "solar.dataset",
    "StoredSubset": "solar.subset",
    "StoredConcat": "solar.concat",
    "codec": "solar.codec",
    "checkpoint": "solar.checkpoint",
    "io_backends": "solar.io_backends",
    "cache": "solar.cache",
    "dist": "solar.dist",
}


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'solar' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
