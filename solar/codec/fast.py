"""The one-blob fast path of :func:`solar.codec.decode`: an ``ebq`` blob decoded on the CPU by the
``cpu-kernel`` decoder with nothing between the header and the kernel but the checks.

Why: a small blob's decode was mostly the general path's bookkeeping (codec lookup and
instantiation, option contexts, grouping, the path choice twice, layouts built per call), tens
of microseconds before any work. Here the header is read once (its static part cached by
:func:`~solar.codec.header.read_header`), the metadata is parsed and checked once per distinct
metadata (cached, bounded: a dataset's blobs of one shape and bound share it when their section
lengths agree), the per-shape plan is cached, and the group driver's share runs directly. The
checks are the general path's own (:func:`~solar.codec.sections.gather`, the metadata's and
payload's), so a damaged blob fails here with the same :class:`~solar.errors.CorruptDataError`.

Anything else (other devices, ``out=``, compiled decoding, a named other path, blobs the kernel
does not cover) returns None and takes the general path.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from solar.errors import CorruptDataError

from . import bitpack, fused, paths
from . import lossless as ll
from .decoders import current
from .ebq import EBQCodec, _Layout
from .ebq_meta import BITPACK, NIBBLES, EbqMeta, code_len
from .header import Header, payload_of, read_header
from .predict import Predictor
from .sections import _ESCAPE_RANGE, _UNORDERED

__all__ = ["decode_one"]

_COVERED = frozenset({Predictor.INTERP, Predictor.FINE, Predictor.LORENZO})
_INT = {4: torch.int32, 8: torch.int64}
#: checked metadata by (descriptor, dtype, shape, metadata bytes, payload length)
_METAS: dict[tuple, EbqMeta] = {}
_METAS_MAX = 4096


def _meta(h: Header, what: str) -> EbqMeta:
    key = (h.descriptor, h.dtype, h.shape, h.meta, h.payload_len)
    m = _METAS.get(key)
    if m is None:
        m = EbqMeta.parse(h, what)  # raises for anything no encoder writes
        if len(_METAS) >= _METAS_MAX:
            _METAS.clear()
        _METAS[key] = m
    return m


@lru_cache(maxsize=1024)
def _layout(shape: tuple[int, ...], fold: int, cubic_levels: int, kshift: int, version: int, qint: int) -> _Layout:
    """The group layout of one blob (the general path builds it per call)."""
    shape = shape or (1,)
    lead = math.prod(shape[:fold])
    masks = np.full(lead, cubic_levels, np.uint64)
    masks.setflags(write=False)
    return _Layout(shape, lead, shape[fold:], masks, 1 << kshift, version >= 6, _INT[qint])


@lru_cache(maxsize=1024)
def _scale(dtype: np.dtype, step: float, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's one-row step and offset arrays (read-only: cached, never written)."""
    steps, offs = np.full(1, step, dtype), np.full(1, offset, dtype)
    steps.setflags(write=False)
    offs.setflags(write=False)
    return steps, offs


def decode_one(blob, decoder: str | None, compile: bool | None = None, what: str = "codec blob") -> torch.Tensor | None:
    """``blob`` (bytes) decoded on the CPU by the ``cpu-kernel`` decoder, or None when the general
    path must decode it (numba missing, another path or compiling asked for by the arguments or
    the environment, a blob the kernel does not cover). ``decoder`` and ``compile`` None follow the
    environment, as :func:`solar.codec.decode`'s. Raises :class:`CorruptDataError` as the general
    path does."""
    if (decoder or current().decoder) not in ("auto", "cpu-kernel") or (compile is None and fused.enabled()) \
            or compile or not paths.kernel_available():
        return None
    h = read_header(blob, what)
    if h.codec != "ebq" or h.version not in EBQCodec.decodes or h.version < 2 or not h.size:
        return None  # the general path reports a foreign codec or version as such
    m = _meta(h, what)
    if m.predictor not in _COVERED:
        return None
    payload = payload_of(blob, h, what)
    lay = _layout(h.shape, m.fold, m.cubic_levels, m.kshift, h.version, m.qint)
    x = np.empty((1, h.size), h.dtype)  # numpy's allocation and from_numpy cost less than torch.empty's
    _kernel(h, m, payload, lay, x, what)
    return torch.from_numpy(x).view(h.shape)


def _kernel(h: Header, m: EbqMeta, payload, lay: _Layout, out: np.ndarray, what: str) -> None:
    """One blob's sections, lossless-decoded here, checked and decoded by one kernel call
    (:func:`solar.codec.kernels_cpu.decode_blob`): the checks of
    :func:`~solar.codec.sections.gather` there, whose refusals raise here with its messages."""
    n, w, c_end = h.size, m.width, m.codes_len
    codes, side, bpw = paths._U8, paths._U8, paths._U32
    if w == BITPACK:
        bitpack.check(payload[:c_end], n, m.qint, what)
        buf = np.zeros(c_end + bitpack.PAD, np.uint8)  # word-aligned, padded: as a group's buffer
        buf[:c_end] = payload[:c_end]
        bpw, kind = _ro(buf.view(np.uint32)), 3
    else:
        nb = code_len(w, n)
        raw = np.frombuffer(ll.decompress(payload[:c_end], ll.LOSSLESS[m.lossless], nb + m.n_side, what), np.uint8)
        kind = 0 if w == NIBBLES else 1 if w == 1 else 2
        codes, side = raw[:nb], raw[nb:]
    name, e_end = ll.LOSSLESS[m.lossless], c_end + m.esc_len
    esc_d, esc_val = _sparse(payload[c_end:e_end], name, m.n_esc, _I8, what)
    out_d, out_val = _sparse(payload[e_end:], name, m.n_out, h.dtype, what)
    dims, plan = paths._geometry(tuple(lay.inner_shape), lay.reverse)
    steps, offs = _scale(h.dtype, m.step, m.offset)
    info = np.zeros(1, np.int64)
    bad = paths._KERNELS.decode_blob(
        n, lay.lead, dims, m.predictor == Predictor.LORENZO, plan, lay.masks, lay.K, paths._PROTO[m.qint], kind,
        codes, side, bpw, esc_d, esc_val, kind < 2 and m.predictor.per_level, 1 << 31 if m.qint == 4 else 0, out_d,
        out_val, steps, offs, m.offset != 0.0, out, info)
    if bad:
        raise CorruptDataError(f"{what}: {_refused(bad, int(info[0]), side.size, n)}; corrupted payload")


_I8 = np.dtype("<i8")


def _sparse(section, name: str, count: int, vdtype: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A sparse section's position deltas and values (read-only views of its decompressed bytes;
    empty without entries)."""
    if not count:
        return paths._I64, paths._EMPTY.get(vdtype, paths._I64)
    raw = ll.decompress(section, name, count * (8 + vdtype.itemsize), what)
    return np.frombuffer(raw, _I8, count), np.frombuffer(raw, vdtype, count, offset=8 * count)


def _refused(code: int, markers: int, sides: int, n: int) -> str:
    """What :func:`~solar.codec.kernels_cpu.decode_blob`'s refusal ``code`` means (the group
    path's words for the same check)."""
    k = paths._KERNELS
    if code == k.SIDE_COUNT:
        return f"nibble stream has {markers} side markers for {sides} side values"
    if code in (k.ESC_UNORDERED, k.OUT_UNORDERED):
        return _UNORDERED
    if code in (k.ESC_RANGE, k.OUT_RANGE):
        return f"sparse position out of range for {n} values"
    return _ESCAPE_RANGE


def _ro(a: np.ndarray) -> np.ndarray:
    """``a`` read-only: every array the kernel reads here is (payload views are), so numba
    compiles one specialization per dtype pair, not one per combination of flags."""
    a.setflags(write=False)
    return a
