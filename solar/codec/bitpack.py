"""The ``bitpack`` lossless stage (``ebq/7``): fixed-length bit-packing per block of 32 residuals.

Why: zstd (and lz4) decode on the CPU only, sequentially, so a GPU decoder fed by them is capped
by the CPU; fixed-length codes per block (cuSZp's design) decode data-parallel on any device,
and on a CPU far faster than an entropy decoder. The price is ratio: a block's width is set by
its largest residual, where an entropy coder pays each value's own length (bench/codec/results.json
has both side by side).

Section layout (one blob's codes section, ``n`` residuals, ``nb = ceil(n / 32)`` blocks)::

    widths   nb x u8            bits per zigzag code in each block (0: an all-zero block, no data),
                                then zero bytes up to a multiple of 4 (the data is word-aligned)
    data     per block, 4 * width bytes: its 32 codes (zero-padded past ``n``) as one little-endian
             bit string, code j at bits [j * width, (j + 1) * width)

A code is the residual's zigzag ``u = (r << 1) ^ (r >> 63)``; it decodes as
``(u >>> 1) ^ -(u & 1)`` in 64-bit two's complement, then to the reference's integer width
(``qint``: 4 bytes allow widths up to 32, whose codes decode exactly into int32). Widths never
exceed ``8 * qint`` and the section is exactly ``head(n) + 4 * sum(widths)`` bytes long (checked
before any code is read). Nothing escapes: a residual of any size has a width.

This module is numpy (encoder, checks) plus the reference decoder's torch ops (any device); the
``cpu-kernel`` (:mod:`solar.codec.kernels_cpu`) and ``triton`` (:mod:`solar.codec.kernels_triton`)
paths unpack the same bits in their kernels.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from solar.errors import CorruptDataError

__all__ = ["BLOCK", "PAD", "head", "Packed", "pack", "blocks", "check", "concat", "unpack_torch"]

#: Values per block (one 32-bit word per bit of width).
BLOCK = 32
_FEW = 64
_M32 = np.uint64(0xFFFFFFFF)


def blocks(n: int) -> int:
    """Blocks of a stream of ``n`` residuals."""
    return -(-n // BLOCK)


def head(n: int) -> int:
    """Bytes of a section's width table (padded to whole 32-bit words)."""
    return 4 * -(-blocks(n) // 4)


def _bit_length(u: np.ndarray) -> np.ndarray:
    """Bits of each uint64 (0 for 0), by binary search on the shift (exact, vectorized)."""
    w = np.zeros(u.shape, np.int64)
    v = u.copy()
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (np.uint64(1) << np.uint64(s))
        w[big] += s
        v[big] >>= np.uint64(s)
    return w + (v > 0)


def pack(r: np.ndarray) -> bytes:
    """Residuals (any signed integer array) -> the section's bytes."""
    r = r.reshape(-1).astype(np.int64, copy=False)
    n, nb = r.size, blocks(r.size)
    u = np.zeros(nb * BLOCK, np.uint64)
    u[:n] = ((r << 1) ^ (r >> 63)).view(np.uint64)
    u = u.reshape(nb, BLOCK)
    widths = _bit_length(u.max(axis=1, initial=0)) if nb else np.zeros(0, np.int64)
    table = np.zeros(head(n), np.uint8)
    table[:nb] = widths
    parts = [table.tobytes()]
    words = np.zeros(int(widths.sum()), np.uint32)
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]) if nb else widths
    for w in np.unique(widths):
        if w == 0:
            continue
        sel = np.flatnonzero(widths == w)
        acc = np.zeros((sel.size, int(w) + 2), np.uint64)  # 32-bit words in uint64 slots
        for j in range(BLOCK):
            v, s = u[sel, j], j * int(w)
            i, sh = s >> 5, s & 31
            acc[:, i] |= (v << np.uint64(sh)) & _M32
            acc[:, i + 1] |= (v >> np.uint64(32 - sh)) & _M32
            if sh:
                acc[:, i + 2] |= (v >> np.uint64(64 - sh)) & _M32
        words[(starts[sel][:, None] + np.arange(w)).reshape(-1)] = acc[:, :w].reshape(-1).astype(np.uint32)
    parts.append(words.astype("<u4").tobytes())
    return b"".join(parts)


def check(section, n: int, qint: int, what: str) -> np.ndarray:
    """The section's block widths, after checking them and the section's length."""
    nb, hb = blocks(n), head(n)
    if len(section) < hb:
        raise CorruptDataError(f"{what}: bitpack section of {len(section)} bytes is shorter than its "
                               f"{nb} block widths; corrupted payload")
    w = np.frombuffer(section, np.uint8, nb)
    if nb <= _FEW:  # a small blob: Python's max and sum of the bytes beat numpy's per-call cost
        widths = bytes(section[:nb])
        top, total = max(widths, default=0), sum(widths)
    else:
        top, total = int(w.max()), int(w.sum(dtype=np.int64))
    if top > 8 * qint:
        raise CorruptDataError(f"{what}: bitpack block width {top} exceeds {8 * qint} bits; corrupted payload")
    need = hb + 4 * total
    if need != len(section):
        raise CorruptDataError(f"{what}: bitpack section is {len(section)} bytes but its block widths "
                               f"need {need}; corrupted payload")
    return w


class Packed(NamedTuple):
    """A group's checked bitpack sections, end to end."""

    buf: np.ndarray  # uint8: every section from a multiple of 4 on, then PAD zero bytes
    starts: np.ndarray  # int64 (B,): where each blob's section (its widths) starts in ``buf``


#: Zero bytes after a group's sections: a code is read as up to 5 bytes (64-bit widths: 9).
PAD = 16


def concat(sections: Sequence) -> Packed:
    """Checked sections of a group (:func:`check`) -> one buffer and each section's start."""
    lens = (np.fromiter((len(s) for s in sections), np.int64, len(sections)) + 3) // 4 * 4
    starts = np.zeros(len(sections), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    buf = np.zeros(int(lens.sum()) + PAD, np.uint8)  # numpy aligns it: words are aligned too
    for s, o in zip(sections, starts):
        buf[o:o + len(s)] = np.frombuffer(s, np.uint8)
    return Packed(buf, starts)


def unpack_torch(packed: Packed, n: int, itype, dev):
    """The reference decoder: a group's checked sections -> ``(B, n)`` residuals in ``itype``, by
    tensor ops on ``dev`` (the bytes go to the device once, every code is unpacked there)."""
    import torch  # decode only: `import solar.codec` stays numpy-only

    B, nb = len(packed.starts), blocks(n)
    widths = packed.buf[packed.starts[:, None] + np.arange(nb)].astype(np.int64)
    data = torch.from_numpy(packed.buf).to(dev).to(torch.int64)
    wt = torch.from_numpy(widths).to(dev)  # (B, nb)
    first = torch.cumsum(wt, 1) - wt  # words before each block within its blob
    bit0 = (torch.from_numpy(packed.starts + head(n)).to(dev).view(B, 1) + 4 * first) * 8  # each block's first bit
    j = torch.arange(BLOCK, device=dev)
    wv = wt[:, :, None]
    pos = (bit0[:, :, None] + j * wv).reshape(B, -1)[:, :n]
    w = wv.expand(B, nb, BLOCK).reshape(B, -1)[:, :n]
    lo = _bits(data, pos, torch.clamp(w, max=32))
    hi = _bits(data, pos + 32, torch.clamp(w - 32, min=0))
    u = lo | (hi << 32)
    r = ((u >> 1) & 0x7FFFFFFFFFFFFFFF) ^ -(u & 1)
    return r.to(itype)


def _bits(data, pos, nbits):
    """``nbits`` (<= 32) bits of the byte string ``data`` (int64 per byte) from bit ``pos`` on."""
    import torch  # decode only, as above

    byte, sh = pos >> 3, pos & 7
    v = torch.zeros_like(pos)
    for k in range(5):
        v |= data[byte + k] << (8 * k)
    mask = (torch.ones_like(nbits) << nbits) - 1
    return (v >> sh) & mask
