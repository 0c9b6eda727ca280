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

__all__ = ["global_order", "index_dtype", "sampler_num_samples", "epoch_positions", "permutation_into"]


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
                 drop_last: bool = False, perm: np.ndarray | None = None) -> np.ndarray:
    """The padded/truncated global order of one epoch (:func:`index_dtype`), identical to
    DistributedSampler's; or, given ``perm``, that permutation padded and split alike (NOTE
    [ Feistel order ] in solar/permute.py).

    See NOTE [ Global order ].
    """
    dt = index_dtype(n, world_size)
    if perm is not None:
        perm = np.asarray(perm).astype(dt, copy=False)
    elif shuffle:
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


def permutation_into(out: np.ndarray, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Write the epoch's permutation of ``len(out)`` samples (NOTE [ Global order ], before any
    padding) into ``out`` (int32 or int64), with no other array of its size: a node's shared
    window is filled in place. torch's ``randperm`` gives the same order in either width."""
    if out.dtype not in (np.int32, np.int64):
        raise TypeError(f"a permutation is written into int32 or int64, not {out.dtype}")
    if not shuffle:
        for lo in range(0, len(out), 1 << 20):
            out[lo:lo + (1 << 20)] = np.arange(lo, min(len(out), lo + (1 << 20)), dtype=out.dtype)
        return out
    g = torch.Generator()
    g.manual_seed(int(seed) + int(epoch))
    t = torch.from_numpy(out)
    torch.randperm(len(out), generator=g, dtype=t.dtype, out=t)
    return out
