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

import itertools
import os
import tempfile
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


def post(cols, dest: np.ndarray, world_size: int, dtype) -> Post:
    """The :class:`Post` of records with one column per array of ``cols`` (as ``dtype``), bound
    for ``dest`` (stable: a destination gets them in order). Each column is gathered into its
    place: no record array in sending order is made first, whose copy was the largest transient
    of a plan (NOTE [ Sharded planning ] in solar/shardplan.py)."""
    order = by_rank(dest, world_size)
    rows = np.empty((len(order), len(cols)), dtype)
    for j, c in enumerate(cols):
        rows[:, j] = np.asarray(c)[order]
    return Post(rows, np.bincount(dest, minlength=world_size).astype(np.int64))


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


def run_together(gens: list[Generator], measure: Callable[[int], bool] | None = None,
                 spill: str | None = None) -> tuple[list, dict]:
    """Run every rank's generator in lockstep, each post delivered as the ``Alltoallv`` would.

    Returns the generators' results, and for each rank ``measure(rank)`` selects, its
    :class:`RankCost` (tracemalloc must be tracing for ``peak_bytes``; 0 otherwise).

    ``spill``: a directory. Each round's posts are then written to a file there as the ranks
    make them, and delivered a few destinations at a time (about ``SPILL_CHUNK`` bytes of
    records): this process holds the ranks' own state but never a whole round of records, which
    at N = 1e8 is several GiB. The ranks' code is the same and gets the same records.
    """
    P = len(gens)
    results: list = [None] * P
    costs = {q: [0.0, 0] for q in range(P) if measure is not None and measure(q)}

    def advance(q: int, value) -> Post | None:
        cost = costs.get(q)
        if cost is not None:
            tracing = tracemalloc.is_tracing()
            if tracing:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
            t0 = time.process_time()
        out = None
        try:
            out = gens[q].send(value)
        except StopIteration as stop:
            results[q] = stop.value
        if cost is not None:
            cost[0] += time.process_time() - t0
            if tracing:
                got = value.rows.nbytes if value is not None else 0
                cost[1] = max(cost[1], tracemalloc.get_traced_memory()[1] - base + got)
        return out

    if spill is None:
        pending = [advance(q, None) for q in range(P)]
        while _in_step(sum(p is not None for p in pending), P):
            delivered = _transpose(pending)  # type: ignore[arg-type]
            pending = [None] * P  # the posts' records are in ``delivered`` now
            for q in range(P):
                pending[q] = advance(q, delivered[q])
                delivered[q] = None
    else:
        with tempfile.TemporaryDirectory(prefix="solar-exchange-", dir=spill) as where:
            box = _Round(os.path.join(where, "0"), P)
            for q in range(P):
                box.put(q, advance(q, None))
            for r in itertools.count(1):
                if not _in_step(box.posted, P):
                    break
                sent, box = box, _Round(os.path.join(where, str(r)), P)
                for lo, delivered in sent.deliveries():
                    for i, got in enumerate(delivered):
                        box.put(lo + i, advance(lo + i, got))
                        delivered[i] = None
                sent.close()
            box.close()
    return results, {q: RankCost(*c) for q, c in costs.items()}


def _in_step(posted: int, P: int) -> bool:
    """Whether all ``P`` ranks posted (True) or all finished (False): nothing else is in step."""
    if posted and posted < P:
        raise RuntimeError("ranks out of step: some rank's plan ended while others still exchange records")
    return posted > 0


#: bytes of records :func:`run_together` with ``spill=`` reads back at a time
SPILL_CHUNK = 128 << 20


class _Round:
    """One round's posts in a file, source after source (each grouped by destination), with
    every source's counts per destination (an int32 P x P matrix) and where its records start."""

    def __init__(self, path: str, P: int) -> None:
        self.fh = open(path, "w+b")
        self.counts = np.zeros((P, P), np.int32)
        self.start = np.zeros(P, np.int64)  # in records
        self.written = 0
        self.posted = 0
        self.row: tuple | None = None  # (k, dtype) of the round's records

    def put(self, q: int, out: Post | None) -> None:
        if out is None:
            return
        rows = np.ascontiguousarray(out.rows)
        if self.row is None:
            self.row = (rows.shape[1], rows.dtype)
        self.start[q] = self.written
        self.counts[q] = out.counts
        rows.tofile(self.fh)
        self.written += len(rows)
        self.posted += 1

    def deliveries(self):
        """Yields ``(first destination, [Post per destination])`` over every destination in turn."""
        self.fh.flush()
        k, dtype = self.row  # type: ignore[misc]
        width = k * dtype.itemsize
        per_dest = self.counts.sum(axis=0, dtype=np.int64)
        read = np.zeros(len(self.start), np.int64)  # records of each source delivered so far
        lo, P = 0, len(per_dest)
        while lo < P:
            hi = lo + 1 + int(np.searchsorted(np.cumsum(per_dest[lo + 1:]) * width, SPILL_CHUNK))
            hi = min(hi, P)
            block = self.counts[:, lo:hi]
            seg = block.sum(axis=1, dtype=np.int64)
            big = np.empty((int(seg.sum()), k), dtype)
            at = 0
            for q in np.flatnonzero(seg):
                n = int(seg[q])
                os.preadv(self.fh.fileno(), [memoryview(big[at:at + n]).cast("B")],
                          int(self.start[q] + read[q]) * width)
                at += n
            read += seg
            src, dst = np.nonzero(block)
            yield lo, _by_destination(big, src, dst, block[src, dst].astype(np.int64), hi - lo, P)
            del big
            lo = hi

    def close(self) -> None:
        self.fh.close()
        os.unlink(self.fh.name)


def _transpose(posts: list[Post]) -> list[Post]:
    """What each rank receives: every source's block for it, in source order. Only the (source,
    destination) pairs that carry records are visited: O(records + P) memory beyond the records."""
    P = len(posts)
    pairs = [(np.full(len(nz), q, np.int32), nz.astype(np.int32), p.counts[nz]) for q, p in enumerate(posts)
             for nz in (np.flatnonzero(p.counts),)]
    src, dst, cnt = (np.concatenate(x) for x in zip(*pairs))
    del pairs
    return _by_destination(np.concatenate([p.rows for p in posts]), src, dst, cnt, P, P)


def _by_destination(big: np.ndarray, src: np.ndarray, dst: np.ndarray, cnt: np.ndarray, D: int,
                    P: int) -> list[Post]:
    """Regroup ``big``, blocks of ``cnt`` records from source ``src`` to destination ``dst``
    (< ``D``) in source-then-destination order, into one :class:`Post` per destination."""
    off = np.cumsum(cnt) - cnt  # each block's start in the sources' records, end to end
    o = np.lexsort((src, dst))  # blocks by destination, then source
    src, dst, cnt, off = src[o], dst[o], cnt[o], off[o]
    start = np.cumsum(cnt) - cnt
    moved = np.take(big, np.repeat(off - start, cnt) + np.arange(len(big), dtype=np.int64), axis=0)
    del big
    bounds = np.searchsorted(dst, np.arange(D + 1))
    out = []
    for t in range(D):
        a, b = bounds[t], bounds[t + 1]
        counts = np.zeros(P, np.int32)  # (P of them, one per rank: int32 halves P**2)
        counts[src[a:b]] = cnt[a:b]
        out.append(Post(moved[start[a]:start[a] + int(cnt[a:b].sum())] if b > a else moved[:0], counts))
    return out
