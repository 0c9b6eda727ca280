"""The ``cpu-kernel`` decoder: numba kernels that decode a group of ``ebq`` blobs (format 2+)
from their lossless-decoded sections straight into the output floats, one compiled call per
group (or per thread's share of it).

Why a second CPU formulation: the reference (:func:`solar.codec.predict.interp_decode`) issues
a handful of tensor ops per (level, axis) pass, each a full memory pass and each with a fixed
cost per call; here one blob row goes codes -> residuals -> integers -> floats while it is in
cache, every pass in place on one grid (SZ3's layout) instead of a new polyphase grid.

Bit-exactness with the reference is by construction, not by tolerance:

* the same pass plan (:func:`solar.codec.predict.interp_plan`), the same residual stream order
  (each pass's odd points in C order over its grid) and the same border rules as
  :func:`~solar.codec.predict.predict_odd`;
* the same integer formulas in the same association: ``K == 1`` cubic points use the reference's
  sign -1 form ``res - ((a + d - 9 (b + c) + 7) >> 4)``, ``K != 1`` its positive form; every value
  is wrapped to the reference's integer width (int32 or int64) before each arithmetic shift, so
  even a forged blob whose sums overflow decodes to the reference's bits (two's complement adds
  and multiplies agree modulo 2**32; shifts do not, hence the wrap);
* escape corrections are added to the residual before its pass, which equals the reference's
  ``K * correction`` added right after the pass (modular arithmetic again); escapes of wide
  codes and of Lorenzo's int8 codes replace, as the reference's ``patch_`` does;
* dequantization is ``float(q)`` (one rounding), a multiply, then an add when the group has any
  nonzero offset: separate operations without fast-math, so no FMA contraction.

numba is optional (the ``fast`` extra): :mod:`solar.codec.paths` imports this module only when
numba imports, and the reference decodes otherwise.
"""

from __future__ import annotations

import numba
import numpy as np

from .passes import C_AXIS as _A
from .passes import C_CNT as _CNT
from .passes import C_DIST as _D
from .passes import C_EVEN as _EVEN
from .passes import C_LEVEL as _LV
from .passes import C_NE as _NE
from .passes import C_START as _START
from .passes import C_STEP as _STEP

__all__ = ["decode_rows"]

@numba.njit(inline="always")
def _wrap(x, is32):
    """``x`` wrapped to int32 (two's complement) when the reference's integers are int32."""
    if is32:
        return np.int64(np.int32(x))
    return x


@numba.njit(nogil=True, cache=True)
def _residuals(b, R, n, kinds, slots, nib, i8, wide, marks, side, esc_pos, esc_val, esc_add, is32):
    """Blob ``b``'s residual stream into ``R`` (length ``n``), as the reference widens it."""
    kind, j = kinds[b], slots[b]
    if kind == 0:  # nibbles: 4-bit two's complement pairs, low nibble first; markers take side values
        for i in range(n):
            v = np.int64(nib[j, i >> 1])
            v = (v >> 4) if i & 1 else (v & 15)
            R[i] = v - 16 if v >= 8 else v
        w2 = 2 * nib.shape[1]
        lo = np.searchsorted(marks, j * w2)
        hi = np.searchsorted(marks, (j + 1) * w2)
        for k in range(lo, hi):
            c = marks[k] - j * w2
            if c < n:
                R[c] = np.int64(side[k]) - 256 if side[k] >= 128 else np.int64(side[k])
    elif kind == 1:  # int8 two's complement
        for i in range(n):
            v = np.int64(i8[j, i])
            R[i] = v - 256 if v >= 128 else v
    else:  # zigzag codes as little-endian byte planes, joined in the reference's integer width
        w = wide.shape[1]
        for i in range(n):
            u = np.int64(0)
            for k in range(w):
                u |= np.int64(wide[j, k, i]) << (8 * k)
            u = _wrap(u, is32)
            R[i] = (u >> 1) ^ -(u & 1)
    lo = np.searchsorted(esc_pos, b * n)
    hi = np.searchsorted(esc_pos, (b + 1) * n)
    for k in range(lo, hi):
        c = esc_pos[k] - b * n
        if esc_add:  # int8 codes of the interpolation predictors: the correction adds
            R[c] = _wrap(np.int64(R[c]) + esc_val[k] + 128, is32)
        else:
            R[c] = esc_val[k]


# point kinds of a pass (:func:`~solar.codec.predict.predict_odd`'s border rules)
_COPY, _LINEAR, _CUBIC = 0, 1, 2


@numba.njit(inline="always")
def _points(T, L, Rt, LL, RR, res, count, kind, K):
    """Odd points ``T[j]`` from their even neighbours ``L[j]``, ``Rt[j]`` (and ``LL[j]``, ``RR[j]``
    two further out) and residuals ``res[j]``: views with non-negative indices, so the loops
    carry no negative-index checks and vectorize where the views are contiguous."""
    is32 = T.itemsize == 4
    if kind == _COPY:
        for j in range(count):
            T[j] = _wrap(np.int64(L[j]) + K * np.int64(res[j]), is32)
    elif kind == _LINEAR:
        for j in range(count):
            T[j] = _wrap((_wrap(np.int64(L[j]) + np.int64(Rt[j]), is32) >> 1) + K * np.int64(res[j]), is32)
    elif K == 1:  # the reference's sign -1 form
        for j in range(count):
            t = np.int64(LL[j]) + np.int64(RR[j]) - 9 * (np.int64(L[j]) + np.int64(Rt[j])) + 7
            T[j] = _wrap(np.int64(res[j]) - (_wrap(t, is32) >> 4), is32)
    else:  # its positive form
        for j in range(count):
            t = 9 * (np.int64(L[j]) + np.int64(Rt[j])) - np.int64(LL[j]) - np.int64(RR[j]) + 8
            T[j] = _wrap((_wrap(t, is32) >> 4) + K * np.int64(res[j]), is32)


@numba.njit(inline="always")
def _stride2(V, res, count, cubic, K):
    """:func:`_points` for odd points 2 apart with neighbours 1 (and 3) away, on one contiguous
    view ``V`` that starts at the first point's farthest left neighbour: compile-time offsets and
    stride, so the loop vectorizes as interleaved loads and stores."""
    is32 = V.itemsize == 4
    if not cubic:
        for j in range(count):
            V[2 * j + 1] = _wrap((_wrap(np.int64(V[2 * j]) + np.int64(V[2 * j + 2]), is32) >> 1)
                                 + K * np.int64(res[j]), is32)
    elif K == 1:
        for j in range(count):
            t = np.int64(V[2 * j]) + np.int64(V[2 * j + 6]) - 9 * (np.int64(V[2 * j + 2]) + np.int64(V[2 * j + 4])) + 7
            V[2 * j + 3] = _wrap(np.int64(res[j]) - (_wrap(t, is32) >> 4), is32)
    else:
        for j in range(count):
            t = 9 * (np.int64(V[2 * j + 2]) + np.int64(V[2 * j + 4])) - np.int64(V[2 * j]) - np.int64(V[2 * j + 6]) + 8
            V[2 * j + 3] = _wrap((_wrap(t, is32) >> 4) + K * np.int64(res[j]), is32)


@numba.njit(inline="always")
def _run(G, R, pos, q0, qstep, count, d, kind, K):
    """``count`` odd points of one kind at ``q0 + j * qstep``, residuals ``R[pos + j]``."""
    if count <= 0:
        return
    res = R[pos:pos + count]
    far = 3 * d if kind == _CUBIC else d  # cubic points have neighbours 3 d away; others not
    if qstep == 2 and d == 1 and kind != _COPY:  # finest innermost-axis pass: constant stride 2
        _stride2(G[q0 - far:q0 + 2 * count + far], R[pos:pos + count], count, kind == _CUBIC, K)
    elif qstep == 1:
        _points(G[q0:q0 + count], G[q0 - d:q0 - d + count], G[q0 + d:q0 + d + count],
                G[q0 - far:q0 - far + count], G[q0 + far:q0 + far + count], res, count, kind, K)
    else:
        end = q0 + (count - 1) * qstep + 1
        _points(G[q0:end:qstep], G[q0 - d:end - d:qstep], G[q0 + d:end + d:qstep],
                G[q0 - far:end - far:qstep], G[q0 + far:end + far:qstep], res, count, kind, K)


@numba.njit(inline="always")
def _kind(k, n_e, even, cubic):
    if even and k == n_e - 1:  # last odd point of an even count: copy
        return _COPY
    if cubic and k >= 1 and k <= n_e - 3:
        return _CUBIC
    return _LINEAR


@numba.njit(nogil=True, cache=True)
def _interp(G, R, plan, cubic_mask, K):
    """In place on ``G`` (one predictor row): the anchor, then every pass of ``plan``.

    A pass along the innermost axis walks each line in runs of one point kind (stride 2
    ``d``); any other pass walks, per point along its axis, the contiguous innermost run of the
    grid, whose points share one kind (a loop without branches)."""
    G[0] = _wrap(np.int64(R[0]) * K, G.itemsize == 4)
    pos = 1
    for p in range(plan.shape[0]):
        d, n_e, even = plan[p, _D], plan[p, _NE], plan[p, _EVEN] != 0
        cubic = ((cubic_mask >> np.uint64(plan[p, _LV])) & np.uint64(1)) != 0 and n_e >= 4
        a = plan[p, _A]
        c0, c1, c2, c3 = plan[p, _CNT], plan[p, _CNT + 1], plan[p, _CNT + 2], plan[p, _CNT + 3]
        s0, s1, s2, s3 = plan[p, _STEP], plan[p, _STEP + 1], plan[p, _STEP + 2], plan[p, _STEP + 3]
        b0 = plan[p, _START] + plan[p, _START + 1] + plan[p, _START + 2] + plan[p, _START + 3]
        for i0 in range(c0):
            for i1 in range(c1):
                for i2 in range(c2):
                    base = b0 + i0 * s0 + i1 * s1 + i2 * s2
                    if a == 3:  # runs along the line: linear | cubic interior | linear | copy
                        last = c3 - 1 if even else c3  # points before the copied one
                        lo = min(1, last) if cubic else last
                        hi = max(min(n_e - 2, last), lo) if cubic else last
                        _run(G, R, pos, base, s3, lo, d, _LINEAR, K)
                        _run(G, R, pos + lo, base + lo * s3, s3, hi - lo, d, _CUBIC, K)
                        _run(G, R, pos + hi, base + hi * s3, s3, last - hi, d, _LINEAR, K)
                        if even:
                            _run(G, R, pos + last, base + last * s3, s3, 1, d, _COPY, K)
                    else:
                        k = i2 if a == 2 else (i1 if a == 1 else i0)
                        _run(G, R, pos, base, s3, c3, d, _kind(k, n_e, even, cubic), K)
                    pos += c3


@numba.njit(nogil=True, cache=True)
def _lorenzo(G, R, dims):
    """In place on ``G``: inclusive prefix sums of ``R`` along every axis of the padded shape."""
    n = G.shape[0]
    is32 = G.itemsize == 4
    m = dims[dims.shape[0] - 1]
    for o in range(n // m):  # innermost axis: a running sum per line
        line, src = G[o * m:(o + 1) * m], R[o * m:(o + 1) * m]
        acc = np.int64(0)
        for i in range(m):
            acc = _wrap(acc + np.int64(src[i]), is32)
            line[i] = acc
    inner = m
    for ax in range(dims.shape[0] - 2, -1, -1):
        m = dims[ax]
        if m > 1:
            for o in range(n // (m * inner)):
                for k in range(1, m):
                    row = (o * m + k) * inner
                    cur, prev = G[row:row + inner], G[row - inner:row]
                    for i in range(inner):
                        cur[i] = np.int64(cur[i]) + np.int64(prev[i])
        inner *= m


@numba.njit(nogil=True, cache=True)
def decode_rows(b0, b1, n, lead, dims, lorenzo, plan, masks, K, proto, kinds, slots, nib, i8, wide, marks, side,
                esc_pos, esc_val, esc_add, out_pos, out_val, steps, offs, add_off, out):
    """Decode blobs ``b0 .. b1 - 1`` of a group into ``out`` (``(B, n)`` floats).

    ``n`` values per blob, ``lead`` predictor rows per blob (folded channels), ``dims`` one
    predictor row's padded shape; ``proto``: an empty array of the reference's integer type.
    Codes: per blob ``kinds`` (0 nibbles, 1 int8, 2 byte planes) and its row ``slots`` in
    ``nib`` / ``i8`` / ``wide``; nibble ``marks`` (flat positions in the unpacked nibble rows)
    take the ``side`` values; ``esc_pos``/``esc_val`` and ``out_pos``/``out_val`` are flat
    positions in ``(B, n)``, sorted, and their values.
    """
    is32 = proto.itemsize == 4
    R = np.empty(n, proto.dtype)
    G = np.empty(n // lead if lead else 0, proto.dtype)
    nr = n // lead if lead else 0
    for b in range(b0, b1):
        _residuals(b, R, n, kinds, slots, nib, i8, wide, marks, side, esc_pos, esc_val, esc_add, is32)
        for r in range(lead):
            if lorenzo:
                _lorenzo(G, R[r * nr:(r + 1) * nr], dims)
            else:
                _interp(G, R[r * nr:(r + 1) * nr], plan, masks[b * lead + r], K)
            x = out[b, r * nr:(r + 1) * nr]
            st = steps[b]
            for i in range(nr):
                x[i] = G[i]
                x[i] *= st
            if add_off:
                off = offs[b]
                for i in range(nr):
                    x[i] += off
        lo = np.searchsorted(out_pos, b * n)
        hi = np.searchsorted(out_pos, (b + 1) * n)
        for k in range(lo, hi):
            out[b, out_pos[k] - b * n] = out_val[k]
