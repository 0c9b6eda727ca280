"""Error-bounded lossy compression of float fields, decoded with torch ops on any device.

Quick use::

    import solar.codec as sc
    blob = sc.encode(field, rel_error=1e-3)          # bytes; |decoded - field| <= bound, strictly
    x = sc.decode(blob, device="cuda")               # torch.Tensor, dtype/shape from the header
    batch = sc.decode_batch(blobs, device="cuda")    # (B, *shape) tensor when shapes match
    sc.header_info(blob)                             # descriptor, dtype, shape, bound, sizes
    gpu_blob = sc.encode(field, rel_error=1e-3, codec={"id": "ebq", "lossless": "bitpack"})
    # ebq/7 bitpack: no CPU lossless stage, a GPU unpacks it (a lower ratio than zstd's)

The guarantee: every finite value comes back within ``abs_error`` of the original (checked on the
encoder side with the decoder's exact arithmetic; misses are stored verbatim); NaN and Inf come
back bit-exact. Damaged, truncated or foreign blobs raise :class:`solar.CorruptDataError`.
See ``docs/codec.md``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from solar.errors import ConfigError, CorruptDataError

from . import decoders, fused
from .base import Codec, Parsed, get_codec, registry
from .header import Header, payload_of, read_header
from .quantize import resolve_bound

__all__ = ["encode", "decode", "decode_batch", "copy_rows", "verify", "header_info", "HeaderInfo", "Codec", "registry",
           "get_codec"]


@dataclass(frozen=True)
class HeaderInfo:
    """What :func:`header_info` reports about a blob, without decoding it."""

    descriptor: str  # "ebq/1"
    codec: str  # "ebq"
    version: int
    dtype: np.dtype
    shape: tuple[int, ...]
    abs_error: float  # the guaranteed absolute bound (0.0: lossless)
    nbytes: int  # decoded size
    blob_len: int  # encoded size

    @property
    def ratio(self) -> float:
        return self.nbytes / self.blob_len if self.blob_len else float("inf")

    @property
    def torch_dtype(self):
        from .torch_ops import TORCH_DTYPES  # imports torch: `import solar.codec` stays numpy-only

        return TORCH_DTYPES[self.dtype.itemsize]


def _as_array(array) -> np.ndarray:
    try:
        import torch  # a tensor argument means torch is loaded; numpy-only callers never need it

        if isinstance(array, torch.Tensor):
            if array.dtype not in (torch.float32, torch.float64):
                raise ConfigError(
                    f"solar.codec.encode needs float32 or float64 data, got a {array.dtype} tensor; cast "
                    "first (e.g. tensor.float()) or store the field raw")
            array = array.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    x = np.asarray(array)
    if x.dtype.kind != "f" or x.dtype.itemsize not in (4, 8):
        raise ConfigError(
            f"solar.codec.encode needs float32 or float64 data, got {x.dtype}; cast first "
            "(e.g. array.astype(np.float32)) or store the field raw")
    if x.ndim > 4:
        raise ConfigError(f"solar.codec.encode supports 0-D to 4-D arrays, got shape {x.shape}; reshape it first")
    x = x.astype(x.dtype.newbyteorder("<"), copy=False)
    return x if x.flags.c_contiguous else x.copy()  # (np.ascontiguousarray would make 0-D 1-D)


def encode(array, *, abs_error: float | None = None, rel_error: float | None = None, codec=None) -> bytes:
    """Compress a float32/float64 array (numpy or CPU/GPU tensor, 0-D to 4-D) into one blob.

    Args:
        array: the field.
        abs_error: absolute bound: every decoded value is within it, strictly.
        rel_error: bound relative to the value range ``max - min`` of the finite values (as in SZ).
            Exactly one of ``abs_error`` / ``rel_error`` must be given; 0 means lossless.
        codec: ``None`` (default ``ebq``), a registered name, a config dict such as
            ``{"id": "ebq", "lossless": "lz4"}``, or a :class:`Codec` instance.

    Raises:
        ConfigError: non-float dtype, more than 4 dimensions, both/neither/negative/NaN bound.
    """
    x = _as_array(array)
    eb = resolve_bound(x, abs_error, rel_error)
    return get_codec(codec).encode(x, eb)


def _as_blob(blob, what: str):
    """``blob`` as a contiguous bytes-like object, or a ConfigError saying what was passed."""
    if not isinstance(blob, (bytes, bytearray, memoryview, np.ndarray)):
        raise ConfigError(f"{what}: expected bytes-like codec blob, got {type(blob).__name__}")
    if isinstance(blob, np.ndarray):
        if blob.dtype.hasobject:
            raise ConfigError(f"{what}: expected the blob's bytes, got a numpy array of Python objects")
        return np.ascontiguousarray(blob).view(np.uint8).reshape(-1)
    if isinstance(blob, memoryview) and not blob.contiguous:
        return blob.tobytes()
    return blob


def _parse(blob, what: str) -> Parsed:
    blob = _as_blob(blob, what)
    header = read_header(blob, what)
    return Parsed(header, payload_of(blob, header, what), what)


def header_info(blob) -> HeaderInfo:
    """Descriptor, dtype, shape and bound of ``blob`` (header checksum verified, payload not)."""
    return _info(read_header(_as_blob(blob, "codec blob")))


def _info(h: Header) -> HeaderInfo:
    return HeaderInfo(h.descriptor, h.codec, h.version, h.dtype, h.shape, h.abs_error, h.nbytes, h.blob_len)


def verify(blob, *, name: Any = None) -> HeaderInfo:
    """Check ``blob`` without decoding it: magic, header and payload checksums, sizes, and a codec
    (and version) this solar knows; xxh3 at memory speed: what a damaged or foreign blob fails first.
    Returns what :func:`header_info` returns (read once, for a caller that checks the shape too).

    Raises :class:`CorruptDataError` naming ``name`` (e.g. a sample) when given."""
    p = _parse(blob, f"sample {name!r}" if name is not None else "codec blob")
    _codec_for(p).check_version(p)
    return _info(p.header)


def _codec_for(p: Parsed) -> Codec:
    try:
        cls = registry.get(p.header.codec)
    except LookupError:
        raise CorruptDataError(
            f"{p.what}: written by codec {p.header.descriptor!r}, which this solar does not know; "
            f"known: {', '.join(registry.names())}") from None
    return cls()


def decode(blob, *, device="cpu", out=None, compile: bool | None = None, decoder: str | None = None,
           threads: int | None = None):
    """Decode one blob into a tensor on ``device`` (dtype and shape from the header).

    ``out``: optional tensor of the right shape/dtype/device to write into (returned).
    ``compile``: decode with the ``torch.compile``-d graph (:mod:`solar.codec.fused`; worth it
    when one shape repeats); None follows ``SOLAR_CODEC_COMPILE`` (off by default).
    ``decoder``: ``"auto"``, ``"reference"`` or ``"cpu-kernel"`` (:mod:`solar.codec.paths`; every
    path gives the same bits); None follows ``SOLAR_CODEC_DECODER`` (default ``"auto"``).
    ``threads``: the ``cpu-kernel`` path's threads (0: every core); None follows ``SOLAR_CODEC_THREADS``.
    Raises :class:`CorruptDataError` for truncated, corrupted or foreign blobs.
    """
    if out is None and not compile and device == "cpu" and type(blob) is bytes:
        decoders.check(decoder, threads)
        x = _fast().decode_one(blob, decoder, compile)  # one blob on the CPU: no grouping, no option contexts
        if x is not None:
            return x
    p = _parse(blob, "codec blob")
    _check_out(out, p.header, device)
    with fused.use(compile), decoders.use(decoder, threads):
        x = _codec_for(p).decode_group([p], device, None if out is None else out.view((1,) + p.header.shape))[0]
    return x if out is None else out


def _rows_of(out, at, n: int):
    """``decode_batch``'s ``at=`` as an int64 array checked against ``out`` (None without ``out``)."""
    if out is None:
        return None
    at = np.arange(n, dtype=np.int64) if at is None else np.asarray(at, dtype=np.int64)
    if at.shape != (n,) or (len(at) and (at.min() < 0 or at.max() >= len(out))):
        raise ConfigError(f"at= must give one row of out (0..{len(out) - 1}) per blob, got {len(at)} rows "
                          f"for {n} blobs")
    return at


def _into(out, at: np.ndarray, x):
    """``x`` (a batch decoded without ``out=``) put into rows ``at`` of ``out``."""
    import torch  # decode only: `import solar.codec` stays numpy-only (encoding, solar ingest)

    if isinstance(x, list) or x.shape[1:] != out.shape[1:] or x.dtype != out.dtype:
        raise ConfigError(f"out= has rows of {out.dtype} {tuple(out.shape[1:])}; the blobs decode to others")
    out[torch.from_numpy(at)] = x.to(out.device)
    return out


def copy_rows(src, src_rows, dst, dst_rows) -> None:
    """``dst[dst_rows[k]] = src[src_rows[k]]`` for every ``k`` (int64 arrays) between two
    contiguous CPU tensors of one row shape and dtype, without the GIL where numba imports
    (decoded rows gathered for a batch)."""
    _fast().copy_rows(src, np.asarray(src_rows, dtype=np.int64), dst, np.asarray(dst_rows, dtype=np.int64))


def _options_ok(decoder, threads) -> bool:
    """Whether ``decoder=`` and ``threads=`` are valid (a batch's blobs are checked before them)."""
    try:
        decoders.check(decoder, threads)
    except ConfigError:
        return False
    return True


_FAST = None


def _fast():
    """:mod:`solar.codec.fast` (it imports torch: imported on the first decode, then kept)."""
    global _FAST
    if _FAST is None:
        from . import fast  # decode only: `import solar.codec` stays numpy-only

        _FAST = fast
    return _FAST


def _check_out(out, h: Header, device) -> None:
    if out is None:
        return
    import torch  # decode only: `import solar.codec` stays numpy-only (encoding, solar ingest)

    from .torch_ops import TORCH_DTYPES

    want = TORCH_DTYPES[h.dtype.itemsize]
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"out= must be a torch.Tensor ({want}, shape {h.shape}), got {type(out).__name__}")
    if out.requires_grad:
        raise ConfigError("out= must not require grad (decoding writes into it in place); pass out.detach()")
    dev = torch.device(device)
    same_device = out.device.type == dev.type and (dev.index is None or out.device.index == dev.index)
    if tuple(out.shape) != h.shape or out.dtype != want or not same_device or not out.is_contiguous():
        raise ConfigError(
            f"out= must be a contiguous {want} tensor of shape {h.shape} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}")


def decode_batch(blobs: Sequence, *, device="cpu", names: Sequence[Any] | None = None, compile: bool | None = None,
                 decoder: str | None = None, threads: int | None = None, out=None, at=None):
    """Decode a mini-batch; blobs of one shape/dtype/codec are decoded with one sequence of ops.

    Returns a stacked ``(B, *shape)`` tensor when every blob has the same shape and dtype (the
    usual mini-batch), otherwise a list of tensors in input order.

    Args:
        blobs: bytes-like blobs.
        device: where the tensor ops run and the result lives.
        names: optional labels (e.g. sample indices) used in error messages, one per blob.
        compile: decode with the ``torch.compile``-d graph (see :func:`decode`); None follows
            ``SOLAR_CODEC_COMPILE``.
        decoder: the decoder path (see :func:`decode`); None follows ``SOLAR_CODEC_DECODER``.
        threads: the ``cpu-kernel`` path's threads over the batch's blobs (0: every core); None
            follows ``SOLAR_CODEC_THREADS`` (default 1).
        out: a contiguous ``(M, *shape)`` tensor on ``device`` to decode into, blob ``i`` into
            row ``at[i]`` (``at``: distinct int64 rows, one per blob; None: rows ``0 .. B-1``);
            then ``out`` is returned (a CPU decode by the ``cpu-kernel`` path writes the rows
            directly).

    Raises:
        CorruptDataError: naming the offending blob (``names[i]`` when given).
        ConfigError: ``out`` and ``at`` that do not fit the blobs (rows of another shape or
            dtype, or not one row per blob).
    """
    import torch  # decode only: `import solar.codec` stays numpy-only (encoding, solar ingest)

    # one blob passed alone would be iterated byte by byte ("got int"): say what to pass instead
    if isinstance(blobs, (bytes, bytearray, memoryview)) or (
            isinstance(blobs, np.ndarray) and blobs.ndim == 1 and not blobs.dtype.hasobject):
        raise ConfigError(f"decode_batch takes a sequence of blobs (e.g. a list of bytes), got one "
                          f"{type(blobs).__name__} object; use decode(blob) for a single blob, or "
                          "decode_batch([blob])")
    if names is not None and len(names) != len(blobs):
        raise ConfigError(f"names= has {len(names)} entries for {len(blobs)} blobs")
    blobs = list(blobs)
    at = _rows_of(out, at, len(blobs))
    if not blobs:
        return [] if out is None else out
    labels = [f"sample {names[i]!r}" if names is not None else f"blob {i} of the batch" for i in range(len(blobs))]
    if str(device) == "cpu" and not compile and _options_ok(decoder, threads):
        with fused.use(compile), decoders.use(decoder, threads):
            x = _fast().decode_rows(blobs, labels, out, at)  # each blob through the one-blob path, into its row
        if x is not None:
            return x
    if out is not None:
        return _into(out, at, decode_batch(blobs, device=device, names=names, compile=compile, decoder=decoder,
                                           threads=threads))
    parsed = [_parse(b, w) for b, w in zip(blobs, labels)]
    groups: dict[Any, list[int]] = defaultdict(list)
    codecs: dict[str, Codec] = {}
    for i, p in enumerate(parsed):
        c = codecs.get(p.header.codec) or codecs.setdefault(p.header.codec, _codec_for(p))
        key = (p.header.descriptor, p.header.dtype, p.header.shape, c.group_key(p))
        groups[key].append(i)
    results: list = [None] * len(parsed)
    stacked = None
    if len({(k[1], k[2]) for k in groups}) == 1:  # one dtype and shape: groups fill rows of one tensor
        h = parsed[0].header
        from .torch_ops import TORCH_DTYPES, copy_rows_  # imports torch, as decoding does

        stacked = torch.empty((len(parsed),) + h.shape, dtype=TORCH_DTYPES[h.dtype.itemsize], device=device)
    with fused.use(compile), decoders.use(decoder, threads):
        for key, idx in groups.items():
            decoded = codecs[key[0].partition("/")[0]].decode_group([parsed[i] for i in idx], device)
            if len(groups) == 1:
                return decoded
            if stacked is not None:
                copy_rows_(stacked, idx, decoded.contiguous())
                continue
            for j, i in enumerate(idx):
                results[i] = decoded[j]
    return stacked if stacked is not None else results
