"""Storage backends: read row ranges of arrays from HDF5 (serial or parallel over MPI), fsspec
URLs (file, http, s3, memory) and feed DALI pipelines.

Backends are looked up by name in :data:`registry`, imported lazily; asking for one whose
dependency is missing raises :class:`solar.MissingDependencyError` naming what to install.
"""

from __future__ import annotations

from solar.capabilities import h5py_has_mpi
from solar.dist import mpi_comm
from solar.registry import Registry

from .base import ArrayInfo, Backend, IOStats, normalize_ranges

__all__ = ["Backend", "ArrayInfo", "IOStats", "normalize_ranges", "registry", "get_backend"]

registry: Registry[type[Backend]] = Registry("storage backend", entry_point_group="solar.io_backends")
registry.register("hdf5", "solar.io_backends.hdf5:HDF5Backend", hint="pip install h5py")
registry.register(
    "mpi-hdf5",
    "solar.io_backends.mpi_hdf5:MPIHDF5Backend",
    hint="pip install 'solar-loader[mpi]' and h5py built with MPI (run `make test` to set it up)",
)
registry.register("fsspec", "solar.io_backends.fsspec:FsspecBackend", hint="pip install fsspec")
registry.register("throttled", "solar.io_backends.throttled:ThrottledBackend",
                  hint="part of SOLAR; wraps another backend (inner=...) with bandwidth= and latency=")


def get_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name``."""
    return registry.get(name)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def choose_backend(url: str) -> str:
    """The ``auto`` rule: ``mpi-hdf5`` under mpirun with MPI-enabled h5py (local files),
    ``fsspec`` for non-local URLs and for ``.npy`` stores (a directory or a ``.npy`` file),
    ``hdf5`` otherwise."""
    if not _is_local(url):
        return "fsspec"
    import os

    path = url[len("file://"):] if url.startswith("file://") else url
    if path.endswith(".npy") or os.path.isdir(path):  # a .npy store (see solar.io_backends.npy_store)
        return "fsspec"
    comm = mpi_comm()
    if comm is not None and comm.size > 1 and h5py_has_mpi():
        return "mpi-hdf5"
    return "hdf5"


def open_backend(url: str, backend: str | Backend = "auto", **options) -> Backend:
    """A backend instance for ``url`` (not yet opened: it opens lazily in the reading process)."""
    import os

    if isinstance(backend, Backend):
        return backend
    url = os.fspath(url)
    name = choose_backend(url) if backend == "auto" else backend
    if name in ("hdf5", "mpi-hdf5") and url.startswith("file://"):
        url = url[len("file://"):]
    return get_backend(name)(url, **options)


__all__ += ["choose_backend", "open_backend"]
