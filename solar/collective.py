"""Rank agreement: how ranks that read together fail together.

Storage backends read; the loader decides which reads every rank makes together (its passes over
a ``DistributedSampler``). This module holds the protocol between the two: the :func:`lockstep`
block the loader's passes run in, :func:`agree` / :func:`union` / :func:`agreement_at_end` over a
collective backend's ``comm``, and the agreement a loader iteration starts with
(:func:`agree_iteration`). Serial backends make no MPI call through any of them.

NOTE [ Collective request checks ]
    On a collective backend every rank must make the same read calls. A request that one rank
    rejects (a row or sample index out of range, unsorted ranges, a wrong ``out``) would make that
    rank raise alone, and the others would pair their next collective read with a different call
    of it and hang. So every check guarding a collective call ends in :func:`agree`: one
    small ``allreduce`` over the backend's ``comm`` tells every rank whether any rank's request
    was bad, *before* anyone enters the collective read, and every rank raises: the bad rank its
    own error, the others one of the same built-in type (``IndexError``/``ValueError``) naming
    the rank that failed and why. Serial backends raise at once and make no MPI call.

    Only calls the ranks make in *lockstep* agree: the loader's passes over a ``DistributedSampler``
    (``H5Dataset.fetch_steps`` runs inside :func:`lockstep`; its sample checks, each field's read
    and the checksum and decode checks agree) and any ``disjoint=True`` read (the collective
    transfer). An independent read agrees nothing itself, even in lockstep: a dataset's lazily
    cached reads (offsets, checksums) are made by some ranks only. Every other read (``ds[i]``,
    ``__getitems__`` from a user's loop or torch's ``DataLoader``, a direct ``read_ranges``) uses
    the independent transfer, which makes no MPI call, so a rank may read alone (rank 0 plotting
    a sample, each rank its own subset) and a bad request raises on the rank that made it: an
    agreement there would wait for ranks that never make the read.

    A pass agrees *once* on what failed after its collective reads (NOTE [ One agreement per
    pass ]): only the checks *before* a collective call need an allreduce of their own.

NOTE [ One agreement per pass ]
    A failure that shows only after a collective read has returned on every rank (a read error
    on one rank, a checksum mismatch) need not be agreed at once: the failing
    rank can keep making the pass's remaining collective calls, with stand-in data, and every
    rank learns of it at the pass's end. So ``H5Dataset`` and ``StoredConcat`` read a pass's
    files and fields inside :func:`agreement_at_end`, and their post-read checks call
    ``agree(problem, later=True)``, which inside it records the rank's first problem and returns
    (the caller then substitutes zeros for what it failed to read and goes on, so its collective
    calls stay in step); the block's end makes one allreduce, before the pass evicts or puts
    anything in a buffer, and every rank raises as :func:`agree` does: one allreduce per pass,
    whatever its files and fields (``stats.extra["agreements"]`` counts them). Checks *before* a
    collective call (a bad request) still agree at once: a rank that skipped the call would
    leave the others waiting in it.

NOTE [ One agreement per iteration ]
    Ranks that build their loaders differently (another ``batch_size``, seed, epoch, buffer or
    field list on one rank) plan different passes, and their collective calls pair wrongly: a
    silent hang, or wrong samples. So a scheduled iteration on a collective backend starts with
    one allreduce over the values its passes depend on (:func:`agree_iteration`, the ``values``
    of ``SolarBatchSampler._agreed_values``); a difference raises ``ConfigError`` on every rank,
    naming each differing value and the ranks that have it (an ``allgather``, made only then).
    The same allreduce carries how each rank's last iteration ended (NOTE [ Early stop ] in
    solar/sampler.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import warnings
from typing import Any, Iterator, NamedTuple

import numpy as np

from solar.errors import ConfigError, CorruptDataError, StorageError
from solar.failfast import agreed

__all__ = ["lockstep", "in_lockstep", "agree", "union", "agreement_at_end", "wait", "agree_iteration",
           "IterationAgreement", "WAIT_WARN_S"]

#: whether the running reads are made by every rank in step (NOTE [ Collective request checks ])
_LOCKSTEP: contextvars.ContextVar[bool] = contextvars.ContextVar("solar_lockstep", default=False)


@contextlib.contextmanager
def lockstep() -> Iterator[None]:
    """Within the block every rank makes the same read calls in the same order (the loader's
    passes), so :func:`agree` may synchronize them; outside it, checks raise locally."""
    token = _LOCKSTEP.set(True)
    try:
        yield
    finally:
        _LOCKSTEP.reset(token)


class _Later:
    """The open :func:`agreement_at_end` block: this rank's first deferred problem."""

    __slots__ = ("problem",)

    def __init__(self) -> None:
        self.problem: Exception | None = None


#: the running pass's deferred agreement (NOTE [ One agreement per pass ]), per thread
_LATER: contextvars.ContextVar[_Later | None] = contextvars.ContextVar("solar_agree_later", default=None)

def in_lockstep() -> bool:
    """Whether the calling code runs inside :func:`lockstep`."""
    return _LOCKSTEP.get()


@contextlib.contextmanager
def agreement_at_end(backend: Any, where: str | None = None) -> Iterator[None]:
    """Within the block ``agree(problem, later=True)`` records this rank's first problem and
    returns; the block's end agrees on it once, as :func:`agree` (NOTE [ One agreement per
    pass ]). A block inside another joins it. An exception leaving the block is not agreed:
    only the problems handed to ``agree`` are."""
    if _LATER.get() is not None:
        yield
        return
    later = _Later()
    token = _LATER.set(later)
    try:
        yield
    finally:
        _LATER.reset(token)
    agree(backend, later.problem, where)

def agree(backend: Any, problem: Exception | None, where: str | None = None, later: bool = False) -> None:
    """Raise ``problem`` -- on a collective backend, on every rank if any rank has one.

    A check guarding a collective call must not fail on one rank alone: the others would
    wait in the collective read for it (see NOTE [ Collective request checks ]). Serial
    backends raise ``problem`` (if any) at once and make no MPI call; collective ones make
    one small ``allreduce`` over the backend's ``comm``, so every rank must call this at the same point;
    that is, only inside :func:`lockstep` (elsewhere ``problem`` is raised on this rank alone).

    ``where`` names what the other ranks' error is about (default: this backend's URL).
    ``later=True`` (a check after a collective read that every rank has made): inside
    :func:`agreement_at_end` on a collective backend in lockstep, record ``problem`` and
    return; the caller must then go on with stand-in data, making the same calls as the other
    ranks (NOTE [ One agreement per pass ]). Elsewhere, as ``later=False``.

    Raises:
        IndexError / CorruptDataError / ValueError: ``problem`` on the rank that has it; on
            the other ranks an error of the same kind naming the lowest failing rank and its
            message (any other exception type is reported to them as a ValueError).
    """
    if not (backend.collective and _LOCKSTEP.get()):
        if problem is not None:
            raise problem
        return
    pending = _LATER.get() if later else None
    if pending is not None:
        if pending.problem is None:
            pending.problem = problem
        return
    from mpi4py import MPI  # only under mpirun (a collective backend)

    comm = backend.comm
    kind = ("index" if isinstance(problem, IndexError) else
            "corrupt" if isinstance(problem, CorruptDataError) else
            "storage" if isinstance(problem, OSError) else "value")
    mine = (0, comm.rank, kind, str(problem)) if problem is not None else (1, comm.rank, "", "")
    failed, rank, kind, why = comm.allreduce(mine, op=MPI.MIN)  # the lowest failing rank, if any
    backend.stats.extra["agreements"] = backend.stats.extra.get("agreements", 0) + 1
    if problem is not None:
        raise agreed(problem)
    if failed == 0:
        cls = {"index": IndexError, "corrupt": CorruptDataError, "storage": StorageError}.get(kind, ValueError)
        what = {"corrupt": "found corrupt data", "storage": "failed to read"}.get(kind, "rejected its read request")
        raise agreed(cls(f"{where or backend.url}: rank {rank} of {comm.size} {what} ({why}); every rank stops "
                         f"here instead of waiting in the next collective read: see rank {rank}'s error"))

def union(backend: Any, mask: np.ndarray) -> np.ndarray:
    """``mask`` (bool) OR-ed over every rank: on a collective backend inside :func:`lockstep`
    (one small ``allreduce`` over the backend's ``comm``, so every rank must call it at the same point,
    as :func:`agree`); elsewhere ``mask`` itself. Lets ranks skip together what none needs."""
    mask = np.ascontiguousarray(mask, dtype=bool)
    if not (backend.collective and _LOCKSTEP.get()):
        return mask
    from mpi4py import MPI  # only under mpirun (a collective backend)

    out = np.empty(mask.shape, np.uint8)
    backend.comm.Allreduce(mask.astype(np.uint8), out, op=MPI.MAX)
    return out.astype(bool)



#: Seconds an iteration waits for the other ranks to start it before saying why it may never end.
WAIT_WARN_S = 60.0


def wait(req, comm, path: str) -> None:
    """Complete the request, warning once if the other ranks do not join within WAIT_WARN_S.

    Every rank must iterate a loader over a DistributedSampler on parallel HDF5 (its passes are
    collective). A loop only some ranks run (``if rank == 0: validate(loader)``) waits here; the
    wait itself is right (a rank may be slower), so it says what to do rather than raise.
    """
    start: float | None = time.monotonic()
    while not req.Test():
        if start is not None and time.monotonic() - start > WAIT_WARN_S:
            warnings.warn(
                f"solar.DataLoader over {path} (rank {comm.rank} of {comm.size}): waited {WAIT_WARN_S:.0f} s for "
                "the other ranks to start this iteration. Over a DistributedSampler on parallel HDF5 every rank "
                "must iterate the loader together; for a loop only some ranks run (validation on rank 0), build "
                "that loader without a DistributedSampler, or open its H5Dataset with backend='hdf5'",
                RuntimeWarning, stacklevel=3)
            start = None
        time.sleep(0.0005)


class IterationAgreement(NamedTuple):
    """What :func:`agree_iteration` found over every rank."""

    steps: int  # the steps every rank's last iteration handed out, or -1 where they differ
    any_open: bool  # whether some rank's last iteration did not run to its end


def agree_iteration(comm, path: str, values: dict[str, int], steps: int, is_open: int) -> IterationAgreement:
    """NOTE [ One agreement per iteration ]: collective over ``comm``; call on SOLAR's MPI thread.

    Raises:
        ConfigError: on every rank, when some value differs between ranks.
    """
    from mpi4py import MPI  # only under mpirun

    mine = np.array([v for x in values.values() for v in (x, -x)] + [-steps, steps, is_open], np.int64)
    out = np.empty_like(mine)
    wait(comm.Iallreduce(mine, out, op=MPI.MAX), comm, path)
    if not np.array_equal(out[:-3:2], -out[1:-3:2]):  # some value's max is not its min
        gathered = comm.allgather(list(values.values()))
        raise agreed(ConfigError(_disagreement(path, list(values), gathered, comm.rank)))
    lo, hi, any_open = out[-3:].tolist()
    return IterationAgreement(hi if -lo == hi else -1, bool(any_open))


def _disagreement(path: str, names: list[str], gathered: list[list[int]], me: int) -> str:
    """The message for ranks whose iterations disagree: each differing value and who has it."""
    parts = []
    for k, name in enumerate(names):
        by_value: dict[int, list[int]] = {}
        for rank, vals in enumerate(gathered):
            by_value.setdefault(vals[k], []).append(rank)
        if len(by_value) > 1:
            has = "; ".join(f"{_ranks(r)} {v}" for v, r in sorted(by_value.items(), key=lambda kv: kv[1][0]))
            parts.append(f"{name}: {has}")
    return (f"solar.DataLoader over {path} (rank {me} of {len(gathered)}): the ranks disagree on what this iteration "
            f"is, so their collective reads would never pair up ({' | '.join(parts)}). Every rank must build the "
            "loader and its DistributedSampler with the same arguments (batch_size, seed, shuffle, drop_last, "
            "buffer=, prefetch=, num_workers, fields) over the same dataset")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f"rank {shown} has" if len(ranks) == 1 else f"ranks {shown} have"
