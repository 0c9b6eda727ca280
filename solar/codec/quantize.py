"""Encoder-side quantization with the strict bound check ("double-check quantization").

The decoder reconstructs ``x' = fl(fl(float(q) * step) + offset)`` in the data's own dtype: one
integer-to-float conversion that is exact (``|q| <= QMAX``), one multiply and one add, each a
separate IEEE-754 operation (no FMA contraction is possible across separate tensor ops). This
module replays exactly that arithmetic in numpy, compares the result with the original using an
error-free difference, and marks every value that misses the bound (bin-edge values, float
rounding, NaN/Inf, values too large to quantize, subnormal results that a flush-to-zero device
could alter) as an exact outlier, stored verbatim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solar.errors import ConfigError

__all__ = ["resolve_bound", "Quantized", "quantize", "verify", "reconstruct_np", "within_bound"]

#: Largest |q| per dtype for which int -> float conversion is exact on every device.
QMAX = {np.dtype("<f4"): (1 << 24) - 1, np.dtype("<f8"): (1 << 52) - 1}


def resolve_bound(x: np.ndarray, abs_error, rel_error) -> float:
    """The absolute bound from exactly one of ``abs_error`` / ``rel_error`` (relative to max - min)."""
    if (abs_error is None) == (rel_error is None):
        raise ConfigError("give exactly one of abs_error= or rel_error= (e.g. rel_error=1e-3)")
    name, val = ("abs_error", abs_error) if abs_error is not None else ("rel_error", rel_error)
    try:
        val = float(val)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float range
        raise ConfigError(f"{name} must be a finite number >= 0, got {val!r}") from None
    if not (math.isfinite(val) and val >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {val!r}")
    if abs_error is not None:
        return val
    finite = x[np.isfinite(x)] if x.size else x
    if finite.size == 0:
        return 0.0
    hi, lo = float(finite.max()), float(finite.min())
    eb = val * (hi / 2 - lo / 2) * 2  # halves first: max - min may overflow float64
    return eb if math.isfinite(eb) else float(np.finfo(np.float64).max)


@dataclass
class Quantized:
    q: np.ndarray  # int32 (float32 data) or int64 (float64 data), same shape as x
    step: float  # exactly representable in the data dtype
    offset: float  # exactly representable in the data dtype
    outliers: np.ndarray  # flat C-order indices of values stored verbatim (int64, sorted)


def _step_for(eb: float, dtype: np.dtype) -> float | None:
    """The largest bin width <= 2*eb representable in ``dtype``, or None if none is usable."""
    ft = dtype.type
    info = np.finfo(dtype)
    step = ft(min(2.0 * eb, float(info.max)))
    if float(step) > 2.0 * eb:  # rounding to the dtype went up: take the next smaller value
        step = np.nextafter(step, ft(0))
    if not (float(step) >= float(info.tiny)):  # zero or subnormal: quantization is pointless
        return None
    return float(step)


def reconstruct_np(q: np.ndarray, step: float, offset: float, dtype: np.dtype) -> np.ndarray:
    """The decoder's arithmetic, replayed in numpy (see the module docstring)."""
    ft = dtype.type
    with np.errstate(over="ignore", invalid="ignore"):
        out = q.astype(dtype) * ft(step)
        out += ft(offset)
    return out


def within_bound(x: np.ndarray, y: np.ndarray, eb: float) -> np.ndarray:
    """``|x - y| <= eb`` decided exactly, False for any non-finite pair.

    ``s = fl(x - y)`` in float64 decides every case but one: rounding is monotone and ``eb`` is a
    float64, so ``|s| < eb`` implies ``|x - y| < eb`` and ``|s| > eb`` implies ``|x - y| > eb``.
    Only ``|s| == eb`` is ambiguous; those few pairs get an error-free difference (Knuth TwoSum).
    """
    with np.errstate(over="ignore", invalid="ignore"):  # (a signalling NaN warns in the casts too)
        a = x.astype(np.float64, copy=False)
        b = y.astype(np.float64, copy=False)
        s = a - b
        mag = np.abs(s)
        ok = mag < eb
        tie = np.flatnonzero(mag == eb)
        if tie.size:  # the true difference exceeds eb iff the rounding error points outward
            at, bt, st = a[tie], b[tie], s[tie]
            v = st - at
            e = (at - (st - v)) + (-bt - v)
            ok[tie] = (e == 0) | (np.sign(e) != np.sign(st))
    return ok


def quantize(x: np.ndarray, eb: float) -> Quantized | None:
    """Quantize ``x`` (C-contiguous float32/float64) with bound ``eb``; None means "store losslessly"."""
    dtype = x.dtype
    step = _step_for(eb, dtype) if eb > 0 else None
    if step is None or x.size == 0:
        return None
    ft = dtype.type
    finite = np.isfinite(x)
    all_finite = bool(finite.all())
    xf = x if all_finite else x[finite]
    if xf.size == 0:
        offset = 0.0
    else:
        lo, hi = float(xf.min()), float(xf.max())
        # offset 0 unless |x| / step would not fit: the decoder then skips the add entirely
        offset = 0.0 if max(abs(lo), abs(hi)) / step < QMAX[dtype] / 2 else float(ft(lo / 2 + hi / 2))
    qmax = QMAX[dtype]
    itype = np.int32 if dtype.itemsize == 4 else np.int64
    with np.errstate(over="ignore", invalid="ignore"):
        qf = np.rint((x.astype(np.float64) - offset) / step)
        np.clip(qf, -qmax, qmax, out=qf)
    if not all_finite:
        qf[~finite] = 0
    q = qf.astype(itype)
    return Quantized(q, step, offset, verify(x.reshape(-1), q.reshape(-1), step, offset, eb))


def verify(x: np.ndarray, q: np.ndarray, step: float, offset: float, eb: float) -> np.ndarray:
    """Flat indices where the decoder's reconstruction of integers ``q`` misses the bound on ``x``.

    Also flags subnormal results, which a flush-to-zero device could alter.
    """
    dtype = x.dtype
    tiny = np.finfo(dtype).tiny
    y = reconstruct_np(q, step, offset, dtype)
    ok = within_bound(x, y, eb)
    if step < tiny:  # products q * step could be subnormal (callers normally rule this out)
        with np.errstate(over="ignore"):
            prod = q.astype(dtype) * dtype.type(step)
        ok &= (prod == 0) | (np.abs(prod) >= tiny)
    if offset != 0.0 or step < tiny:  # otherwise y is 0 or a product >= step >= tiny
        ok &= (y == 0) | (np.abs(y) >= tiny)
    return np.flatnonzero(~ok).astype(np.int64)
