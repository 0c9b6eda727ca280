"""Background prefetch: run a fetch function for the next steps on one thread, in order.

One thread, not a pool: the fetches mutate the rank's buffer (hits, keeps) and, on a collective
backend, make MPI calls that every rank must issue in the same order; a single FIFO thread keeps
both in step order while I/O overlaps the training loop (h5py, throttled sleeps and network reads
all release the GIL, and torch kernels release it too). Collective passes run on the process's
one MPI thread instead (``executor=``, NOTE [ SOLAR's own MPI traffic ] in solar/dist.py), which
every loader shares.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Callable, Iterable, Iterator, TypeVar

from solar.dist import on_mpi_thread

__all__ = ["prefetch"]

T = TypeVar("T")
R = TypeVar("R")


def prefetch(items: Iterable[T], fn: Callable[[T], R], depth: int = 2, cancel: bool = True,
             executor: Executor | None = None, timeout: float = 0) -> Iterator[R]:
    """Yield ``fn(item)`` for each item, computing up to ``depth`` items ahead on a background thread.

    ``depth=0`` runs ``fn`` inline. Exceptions from ``fn`` are re-raised, with their type, when
    their item is reached. Closing the generator early waits for the running fetch, so no read
    outlives the epoch; with ``cancel=True`` what has not started is dropped, with ``cancel=False``
    it still runs. Collective reads need ``cancel=False``: how many fetches were *submitted*
    depends only on how many results the consumer took, which is the same on every rank, while
    how many had *started* depends on timing.

    ``executor``: the shared MPI thread (:func:`solar.dist.mpi_executor`) to run ``fn`` on (not
    shut down here); then ``fn`` runs there even with ``depth=0`` (submitted and waited for one
    item at a time).

    When taking the next item raises, the results of the items before it are yielded first,
    then the error is raised (a failing sampler: every batch before it, as torch's loader).

    ``timeout`` (> 0): wait at most that many seconds for a result, then raise torch's
    ``RuntimeError("DataLoader timed out after N seconds")``. The stalled fetch is abandoned,
    not waited for (a stalled storage request may never return): it finishes on its thread in
    the background, and what has not started is dropped, except with ``cancel=False``
    (collective passes, which the other ranks make too: they still run).
    """
    if depth <= 0 and executor is None:
        for item in items:
            yield fn(item)
        return
    depth = max(depth, 0)
    pool = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="solar-prefetch")
    pending: collections.deque = collections.deque()
    it = iter(items)
    stalled = False

    def result():
        nonlocal stalled
        fut = pending.popleft()
        try:
            return fut.result(timeout if timeout > 0 else None)
        except FuturesTimeout:
            if fut.done():  # done meanwhile, or the fetch raised a TimeoutError of its own
                return fut.result()
            stalled = True
            pending.appendleft(fut)
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None

    try:
        while True:
            try:
                item = next(it)
            except StopIteration:
                break
            except Exception:  # the items failed (a sampler): what was fetched before it first
                while pending:
                    yield result()
                raise
            pending.append(pool.submit(fn, item))
            if len(pending) > depth:
                yield result()
        while pending:
            yield result()
    finally:
        if cancel:  # (collective passes are never cancelled: another rank may run them, stalled or not)
            for fut in pending:
                fut.cancel()
        # An abandoned generator is closed by the garbage collector wherever a collection happens
        # to run, also in a new thread's start-up inside threading's own locks (the thread is then
        # still a _DummyThread), where joining a thread deadlocks on those locks: then nothing waits.
        can_wait = not (stalled or isinstance(threading.current_thread(), threading._DummyThread))
        if executor is None:
            pool.shutdown(wait=can_wait)
        elif can_wait and not on_mpi_thread():  # (a generator collected on that thread cannot wait for it)
            wait(pending)
