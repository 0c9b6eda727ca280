"""An order no rank materializes: a seeded Feistel permutation with cycle-walking (opt-in).

NOTE [ Feistel order ]
    ``PlanConfig(order="feistel")`` replaces DistributedSampler's ``randperm`` (NOTE [ Global
    order ]) with a keyed bijection of ``[0, N)`` whose position -> sample and sample ->
    position are O(1) each: a balanced Feistel network over the smallest even number of bits
    whose domain holds ``N`` (at most 4N values), six rounds keyed from ``(seed, epoch)``, and
    cycle-walking (apply it again until the value falls below ``N``; on average fewer than four
    times) to stay inside ``[0, N)``. So sharded planning reads any position of any epoch with no
    O(N) array anywhere, not even once per node (NOTE [ Sharded planning ] in solar/shardplan.py).

    **It is not torch's order.** The global batches are not those of a ``DistributedSampler``
    with the same seed, and a run with ``order="feistel"`` cannot be compared sample for sample
    with one that uses torch's. It is a different uniform-looking shuffle, fixed by ``(seed,
    epoch)``, with DistributedSampler's padding (the head repeated) and split, so everything else
    (steps, resume positions, world-size changes, the hit-rate bound) is unchanged. It is meant
    for users who want O(N/P) planning without a node-shared window; it makes no claim of
    cryptographic or statistical quality beyond "a keyed bijection that mixes well".
"""

from __future__ import annotations

import numpy as np

__all__ = ["FeistelOrder"]

_ROUNDS = 6
_M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelOrder:
    """The Feistel permutation of ``[0, n)`` for each epoch (NOTE [ Feistel order ]); an
    :class:`~solar.shardplan.OrderSource`."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = int(n), int(seed)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)

    def _keys(self, epoch: int) -> list[np.uint64]:
        x = _splitmix((self.seed & _M64) ^ _splitmix(int(epoch) & _M64))
        keys = []
        for _ in range(_ROUNDS):
            x = _splitmix(x)
            keys.append(np.uint64(x))
        return keys

    def _f(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (r ^ key) * np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(29)
        return x & self.mask

    def _walk(self, x: np.ndarray, keys: list[np.uint64], forward: bool) -> np.ndarray:
        h = np.uint64(self.half)
        out = x.astype(np.uint64)
        todo = np.arange(len(out))
        while len(todo):
            v = out[todo]
            left, right = v >> h, v & self.mask
            for k in (keys if forward else keys[::-1]):
                if forward:
                    left, right = right, left ^ self._f(right, k)
                else:
                    left, right = right ^ self._f(left, k), left
            out[todo] = (left << h) | right
            todo = todo[out[todo] >= np.uint64(self.n)]  # outside [0, n): walk on
        return out

    def perm_at(self, epoch: int, idx: np.ndarray) -> np.ndarray:
        """The sample at each position ``idx`` (< n) of the epoch's permutation."""
        return self._walk(np.asarray(idx), self._keys(epoch), True).astype(np.int64)

    def position_of(self, epoch: int, samples: np.ndarray) -> np.ndarray:
        """The inverse: each sample's position in the epoch's permutation."""
        return self._walk(np.asarray(samples), self._keys(epoch), False).astype(np.int64)

    def perm(self, epoch: int) -> np.ndarray:
        """The whole permutation (O(n): for a single process or a test)."""
        return self.perm_at(epoch, np.arange(self.n))
