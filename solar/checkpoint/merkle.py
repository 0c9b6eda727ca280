"""Merkle trees over chunk digests: pure functions, no I/O.

A tree is a list of levels, leaves first, each an ``(n, 16)`` uint8 array; a parent is the hash of
a tag byte and its children's digests (tags keep leaves, pairs and lone children apart, so no
interior digest can pose as a chunk digest). Comparing two trees top-down visits only the subtrees
whose digests differ, so an unchanged tensor costs one comparison of its root and a tensor with k
changed chunks costs O(k log n) comparisons.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .chunking import DIGEST_SIZE

__all__ = ["build", "root", "diff", "combine", "EMPTY_ROOT_TAG"]

_PAIR, _LONE, EMPTY_ROOT_TAG, _COMBINE = b"\x01", b"\x02", b"\x03", b"\x04"


def build(leaves: np.ndarray, digest: Callable[[bytes], bytes]) -> list[np.ndarray]:
    """All levels of the tree over ``leaves`` (``(n, 16)`` uint8); the last level has one node."""
    levels = [np.ascontiguousarray(leaves, dtype=np.uint8).reshape(-1, DIGEST_SIZE)]
    if len(levels[0]) == 0:
        return [levels[0], np.frombuffer(digest(EMPTY_ROOT_TAG), dtype=np.uint8).reshape(1, DIGEST_SIZE)]
    while len(levels[-1]) > 1:
        cur = levels[-1].tobytes()
        n = len(levels[-1])
        step = 2 * DIGEST_SIZE
        out = bytearray()
        for a in range(0, (n // 2) * step, step):
            out += digest(_PAIR + cur[a:a + step])
        if n % 2:
            out += digest(_LONE + cur[-DIGEST_SIZE:])
        levels.append(np.frombuffer(bytes(out), dtype=np.uint8).reshape(-1, DIGEST_SIZE))
    return levels


def root(levels: list[np.ndarray]) -> bytes:
    return levels[-1][0].tobytes()


def combine(digests: list[bytes], digest: Callable[[bytes], bytes]) -> bytes:
    """One digest over an ordered list of digests (a checkpoint's root over its tensors' roots)."""
    return digest(_COMBINE + b"".join(digests))


def diff(old: list[np.ndarray] | None, new: list[np.ndarray]) -> np.ndarray:
    """Indices of the leaves of ``new`` that differ from ``old`` at the same position, top-down.

    Trees of different leaf counts have different shapes; then every leaf counts as changed (the
    content-addressed store still skips chunks it already holds).
    """
    n = len(new[0])
    if old is None or len(old[0]) != n or len(old) != len(new):
        return np.arange(n, dtype=np.int64)
    cand = np.zeros(1, dtype=np.int64)
    for level in range(len(new) - 1, -1, -1):
        a, b = old[level][cand], new[level][cand]
        cand = cand[(a != b).any(axis=1)]
        if level == 0 or len(cand) == 0:
            break
        width = len(new[level - 1])
        kids = np.concatenate([2 * cand, 2 * cand + 1])
        cand = np.sort(kids[kids < width])
    return cand if n else np.zeros(0, dtype=np.int64)
