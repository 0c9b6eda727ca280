"""Where each interpolation pass's odd points lie in one predictor row's flat grid.

The numba (:mod:`solar.codec.kernels_cpu`) and Triton (:mod:`solar.codec.kernels_triton`)
decoders walk the passes of :func:`solar.codec.predict.interp_plan` in place on one grid; this
module turns the plan into integer descriptors they read by column (numpy only).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from . import predict as pr

__all__ = ["interp_passes", "NDIM", "C_AXIS", "C_DIST", "C_NE", "C_EVEN", "C_LEVEL", "C_START", "C_STEP", "C_CNT"]

#: Sample shapes are padded with leading 1-axes to this many dimensions (encode takes 0-D to 4-D).
NDIM = 4
#: Descriptor columns: axis, neighbour distance, n_e (even points), m even, level, then per axis
#: the first odd point's offset, the step and the count (flat element units).
C_AXIS, C_DIST, C_NE, C_EVEN, C_LEVEL, C_START, C_STEP, C_CNT = 0, 1, 2, 3, 4, 5, 5 + NDIM, 5 + 2 * NDIM
_COLS = 5 + 3 * NDIM


@lru_cache(maxsize=256)
def interp_passes(shape: tuple[int, ...], reverse: bool) -> np.ndarray:
    """``(passes, _COLS)`` int64 descriptors of :func:`~solar.codec.predict.interp_plan`'s passes
    on ``shape`` padded to :data:`NDIM` axes: where each pass's odd points lie in the flat grid."""
    pad = NDIM - len(shape)
    full = (1,) * pad + tuple(shape)
    flat = [math.prod(full[b + 1:]) for b in range(NDIM)]
    plan = pr.interp_plan(tuple(shape), reverse)
    out = np.zeros((len(plan), _COLS), np.int64)
    for i, st in enumerate(plan):
        a = st.axis - 1 + pad
        s = 1 << st.level
        out[i, :C_START] = (a, s * flat[a], (st.m + 1) // 2, st.m % 2 == 0, st.level)
        for b in range(NDIM):
            if b == a:
                start, step, cnt = s, 2 * s, st.m // 2
            else:
                stride = 1 if b < pad else st.sel[b - pad + 1].step
                start, step, cnt = 0, stride, len(range(0, full[b], stride))
            out[i, C_START + b], out[i, C_STEP + b], out[i, C_CNT + b] = start * flat[b], step * flat[b], cnt
    out.setflags(write=False)
    return out
