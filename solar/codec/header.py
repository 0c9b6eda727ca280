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


_PREFIX = struct.Struct("<4sBB")  # magic, header format version, descriptor length
_DTYPE_NDIM = struct.Struct("<BB")
_BOUND_META = struct.Struct("<dH")  # abs_error, meta length
_TAIL = struct.Struct("<QQQ")  # payload length, payload xxh3, header xxh3
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]


def _truncated(what: str, n: int) -> CorruptDataError:
    return CorruptDataError(f"{what}: truncated header ({n} bytes); the blob is incomplete or not a SOLAR "
                            "codec blob")


def read_header(blob, what: str = "codec blob") -> Header:
    """Parse and verify a blob's header; the payload checksum is checked by :func:`check_payload`.

    The header's static part (magic through the metadata length: codec, dtype, shape, bound) is
    the same for every sample of a field, so once validated it is remembered by its bytes; per
    blob only the metadata, the lengths and the checksums are read and checked (this runs once per
    blob of every mini-batch, so it is kept to a few C calls).

    Raises:
        CorruptDataError: wrong magic (a foreign blob), truncation, a header checksum mismatch,
            an unknown dtype, or a declared size that is impossible.
    """
    buf = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    n = len(buf)
    static = None
    if n >= 6:
        end = 6 + buf[5] + 2  # past the descriptor, dtype code and ndim
        if end <= n:
            end += 8 * buf[end - 1] + 10  # past the shape, bound and metadata length
            if end <= n:
                static = _STATIC.get(bytes(buf[:end]))
    if static is None:
        static = _parse_static(buf, what)
    descriptor, dtype, shape, abs_error, meta_len, pos = static
    if pos + meta_len + 24 > n:
        raise _truncated(what, n)
    meta = bytes(buf[pos:pos + meta_len])
    pos += meta_len
    payload_len, payload_sum, header_sum = _TAIL.unpack_from(buf, pos)
    if xxhash.xxh3_64_intdigest(buf[:pos + 16]) != header_sum:
        raise CorruptDataError(f"{what}: header checksum mismatch; the blob is corrupted")
    pos += 24
    if pos + payload_len != n:
        raise CorruptDataError(
            f"{what}: payload is {n - pos} bytes but the header says {payload_len}; "
            "the blob is truncated or has trailing bytes")
    return Header(descriptor, dtype, shape, abs_error, meta, pos, payload_len, payload_sum)


#: validated static header parts, by their bytes (a handful per dataset; bounded all the same)
_STATIC: dict[bytes, tuple] = {}
_STATIC_MAX = 4096


def _parse_static(buf: memoryview, what: str) -> tuple:
    """Validate magic through metadata length -> (descriptor, dtype, shape, bound, meta length,
    offset of the metadata), and remember it when valid."""
    n = len(buf)
    if n < 4:
        raise _truncated(what, n)
    if bytes(buf[:4]) != MAGIC:
        raise CorruptDataError(
            f"{what}: not a SOLAR codec blob (magic {bytes(buf[:4])!r}, expected {MAGIC!r}); was it written "
            "by solar.codec.encode?")
    if n < 6:
        raise _truncated(what, n)
    _, fmt, desc_len = _PREFIX.unpack_from(buf)
    if fmt > FORMAT_VERSION:
        raise CorruptDataError(f"{what}: header format version {fmt} is newer than this solar reads "
                               f"({FORMAT_VERSION}); upgrade solar")
    if fmt != FORMAT_VERSION:  # no solar wrote it: damage, not a newer writer
        raise CorruptDataError(f"{what}: invalid header format version {fmt}; the blob is corrupted or not "
                               "a SOLAR codec blob")
    pos = 6 + desc_len
    if pos + 2 > n:
        raise _truncated(what, n)
    desc_raw = bytes(buf[6:pos])
    dtype_code, ndim = _DTYPE_NDIM.unpack_from(buf, pos)
    if ndim > MAX_NDIM:
        raise CorruptDataError(f"{what}: header declares {ndim} dimensions (max {MAX_NDIM})")
    pos += 2
    if pos + 8 * ndim + 10 > n:
        raise _truncated(what, n)
    shape = _SHAPES[ndim].unpack_from(buf, pos)
    pos += 8 * ndim
    abs_error, meta_len = _BOUND_META.unpack_from(buf, pos)
    pos += 10
    # From here on the numbers are what the encoder wrote (the checksum is checked per blob by
    # the caller); still validate them, because a forged or buggy writer must not make the
    # decoder allocate terabytes or index out of range.
    descriptor, bad = _static_problem(desc_raw, dtype_code, shape, abs_error)
    if bad:  # a truncated or corrupted blob is reported as that, before what its bytes claim
        end = pos + meta_len
        if end + 24 > n:
            raise _truncated(what, n)
        if xxhash.xxh3_64_intdigest(buf[:end + 16]) != _TAIL.unpack_from(buf, end)[2]:
            raise CorruptDataError(f"{what}: header checksum mismatch; the blob is corrupted")
        raise CorruptDataError(f"{what}: {bad}")
    static = (descriptor, DTYPES[dtype_code], shape, float(abs_error), meta_len, pos)
    if len(_STATIC) >= _STATIC_MAX:
        _STATIC.clear()
    _STATIC[bytes(buf[:pos])] = static
    return static


def _static_problem(desc_raw: bytes, dtype_code: int, shape: tuple, abs_error: float) -> tuple[str, str | None]:
    """The descriptor and what is wrong with the static header fields (None: nothing)."""
    try:
        descriptor = desc_raw.decode("ascii")
        int(descriptor.partition("/")[2])
    except (UnicodeDecodeError, ValueError):
        return "", f"malformed codec descriptor {desc_raw!r}"
    if dtype_code not in DTYPES:
        return descriptor, f"unknown dtype code {dtype_code}"
    # every dimension on its own too: with a 0 among them the product passes, but a later
    # reshape or allocation of the huge one would not
    if math.prod(shape) > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in shape):
        return descriptor, f"header declares shape {tuple(shape)}, larger than any blob SOLAR writes"
    if not (abs_error >= 0.0 and math.isfinite(abs_error)):
        return descriptor, f"invalid error bound {abs_error!r} in header"
    return descriptor, None


def payload_of(blob, header: Header, what: str = "codec blob") -> memoryview:
    """The checked payload bytes of ``blob``."""
    buf = memoryview(blob).cast("B")
    payload = buf[header.payload_offset:header.blob_len]
    if xxhash.xxh3_64_intdigest(payload) != header.payload_sum:
        raise CorruptDataError(f"{what}: payload checksum mismatch; the compressed data is corrupted")
    return payload
