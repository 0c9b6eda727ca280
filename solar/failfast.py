"""Fail fast under MPI: a rank that fails or leaves never leaves the others waiting.

NOTE [ Fail fast ]
    SOLAR makes collective MPI calls (parallel-HDF5 opens, reads and closes, the loader's small
    agreements). A rank that stops making them, because it failed or ended early, leaves every
    other rank waiting in one until the allocation's wall time: MPI has no way to tell a slow
    rank from a gone one. What the library does, once it has made its private communicator in
    a job of two or more ranks (:func:`install`, from :func:`solar.dist.private_comm`):

    * **An uncaught exception aborts the job.** ``sys.excepthook`` prints the error with the
      rank's number, then calls ``MPI_Abort`` on ``COMM_WORLD``: ``mpirun`` then ends every rank
      and exits non-zero. This is what ``python -m mpi4py`` does; without it, Python's exit ran
      SOLAR's *collective* closes of parallel-HDF5 files on the failing rank while the others
      waited in a read (a hang). MPI_Abort is the only tool: after an exception, a rank cannot
      know which collective calls the others are in, so no orderly exit is safe.
      ``SOLAR_ABORT_ON_ERROR=0`` leaves ``sys.excepthook`` alone.
    * **A rank that ends is announced.** A rank that ends without an exception (``sys.exit(3)``
      in the loop, one more epoch on the other ranks) tells rank 0 at exit, over a separate
      duplicate communicator, and rank 0 tells every rank once (O(P) messages per job, not
      O(P^2)). A watchdog thread on each rank then aborts the job if one of this rank's two
      collective threads (where all of SOLAR's collective calls run: the MPI thread,
      :func:`solar.dist.mpi_executor`, and the planning thread, :func:`solar.dist.plan_executor`)
      is still in one call ``SOLAR_PEER_EXIT_GRACE`` seconds (default 10) after both the
      announcement and the call's start: a rank that has ended joins no collective call any
      more, and a call the ended rank did join returns within moments. A rank that is busy with
      anything else (a long checkpoint save on rank 0 while the others have ended) is never
      aborted.
    * **At exit, collective closes wait for every rank.** Parallel-HDF5 files still open at
      exit must be closed collectively before MPI is finalized. They are closed by one exit
      handler, in the order they were opened, only after a barrier that every rank enters at
      its own exit: so a rank that ends early waits there for the others (as it would in
      ``MPI_Finalize``) instead of entering a close the others would pair with a read.

    Not covered: a rank that hangs without exiting (a deadlock in user code), and a rank that
    ended while the others wait in the *script's own* MPI calls (``comm.allreduce(loss)``);
    a rank killed by a signal (the OOM killer) is noticed by ``mpirun`` itself.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

__all__ = ["install", "installed", "busy", "register_exit_close", "agreed", "is_agreed", "abort_out_of_step"]

_NOTICE, _RELAY = 7101, 7102
_POLL_S = 0.05


class _Guard:
    """The process's failure watch: its communicator, what it heard, and the collective threads' state."""

    def __init__(self, comm) -> None:
        self.comm = comm  # a duplicate used only for exit notices: they never pair with a collective
        self.rank, self.size = comm.rank, comm.size
        self.grace = float(os.environ.get("SOLAR_PEER_EXIT_GRACE", "10"))
        self.gone: int | None = None  # the first rank known to have ended
        self.gone_at: float | None = None
        #: each collective thread's current call (thread ident -> (start, what)): the MPI thread's
        #: and the planning thread's (solar/dist.py), which run on communicators of their own
        self.calls: dict[int, tuple[float, str]] = {}
        self.stop = threading.Event()
        self.sends: list = []
        self.relayed = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="solar-failfast", daemon=True)
        self.thread.start()

    # -- the watchdog ---------------------------------------------------------------------------
    def _watch(self) -> None:
        import numpy as np  # numpy and mpi4py: only the watchdog under mpirun; `solar info` imports this module
        from mpi4py import MPI

        buf = np.zeros(1, np.int64)
        heard = 0
        src, tag = (MPI.ANY_SOURCE, _NOTICE) if self.rank == 0 else (0, _RELAY)
        req = self.comm.Irecv(buf, source=src, tag=tag)
        try:
            while not self.stop.is_set():
                if req is not None and req.Test():
                    self._heard(int(buf[0]))
                    heard += 1
                    # rank 0 hears every other rank's notice once; the others hear one relay
                    req = self.comm.Irecv(buf, source=src, tag=tag) if self.rank == 0 and heard < self.size - 1 \
                        else None
                self._check()
                self.stop.wait(_POLL_S)
        finally:
            if req is not None:
                req.Cancel()
                req.Wait()

    def _heard(self, rank: int) -> None:
        with self.lock:
            if self.gone is None:
                self.gone, self.gone_at = rank, time.monotonic()
        if self.rank == 0:
            self._relay(rank)

    def _relay(self, rank: int) -> None:
        """Rank 0 tells every other rank, once, that ``rank`` has ended."""
        import numpy as np  # only under mpirun; `solar info` imports this module

        with self.lock:
            if self.relayed:
                return
            self.relayed = True
        msg = np.array([rank], np.int64)
        self.sends += [self.comm.Isend(msg, dest=r, tag=_RELAY) for r in range(1, self.size) if r != rank]

    def _check(self) -> None:
        with self.lock:
            gone_at, oldest = self.gone_at, min(self.calls.values(), default=None)
        if gone_at is None or oldest is None or self.stop.is_set():
            return
        since, what = oldest
        if time.monotonic() - max(gone_at, since) > self.grace:
            _abort(f"solar: rank {self.rank} of {self.size} has waited {self.grace:.0f} s in a collective call "
                   f"({what or 'SOLAR MPI call'}) that rank {self.gone} will never join: rank {self.gone} "
                   "has ended (its script returned or called sys.exit) while this rank still iterates a loader "
                   "that every rank must iterate together. Ending the MPI job (MPI_Abort) instead of waiting "
                   "forever; see rank " f"{self.gone}'s output for why it ended early")

    # -- exit -----------------------------------------------------------------------------------
    def announce_exit(self) -> None:
        import numpy as np  # only under mpirun; `solar info` imports this module

        if self.rank == 0:
            self._heard(0)
        else:
            self.sends.append(self.comm.Isend(np.array([self.rank], np.int64), dest=0, tag=_NOTICE))

    def exit_barrier(self) -> None:
        """Wait until every rank has reached its exit (warning once if that takes a while)."""
        req = self.comm.Ibarrier()
        start, warned = time.monotonic(), False
        while not req.Test():
            if not warned and time.monotonic() - start > 60:
                print(f"solar: rank {self.rank} of {self.size} has ended and waits for the other ranks to end "
                      "before closing its parallel-HDF5 files collectively", file=sys.stderr, flush=True)
                warned = True
            time.sleep(0.002)

    def shutdown(self) -> None:
        from mpi4py import MPI  # only under mpirun

        self.stop.set()
        self.thread.join()
        MPI.Request.Waitall(self.sends)
        self.sends = []


_GUARD: _Guard | None = None
_CLOSES: dict[int, Callable[[], None]] = {}  # collective closes still due at exit, by opening order
_SEQ = [0]
_PREVIOUS_HOOK: Any = None
_EXIT_PID: int | None = None  # the process whose exit handler is registered
_GUARD_PID: int | None = None  # the process the watch runs in (a forked child has none)


def installed() -> bool:
    return _GUARD is not None and _GUARD_PID == os.getpid()


def _ensure_exit_handler() -> None:
    """Register :func:`_at_exit` once per process (a forked child's inherited closes are its
    parent's: it starts with none)."""
    global _EXIT_PID
    if _EXIT_PID != os.getpid():
        _CLOSES.clear()
        _EXIT_PID = os.getpid()
        atexit.register(_at_exit)


def install(comm) -> None:
    """Start the failure watch over ``comm`` (SOLAR's private duplicate of COMM_WORLD).

    Collective over ``comm`` (one ``MPI_Comm_dup``): :func:`solar.dist.private_comm` calls it
    where every rank makes that communicator. A no-op for one rank, in a forked child, or when
    already installed.
    """
    global _GUARD, _GUARD_PID, _PREVIOUS_HOOK
    if comm.size < 2 or installed():
        return
    _GUARD = _Guard(comm.Dup())
    _GUARD_PID = os.getpid()
    if os.environ.get("SOLAR_ABORT_ON_ERROR", "1") != "0":
        _PREVIOUS_HOOK = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    _ensure_exit_handler()


def busy(what: str | None) -> None:
    """The calling collective thread starts (``what``: a short description) or ends (``None``) a call."""
    g = _GUARD
    if g is None:
        return
    me = threading.get_ident()
    with g.lock:
        if what is None:
            g.calls.pop(me, None)
        else:
            g.calls[me] = (time.monotonic(), what)


def register_exit_close(close: Callable[[], None]) -> int:
    """Register a collective close to make at exit if not done before; returns its token
    (:func:`unregister_exit_close`). Closes run in registration order, which is the order
    of the collective opens and so the same on every rank."""
    _ensure_exit_handler()
    _SEQ[0] += 1
    _CLOSES[_SEQ[0]] = close
    return _SEQ[0]


def unregister_exit_close(token: int) -> None:
    _CLOSES.pop(token, None)


def replace_exit_close(token: int, close: Callable[[], None]) -> None:
    """Keep ``token``'s place in the order, with another close."""
    if token in _CLOSES:
        _CLOSES[token] = close


def weak_close(obj: Any, method: str) -> Callable[[], None]:
    """A close callable that calls ``obj.<method>()`` if ``obj`` is still alive."""
    ref = weakref.ref(obj)

    def close() -> None:
        o = ref()
        if o is not None:
            getattr(o, method)()
    return close


def agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every rank alike (after an agreement): raising it leaves the
    ranks' collective calls in step, so the loader may go on (retry a pass step by step)."""
    exc._solar_agreed = True  # type: ignore[attr-defined]
    return exc


def is_agreed(exc: BaseException) -> bool:
    return bool(getattr(exc, "_solar_agreed", False))


def abort_out_of_step(exc: BaseException, where: str) -> None:
    """``exc`` left a collective pass on this rank alone: its remaining collective calls will
    never be made, and the other ranks wait in them. In a job of two or more ranks with the
    watch installed, print it and end the job; otherwise return (the caller re-raises)."""
    if not installed() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    g = _GUARD
    print(f"solar: rank {g.rank} of {g.size} failed {where} with {type(exc).__name__}: {exc}", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    _abort(f"solar: ending the MPI job (MPI_Abort) because rank {g.rank} left a collective pass the other ranks "
           "are still in: they would wait for it forever")


def _abort_on_uncaught(etype, value, tb) -> None:
    rank = _GUARD.rank if _GUARD is not None else "?"
    size = _GUARD.size if _GUARD is not None else "?"
    if issubclass(etype, KeyboardInterrupt) or not installed():
        (_PREVIOUS_HOOK or sys.__excepthook__)(etype, value, tb)
        return
    print(f"solar: rank {rank} of {size} failed with an uncaught {etype.__name__}: {value}", file=sys.stderr)
    (_PREVIOUS_HOOK or sys.__excepthook__)(etype, value, tb)
    _abort(f"solar: ending the MPI job (MPI_Abort) because rank {rank} failed: the other ranks would wait for it "
           "in their next collective call forever (set SOLAR_ABORT_ON_ERROR=0 to keep Python's own exit)")


def _abort(message: str) -> None:
    try:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        from mpi4py import MPI  # only under mpirun

        MPI.COMM_WORLD.Abort(1)


def _at_exit() -> None:
    """Announce this rank's end, wait for every rank's, then make the collective closes."""
    if _EXIT_PID != os.getpid():
        return
    g = _GUARD
    if g is not None and installed():
        try:
            g.announce_exit()
            g.exit_barrier()
        finally:
            g.shutdown()
    for token in sorted(_CLOSES):
        close = _CLOSES.pop(token)
        try:
            close()
        except Exception:  # noqa: BLE001 - one file's close must not skip the others' (collective)
            traceback.print_exc()
