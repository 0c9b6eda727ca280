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
import struct
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from solar.errors import CorruptDataError

from . import bitpack, decoders, fused, paths
from . import lossless as ll
from .ebq import EBQCodec
from .ebq_meta import BITPACK, NIBBLES, EbqMeta, code_len
from .header import Header, payload_of, read_header
from .predict import Predictor
from .sections import _ESCAPE_RANGE, _UNORDERED
from .torch_ops import TORCH_DTYPES

__all__ = ["copy_rows", "decode_one", "decode_rows"]

_COVERED = frozenset({Predictor.INTERP, Predictor.FINE, Predictor.LORENZO})
_INT = {4: torch.int32, 8: torch.int64}
_SUMS = struct.Struct("<QQ")  # payload_sum, header_sum: the header's last fields


class _Plan(NamedTuple):
    """Everything one header decides (cached per header bytes, checksums left out)."""

    h: Header  # the first blob's (its payload_sum is that blob's)
    m: EbqMeta
    blob_len: int
    args: tuple  # decode_blob's leading arguments (kernels_cpu.decode_blob)
    lossless: str  # the sections' lossless stage
    nb: int  # bytes of codes in the codes section (its side values follow)
    work: int  # the kernel's scratch integers


#: plans by header bytes through payload_len (None: a blob the kernel does not cover); bounded
_PLANS: dict[bytes, _Plan | None] = {}
_PLANS_MAX = 4096


def decode_one(blob, decoder: str | None, compile: bool | None = None, what: str = "codec blob") -> torch.Tensor | None:
    """``blob`` (bytes) decoded on the CPU by the ``cpu-kernel`` decoder, or None when the general
    path must decode it (numba missing, another path or compiling asked for by the arguments or
    the environment, a blob the kernel does not cover). ``decoder`` and ``compile`` None follow the
    environment, as :func:`solar.codec.decode`'s. Raises :class:`CorruptDataError` as the general
    path does."""
    if compile or (decoder or decoders.name()) not in ("auto", "cpu-kernel") or (compile is None and fused.enabled()) \
            or not paths.kernel_available():
        return None
    job = _checked(blob, what)
    if job is None:
        return None
    h = job.plan.h
    x = np.empty(h.shape, h.dtype)  # numpy's allocation and from_numpy cost less than torch.empty's
    _kernel(job.plan, job.payload, x.reshape(1, h.size), what)
    return torch.from_numpy(x)


def decode_rows(blobs, labels, out: torch.Tensor | None = None, at: np.ndarray | None = None) -> torch.Tensor | None:
    """A batch of ``blobs`` of one shape and dtype decoded on the CPU, each through the one-blob
    path straight into its row of the ``(B, *shape)`` result, the blobs split into one contiguous
    share per thread (:func:`solar.codec.decoders.current`'s count; the lossless stage and the
    kernel release the GIL). Call it inside the batch's ``fused.use`` / ``decoders.use`` block.
    ``out`` (a contiguous CPU tensor): blob ``i`` into ``out[at[i]]`` instead (``at`` None: row
    ``i``), returned; None also where the blobs' shape or dtype is not ``out``'s rows'.

    None when the group path must decode the batch: another path or compiling in effect, numba
    missing, a blob that is not a flat byte buffer, that the kernel does not cover, or of another
    shape or dtype, and any damaged blob (the group path then refuses it with its own message,
    naming the first damaged blob in batch order, as it always has)."""
    if decoders.current().decoder not in ("auto", "cpu-kernel") or fused.enabled() or not paths.kernel_available():
        return None
    jobs: list[_Job] = []
    try:
        for blob, what in zip(blobs, labels):
            view = _flat(blob)
            job = None if view is None else _checked(view, what)
            if job is None or (jobs and (job.plan.h.shape, job.plan.h.dtype) != (jobs[0].plan.h.shape,
                                                                                 jobs[0].plan.h.dtype)):
                return None
            jobs.append(job)
        h = jobs[0].plan.h
        if out is None:
            x = np.empty((len(jobs),) + h.shape, h.dtype)
        elif tuple(out.shape[1:]) != h.shape or out.dtype != TORCH_DTYPES[h.dtype.itemsize] \
                or not out.is_contiguous() or out.device.type != "cpu":
            return None
        else:
            x = out.numpy()
        rows = x.reshape(len(x), h.size)
        at = np.arange(len(jobs)) if at is None else at
        threads = min(decoders.current().threads, len(jobs))
        if threads <= 1:
            _rows(jobs, labels, 0, len(jobs), rows, at)
        else:
            cuts = np.linspace(0, len(jobs), threads + 1).astype(int)
            futures = [paths._pool(threads).submit(_rows, jobs, labels, a, b, rows, at)
                       for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
            for f in futures:
                f.exception()  # every share done before any refusal is looked at
            for f in futures:
                f.result()
    except CorruptDataError:
        return None
    return torch.from_numpy(x) if out is None else out


def copy_rows(src: torch.Tensor, src_rows: np.ndarray, dst: torch.Tensor, dst_rows: np.ndarray) -> None:
    """``dst[dst_rows[k]] = src[src_rows[k]]`` for every ``k`` (int64 arrays): rows of two
    contiguous CPU tensors of one row shape and dtype, in one compiled loop without the GIL where
    numba imports, else with torch's index ops."""
    if not len(src_rows):
        return
    k = paths._kernels()
    if k is not None and src.is_contiguous() and dst.is_contiguous():
        width = src[0].numel()
        k.copy_rows(src.numpy().reshape(len(src), width), src_rows, dst.numpy().reshape(len(dst), width), dst_rows)
    else:
        dst.index_copy_(0, torch.from_numpy(dst_rows), src.index_select(0, torch.from_numpy(src_rows)))


class _Job(NamedTuple):
    """One checked blob: its plan and its payload (a view of the blob)."""

    plan: _Plan
    payload: memoryview


def _checked(blob, what: str) -> _Job | None:
    """``blob``'s plan and payload after its header and payload checksums, or None when the kernel
    does not cover it; raises :class:`CorruptDataError` in the header's own words."""
    key, tail = _key(blob)
    p = _PLANS.get(key) if key else None
    if p is None:
        if key and key in _PLANS:
            return None  # not covered (the general path checks and decodes it)
        p = _plan(blob, key, what)
        if p is None:
            return None
    payload_sum, header_sum = _SUMS.unpack_from(blob, tail + 8)
    view = memoryview(blob)
    payload = view[tail + 24:]
    if len(blob) != p.blob_len or xxhash.xxh3_64_intdigest(view[:tail + 16]) != header_sum \
            or xxhash.xxh3_64_intdigest(payload) != payload_sum:
        payload_of(blob, read_header(blob, what), what)  # raises, in the header's own words
        return None  # (unreachable: a blob that passes both checks matches its cached plan)
    return _Job(p, payload)


def _flat(blob):
    """``blob`` as bytes or a flat memoryview of its bytes, or None for anything else (the group
    path reads, or refuses, those)."""
    if type(blob) is bytes:
        return blob
    if isinstance(blob, np.ndarray):
        ok = blob.dtype == np.uint8 and blob.ndim == 1 and blob.flags.c_contiguous
        return memoryview(blob) if ok else None
    if isinstance(blob, bytearray):
        return memoryview(blob)
    if isinstance(blob, memoryview) and blob.format == "B" and blob.ndim == 1 and blob.c_contiguous:
        return blob
    return None


def _rows(jobs: list[_Job], labels, b0: int, b1: int, rows: np.ndarray, at) -> None:
    """Blobs ``b0 .. b1 - 1`` of a batch, blob ``i`` into row ``at[i]`` of ``rows``."""
    for i in range(b0, b1):
        r = int(at[i])
        _kernel(jobs[i].plan, jobs[i].payload, rows[r:r + 1], labels[i])


def _key(blob: bytes) -> tuple[bytes, int]:
    """The header bytes through ``payload_len`` (where the checksums start: the second value), or
    empty when ``blob`` is too short to hold them (the header check says what is wrong)."""
    n = len(blob)
    if n < 6:
        return b"", 0
    e = 8 + blob[5]  # past the descriptor, dtype code and ndim
    if e > n:
        return b"", 0
    e += 8 * blob[e - 1] + 10  # past the shape, bound and metadata length
    if e > n:
        return b"", 0
    t = e + (blob[e - 2] | blob[e - 1] << 8) + 8  # past the metadata and payload_len
    return (bytes(blob[:t]), t - 8) if t + 16 <= n else (b"", 0)  # (bytes of bytes: no copy)


def _plan(blob: bytes, key: bytes, what: str) -> _Plan | None:
    """Check ``blob``'s header and metadata fully and plan its decode (cached under ``key``);
    None for a blob the kernel does not cover."""
    h = read_header(blob, what)
    p = None
    if h.codec == "ebq" and h.version in EBQCodec.decodes and h.version >= 2 and h.size:
        m = EbqMeta.parse(h, what)  # raises for anything no encoder writes
        if m.predictor in _COVERED:
            args = _args(h, m)
            p = _Plan(h, m, h.blob_len, args, ll.LOSSLESS[m.lossless], code_len(m.width, h.size),
                      h.size + 2 * (h.size // args[1]))
    if key:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = p
    return p


def _args(h: Header, m: EbqMeta) -> tuple:
    """:func:`~solar.codec.kernels_cpu.decode_blob`'s arguments that the header decides."""
    shape = h.shape or (1,)
    lead = math.prod(shape[:m.fold])
    masks = np.full(lead, m.cubic_levels, np.uint64)
    steps, offs = np.full(1, m.step, h.dtype), np.full(1, m.offset, h.dtype)
    for a in (masks, steps, offs):
        a.setflags(write=False)  # cached, never written
    dims, plan = paths._geometry(tuple(shape[m.fold:]), h.version >= 6)
    kind = 3 if m.width == BITPACK else 0 if m.width == NIBBLES else 1 if m.width == 1 else 2
    return (h.size, lead, dims, m.predictor == Predictor.LORENZO, plan, masks, 1 << m.kshift, kind,
            kind < 2 and m.predictor.per_level, 1 << 31 if m.qint == 4 else 0, steps, offs, m.offset != 0.0)


def _kernel(p: _Plan, payload, out: np.ndarray, what: str) -> None:
    """One blob's sections, lossless-decoded here, checked and decoded by one kernel call
    (:func:`solar.codec.kernels_cpu.decode_blob`): the checks of
    :func:`~solar.codec.sections.gather` there, whose refusals raise here with its messages."""
    h, m = p.h, p.m
    n, w, c_end = h.size, m.width, m.codes_len
    codes, side, bpw = paths._U8, paths._U8, paths._U32
    if w == BITPACK:
        bitpack.check(payload[:c_end], n, m.qint, what)
        buf = np.zeros(c_end + bitpack.PAD, np.uint8)  # word-aligned, padded: as a group's buffer
        buf[:c_end] = payload[:c_end]
        bpw = _ro(buf.view(np.uint32))
    else:
        nb = p.nb
        raw = np.frombuffer(ll.decompress(payload[:c_end], p.lossless, nb + m.n_side, what), np.uint8)
        codes, side = raw[:nb], raw[nb:]
    esc_d = esc_val = out_d = paths._I64
    out_val = paths._EMPTY[h.dtype]
    if m.n_esc:
        esc_d, esc_val = _sparse(payload[c_end:c_end + m.esc_len], p.lossless, m.n_esc, _I8, what)
    if m.n_out:
        out_d, out_val = _sparse(payload[c_end + m.esc_len:], p.lossless, m.n_out, h.dtype, what)
    bad = paths._KERNELS.decode_blob(*p.args, paths.work(m.qint, p.work), codes, side, bpw, esc_d, esc_val, out_d,
                                     out_val, out)
    if bad:
        raise CorruptDataError(f"{what}: {_refused(bad, side.size, n)}; corrupted payload")


_I8 = np.dtype("<i8")


def _sparse(section, name: str, count: int, vdtype: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A sparse section's position deltas and values (read-only views of its decompressed bytes)."""
    raw = ll.decompress(section, name, count * (8 + vdtype.itemsize), what)
    return np.frombuffer(raw, _I8, count), np.frombuffer(raw, vdtype, count, offset=8 * count)


def _refused(code: int, sides: int, n: int) -> str:
    """What :func:`~solar.codec.kernels_cpu.decode_blob`'s refusal ``code`` means (the group
    path's words for the same check)."""
    k = paths._KERNELS
    if code < 0:
        return f"nibble stream has {-1 - code} side markers for {sides} side values"
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
