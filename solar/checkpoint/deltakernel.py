"""The compiled apply of a sparse delta (numba, optional): positions and XOR in one pass.

:func:`.delta.apply`'s numpy form turns a sparse delta's gaps into positions (a cumulative sum
plus a range), then gathers, XORs and scatters the changed words: five passes over ``k`` elements,
each a loop with its own fixed cost. Here one loop walks the gaps, XORs each value into its word
and checks each position against the chunk, with the GIL released (the reader's threads apply in
parallel). The gap and value planes are joined into words by numpy before (two short passes): a
kernel composing them from the planes itself would need the element size as a constant, which
numba's arrays do not give (their itemsize is a run-time field, so the byte loop stays a loop).

Bounds are checked, not trusted: a position past the chunk stops the loop before that element is
written (and is returned), so a damaged or crafted delta never writes outside ``out``.

numba is optional (the ``fast`` extra): :mod:`.delta` imports this module only when numba imports,
in the background (:func:`.delta.warm_kernel`), and applies with numpy until it is ready.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["sparse_apply"]


@numba.njit(nogil=True, cache=True)
def sparse_apply(gaps, vals, out):  # pragma: no cover - compiled (tested through delta.apply)
    """XOR ``vals[i]`` into ``out`` at the position gap ``gaps[i]`` after the previous one (the first:
    after -1); ``out`` is the chunk's words, of ``vals``' type. Returns -1, or the first position past
    the chunk (its element and the ones after it are not applied)."""
    n = out.size
    p = -1
    for i in range(gaps.size):
        p += 1 + np.int64(gaps[i])
        if p >= n:
            return p
        out[p] ^= vals[i]
    return -1
