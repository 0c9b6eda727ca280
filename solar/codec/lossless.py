"""The CPU lossless stage: ``none``, ``lz4`` (block format, fast) and ``zstd`` (better ratio).

Everything after this stage runs in torch ops on the target device. Decompression always knows
the exact output size from the (checksummed) header, and refuses sizes no real stream of the given
compressed length could produce, so a forged header cannot make it allocate terabytes.
"""

from __future__ import annotations

import os
import threading
from enum import IntEnum

from solar.errors import ConfigError, CorruptDataError, MissingDependencyError

__all__ = ["Lossless", "LOSSLESS", "compress", "decompress", "check_expansion", "default_lossless"]


class Lossless(IntEnum):
    """The lossless-stage id in a blob's metadata. Never renumber: ids are part of the on-disk format."""

    NONE = 0
    LZ4 = 1
    ZSTD = 2


#: id in the blob -> name (the ``lossless=`` option's spelling).
LOSSLESS = {int(s): s.name.lower() for s in Lossless}
LOSSLESS_IDS = {v: k for k, v in LOSSLESS.items()}
#: The largest expansion each format can produce (lz4: 255x; zstd: ~32768x for RLE blocks).
_MAX_RATIO = {"none": 1, "lz4": 256, "zstd": 40000}


class _Local(threading.local):
    """zstandard (de)compressor objects are not thread-safe: one set per thread."""

    def __init__(self) -> None:
        self.compressors: dict[int, object] = {}
        self.decompressor = None


_local = _Local()


def _zstd():
    try:
        import zstandard  # may be missing: the error names the package to install
    except ImportError as exc:  # pragma: no cover - zstandard ships in the test env
        raise MissingDependencyError(
            "the zstd lossless stage needs the 'zstandard' package: pip install zstandard"
        ) from exc
    return zstandard


def default_lossless() -> str:
    """``SOLAR_CODEC_LOSSLESS`` when set (e.g. ``bitpack`` for blobs a GPU decodes whole, chosen
    for ``solar ingest`` without an option of its own), else zstd when installed (SZ3-level ratios
    need an entropy coder), else lz4 (a core dependency)."""
    env = os.environ.get("SOLAR_CODEC_LOSSLESS", "").strip().lower()
    if env:
        return env
    try:
        import zstandard  # noqa: F401  (whether it is installed decides the default)
    except ImportError:  # pragma: no cover
        return "lz4"
    return "zstd"


def compress(data, name: str, level: int | None = None) -> bytes:
    """Compress ``data`` (bytes-like) with the named stage."""
    if name == "none":
        return bytes(data)
    if name == "lz4":
        import lz4.block  # only lz4 blobs need it

        return lz4.block.compress(data, store_size=False, mode="high_compression" if level else "default",
                                  compression=level or 0)
    if name == "zstd":
        lvl = 9 if level is None else level
        c = _local.compressors.get(lvl)
        if c is None:
            zs = _zstd()
            # min_match=7: residual codes are noise-like; short matches cost more than the
            # literals they replace, and skipping them leaves zstd's Huffman literal coder the
            # whole stream: a better ratio and a faster encode than the level's defaults
            params = zs.ZstdCompressionParameters.from_level(lvl, min_match=7, write_content_size=True)
            c = _local.compressors[lvl] = zs.ZstdCompressor(compression_params=params)
        return c.compress(data)
    raise ConfigError(f"unknown lossless stage {name!r}; use one of {sorted(LOSSLESS_IDS)}")


def check_expansion(clen: int, size: int, name: str, what: str = "codec blob") -> None:
    """Refuse (before allocating) a ``size`` no ``clen``-byte section of stage ``name`` can produce."""
    if size > _MAX_RATIO.get(name, 1) * clen + (65536 if name != "none" else 0):
        raise CorruptDataError(
            f"{what}: a {clen}-byte {name} section cannot expand to {size} bytes; corrupted header")


def decompress(data, name: str, size: int, what: str = "codec blob"):
    """Decompress ``data`` to exactly ``size`` bytes, or raise :class:`CorruptDataError`."""
    check_expansion(len(data), size, name, what)
    try:
        if name == "none":
            out = data
        elif name == "lz4":
            import lz4.block  # only lz4 blobs need it

            out = lz4.block.decompress(data, uncompressed_size=size) if size else b""
        elif name == "zstd":
            if _local.decompressor is None:
                _local.decompressor = _zstd().ZstdDecompressor()
            out = _local.decompressor.decompress(data, max_output_size=size) if size or len(data) else b""
        else:
            raise CorruptDataError(f"{what}: unknown lossless stage {name!r}")
    except CorruptDataError:
        raise
    except MissingDependencyError:
        raise
    except Exception as exc:  # lz4.block.LZ4BlockError, zstandard.ZstdError, ...
        raise CorruptDataError(f"{what}: {name} section does not decompress ({exc})") from None
    if len(out) != size:
        raise CorruptDataError(f"{what}: {name} section decompressed to {len(out)} bytes, expected {size}")
    return out
