"""The blob header shared by every SOLAR codec.

Every blob is ``header | payload``. The header is small, fixed in meaning across codec versions,
and self-checking, so a reader can tell a foreign or damaged blob from a good one *before* it
allocates anything, and can report dtype/shape/bound without decoding (:func:`read_header`).

Layout (little-endian)::

    magic        4s   b"SLRC"
    fmt          u8   header format version (1)
    desc_len     u8   length of the descriptor
    descriptor   .s   ASCII "name/version", e.g. "ebq/1": which codec and which version wrote it
    dtype        u8   1 = float32, 2 = float64
    ndim         u8   0..MAX_NDIM
    shape        ndim x u64
    abs_error    f64  the guaranteed absolute bound (0 = lossless)
    meta_len     u16  length of the codec's private metadata
    meta         .s   codec-specific (section lengths, step, predictor ...)
    payload_len  u64  exact length of the payload that follows
    payload_sum  u64  xxh3-64 of the payload
    header_sum   u64  xxh3-64 of every header byte before this field

Why two checksums: the header checksum lets :func:`read_header` trust the shape and lengths it
returns (so allocation sizes come from checked numbers); the payload checksum turns any bit flip
in the compressed data into a :class:`~solar.errors.CorruptDataError` instead of silent garbage.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import xxhash

from solar.errors import CorruptDataError

__all__ = ["MAGIC", "MAX_NDIM", "Header", "pack_header", "read_header", "DTYPES"]

MAGIC = b"SLRC"
FORMAT_VERSION = 1
MAX_NDIM = 8
#: Hard cap on the element count a header may declare (2**40 values = 4 TiB of float32).
MAX_ELEMENTS = 1 << 40
MAX_META = 4096
DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f8")}
_DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Header:
    """What a blob says about itself (checked by its header checksum)."""

    descriptor: str
    dtype: np.dtype
    shape: tuple[int, ...]
    abs_error: float
    meta: bytes
    payload_offset: int
    payload_len: int
    payload_sum: int

    @property
    def codec(self) -> str:
        """The codec name part of the descriptor (``"ebq"`` for ``"ebq/1"``)."""
        return self.descriptor.partition("/")[0]

    @cached_property
    def version(self) -> int:
        """The format version part of the descriptor (cached: the decoder asks per blob, often)."""
        return int(self.descriptor.partition("/")[2])

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Decoded size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def blob_len(self) -> int:
        return self.payload_offset + self.payload_len


def pack_header(descriptor: str, dtype: np.dtype, shape: tuple[int, ...], abs_error: float,
                meta: bytes, payload: bytes) -> bytes:
    """Build the header for ``payload`` (the caller appends the payload)."""
    desc = descriptor.encode("ascii")
    head = b"".join([
        MAGIC,
        struct.pack("<BB", FORMAT_VERSION, len(desc)),
        desc,
        struct.pack("<BB", _DTYPE_CODES[np.dtype(dtype).newbyteorder("<")], len(shape)),
        struct.pack(f"<{len(shape)}Q", *shape),
        struct.pack("<dH", float(abs_error), len(meta)),
        meta,
        struct.pack("<QQ", len(payload), xxhash.xxh3_64_intdigest(payload)),
    ])
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


class _Reader:
    """Bounds-checked cursor: every read past the end is a CorruptDataError, never an IndexError."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf, self.pos, self.what = buf, 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CorruptDataError(
                f"{self.what}: truncated header ({len(self.buf)} bytes); the blob is incomplete or "
                "not a SOLAR codec blob")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def read_header(blob, what: str = "codec blob") -> Header:
    """Parse and verify a blob's header; the payload checksum is checked by :func:`check_payload`.

    Raises:
        CorruptDataError: wrong magic (a foreign blob), truncation, a header checksum mismatch,
            an unknown dtype, or a declared size that is impossible.
    """
    buf = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    r = _Reader(buf, what)
    magic = bytes(r.take(4))
    if magic != MAGIC:
        raise CorruptDataError(
            f"{what}: not a SOLAR codec blob (magic {magic!r}, expected {MAGIC!r}); was it written "
            "by solar.codec.encode?")
    fmt, desc_len = r.unpack("<BB")
    if fmt != FORMAT_VERSION:
        raise CorruptDataError(f"{what}: unknown header format version {fmt}; upgrade solar")
    desc_raw = bytes(r.take(desc_len))
    dtype_code, ndim = r.unpack("<BB")
    if ndim > MAX_NDIM:
        raise CorruptDataError(f"{what}: header declares {ndim} dimensions (max {MAX_NDIM})")
    shape = r.unpack(f"<{ndim}Q")
    abs_error, meta_len = r.unpack("<dH")
    meta = bytes(r.take(meta_len))
    payload_len, payload_sum = r.unpack("<QQ")
    end = r.pos
    (header_sum,) = r.unpack("<Q")
    if xxhash.xxh3_64_intdigest(buf[:end]) != header_sum:
        raise CorruptDataError(f"{what}: header checksum mismatch; the blob is corrupted")
    # From here on the numbers are what the encoder wrote; still validate them, because a forged
    # or buggy writer must not make the decoder allocate terabytes or index out of range.
    try:
        descriptor = desc_raw.decode("ascii")
        name, _, ver = descriptor.partition("/")
        int(ver)
    except (UnicodeDecodeError, ValueError):
        raise CorruptDataError(f"{what}: malformed codec descriptor {desc_raw!r}") from None
    if dtype_code not in DTYPES:
        raise CorruptDataError(f"{what}: unknown dtype code {dtype_code}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise CorruptDataError(f"{what}: header declares shape {tuple(shape)}, larger than any blob SOLAR writes")
    if not (abs_error >= 0.0 and math.isfinite(abs_error)):
        raise CorruptDataError(f"{what}: invalid error bound {abs_error!r} in header")
    if r.pos + payload_len != len(buf):
        raise CorruptDataError(
            f"{what}: payload is {len(buf) - r.pos} bytes but the header says {payload_len}; "
            "the blob is truncated or has trailing bytes")
    return Header(descriptor, DTYPES[dtype_code], tuple(int(s) for s in shape), float(abs_error),
                  meta, r.pos, int(payload_len), int(payload_sum))


def payload_of(blob, header: Header, what: str = "codec blob") -> memoryview:
    """The checked payload bytes of ``blob``."""
    buf = memoryview(blob).cast("B")
    payload = buf[header.payload_offset:header.blob_len]
    if xxhash.xxh3_64_intdigest(payload) != header.payload_sum:
        raise CorruptDataError(f"{what}: payload checksum mismatch; the compressed data is corrupted")
    return payload
