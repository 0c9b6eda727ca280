"""The communicator a job-wide checkpoint writer talks through: one small interface over an mpi4py
communicator or a torch.distributed process group.

A job writer needs two private channels: one for the collectives of its construction (opening the
root) and one used by its background commit thread (every collective of a save, its agreement
first). Each is a duplicate of the communicator the user passed (``comm.Dup()`` for mpi4py, a new
gloo group over the same ranks for torch.distributed), so the writer's collectives never interleave
with the training code's collectives on the same communicator, nor with each other. Creating them
is collective: every rank of the job constructs its writer.
"""

from __future__ import annotations

import time
from typing import Any

from solar.errors import ConfigError

__all__ = ["JobComm", "job_comm"]


class JobComm:
    """``rank``, ``size``, ``allgather`` and ``bcast`` of Python objects over one channel."""

    def __init__(self, kind: str, handle: Any, rank: int, size: int, owned: bool = True) -> None:
        self.kind = kind
        self.owned = owned  # a private copy this writer made (freed by close), not the caller's
        self.handle = handle
        self.rank = rank
        self.size = size

    def _arrive(self) -> None:
        """Wait, sleeping, until every rank has reached this collective (mpi only).

        Open MPI's blocking collectives spin while they wait: a rank that arrives first would burn
        a core polling while the others still hash and copy, and on a node with as many ranks as
        cores that slows the ranks it waits for. A non-blocking barrier tested with short sleeps
        costs no CPU; the collective after it then completes at once.
        """
        if self.kind == "mpi" and self.owned:
            req = self.handle.Ibarrier()
            while not req.Test():
                time.sleep(0.0005)

    def allgather(self, obj: Any) -> list:
        if self.kind == "mpi":
            self._arrive()
            return self.handle.allgather(obj)
        import torch.distributed as dist  # only for a torch.distributed group

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.handle)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self.kind == "mpi":
            self._arrive()
            return self.handle.bcast(obj, root=root)
        import torch.distributed as dist  # only for a torch.distributed group

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.handle, root), group=self.handle)
        return box[0]

    def close(self) -> None:
        if self.kind == "mpi" and self.owned and self.handle is not None:
            self.handle.Free()
        self.handle = None


def _is_mpi(comm: Any) -> bool:
    return all(hasattr(comm, a) for a in ("Dup", "allgather", "bcast", "Get_rank"))


def job_comm(comm: Any, copies: int = 2) -> list[JobComm]:
    """``copies`` private channels over the ranks of ``comm`` (collective: every rank calls it).

    Args:
        comm: an mpi4py communicator (``MPI.COMM_WORLD`` or a sub-communicator), a
            ``torch.distributed`` process group, or the string ``"torch"`` for the default group.

    Raises:
        ConfigError: ``comm`` is neither, or torch.distributed is not initialised.
    """
    if _is_mpi(comm):
        from mpi4py import MPI  # the communicator came from mpi4py, so it is installed

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ConfigError("the job checkpoint writer commits from a background thread and needs MPI initialised "
                              "with MPI_THREAD_MULTIPLE (mpi4py's default); do not lower mpi4py.rc.thread_level")
        return [JobComm("mpi", comm.Dup(), comm.Get_rank(), comm.Get_size()) for _ in range(copies)]
    import torch.distributed as dist  # only when comm is not an mpi4py communicator

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"comm={comm!r} is neither an mpi4py communicator nor a torch.distributed process group "
                          "(torch.distributed is not initialised); pass MPI.COMM_WORLD, or call "
                          "torch.distributed.init_process_group first and pass its group (or comm='torch')")
    group = dist.group.WORLD if comm == "torch" or comm is None else comm
    if not isinstance(group, dist.ProcessGroup):
        raise ConfigError(f"comm={comm!r} is not a torch.distributed ProcessGroup nor an mpi4py communicator")
    ranks = dist.get_process_group_ranks(group)
    out = []
    for _ in range(copies):
        # gloo: the writer's objects are CPU pickles whatever backend the training uses
        handle = dist.new_group(ranks=ranks, backend="gloo")
        out.append(JobComm("torch", handle, dist.get_rank(handle), dist.get_world_size(handle)))
    return out


def plain_comm(comm: Any) -> JobComm:
    """``comm`` itself (no private copy) behind the same interface: for one-off collectives the
    caller makes in step on every rank, such as agreeing on the version to load."""
    if _is_mpi(comm):
        return JobComm("mpi", comm, comm.Get_rank(), comm.Get_size(), owned=False)
    import torch.distributed as dist  # only when comm is not an mpi4py communicator

    group = dist.group.WORLD if comm == "torch" else comm
    return JobComm("torch", group, dist.get_rank(group), dist.get_world_size(group), owned=False)
