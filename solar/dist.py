"""Where this process sits in the job: rank and world size.

Order of precedence (the Loader issue's rule): an initialized ``torch.distributed`` process group,
then mpi4py when launched under ``mpirun``/``mpiexec``, then the ``RANK``/``WORLD_SIZE`` environment
variables, else a single process. mpi4py is imported only when a launcher is detected, so a plain
``python`` run never initializes MPI.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from solar import failfast

__all__ = ["DistInfo", "get_dist_info", "under_mpirun", "mpi_comm", "private_comm", "plan_comm", "mpi_executor",
           "plan_executor", "on_mpi_thread", "collective_call"]

T = TypeVar("T")

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
        from mpi4py import MPI  # optional (the mpi extra), and only under mpirun
    except ImportError:
        return None
    return MPI.COMM_WORLD


def get_dist_info() -> DistInfo:
    try:
        import torch.distributed as tdist  # heavy; `solar info` and `import solar.dist` stay torch-free

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


# NOTE [ SOLAR's own MPI traffic ]
#     MPI pairs the collective calls of a communicator by their order on each rank. SOLAR makes
#     collective calls of its own (opening and closing parallel HDF5 files, the loader's
#     collective reads and its small agreement allreduces), while the training script makes
#     others: its own mpi4py reductions on COMM_WORLD, and a second loader (a validation pass in
#     the middle of an epoch) whose reads would otherwise run on another thread. Two rules keep
#     the pairing right on every rank:
#
#     * SOLAR's calls go over a **private duplicate** of the communicator (:func:`private_comm`),
#       never COMM_WORLD itself, so a script's ``comm.allreduce`` cannot pair with one of ours
#       (a user's sum would meet our allreduce's tuple, or both ranks would hang).
#     * they all run on **one thread per process** (:func:`mpi_executor`), in the order they
#       were submitted. Submissions come from the training loop's thread, in program order,
#       which is the same on every rank, so the calls are too, however many loaders run. A
#       thread per loader would make its calls when it got to them, and a validation loader's
#       pass would meet the training loader's read-ahead in a different order on each rank.
#
#     Sharded planning (NOTE [ Sharded planning ] in solar/shardplan.py) is the one exception, for
#     a reason: an epoch's plan takes seconds of exchanges, and queued between the reads it held
#     up every read behind it (the first epoch's batches after its head waited for the whole
#     plan: NOTE [ First steps ] in solar/schedule.py). Its calls go over a communicator of their
#     own (:func:`plan_comm`, a second duplicate) on a thread of their own (:func:`plan_executor`),
#     submitted, like the reads, from the training loop's thread in program order: each
#     communicator's calls keep one order on every rank, and the two threads' calls never pair
#     with each other (MPI_THREAD_MULTIPLE, mpi4py's default level).
#
#     Reads outside the loader's passes (``ds[i]``) stay independent and run where they are
#     called. A script making its own *parallel HDF5* calls (an ``mpio`` h5py file of its own)
#     while a loader reads ahead should do them through :func:`collective_call` too: h5py holds
#     one lock over every HDF5 call, so a collective HDF5 call on two threads can wait on each
#     other across ranks.

_COMMS: dict = {}
_COMMS_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_PID: int | None = None
_EXECUTOR_IDENT: int | None = None  # its thread, noted by the thread itself as it starts
_PLANNER: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the planning thread's executor)


def private_comm(comm=None):
    """SOLAR's duplicate of ``comm`` (default ``MPI.COMM_WORLD``), one per process and base comm.

    The first call for a communicator is collective over it (``MPI_Comm_dup``): make it at the
    same point on every rank, from the thread that owns ``comm`` (opening a parallel-HDF5 dataset
    does it). Later calls return the cached duplicate and make no MPI call. Returns ``None``
    when not under an MPI launcher and no ``comm`` is given. See NOTE [ SOLAR's own MPI traffic ].
    """
    if comm is None:
        comm = mpi_comm()
        if comm is None:
            return None
    key = (os.getpid(), comm.py2f())
    with _COMMS_LOCK:
        dup = _COMMS.get(key)
        made = dup is None
        if made:
            dup = _COMMS[key] = comm.Dup()
    if made:
        failfast.install(dup)  # NOTE [ Fail fast ] in solar/failfast.py (collective, as the Dup)
    return dup


def plan_comm(comm):
    """The sharded planner's duplicate of ``comm`` (SOLAR's private communicator), one per
    process and communicator (NOTE [ SOLAR's own MPI traffic ]). The first call for ``comm`` is
    collective over it (``MPI_Comm_dup``, made on the MPI thread, in ``comm``'s order); later
    calls return the cached duplicate and make no MPI call."""
    key = (os.getpid(), comm.py2f(), "plan")
    with _COMMS_LOCK:
        dup = _COMMS.get(key)
    if dup is None:
        dup = collective_call(comm.Dup)
        with _COMMS_LOCK:
            _COMMS[key] = dup
    return dup


def plan_executor() -> _MPIExecutor:
    """The process's one planning thread (created on first use; a forked child makes its own):
    plans made ahead, and a sharded planner's collective calls over :func:`plan_comm`."""
    global _PLANNER
    with _COMMS_LOCK:
        if _PLANNER is None or _PLANNER[0] != os.getpid():
            _PLANNER = (os.getpid(), _MPIExecutor(max_workers=1, thread_name_prefix="solar-plan"))
        return _PLANNER[1]


def _note_thread() -> None:
    global _EXECUTOR_IDENT
    _EXECUTOR_IDENT = threading.get_ident()


class _MPIExecutor(ThreadPoolExecutor):
    """The MPI thread's executor; it tells the failure watch when a call starts and ends
    (NOTE [ Fail fast ] in solar/failfast.py: a call still running long after another rank
    ended can never return)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_tracked, fn, *args, **kwargs)

    def submit_local(self, fn, /, *args, **kwargs):
        """Submit a call that makes no collective call (an unsharded plan made ahead): the
        failure watch leaves it alone, however long it runs."""
        return super().submit(fn, *args, **kwargs)


def _tracked(fn: Callable[..., T], *args, **kwargs) -> T:
    failfast.busy(getattr(fn, "__qualname__", None) or "SOLAR MPI call")
    try:
        return fn(*args, **kwargs)
    finally:
        failfast.busy(None)


def mpi_executor() -> ThreadPoolExecutor:
    """The single thread that makes SOLAR's collective MPI calls in this process (created on first use)."""
    global _EXECUTOR, _EXECUTOR_PID
    with _COMMS_LOCK:
        if _EXECUTOR is None or _EXECUTOR_PID != os.getpid():  # a forked child starts its own
            _EXECUTOR = _MPIExecutor(max_workers=1, thread_name_prefix="solar-mpi", initializer=_note_thread)
            _EXECUTOR_PID = os.getpid()
        return _EXECUTOR


def on_mpi_thread() -> bool:
    """Whether the calling thread is :func:`mpi_executor`'s."""
    return _EXECUTOR_IDENT is not None and threading.get_ident() == _EXECUTOR_IDENT and _EXECUTOR_PID == os.getpid()


def collective_call(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn(*args, **kwargs)`` on :func:`mpi_executor`'s thread and return its result.

    Inline when already on that thread (nested calls) or when the interpreter is shutting down
    (no other thread runs then). Exceptions propagate with their type.
    """
    if on_mpi_thread():
        return fn(*args, **kwargs)
    try:
        fut = mpi_executor().submit(fn, *args, **kwargs)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return fn(*args, **kwargs)
    return fut.result()


# -- a communicator for code that runs collectively under mpirun and alone without it ---------------
from solar.errors import MPIUnavailableError  # noqa: E402


class SerialComm:
    """The few mpi4py calls collective code makes, for a world of one process."""

    rank, size = 0, 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def allreduce(self, obj, op=None):
        return obj

    def Barrier(self):
        pass


def comm_or_serial(comm, who: str = "solar ingest"):
    """``(communicator, parallel)`` for ``comm``: ``None`` is :class:`SerialComm`; ``"auto"`` is
    MPI world under mpirun (:class:`SerialComm` for one rank or none); anything else is used as
    given. ``parallel`` says whether the ranks write one HDF5 file together, which needs h5py
    built against parallel HDF5: without it :class:`MPIUnavailableError` names ``who``."""
    if comm is None:
        return SerialComm(), False
    if comm == "auto":
        comm = mpi_comm()
        if comm is None or comm.size == 1:
            return SerialComm(), False
        import h5py  # heavy; only a run on several ranks asks for it

        if not h5py.get_config().mpi:
            raise MPIUnavailableError(
                f"{who} runs on {comm.size} MPI ranks but h5py was built without MPI support, so the "
                "ranks cannot write one file together; build h5py against parallel HDF5 (`make setup`) or run "
                "without mpirun")
    return comm, True


def share(lo: int, hi: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``[lo, hi)`` split evenly over ``size`` ranks."""
    n = hi - lo
    return lo + rank * n // size, lo + (rank + 1) * n // size


__all__ += ["SerialComm", "comm_or_serial", "share"]
