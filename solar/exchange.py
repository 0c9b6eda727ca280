"""All-to-all record exchange for sharded planning: over MPI, or every rank in one process.

Rank code (:mod:`solar.shardplan`) is written as a generator that yields a :class:`Post` (its
records, grouped by destination rank) and receives the records every rank sent it, ordered by
source rank and, within a source, in the order they were sent. :func:`run_mpi` carries each post
with one ``Alltoall`` (the counts) and one ``Alltoallv`` (the records); :func:`run_together`
runs all ``P`` ranks' generators in one process, in lockstep, handing each the same records the
``Alltoallv`` would (NOTE [ Sharded planning ] in solar/shardplan.py: same code path, the
collective replaced by its result). Neither imports mpi4py: ``run_mpi`` takes the communicator.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Callable, Generator, NamedTuple

import numpy as np

__all__ = ["Post", "post", "reply", "by_rank", "run_mpi", "run_together", "RankCost"]


class Post(NamedTuple):
    """One rank's side of an all-to-all: ``rows`` (n, k) records sorted by destination, and how
    many go to each rank (``counts``, length P). Every rank posts the same ``k`` and dtype. What
    an exchange delivers is a Post too: the records by source rank, and how many came from each."""

    rows: np.ndarray
    counts: np.ndarray


def post(rows: np.ndarray, dest: np.ndarray, world_size: int) -> Post:
    """The :class:`Post` of ``rows`` bound for ``dest`` (stable: a destination gets them in order)."""
    order = by_rank(dest, world_size)
    return Post(np.ascontiguousarray(rows[order]), np.bincount(dest, minlength=world_size).astype(np.int64))


def by_rank(ranks: np.ndarray, world_size: int) -> np.ndarray:
    """The stable order that groups ``ranks`` (values < world_size) by rank: a radix sort in
    O(n) where the ranks fit 16 bits (numpy sorts those stably by radix), else a merge sort."""
    ranks = np.asarray(ranks)
    if world_size <= 1 << 16:
        ranks = ranks.astype(np.uint16)
    return np.argsort(ranks, kind="stable")


def reply(rows: np.ndarray, received: Post) -> Post:
    """The answer to ``received`` (what an exchange delivered): ``rows[i]`` goes back to the
    rank that sent ``received.rows[i]``, which gets its answers in the order it asked."""
    return Post(np.ascontiguousarray(rows), received.counts)


def run_mpi(gen: Generator, comm):
    """Drive one rank's generator over ``comm`` (collective: every rank of ``comm`` runs its
    own generator of the same protocol); returns the generator's result."""
    value = None
    while True:
        try:
            out = gen.send(value)
        except StopIteration as stop:
            return stop.value
        value = _alltoallv(comm, out)


def _alltoallv(comm, out: Post) -> Post:
    k = out.rows.shape[1]
    recv_counts = np.empty(comm.size, np.int64)
    comm.Alltoall(out.counts, recv_counts)
    recv = np.empty((int(recv_counts.sum()), k), out.rows.dtype)
    # MPI counts are C ints: a single pair's records stay far below 2**31 / k at any planned size
    comm.Alltoallv([out.rows, (out.counts * k).astype(np.int32)], [recv, (recv_counts * k).astype(np.int32)])
    return Post(recv, recv_counts)


class RankCost(NamedTuple):
    """What one rank's code cost in :func:`run_together` (the exchanges themselves excluded)."""

    seconds: float  # CPU time inside the rank's generator
    #: the most it had allocated at once in one of its resumptions (tracemalloc), counting the
    #: records delivered to it (under MPI its own receive buffer)
    peak_bytes: int


def run_together(gens: list[Generator], measure: Callable[[int], bool] | None = None) -> tuple[list, dict]:
    """Run every rank's generator in lockstep, each post delivered as the ``Alltoallv`` would.

    Returns the generators' results, and for each rank ``measure(rank)`` selects, its
    :class:`RankCost` (tracemalloc must be tracing for ``peak_bytes``; 0 otherwise).
    """
    P = len(gens)
    results: list = [None] * P
    pending: list[Post | None] = [None] * P
    costs = {q: [0.0, 0] for q in range(P) if measure is not None and measure(q)}

    def advance(q: int, value) -> None:
        cost = costs.get(q)
        if cost is not None:
            tracing = tracemalloc.is_tracing()
            if tracing:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
            t0 = time.process_time()
        try:
            pending[q] = gens[q].send(value)
        except StopIteration as stop:
            pending[q], results[q] = None, stop.value
        if cost is not None:
            cost[0] += time.process_time() - t0
            if tracing:
                got = value.rows.nbytes if value is not None else 0
                cost[1] = max(cost[1], tracemalloc.get_traced_memory()[1] - base + got)

    for q in range(P):
        advance(q, None)
    while any(p is not None for p in pending):
        if any(p is None for p in pending):
            raise RuntimeError("ranks out of step: some rank's plan ended while others still exchange records")
        delivered = _transpose(pending)  # type: ignore[arg-type]
        pending = [None] * P  # the posts' records are in ``delivered`` now
        for q in range(P):
            advance(q, delivered[q])
            delivered[q] = None
    return results, {q: RankCost(*c) for q, c in costs.items()}


def _transpose(posts: list[Post]) -> list[Post]:
    """What each rank receives: every source's block for it, in source order. Only the (source,
    destination) pairs that carry records are visited: O(records + P) memory beyond the records."""
    P = len(posts)
    pairs = [(np.full(len(nz), q, np.int32), nz.astype(np.int32), p.counts[nz]) for q, p in enumerate(posts)
             for nz in (np.flatnonzero(p.counts),)]
    src, dst, cnt = (np.concatenate(x) for x in zip(*pairs))
    del pairs
    off = np.cumsum(cnt) - cnt  # each block's start in the sources' records, end to end
    big = np.concatenate([p.rows for p in posts])
    o = np.lexsort((src, dst))  # blocks by destination, then source
    src, dst, cnt, off = src[o], dst[o], cnt[o], off[o]
    start = np.cumsum(cnt) - cnt
    moved = big[np.repeat(off - start, cnt) + np.arange(len(big), dtype=np.int64)]
    del big
    bounds = np.searchsorted(dst, np.arange(P + 1))
    out = []
    for t in range(P):
        a, b = bounds[t], bounds[t + 1]
        counts = np.zeros(P, np.int32)  # (P of them, one per rank: int32 halves P**2)
        counts[src[a:b]] = cnt[a:b]
        out.append(Post(moved[start[a]:start[a] + int(cnt[a:b].sum())] if b > a else moved[:0], counts))
    return out
