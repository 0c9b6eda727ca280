"""The ``triton`` decoder's kernel: the interpolation predictors' passes as Triton programs.

One launch per (level, axis) pass over every predictor row of a group: each program instance
takes a block of the pass's odd points, finds its place in the row's grid from the pass
descriptor (:func:`solar.codec.passes.interp_passes`), predicts it from its even neighbours
along the pass axis and writes ``prediction + K * residual`` in place. The points of one pass
depend only on points of earlier passes, so a pass is one race-free launch; cubic or linear is
chosen per row (a group's blobs may differ) and per point (the borders), as in
:func:`~solar.codec.predict.predict_odd`.

Bit-exact with the reference: the integers are the reference's width (int32 or int64), whose
adds and multiplies wrap alike, every shift is arithmetic, and the ``K == 1`` cubic points use
the reference's sign -1 form. Residual widening, escapes, dequantization and outliers stay in
the reference's torch ops (device-agnostic, and float ops there are never contracted).

Runs where Triton does: CUDA (Triton ships with CUDA builds of torch), or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported; how the tests
check it without a GPU). :mod:`solar.codec.paths` imports this module only then.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .bitpack import Packed, blocks, head
from .passes import C_AXIS, C_CNT, C_DIST, C_EVEN, C_LEVEL, C_NE, C_START, C_STEP, interp_passes

__all__ = ["interp_decode", "unpack"]

_BLOCK = 256


@triton.jit
def _pass(G, R, cub, total, cnt, n_row, pos, d, copy_k, cubic_hi, c1, c2, c3, s0, s1, s2, s3, start, a, K,
          BLOCK: tl.constexpr, ONE: tl.constexpr):
    """``total`` odd points (``cnt`` per row): block ``program_id`` of them. Point ``k`` along the
    axis is copied when ``k == copy_k``, cubic (on cubic rows) when ``1 <= k <= cubic_hi``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < total
    row = idx // cnt
    j = idx % cnt
    i3 = j % c3
    t = j // c3
    i2 = t % c2
    t = t // c2
    i1 = t % c1
    i0 = t // c1
    k = tl.where(a == 3, i3, tl.where(a == 2, i2, tl.where(a == 1, i1, i0)))
    base = row * n_row
    q = base + start + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
    res = tl.load(R + base + pos + j, mask=m, other=0)
    copy = k == copy_k
    cubic = (tl.load(cub + row, mask=m, other=0) != 0) & (k >= 1) & (k <= cubic_hi)
    b = tl.load(G + q - d, mask=m, other=0)
    c = tl.load(G + q + d, mask=m & ~copy, other=0)
    fa = tl.load(G + q - 3 * d, mask=m & cubic, other=0)
    fd = tl.load(G + q + 3 * d, mask=m & cubic, other=0)
    lin = (b + c) >> 1
    if ONE:  # K == 1: the reference's sign -1 cubic form
        v = tl.where(copy, res + b, tl.where(cubic, res - ((fa + fd - 9 * (b + c) + 7) >> 4), res + lin))
    else:
        kr = K * res
        v = tl.where(copy, b + kr, tl.where(cubic, ((9 * (b + c) - fa - fd + 8) >> 4) + kr, lin + kr))
    tl.store(G + q, v, mask=m)


@triton.jit
def _unpack(W, boff, bw, R, total, n, nb, BLOCK: tl.constexpr):
    """Residual ``idx`` of the ``(rows, n)`` output: its block's width ``bw`` and first word
    ``boff``, its code from the two words that hold its first bit (and the next two for widths
    over 32), un-zigzagged in 64 bits as :mod:`solar.codec.bitpack` defines."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < total
    row = idx // n
    i = idx % n
    blk = row * nb + i // 32
    w = tl.load(bw + blk, mask=m, other=0).to(tl.int64)
    bit = tl.load(boff + blk, mask=m, other=0) * 32 + (i % 32) * w
    lo = _word_bits(W, bit, tl.minimum(w, 32), m)
    hi = _word_bits(W, bit + 32, tl.maximum(w - 32, 0), m & (w > 32))
    u = lo | (hi << 32)
    r = ((u >> 1) & 0x7FFFFFFFFFFFFFFF) ^ -(u & 1)
    tl.store(R + idx, r.to(R.dtype.element_ty), mask=m)


@triton.jit
def _word_bits(W, bit, nbits, m):
    k = bit >> 5
    a = tl.load(W + k, mask=m, other=0).to(tl.int64) & 0xFFFFFFFF
    b = tl.load(W + k + 1, mask=m, other=0).to(tl.int64) & 0xFFFFFFFF
    return ((a | (b << 32)) >> (bit & 31)) & ((tl.full(bit.shape, 1, tl.int64) << nbits) - 1)


def unpack(packed: Packed, rows: int, n: int, itype: torch.dtype, dev) -> torch.Tensor:
    """A group's bitpack sections -> ``(rows, n)`` residuals of ``itype`` on ``dev``: the bytes go
    to the device once; the block offsets (a prefix sum of the widths) and the codes are computed
    there."""
    nb = blocks(n)
    W = torch.from_numpy(packed.buf.view(np.int32)).to(dev)
    at = torch.from_numpy(packed.starts // 4).to(dev)
    tw = at[:, None] + torch.arange(nb, device=dev) // 4  # the word of each block's width
    bw = (W[tw].to(torch.int64) >> (8 * (torch.arange(nb, device=dev) % 4))) & 255
    boff = at[:, None] + head(n) // 4 + torch.cumsum(bw, 1) - bw
    R = torch.empty((rows, n), dtype=itype, device=dev)
    total = rows * n
    if total:
        _unpack[(triton.cdiv(total, _BLOCK),)](W, boff.contiguous(), bw.contiguous(), R, total, n, nb,
                                                BLOCK=_BLOCK)
    return R


def interp_decode(R: torch.Tensor, shape: tuple[int, ...], masks: np.ndarray, K: int, reverse: bool) -> torch.Tensor:
    """Residual rows ``R`` (``(rows, n)`` of the reference's integer type, escapes applied) ->
    the integers ``(rows, n)``; ``masks`` one ``cubic_levels`` per row."""
    rows, n = R.shape
    R = R.contiguous()
    G = torch.empty_like(R)
    G[:, 0] = R[:, 0] * K
    cubs: dict[int, torch.Tensor] = {}
    pos = 1
    for p in interp_passes(tuple(shape), reverse).tolist():
        level, d, n_e, even, a = p[C_LEVEL], p[C_DIST], p[C_NE], p[C_EVEN], p[C_AXIS]
        cnt, step, start = p[C_CNT:C_CNT + 4], p[C_STEP:C_STEP + 4], sum(p[C_START:C_START + 4])
        per_row = cnt[0] * cnt[1] * cnt[2] * cnt[3]
        if level not in cubs:
            bits = (np.asarray(masks, np.uint64) >> np.uint64(level)) & np.uint64(1)
            cubs[level] = torch.from_numpy(bits.astype(np.int8)).to(R.device)
        total = rows * per_row
        copy_k = n_e - 1 if even else -1  # the last odd point of an even count copies its neighbour
        cubic_hi = n_e - 3 if n_e >= 4 else 0  # cubic interior points: 1 <= k <= n_e - 3
        _pass[(triton.cdiv(total, _BLOCK),)](G, R, cubs[level], total, per_row, n, pos, d, copy_k, cubic_hi,
                                              cnt[1], cnt[2], cnt[3], step[0], step[1], step[2], step[3],
                                              start, a, K, BLOCK=_BLOCK, ONE=K == 1)
        pos += per_row
    return G
