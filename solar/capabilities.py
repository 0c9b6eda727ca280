"""What this process can do: versions of the stack and the optional capabilities found.

Used by ``solar info``, by the backend ``auto`` choice and by the test suite's MPI/GPU split.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import subprocess
import sys
from typing import Any

from solar import __version__
from solar.dist import get_dist_info, under_mpirun

__all__ = ["capabilities", "h5py_has_mpi", "dali_available", "cuda_devices", "fsspec_protocol_missing", "pip_name",
           "OPTIONAL_PACKAGES", "FSSPEC_PROTOCOLS"]

#: Optional packages ``solar info`` reports (version, or ``"missing"``): the codec's lossless
#: stages, ``.safetensors`` checkpoints, the benchmarks' plots.
OPTIONAL_PACKAGES = ("zstandard", "lz4", "safetensors", "matplotlib")

#: fsspec protocols ``solar info`` reports on.
FSSPEC_PROTOCOLS = ("file", "memory", "http", "https", "s3", "gs", "gcs", "abfs", "az", "hdfs", "webhdfs", "sftp")

# NOTE [ What an fsspec protocol needs ]
#     fsspec's registry (``known_implementations``) names each protocol's class by its dotted path
#     and the hint to print when it does not import. A class of another package (``s3fs.S3FileSystem``)
#     needs that package: its top module must be found. fsspec's own implementations live in
#     ``fsspec.implementations``, which is always there, and import their third-party packages
#     either at the top of their module (``sftp``: paramiko) or only when a filesystem is made
#     (``hdfs``: ``HadoopFileSystem.__init__`` imports pyarrow), so importing the class proves
#     nothing; ``_FSSPEC_NEEDS`` lists those packages. Checked with ``importlib.util.find_spec``,
#     which imports nothing heavy (only a package's parent, for a dotted name).
_FSSPEC_NEEDS = {
    "fsspec.implementations.arrow": ("pyarrow",),
    "fsspec.implementations.http": ("aiohttp", "yarl"),
    "fsspec.implementations.sftp": ("paramiko",),
    "fsspec.implementations.webhdfs": ("requests",),
    "fsspec.implementations.github": ("requests",),
    "fsspec.implementations.gist": ("requests",),
    "fsspec.implementations.jupyter": ("requests",),
    "fsspec.implementations.dbfs": ("requests",),
    "fsspec.implementations.smb": ("smbclient", "smbprotocol"),
    "fsspec.implementations.git": ("pygit2",),
    "fsspec.implementations.libarchive": ("libarchive",),
    "fsspec.implementations.dask": ("dask", "distributed"),
}

#: pip's name for a module whose distribution is named otherwise (pip matches ``_`` and ``-``).
_PIP_NAMES = {"smbclient": "smbprotocol", "libarchive": "libarchive-c"}


def h5py_has_mpi() -> bool:
    try:
        import h5py  # heavy; `solar info` and the demo ask, `import solar.capabilities` stays light
    except ImportError:
        return False
    return bool(h5py.get_config().mpi)


def dali_available() -> bool:
    return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None


def cuda_devices() -> list[str]:
    import torch  # heavy; only the report asks

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _mpi_library_version() -> str | None:
    """The MPI library mpi4py loads, without initializing MPI in this process.

    Under mpirun MPI is (or will be) initialized anyway; outside it, a short child process asks
    with ``mpi4py.rc.initialize = False`` (MPI allows this query before ``MPI_Init``), so this
    process's own later use of mpi4py is untouched.
    """
    if under_mpirun():
        from mpi4py import MPI  # optional (the mpi extra); under mpirun MPI is initialized anyway

        return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
            "from mpi4py import MPI; print(MPI.Get_library_version().replace(\"\\x00\", \"\").splitlines()[0].strip())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import; a module left half-imported
        return False


def pip_name(module: str) -> str:
    """The name to ``pip install`` for top-level ``module``."""
    return _PIP_NAMES.get(module, module)


def fsspec_protocol_missing(protocol: str) -> list[str] | None:
    """The top-level modules that fsspec's implementation of ``protocol`` needs and that are not
    installed here: ``[]`` when it is usable, ``None`` when fsspec knows no such protocol. See
    NOTE [ What an fsspec protocol needs ]."""
    from fsspec.registry import known_implementations, registry  # only a protocol check imports fsspec

    cls = registry.get(protocol)  # imported already: fsspec registers hdfs's class without pyarrow too
    if cls is not None:
        module = cls.__module__
    elif protocol in known_implementations:
        module = known_implementations[protocol]["class"].rpartition(".")[0]
    else:
        return None
    if module.startswith("fsspec."):
        need = _FSSPEC_NEEDS.get(module, ())
    else:
        need = (module.partition(".")[0],)
    return [m for m in need if not _found(m)]


def _package_version(name: str) -> str:
    """``name``'s installed version, ``"missing"`` when it cannot be imported; without importing it."""
    if not _found(name):
        return "missing"
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # importable but not installed as a distribution
        return "installed (version unknown)"


def capabilities() -> dict[str, Any]:
    # heavy: the report imports what it reports on, and only when asked
    import fsspec
    import h5py
    import numpy
    import torch

    caps: dict[str, Any] = {
        "solar": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "h5py_mpi": h5py_has_mpi(),
        "fsspec": fsspec.__version__,
    }
    if importlib.util.find_spec("mpi4py") is not None:
        import mpi4py  # optional (the mpi extra)

        caps["mpi4py"] = mpi4py.__version__
        caps["mpi_library"] = _mpi_library_version()
    else:
        caps["mpi4py"] = None
    dist = get_dist_info()
    caps["under_mpirun"] = under_mpirun()
    caps["rank"] = dist.rank
    caps["world_size"] = dist.world_size
    caps["world_source"] = dist.source
    caps["dali"] = None
    if dali_available():
        try:
            import nvidia.dali as dali  # optional (the dali extra)

            caps["dali"] = dali.__version__
        except Exception as exc:  # DALI import can fail on driver issues; report, do not crash
            caps["dali"] = f"unusable: {exc}"
    caps["cuda_devices"] = cuda_devices()
    for name in OPTIONAL_PACKAGES:
        caps[name] = _package_version(name)
    protocols, unusable = [], {}
    for proto in FSSPEC_PROTOCOLS:
        missing = fsspec_protocol_missing(proto)
        if missing:
            unusable[proto] = "pip install " + " ".join(dict.fromkeys(map(pip_name, missing)))
        elif missing is not None:
            protocols.append(proto)
    caps["fsspec_protocols"] = protocols
    caps["fsspec_protocols_missing"] = unusable  # protocol -> what installs it
    return caps
