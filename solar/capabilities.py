"""What this process can do: versions of the stack and the optional capabilities found.

Used by ``solar info``, by the backend ``auto`` choice and by the test suite's MPI/GPU split.
"""

from __future__ import annotations

import importlib.util
import platform
from typing import Any

from solar import __version__
from solar.dist import get_dist_info, under_mpirun

__all__ = ["capabilities", "h5py_has_mpi", "dali_available", "cuda_devices"]


def h5py_has_mpi() -> bool:
    try:
        import h5py
    except ImportError:
        return False
    return bool(h5py.get_config().mpi)


def dali_available() -> bool:
    return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None


def cuda_devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _mpi_library_version() -> str | None:
    """The MPI library mpi4py loads, without initializing MPI in this process.

    Under mpirun MPI is (or will be) initialized anyway; outside it, a short child process asks
    with ``mpi4py.rc.initialize = False`` (MPI allows this query before ``MPI_Init``), so this
    process's own later use of mpi4py is untouched.
    """
    import subprocess
    import sys

    if under_mpirun():
        from mpi4py import MPI

        return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
            "from mpi4py import MPI; print(MPI.Get_library_version().replace(\"\\x00\", \"\").splitlines()[0].strip())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def capabilities() -> dict[str, Any]:
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
        import mpi4py

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
            import nvidia.dali as dali

            caps["dali"] = dali.__version__
        except Exception as exc:  # DALI import can fail on driver issues; report, do not crash
            caps["dali"] = f"unusable: {exc}"
    caps["cuda_devices"] = cuda_devices()
    protocols = []
    for proto in ("file", "memory", "http", "https", "s3", "gcs", "abfs", "hdfs", "sftp"):
        try:  # importing the class is the only reliable test (optional deps are checked inside)
            fsspec.get_filesystem_class(proto)
        except (ImportError, ValueError):
            continue
        protocols.append(proto)
    caps["fsspec_protocols"] = protocols
    return caps
