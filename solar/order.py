"""DistributedSampler's global order, and the positions an epoch consumes.

NOTE [ Global order ]
    The global order of epoch ``e`` is exactly ``torch.utils.data.DistributedSampler``'s:
    ``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`` (or ``arange(N)`` with
    ``shuffle=False``), padded by repeating its head up to ``ceil(N / P) * P`` (``drop_last=False``)
    or truncated to ``floor(N / P) * P`` (``drop_last=True``). Rank r's k-th local batch in torch
    holds global positions ``[k*G, (k+1)*G)`` with stride P (``G = P*b``), so global mini-batch k
    is ``order[k*G:(k+1)*G]``. SOLAR keeps every global mini-batch and only changes *which rank*
    gets which of its samples: the training semantics (the all-reduced gradient) do not change.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["global_order", "index_dtype", "sampler_num_samples", "epoch_positions"]


def index_dtype(n: int, world_size: int = 1) -> type:
    """The integer type of a plan's per-sample arrays (indices, positions, ranks) for ``n`` samples
    on ``world_size`` ranks.

    Why not always int64: a planner holds several such arrays of N entries on *every* rank (the
    schedule needs the whole global order), so their width is most of its memory; int32 halves it
    below about 2**31 samples. Positions of an epoch padded to whole steps, a resumed tail
    included, and the step * P + rank keys built from them stay below N + 2P; the 2**20 margin
    is kept below that.
    """
    return np.int32 if n + 2 * world_size < 2**31 - 2**20 else np.int64


def sampler_num_samples(n: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank per epoch, exactly as ``DistributedSampler.num_samples``."""
    if drop_last and n % world_size:
        return math.ceil((n - world_size) / world_size)
    return math.ceil(n / world_size)


def epoch_positions(per_rank: int, world_size: int, batch_size: int, drop_last_batch: bool) -> int:
    """Positions of the global order an epoch consumes: every rank's samples, less DataLoader's
    dropped last batch."""
    if drop_last_batch:
        per_rank -= per_rank % batch_size
    return per_rank * world_size


def global_order(n: int, world_size: int, seed: int, epoch: int, shuffle: bool = True,
                 drop_last: bool = False) -> np.ndarray:
    """The padded/truncated global order of one epoch (:func:`index_dtype`), identical to
    DistributedSampler's.

    See NOTE [ Global order ].
    """
    dt = index_dtype(n, world_size)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(int(seed) + int(epoch))
        perm = torch.randperm(n, generator=g).numpy().astype(dt)  # torch's int64 order, then narrowed
    else:
        perm = np.arange(n, dtype=dt)
    total = sampler_num_samples(n, world_size, drop_last) * world_size
    if total <= n:
        return perm[:total]
    out = np.empty(total, dtype=perm.dtype)  # perm repeated to length total, in an array of its own
    for start in range(0, total, n):  # (np.tile(...)[:total] and np.resize keep a longer array alive)
        out[start:start + n] = perm[:total - start]
    return out
