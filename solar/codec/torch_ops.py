"""Decoder kernels in plain torch tensor ops (CPU and CUDA alike, no per-element Python loop).

Every function works on a whole batch at once: codes of ``B`` blobs arrive as one ``(B, w, n)``
uint8 tensor of byte planes, and each step below is one tensor op (or a handful) over the batch.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["join_planes", "unpack_nibbles", "unzigzag_", "patch_", "dequantize", "copy_rows_", "take_rows",
           "scratch", "TORCH_DTYPES"]

TORCH_DTYPES = {4: torch.float32, 8: torch.float64}


def join_planes(planes: torch.Tensor, itype: torch.dtype) -> torch.Tensor:
    """``(B, w, n)`` little-endian byte planes -> ``(B, n)`` unsigned codes in ``itype``.

    Planes (byte shuffle) compress better than interleaved bytes; joining them back is shifts
    and ors, ``w - 1`` passes.
    """
    w = planes.shape[1]
    u = planes[:, 0].to(itype)
    for k in range(1, w):
        u |= planes[:, k].to(itype) << (8 * k)
    return u


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """``(B, k)`` int8 bytes of 4-bit two's complement pairs (low nibble first) -> ``(B, 2k)`` int8.

    Why int16: each packed byte becomes one little-endian int16 word whose low byte is the
    sign-extended low nibble and whose high byte is the sign-extended high nibble, so the int8
    view of the words *is* the interleaved stream. Every op is a contiguous vector pass, which
    a CPU runs much faster than writes of the two nibbles through stride-2 int8 views. The
    result lives in a scratch buffer and never leaves the decoder.
    """
    B, k = b.shape
    w = scratch.get("nibbles", B * k, torch.int16, b.device).view(B, k)
    hi = scratch.get("nibbles_hi", B * k, torch.int16, b.device).view(B, k)
    w.copy_(b)  # sign-extending widen
    torch.bitwise_right_shift(w, 4, out=hi)  # high nibble, sign-extended
    hi <<= 8
    w <<= 12
    w >>= 12  # low nibble, sign-extended over 16 bits
    w &= 0xFF
    w |= hi
    return w.view(torch.int8).view(B, 2 * k)


def unzigzag_(u: torch.Tensor) -> torch.Tensor:
    """In place: zigzag code ``u`` (non-negative) -> signed ``(u >> 1) ^ -(u & 1)``."""
    sign = u & 1
    sign.neg_()
    u >>= 1
    u ^= sign
    return u


def patch_(flat: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor | None) -> torch.Tensor:
    """In place: ``flat[index] = values`` (escapes / exact outliers); a no-op when empty."""
    if index is not None and index.numel():
        flat.index_put_((index,), values)
    return flat


def _host_rows(*ts: torch.Tensor) -> bool:
    """Whether row gathers/scatters of ``ts`` may go through numpy: contiguous CPU tensors."""
    return all(t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad for t in ts)


def copy_rows_(dst: torch.Tensor, rows, src: torch.Tensor) -> torch.Tensor:
    """In place: ``dst[rows[i]] = src[i]`` along dim 0 (torch's ``index_copy_``).

    Why not ``index_copy_`` itself: on a CPU it copies element by element, where numpy's row
    copies are one ``memcpy`` per row, far faster for rows of kilobytes. On other devices
    ``index_copy_`` is the right kernel.
    """
    if _host_rows(dst, src):
        dst.numpy()[np.asarray(rows, dtype=np.int64)] = src.numpy()
    else:
        dst.index_copy_(0, torch.as_tensor(np.asarray(rows, dtype=np.int64), device=dst.device), src)
    return dst


def take_rows(src: torch.Tensor, rows, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[rows[i]]`` along dim 0 (``index_select``), row copies on a CPU as in
    :func:`copy_rows_`."""
    if _host_rows(src, out):
        np.take(src.numpy(), np.asarray(rows, dtype=np.int64), axis=0, out=out.numpy())
        return out
    return torch.index_select(src, 0, torch.as_tensor(np.asarray(rows, dtype=np.int64), device=src.device), out=out)


def dequantize(q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``fl(fl(float(q) * step) + offset)`` as separate ops, bit-identical to the encoder's check.

    ``step``/``offset`` are ``(B, 1, ..., 1)`` tensors of ``dtype``; keeping the multiply and the
    add in separate kernels rules out FMA contraction, which would change the rounding. ``offset``
    None means zero (the encoder prefers it: one pass less, one rounding less).
    """
    x = torch.empty(q.shape, dtype=dtype, device=q.device)
    x.copy_(q)  # exact int -> float conversion (|q| <= 2**24 / 2**52), a vectorized contiguous pass
    x.mul_(step)  # one rounded multiply per element (faster than a mixed-dtype mul with promotion)
    if offset is not None:
        x.add_(offset)
    return x


class _Scratch(threading.local):
    """Per-thread reusable decode buffers, one per (slot, dtype, device).

    Why: a fresh multi-megabyte CPU tensor costs a page fault per 4 KiB on first touch, which
    would make allocation (not arithmetic) the largest cost of decoding. Intermediates therefore live in
    buffers that are reused across calls; only the returned tensor is freshly allocated. Buffers
    never escape the decoder.
    """

    def __init__(self) -> None:
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, slot: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, dtype, device)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=dtype, device=device)
            self.bufs[key] = buf
        return buf[:n]

    def clear(self) -> None:
        self.bufs.clear()


scratch = _Scratch()
