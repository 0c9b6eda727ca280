"""Integer predictors shared by the numpy encoder and the torch decoder.

The codec quantizes first (``q = round((x - offset) / step)``) and predicts afterwards, on exact
integers ("dual quantization", cuSZ). Because the encoder predicts from the *same* integers the
decoder will have reconstructed, the encoder computes every residual at once, and the decoder
needs no per-element loop: only a loop over a handful of levels and axes.

Two predictor families:

* **Multi-level interpolation** (SZ3 / cuSZ-i style, ``"cubic"`` or ``"linear"``): level by
  level, coarse to fine, and axis by axis within a level, the points at odd multiples of the
  stride ``s`` along one axis are predicted from their already-known neighbours at even
  multiples (cubic ``(-a + 9b + 9c - d) / 16`` in the interior, linear near the borders, copy at
  the far edge). Integer rounding is by arithmetic shift, which numpy and torch (CPU and CUDA)
  define identically for signed integers.
* **Lorenzo** (``"lorenzo"``): the first-order N-D Lorenzo predictor, whose inverse is one
  inclusive prefix sum per axis.

Residuals are stored in the array's natural (C) order; the decoder rebuilds ``q`` in place.
Arrays carry a leading batch axis here (size 1 in the encoder), so one sequence of tensor ops
decodes a whole mini-batch of same-shaped samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["PREDICTORS", "Step", "interp_plan", "predict_odd", "interp_stream", "interp_decode",
           "natural_to_stream", "lorenzo_residuals", "lorenzo_reconstruct"]

#: id in the blob -> name. Never renumber: ids are part of the on-disk format.
PREDICTORS = {0: "raw", 1: "linear", 2: "cubic", 3: "lorenzo", 4: "interp"}
PREDICTOR_IDS = {v: k for k, v in PREDICTORS.items()}


@dataclass(frozen=True)
class Step:
    """One (level, axis) pass of the interpolation predictor.

    ``sel`` selects the grid refined by this pass from the batched array (stride ``s`` on the
    axes up to ``axis``, ``2s`` after it); along ``axis`` its even points are known and its
    ``m // 2`` odd points are predicted. ``level`` is log2(s).
    """

    sel: tuple[slice, ...]
    axis: int
    level: int
    m: int


@lru_cache(maxsize=256)
def interp_plan(shape: tuple[int, ...]) -> tuple[Step, ...]:
    """The ordered passes that refine the anchor ``q[0, ..., 0]`` into the full grid."""
    if not shape or min(shape) == 0:
        return ()
    level = 0
    while (1 << level) < max(shape):
        level += 1
    steps: list[Step] = []
    for lv in range(level - 1, -1, -1):
        s = 1 << lv
        for a in range(len(shape)):
            sel = (slice(None),) + tuple(slice(0, None, s if b <= a else 2 * s) for b in range(len(shape)))
            m = len(range(0, shape[a], s))
            if m // 2:
                steps.append(Step(sel, a + 1, lv, m))
    return tuple(steps)


def _3d(t, axis: int):
    """View a contiguous array as (outer, n, inner) around ``axis``."""
    outer = math.prod(t.shape[:axis])
    return t.reshape(outer, t.shape[axis], -1)


def predict_odd(E, axis: int, m: int, cubic: bool):
    """Integer predictions of the ``m // 2`` odd points from the ``(m + 1) // 2`` even points ``E``.

    ``E`` is contiguous (numpy or torch). Returned as an ``(outer, n_e, inner)`` array whose first
    ``m // 2`` columns are the predictions: the bulk is computed with *flat* shifted slices (long
    contiguous vector ops even when ``axis`` is the last one); the few border columns where a
    flat shift would read the next row are then overwritten with the border formulas.

    * interior (cubic levels, ``n_e >= 4``): ``(-E[k-1] + 9 E[k] + 9 E[k+1] - E[k+2] + 8) >> 4``
    * ``k = 0`` and ``k = n_e - 2`` on cubic levels, every ``k`` on linear ones: ``(E[k] + E[k+1]) >> 1``
    * ``k = n_e - 1`` (only when ``m`` is even): ``E[k]``
    """
    n_e = (m + 1) // 2
    E3 = _3d(E, axis)
    inner = E3.shape[2]
    Ef = E3.reshape(-1)
    L = Ef.shape[0]
    P = Ef.copy() if isinstance(Ef, np.ndarray) else Ef.clone()  # the copy column (k = n_e - 1) for free
    P3 = P.reshape(E3.shape)
    if cubic and n_e >= 4:
        lo, hi = inner, L - 2 * inner
        t = P[lo:hi]
        t += Ef[lo + inner:hi + inner]
        t *= 9
        t -= Ef[lo - inner:hi - inner]
        t -= Ef[lo + 2 * inner:hi + 2 * inner]
        t += 8
        t >>= 4
        cols = (0, n_e - 2)
    else:
        t = P[:L - inner]
        t += Ef[inner:]
        t >>= 1
        cols = ()
    for k in cols:
        c = P3[:, k]
        c[...] = E3[:, k] + E3[:, k + 1]
        c >>= 1
    if m % 2 == 0:
        P3[:, n_e - 1] = E3[:, n_e - 1]
    return P3


def interp_stream(q, cubic_levels: int):
    """Encoder: the residual stream of batched ``q`` (anchor, then each pass's odd block in C order).

    ``cubic_levels`` is a bit mask: bit ``l`` set = cubic interpolation on level ``l``.
    """
    B = q.shape[0]
    parts = [q.reshape(B, -1)[:, :1]]
    for st in interp_plan(tuple(q.shape[1:])):
        V = q[st.sel]
        E = np.ascontiguousarray(_take(V, st.axis, 0, (st.m + 1) // 2, 2, 0))
        O = _3d(np.ascontiguousarray(_take(V, st.axis, 0, st.m // 2, 2, 1)), st.axis)
        P = predict_odd(E, st.axis, st.m, bool(cubic_levels >> st.level & 1))[:, :st.m // 2]
        parts.append((O - P).reshape(B, -1))
    return np.concatenate(parts, axis=1)


def interp_decode(R, shape: tuple[int, ...], cubic_levels: int):
    """Decoder: residual stream ``R`` (``(B, n)`` integer tensor, consumed) -> ``q`` of ``(B, *shape)``.

    Polyphase: the grid refined so far is kept contiguous; each pass predicts its odd points
    with contiguous vector ops and interleaves them with the even ones (two strided copies).
    """
    import torch

    B = R.shape[0]
    C = R[:, :1].reshape((B,) + (1,) * len(shape))
    pos = 1
    for st in interp_plan(tuple(shape)):
        n_o = st.m // 2
        P = predict_odd(C, st.axis, st.m, bool(cubic_levels >> st.level & 1))
        outer, n_e, inner = P.shape
        cnt = outer * n_o * inner // B
        O = R[:, pos:pos + cnt].reshape(outer, n_o, inner)
        pos += cnt
        out = torch.empty((outer, st.m, inner), dtype=R.dtype, device=R.device)
        out[:, 0::2] = C.reshape(outer, n_e, inner)
        torch.add(O, P[:, :n_o], out=out[:, 1::2])
        C = out.reshape(C.shape[:st.axis] + (st.m,) + C.shape[st.axis + 1:])
    return C


def natural_to_stream(r, shape: tuple[int, ...]):
    """Reorder residuals stored in natural (C) order (format version 1) into stream order."""
    import torch

    B = r.shape[0]
    r = r.reshape((B,) + tuple(shape))
    parts = [r.reshape(B, -1)[:, :1]]
    for st in interp_plan(tuple(shape)):
        parts.append(_take(r[st.sel], st.axis, 0, st.m // 2, 2, 1).reshape(B, -1))
    return torch.cat(parts, dim=1)


def _take(arr, axis: int, lo: int, hi: int, step: int = 1, start: int = 0):
    idx = [slice(None)] * arr.ndim
    idx[axis] = slice(start + step * lo, start + step * hi, step) if hi > lo else slice(0, 0)
    return arr[tuple(idx)]


def lorenzo_residuals(q):
    """Encoder: first-order N-D Lorenzo residuals (backward difference along every axis)."""
    r = q
    for ax in range(1, q.ndim):
        r = np.diff(r, axis=ax, prepend=np.zeros_like(_take(r, ax, 0, 1)))
    return r


def lorenzo_reconstruct(r):
    """Decoder: inclusive prefix sum along every axis, in the residuals' integer dtype."""
    import torch

    for ax in range(1, r.ndim):
        r = torch.cumsum(r, dim=ax, dtype=r.dtype)
    return r
