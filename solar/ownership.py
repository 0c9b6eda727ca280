"""Which rank owns (keeps) each sample, and the capacity whose owned samples fit a byte budget.

Ownership is a pure function of the sample index (NOTE [ Pinned residency: why the bound is
reached ] in solar/schedule.py): every rank and every process computes it alike, without the
order or any communication.
"""

from __future__ import annotations

import numpy as np

__all__ = ["owner_of", "capacity_for_bytes", "capacity_for_uniform"]


def owner_of(indices: np.ndarray, world_size: int, batch_size: int, capacity: int) -> np.ndarray:
    """The rank that owns (keeps) each sample index, or -1: a pure function of the index.

    Indices ``< P*C`` are owned: full rounds of ``b``-blocks go round-robin over ranks
    (``(i // b) % P``); the remaining ``P * (C % b)`` indices are dealt out one by one
    (``i % P``). Every rank owns exactly ``C`` samples. See NOTE [ Pinned residency: why the bound is reached ].
    """
    P, b, C = world_size, batch_size, capacity
    i = np.asarray(indices)
    if i.dtype.kind not in "iu" or i.dtype.itemsize < 4 or max(P, b) > np.iinfo(i.dtype).max:
        i = i.astype(np.int64)  # too narrow to divide by b and P: widened (the planner's int32 is not)
    # The bounds stay Python ints: compared with any index array they are exact (no clipping, so
    # an index at the dtype's maximum is owned when it should be), and one is subtracted only
    # from indices at or past it, which it therefore fits.
    full, owned = P * b * (C // b), P * C
    own = np.full(i.shape, -1, dtype=np.int32 if P < 2**31 else np.int64)
    m1 = i < full
    own[m1] = (i[m1] // b) % P
    m2 = (i >= full) & (i < owned)
    if m2.any():
        own[m2] = (i[m2] - full) % P
    return own


def capacity_for_uniform(num_samples: int, sample_bytes: int, budget: int, world_size: int) -> int:
    """:func:`capacity_for_bytes` when every one of ``num_samples`` samples is ``sample_bytes``
    (raw fields): ``budget`` bytes hold that many, capped at a rank's share."""
    return int(min(-(-num_samples // world_size), budget // max(1, sample_bytes)))


def capacity_for_bytes(sizes: np.ndarray, budget: int, world_size: int, batch_size: int) -> int:
    """Largest per-rank capacity ``C`` (samples) whose owned samples fit ``budget`` bytes on every rank.

    ``sizes[i]`` is sample i's stored size (all fields). Raw fields have equal sizes; compressed
    fields vary, and the owned set must fit on the rank that owns it.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    if n and sizes.min() == sizes.max():  # raw fields: every sample costs the same
        return capacity_for_uniform(n, int(sizes[0]), budget, world_size)

    P, b = world_size, batch_size
    prefix = np.concatenate([[0], np.cumsum(sizes)])  # int64: exact sums

    def fits(c: int) -> bool:
        # per-rank owned bytes from the prefix sums, by owner_of's two parts: O(N/b + P*b) per
        # capacity tried, where owner_of over every index would be O(N) per capacity tried
        m = min(n, P * c)
        end1 = min(P * b * (c // b), m)  # b-blocks dealt round-robin: block k -> rank k % P
        starts = np.arange(0, end1, b)
        block = prefix[np.minimum(starts + b, end1)] - prefix[starts]
        per_rank = np.zeros(P, np.int64)
        if len(starts):
            per_rank += np.bincount(np.arange(len(starts)) % P, weights=block, minlength=P).astype(np.int64)
        tail = sizes[end1:m]  # the rest one by one: index end1 + j -> rank j % P
        if len(tail):
            per_rank += np.pad(tail, (0, -len(tail) % P)).reshape(-1, P).sum(axis=0)
        return bool(per_rank.max(initial=0) <= budget)

    lo, hi = 0, -(-n // world_size)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
