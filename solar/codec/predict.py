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

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["PREDICTORS", "Step", "interp_plan", "interp_residuals", "interp_reconstruct_"]

#: id in the blob -> name. Never renumber: ids are part of the on-disk format.
PREDICTORS = {0: "raw", 1: "linear", 2: "cubic", 3: "lorenzo"}
PREDICTOR_IDS = {v: k for k, v in PREDICTORS.items()}


@dataclass(frozen=True)
class Step:
    """One (level, axis) pass: view ``sel`` of the batched array, refine along ``axis``.

    ``regions`` are ``(kind, lo, hi)`` ranges of odd-position indices ``k`` (the point at
    position ``2k + 1`` of the view along ``axis``) with ``kind`` in ``lin``/``cub``/``copy``.
    """

    sel: tuple[slice, ...]
    axis: int
    regions: tuple[tuple[str, int, int], ...]


def _regions(m: int, cubic: bool) -> tuple[tuple[str, int, int], ...]:
    n_e, n_o = (m + 1) // 2, m // 2
    lin_hi = min(n_o, n_e - 1)  # k needs a right neighbour E[k + 1]
    out: list[tuple[str, int, int]] = []
    if cubic and n_e - 2 > 1:  # interior k in [1, n_e - 2) has E[k-1], E[k], E[k+1], E[k+2]
        out += [("lin", 0, 1), ("cub", 1, n_e - 2), ("lin", n_e - 2, lin_hi)]
    else:
        out.append(("lin", 0, lin_hi))
    if n_o == n_e:  # the last odd point has no right neighbour
        out.append(("copy", n_o - 1, n_o))
    return tuple((k, lo, hi) for k, lo, hi in out if hi > lo)


@lru_cache(maxsize=256)
def interp_plan(shape: tuple[int, ...], cubic: bool = True) -> tuple[Step, ...]:
    """The ordered passes that refine the anchor ``q[0, ..., 0]`` into the full grid."""
    if not shape or min(shape) == 0:
        return ()
    top = 1
    while top < max(shape):
        top *= 2
    steps: list[Step] = []
    s = top // 2
    while s >= 1:
        for a in range(len(shape)):
            sel = (slice(None),) + tuple(slice(0, None, s if b <= a else 2 * s) for b in range(len(shape)))
            m = len(range(0, shape[a], s))
            regions = _regions(m, cubic)
            if regions:
                steps.append(Step(sel, a + 1, regions))
        s //= 2
    return tuple(steps)


def _take(arr, axis: int, lo: int, hi: int, step: int = 1, start: int = 0):
    idx = [slice(None)] * arr.ndim
    idx[axis] = slice(start + step * lo, start + step * hi, step) if hi > lo else slice(0, 0)
    return arr[tuple(idx)]


def _predict(E, axis: int, kind: str, lo: int, hi: int):
    """Integer prediction of odd points ``lo..hi`` from the even points ``E`` (numpy or torch)."""
    if kind == "copy":
        return _take(E, axis, lo, hi) + 0
    t = _take(E, axis, lo, hi) + _take(E, axis, lo + 1, hi + 1)
    if kind == "lin":
        t >>= 1
        return t
    t *= 9
    t -= _take(E, axis, lo - 1, hi - 1)
    t -= _take(E, axis, lo + 2, hi + 2)
    t += 8
    t >>= 4
    return t


def _split(V, axis: int):
    return _take(V, axis, 0, (V.shape[axis] + 1) // 2, 2, 0), _take(V, axis, 0, V.shape[axis] // 2, 2, 1)


def interp_residuals(q, cubic: bool = True):
    """Encoder: residuals (same shape/dtype as ``q``, batched) of the interpolation predictor."""
    r = q.copy()
    for st in interp_plan(tuple(q.shape[1:]), cubic):
        E, _ = _split(q[st.sel], st.axis)
        _, O_q = _split(q[st.sel], st.axis)
        _, O_r = _split(r[st.sel], st.axis)
        for kind, lo, hi in st.regions:
            _take(O_r, st.axis, lo, hi)[...] = _take(O_q, st.axis, lo, hi) - _predict(E, st.axis, kind, lo, hi)
    return r


def interp_reconstruct_(r):
    """Decoder, in place: turn residuals ``r`` (batched integer tensor) back into ``q``."""
    return _interp_reconstruct(r, True)


def _interp_reconstruct(r, cubic: bool):
    for st in interp_plan(tuple(r.shape[1:]), cubic):
        E, O = _split(r[st.sel], st.axis)
        for kind, lo, hi in st.regions:
            _take(O, st.axis, lo, hi).__iadd__(_predict(E, st.axis, kind, lo, hi))
    return r


def interp_reconstruct_linear_(r):
    """Decoder for the linear interpolation predictor, in place."""
    return _interp_reconstruct(r, False)


def lorenzo_residuals(q):
    """Encoder: first-order N-D Lorenzo residuals (backward difference along every axis)."""
    import numpy as np

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
