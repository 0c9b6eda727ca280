"""The ``cpu-kernel`` decoder: numba kernels that decode a group of ``ebq`` blobs (format 2+)
from their lossless-decoded sections straight into the output floats, one compiled call per
group (or per thread's share of it).

Why a second CPU formulation: the reference (:func:`solar.codec.predict.interp_decode`) issues
a handful of tensor ops per (level, axis) pass, each a full memory pass and each with a fixed
cost per call; here one blob row goes codes -> residuals -> integers -> floats in one compiled
call, each pass one loop nest that writes the next polyphase grid (the reference's layout:
contiguous loads, and stores that are either contiguous rows or interleaved pairs, so every
loop vectorizes at every level).

Performance rule (measured, not cosmetic): no function taking arrays is called, even inlined,
inside a per-value loop. numba reference-counts the array arguments of every such call, two
atomic operations each, which made the innermost loops about a hundred times slower; views are
made once per line or block, and the loops index them directly.

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
from .passes import C_EVEN as _EVEN
from .passes import C_LEVEL as _LV
from .passes import C_NE as _NE
from .passes import NDIM

__all__ = ["decode_rows", "copy_rows"]

@numba.njit(inline="always")
def _wrap(x, is32):
    """``x`` wrapped to int32 (two's complement) when the reference's integers are int32."""
    if is32:
        return np.int64(np.int32(x))
    return x


@numba.njit(nogil=True, cache=True)
def _unpack(R, W, w0, n):
    """A bitpack section (:mod:`solar.codec.bitpack`) from word ``w0`` of ``W`` -> ``R``'s ``n``
    residuals: each block's codes from its own words, ``(u >>> 1) ^ -(u & 1)`` in 64 bits. A code
    is read from the two words that hold its first bit (the section is followed by padding)."""
    nb = (n + 31) >> 5
    data = w0 + ((nb + 3) >> 2)  # past the width table
    one = np.uint64(1)
    for blk in range(nb):
        w = np.int64((W[w0 + (blk >> 2)] >> np.uint32(8 * (blk & 3))) & np.uint32(255))
        i0 = blk * 32
        cnt = min(32, n - i0)
        Rb = R[i0:i0 + cnt]
        if w == 0:
            Rb[:] = 0
            continue
        Wb = W[data:data + w + 2]
        mask = (one << np.uint64(min(w, 32))) - one
        for j in range(cnt):
            bit = j * w
            k = bit >> 5
            u = ((np.uint64(Wb[k]) | (np.uint64(Wb[k + 1]) << np.uint64(32))) >> np.uint64(bit & 31)) & mask
            if w > 32:  # the high part: w - 32 bits from bit + 32 on
                b2 = bit + 32
                k2 = b2 >> 5
                hi = (np.uint64(Wb[k2]) | (np.uint64(Wb[k2 + 1]) << np.uint64(32))) >> np.uint64(b2 & 31)
                u |= (hi & ((one << np.uint64(w - 32)) - one)) << np.uint64(32)
            Rb[j] = np.int64(u >> one) ^ -np.int64(u & one)
        data += w


@numba.njit(nogil=True, cache=True)
def _residuals(b, R, n, kinds, slots, nib, i8, wide, bpw, bp_at, marks, side, esc_pos, esc_val, esc_add, is32):
    """Blob ``b``'s residual stream into ``R`` (length ``n``), as the reference widens it."""
    kind, j = kinds[b], slots[b]
    if kind == 3:  # bitpack: no escapes
        _unpack(R, bpw, bp_at[j], n)
        return
    if kind == 0:  # nibbles: 4-bit two's complement pairs, low nibble first; markers take side values
        row = nib[j]
        for k in range(n >> 1):  # a byte per pair, no branch: the loop vectorizes
            v = np.int64(row[k])
            R[2 * k] = ((v & 15) ^ 8) - 8
            R[2 * k + 1] = ((v >> 4) ^ 8) - 8
        if n & 1:
            R[n - 1] = ((np.int64(row[n >> 1]) & 15) ^ 8) - 8
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


# point kinds of an outer-axis pass's rows (:func:`~solar.codec.predict.predict_odd`'s border rules)
_COPY, _LINEAR, _CUBIC = 0, 1, 2


@numba.njit(inline="always")
def _lines(src, dst, R, pos, outer, n_e, even, cubic, K, X, st, last):
    """A pass along the innermost axis: ``outer`` lines of ``n_e`` known points in ``src``, each
    refined into ``m = 2 n_e`` (or ``2 n_e - 1``) points of ``dst``: ``O[2J] = C[J]`` and the odd
    point ``O[2J + 1]`` between ``C[J]`` and ``C[J + 1]`` (cubic: ``C[J - 1]`` and ``C[J + 2]``
    too) from residual ``R[pos + ...]``. ``last``: also dequantized into ``X`` (:func:`_pass`).

    Linear points (every one but the first of a cubic line: ``J < last``), cubic points
    (``1 <= J < hi``), the linear ones after them, then the copied last odd point of an even
    count. The flat grids are indexed by unsigned offsets: no view (each costs two atomic
    reference counts, which cost more than a short line's work) and no negative-index check
    (numba checks signed indices only); contiguous loads and interleaved stores, which vectorize.
    Every value that meets a shift or a store is cast to the grid's type ``c`` first (the
    reference's wrap), so int32 grids compute in 32-bit lanes."""
    c, U = dst.dtype.type, np.uint64
    m = 2 * n_e if even else 2 * n_e - 1
    n_o = m // 2
    odd = n_o - 1 if even else n_o  # odd points before the copied one
    lo = min(1, odd) if cubic else odd
    hi = max(min(n_e - 2, odd), lo) if cubic else odd
    one, two, three = U(1), U(2), U(3)
    for o in range(outer):
        cb, ob, rb = U(o * n_e), U(o * m), U(pos + o * n_o)  # the line's first point in each grid
        for j in range(lo):  # linear: J = j
            u = U(j)
            b = src[cb + u]
            dst[ob + two * u] = b
            dst[ob + two * u + one] = c((c(b + src[cb + u + one]) >> 1) + K * R[rb + u])
        if K == 1:  # cubic (lo == 1 when there are any): J = j + 1, the reference's sign -1 form
            for j in range(hi - lo):
                u = U(j)
                b = src[cb + u + one]
                dst[ob + two * u + two] = b
                t = c(src[cb + u] + src[cb + u + three] - 9 * (b + src[cb + u + two]) + 7)
                dst[ob + two * u + three] = c(R[rb + u + one] - (t >> 4))
        else:
            for j in range(hi - lo):
                u = U(j)
                b = src[cb + u + one]
                dst[ob + two * u + two] = b
                t = c(9 * (b + src[cb + u + two]) - src[cb + u] - src[cb + u + three] + 8)
                dst[ob + two * u + three] = c((t >> 4) + K * R[rb + u + one])
        for J in range(hi, odd):  # linear after the cubic ones (a point or two)
            b = src[cb + U(J)]
            dst[ob + U(2 * J)] = b
            dst[ob + U(2 * J + 1)] = c((c(b + src[cb + U(J + 1)]) >> 1) + K * R[rb + U(J)])
        if even:  # the last odd point has no right neighbour: copy
            b = src[cb + U(odd)]
            dst[ob + U(2 * odd)] = b
            dst[ob + U(2 * odd + 1)] = c(b + K * R[rb + U(odd)])
        else:
            dst[ob + U(2 * (n_e - 1))] = src[cb + U(n_e - 1)]
        if last:
            for i in range(m):
                X[ob + U(i)] = dst[ob + U(i)]
                X[ob + U(i)] *= st


@numba.njit(inline="always")
def _rows(src, dst, R, pos, outer, inner, n_e, even, cubic, K, X, st, last):
    """A pass along an outer axis: ``outer`` blocks of ``n_e`` known rows of ``inner`` values
    in ``src``, each refined into ``m`` rows of ``dst``: even rows copied, odd rows computed from
    whole rows of neighbours and residuals ``R[pos + ...]``. ``last``: the plan's last pass,
    whose rows go dequantized into ``X`` (``float(q)``, then ``* st``) while they are in cache
    and never into the grid (nothing reads it after the last pass): each odd row is computed
    into a one-row scratch ``T``, then copied where it goes. Flat grids indexed by unsigned row
    offsets, as :func:`_lines` (no view, no reference count, no negative-index check); casts as
    there."""
    c, U = dst.dtype.type, np.uint64
    m = 2 * n_e if even else 2 * n_e - 1
    n_o = m // 2
    T = np.empty(inner, dst.dtype)
    for o in range(outer):
        cb, ob, rb = o * n_e * inner, o * m * inner, pos + o * n_o * inner  # the block's first value
        for k in range(0 if last else n_e):
            c0, o0 = U(cb + k * inner), U(ob + 2 * k * inner)
            for i in range(inner):
                dst[o0 + U(i)] = src[c0 + U(i)]
        for k in range(n_o):
            kind = _kind(k, n_e, even, cubic)
            cm, c0, c1 = U(cb + max(k - 1, 0) * inner), U(cb + k * inner), U(cb + (k + 1) * inner)
            c2, r0 = U(cb + min(k + 2, n_e - 1) * inner), U(rb + k * inner)
            if kind == _COPY:  # the odd row into the one-row scratch T (in cache), then where it goes
                for i in range(inner):
                    u = U(i)
                    T[i] = c(src[c0 + u] + K * R[r0 + u])
            elif kind == _LINEAR:
                for i in range(inner):
                    u = U(i)
                    T[i] = c((c(src[c0 + u] + src[c1 + u]) >> 1) + K * R[r0 + u])
            elif K == 1:
                for i in range(inner):
                    u = U(i)
                    t = c(src[cm + u] + src[c2 + u] - 9 * (src[c0 + u] + src[c1 + u]) + 7)
                    T[i] = c(R[r0 + u] - (t >> 4))
            else:
                for i in range(inner):
                    u = U(i)
                    t = c(9 * (src[c0 + u] + src[c1 + u]) - src[cm + u] - src[c2 + u] + 8)
                    T[i] = c((t >> 4) + K * R[r0 + u])
            o1 = U(ob + (2 * k + 1) * inner)
            if not last:
                for i in range(inner):
                    dst[o1 + U(i)] = T[i]
                continue
            x0 = U(ob + 2 * k * inner)
            for i in range(inner):
                X[x0 + U(i)] = src[c0 + U(i)]
                X[x0 + U(i)] *= st
            for i in range(inner):
                X[o1 + U(i)] = T[i]
                X[o1 + U(i)] *= st
        if last and not even:  # the last even row has no odd row after it
            c0, x0 = U(cb + (n_e - 1) * inner), U(ob + (m - 1) * inner)
            for i in range(inner):
                X[x0 + U(i)] = src[c0 + U(i)]
                X[x0 + U(i)] *= st


@numba.njit(inline="always")
def _kind(k, n_e, even, cubic):
    if even and k == n_e - 1:  # last odd point of an even count: copy
        return _COPY
    if cubic and k >= 1 and k <= n_e - 3:
        return _CUBIC
    return _LINEAR


@numba.njit(inline="always")
def _pass(src, dst, R, pos, outer, inner, n_e, even, cubic, K, X, st, last):
    """One pass: the grid ``src`` (``outer`` blocks of ``n_e`` rows of ``inner`` values) refined
    along its middle axis into ``dst``, residuals from ``R[pos]`` on. ``last``: the plan's last
    pass, whose grid also goes dequantized into the floats ``X`` (``float(q)``, then ``* st``:
    two roundings, as the reference's separate ops), block by block while it is in cache."""
    if inner == 1:
        _lines(src, dst, R, pos, outer, n_e, even, cubic, K, X, st, last)
    else:
        _rows(src, dst, R, pos, outer, inner, n_e, even, cubic, K, X, st, last)


@numba.njit(nogil=True, cache=True)
def _interp(G, R, plan, cubic_mask, K, W, X, st):
    """The anchor, then every pass of ``plan`` (``G`` and ``W``: grids of the row's size), the
    last one dequantizing into the floats ``X`` with step ``st`` (:func:`_pass`).

    Polyphase, as the reference: the grid refined so far is kept contiguous, and each pass
    writes the next grid into the other buffer, its even points copied and its odd points
    computed between them. A pass along the innermost axis then loads each line contiguously
    and stores interleaved pairs, any other pass copies and computes whole contiguous rows:
    every loop vectorizes, at every level."""
    in_g = plan.shape[0] % 2 == 0  # where the grid refined so far is (the last pass writes into G)
    (G if in_g else W)[0] = _wrap(np.int64(R[0]) * K, G.itemsize == 4)
    sizes = np.ones(NDIM, np.int64)
    pos = 1
    for p in range(plan.shape[0]):
        a, n_e, even = plan[p, _A], plan[p, _NE], plan[p, _EVEN] != 0
        cubic = ((cubic_mask >> np.uint64(plan[p, _LV])) & np.uint64(1)) != 0 and n_e >= 4
        outer, inner = 1, 1
        for b in range(a):
            outer *= sizes[b]
        for b in range(a + 1, NDIM):
            inner *= sizes[b]
        if in_g:
            _pass(G, W, R, pos, outer, inner, n_e, even, cubic, K, X, st, p == plan.shape[0] - 1)
        else:
            _pass(W, G, R, pos, outer, inner, n_e, even, cubic, K, X, st, p == plan.shape[0] - 1)
        m = 2 * n_e if even else 2 * n_e - 1
        pos += outer * (m // 2) * inner
        sizes[a] = m
        in_g = not in_g


@numba.njit(nogil=True, cache=True)
def _lorenzo(G, R, dims, X, st):
    """Inclusive prefix sums of ``R`` along every axis of the padded shape, in place on ``G``;
    the last axis's sums go dequantized into the floats ``X`` (``float(q)``, then ``* st``) row
    by row while they are in cache. A row of at most two axes takes :func:`_lorenzo2`."""
    n = G.shape[0]
    is32 = np.iinfo(G.dtype).bits == 32
    naxes = dims.shape[0]
    if naxes == 4 and dims[0] == 1 and dims[1] == 1:
        _lorenzo2(G, R, dims[2], dims[3], X, st)
        return
    last = -1  # the outer axis summed last (the outermost longer than 1); -1: only the innermost
    for ax in range(naxes - 1):
        if dims[ax] > 1:
            last = ax
            break
    m = dims[naxes - 1]
    for o in range(n // m):  # innermost axis: a running sum per line
        line, src, xl = G[o * m:(o + 1) * m], R[o * m:(o + 1) * m], X[o * m:(o + 1) * m]
        acc = np.int64(0)
        for i in range(m):
            acc = _wrap(acc + np.int64(src[i]), is32)
            line[i] = acc
        if last < 0:
            for i in range(m):
                xl[i] = line[i]
                xl[i] *= st
    inner = m
    for ax in range(naxes - 2, -1, -1):
        m = dims[ax]
        if m > 1:
            for o in range(n // (m * inner)):
                if ax == last:  # the block's first row is final already
                    first, x0 = G[o * m * inner:(o * m + 1) * inner], X[o * m * inner:(o * m + 1) * inner]
                    for i in range(inner):
                        x0[i] = first[i]
                        x0[i] *= st
                for k in range(1, m):
                    row = (o * m + k) * inner
                    cur, prev = G[row:row + inner], G[row - inner:row]
                    for i in range(inner):
                        cur[i] = np.int64(cur[i]) + np.int64(prev[i])
                    if ax == last:
                        xr = X[row:row + inner]
                        for i in range(inner):
                            xr[i] = cur[i]
                            xr[i] *= st
        inner *= m


@numba.njit(nogil=True, cache=True)
def _lorenzo2(G, R, rows, m, X, st):
    """:func:`_lorenzo` of a ``rows x m`` grid, four rows at a time: the column sums of four rows
    (vectorized loops, into ``G``'s first ``4 m`` values), then the four rows' running sums in
    one loop, converted to floats, then ``* st`` while they are in cache. Sums along both axes in
    either order give the same integers (two's complement adds commute modulo the width), and
    four independent running sums keep the adder busy where one would wait on its own previous
    sum each step. Every sum is cast to the grid's type ``c`` (the reference's wrap), so an int32
    sum stays a 32-bit add."""
    c = G.dtype.type
    T = G[:4 * m].reshape((4, m)) if rows >= 4 else G[:m].reshape((1, m))
    last = T.shape[0] - 1  # the column sums of the latest row finished
    for i in range(m):
        T[last, i] = 0
    k = 0
    while k + 4 <= rows:
        r4 = R[k * m:(k + 4) * m].reshape((4, m))
        for r in range(4):  # the column sums: row r's from row r - 1's (row 0's from the last block's row 3)
            q = 3 if r == 0 else r - 1
            for i in range(m):
                T[r, i] = c(T[q, i] + r4[r, i])
        x4 = X[k * m:(k + 4) * m].reshape((4, m))
        a0 = a1 = a2 = a3 = c(0)
        for i in range(m):  # four independent running sums, as floats (float(q)) into the output
            a0, a1, a2, a3 = c(a0 + T[0, i]), c(a1 + T[1, i]), c(a2 + T[2, i]), c(a3 + T[3, i])
            x4[0, i], x4[1, i], x4[2, i], x4[3, i] = a0, a1, a2, a3
        for r in range(4):  # then * st, vectorized, while the rows are in cache
            for i in range(m):
                x4[r, i] *= st
        k += 4
    while k < rows:  # the last rows one at a time
        src, xl = R[k * m:(k + 1) * m], X[k * m:(k + 1) * m]
        for i in range(m):
            T[last, i] = c(T[last, i] + src[i])
        acc = c(0)
        for i in range(m):
            acc = c(acc + T[last, i])
            xl[i] = acc
            xl[i] *= st
        k += 1


@numba.njit(nogil=True, cache=True)
def decode_rows(b0, b1, n, lead, dims, lorenzo, plan, masks, K, work, kinds, slots, nib, i8, wide, bpw, bp_at, marks,
                side, esc_pos, esc_val, esc_add, out_pos, out_val, steps, offs, add_off, out):
    """Decode blobs ``b0 .. b1 - 1`` of a group into ``out`` (``(B, n)`` floats).

    ``n`` values per blob, ``lead`` predictor rows per blob (folded channels), ``dims`` one
    predictor row's padded shape; ``work``: scratch integers of the reference's type, at least
    ``n + 2 n / lead`` (:func:`solar.codec.paths.work`: kept per thread, so a decode touches no
    fresh pages for them).
    Codes: per blob ``kinds`` (0 nibbles, 1 int8, 2 byte planes, 3 bitpack) and its row ``slots``
    in ``nib`` / ``i8`` / ``wide`` (bitpack: ``bp_at[slot]``, its section's first word in the
    uint32 ``bpw``); nibble ``marks`` (flat positions in the unpacked nibble rows)
    take the ``side`` values; ``esc_pos``/``esc_val`` and ``out_pos``/``out_val`` are flat
    positions in ``(B, n)``, sorted, and their values.
    """
    is32 = np.iinfo(work.dtype).bits == 32
    nr = n // lead if lead else 0
    R, G, W = work[:n], work[n:n + nr], work[n + nr:n + 2 * nr]
    for b in range(b0, b1):
        _residuals(b, R, n, kinds, slots, nib, i8, wide, bpw, bp_at, marks, side, esc_pos, esc_val, esc_add, is32)
        for r in range(lead):
            x = out[b, r * nr:(r + 1) * nr]
            st = steps[b]
            if lorenzo:  # the last sums dequantize into x
                _lorenzo(G, R[r * nr:(r + 1) * nr], dims, x, st)
            elif plan.shape[0] == 0:  # one value: the anchor
                G[0] = _wrap(np.int64(R[r * nr]) * K, is32)
                for i in range(nr):
                    x[i] = G[i]
                    x[i] *= st
            else:  # the last pass dequantizes into x
                _interp(G, R[r * nr:(r + 1) * nr], plan, masks[b * lead + r], K, W, x, st)
            if add_off:
                off = offs[b]
                for i in range(nr):
                    x[i] += off
        lo = np.searchsorted(out_pos, b * n)
        hi = np.searchsorted(out_pos, (b + 1) * n)
        for k in range(lo, hi):
            out[b, out_pos[k] - b * n] = out_val[k]


#: :func:`decode_blob`'s positive answers: what the checks refused (negative: the side markers'
#: count, ``-1 - count``, which is not the side values')
ESC_UNORDERED, ESC_RANGE, ESC_VALUE, OUT_UNORDERED, OUT_RANGE = 2, 3, 4, 5, 6


@numba.njit(nogil=True, cache=True)
def _positions(d, n, pos):
    """``pos``: the running sums of the deltas ``d`` (a blob's sparse section), checked as
    :func:`solar.codec.sections._sparse_one` checks them -> 0, or 1 for deltas out of order or
    range (a first delta below 0, a later one below 1, any at ``n`` or more), 2 for a sum past
    ``n`` (every delta is below ``n`` by then, so no sum wraps before one passes ``n``)."""
    for k in range(d.shape[0]):
        if d[k] < (1 if k else 0) or d[k] >= n:
            return 1
    s = np.int64(0)
    for k in range(d.shape[0]):
        s += d[k]
        if s >= n:
            return 2
        pos[k] = s
    return 0


@numba.njit(nogil=True, cache=True)
def _markers(packed, marks):
    """Flat positions of the -8 markers (nibble 8) in ``packed``'s nibble pairs, low nibble first,
    into ``marks`` while it has room -> how many there are (:func:`~solar.codec.sections.check_side`'s
    count: the padding nibble of an odd count included)."""
    k = 0
    for j in range(packed.shape[0]):
        b = packed[j]
        if (b & 15) == 8 or (b >> 4) == 8:  # rare: one byte in tens
            for h in range(2):
                if (b >> (4 * h)) & 15 == 8:
                    if k < marks.shape[0]:
                        marks[k] = 2 * j + h
                    k += 1
    return k


@numba.njit(nogil=True, cache=True)
def decode_blob(n, lead, dims, lorenzo, plan, masks, K, kind, esc_add, esc_limit, steps, offs, add_off, work,
                codes, side, bpw, esc_d, esc_val, out_d, out_val, out):
    """One blob (:func:`decode_rows` of a group of one) from its lossless-decoded sections, with
    the checks the group path makes in numpy before its kernel (side marker count, sparse
    positions, escape values within ``[-esc_limit, esc_limit)`` when ``esc_limit``) -> 0, or
    what the checks refused (see :data:`ESC_UNORDERED`), before any value is written.
    ``codes``: the codes section (nibble pairs, int8 codes, or ``kind`` 2's byte planes); bitpack
    codes are the words ``bpw``. ``esc_d``/``out_d``: the sparse sections' position deltas,
    ``esc_val``/``out_val`` their values. The leading arguments up to ``add_off`` are
    :func:`decode_rows`'s for the blob's header, ``work`` its scratch."""
    marks = np.empty(side.shape[0] if kind == 0 else 0, np.int64)
    if kind == 0:
        found = _markers(codes, marks)
        if found != side.shape[0]:
            return -1 - found
    esc_pos = np.empty(esc_d.shape[0], np.int64)
    bad = _positions(esc_d, n, esc_pos)
    if bad:
        return ESC_UNORDERED if bad == 1 else ESC_RANGE
    if esc_limit:
        for k in range(esc_val.shape[0]):
            if esc_val[k] < -esc_limit or esc_val[k] >= esc_limit:
                return ESC_VALUE
    out_pos = np.empty(out_d.shape[0], np.int64)
    bad = _positions(out_d, n, out_pos)
    if bad:
        return OUT_UNORDERED if bad == 1 else OUT_RANGE
    L = codes.shape[0]
    w = L // n if kind == 2 else 1
    one = np.zeros(1, np.int64)
    decode_rows(0, 1, n, lead, dims, lorenzo, plan, masks, K, work, np.full(1, kind, np.int8), one,
                codes.reshape((1, L)), codes.reshape((1, L)), codes.reshape((1, w, L // w)), bpw, one, marks, side,
                esc_pos, esc_val, esc_add, out_pos, out_val, steps, offs, add_off, out)
    return 0


@numba.njit(nogil=True, cache=True)
def copy_rows(src, src_rows, dst, dst_rows):
    """``dst[dst_rows[k]] = src[src_rows[k]]`` for every ``k`` (2-D arrays of one row width)."""
    for k in range(src_rows.shape[0]):
        dst[dst_rows[k]] = src[src_rows[k]]
