"""Where this process sits in the job: rank and world size.

Order of precedence (the Loader issue's rule): an initialized ``torch.distributed`` process group,
then mpi4py when launched under ``mpirun``/``mpiexec``, then the ``RANK``/``WORLD_SIZE`` environment
variables, else a single process. mpi4py is imported only when a launcher is detected, so a plain
``python`` run never initializes MPI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DistInfo", "get_dist_info", "under_mpirun", "mpi_comm"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_MPI_TYPE")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    source: str  # "torch.distributed" | "mpi" | "env" | "single"


def under_mpirun() -> bool:
    """True if an MPI launcher started this process (OpenMPI, MPICH/Hydra or PMIx variables)."""
    return any(v in os.environ for v in _MPI_ENV[:4])


def mpi_comm():
    """``MPI.COMM_WORLD`` when launched under mpirun with mpi4py installed, else ``None``."""
    if not under_mpirun():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def get_dist_info() -> DistInfo:
    try:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return DistInfo(tdist.get_rank(), tdist.get_world_size(), "torch.distributed")
    except ImportError:  # pragma: no cover - torch always has it
        pass
    comm = mpi_comm()
    if comm is not None:
        return DistInfo(comm.rank, comm.size, "mpi")
    if "WORLD_SIZE" in os.environ:
        return DistInfo(int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"]), "env")
    return DistInfo(0, 1, "single")
