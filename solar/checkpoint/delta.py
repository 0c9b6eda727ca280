"""Deltas of one chunk against an older chunk: finding what changed, encoding it, applying it.

A chunk that changed since the previous version is usually changed in a few elements only (bf16
weights in fine-tuning: about 1% per step, at random positions), so its 1 MiB are stored as what
changed against the previous version's chunk at the same place, when that is smaller:

- ``SPARSE`` / ``SPARSE16``: the changed elements' positions (gaps between them, u32, or u16 when
  every gap fits) and values (XOR with the base), each split into byte planes and compressed with
  zstd: about 2.5 B per changed bf16 element;
- ``XOR``: the whole chunk XOR the base, split into byte planes and compressed with zstd (moderately
  dense changes whose high bytes stay the same).

Whichever is smaller is kept, and neither when it would not be clearly smaller than the chunk
(dense changes: every fp32 master weight and Adam moment moves each step), nor when more than
:data:`DENSE` of the elements changed (then trying costs time and saves nothing).

A delta object (``deltas/<2 hex>/<target hex><base hex>`` in a root) is::

    DELTA_MAGIC (4 B) | kind (u8) | element size (u8) | 0 (2 B) | base digest (16 B) | chunk length (u64)
        | SPARSE, SPARSE16: changed count (u64) | zstd(gap planes + value planes)
        | XOR:    zstd(byte planes of chunk XOR base)

Its bytes are not hashed themselves, nor is its base before it is applied: the chunk it rebuilds is,
against the target digest (:mod:`.deltastore`), and a wrong byte in the base or the delta fails that.

Change detection runs in torch on whatever device the bytes are (:func:`changed_positions`,
:func:`changed_leaves`): on CUDA only the indices and the changed leaves cross to the host.

A sparse delta is applied with numpy, or, once numba has loaded it in the background, by one
compiled loop (:mod:`.deltakernel`, :func:`warm_kernel`): about half the CPU time per changed element.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch
import zstandard

__all__ = ["SPARSE", "SPARSE16", "XOR", "DENSE", "Encoded", "encode", "xor_delta", "apply", "header",
           "changed_positions", "changed_leaves", "element_size", "sample_words", "clearly_dense", "DeltaFormatError",
           "warm_kernel", "want_kernel"]

DELTA_MAGIC = b"SDL\x01"
SPARSE, XOR, SPARSE16 = 1, 2, 3
_GAP = {SPARSE: (4, np.uint32), SPARSE16: (2, np.uint16)}  # a sparse kind's gap width and type
_HEAD = struct.Struct("<4sBBxx16sQ")
_COUNT = struct.Struct("<Q")
#: above this fraction of changed elements no delta is tried: the chunk is written whole
DENSE = 0.25
#: words compared before the rest to find clearly dense changes (:func:`_sampled_fraction`)
_SAMPLE = 4096
_BLOCK = 32  # words per run of the sample
_FIRST = 32  # runs of the sample's first part, which decides alone for clearly dense changes
_FIRST_DENSE = 0.75  # ... when more than this fraction of its words differ
#: the XOR form is tried from this fraction of changed elements on (below it SPARSE always wins)
_TRY_XOR = 0.02
#: a delta is kept only if it is at most this fraction of the chunk's length
KEEP_BELOW = 0.9
_LEVEL = 1
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


#: the longest shared ``arange`` kept (:func:`_arange`): the elements of a 1 MiB chunk of bytes
_ARANGE_MAX = 1 << 20
_ARANGE = np.arange(0, dtype=np.intp)
#: (gap width, element size) -> the compiled sparse apply, once loaded (:func:`warm_kernel`)
_READY: dict = {}
_GAP_TYPE = dict(_GAP.values())  # gap width -> type
_SIGNATURES = ((2, 2), (2, 4), (4, 2), (4, 4), (2, 1), (2, 8), (4, 1), (4, 8))
_warm_lock = threading.Lock()
_warming: threading.Thread | None = None
_restores = 0  # restores that applied deltas in this process (want_kernel)
#: a restore applying at least this many delta bytes loads the kernel at once (:func:`want_kernel`)
WARM_BYTES = 256 << 20
log = logging.getLogger("solar.checkpoint")
_local = threading.local()  # one zstd context of each kind per thread (made when first needed: ~1 MiB each)


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "cz"):
        _local.cz = zstandard.ZstdCompressor(level=_LEVEL)
    return _local.cz


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dz"):
        _local.dz = zstandard.ZstdDecompressor()
    return _local.dz


class DeltaFormatError(ValueError):
    """A delta object that is not one :func:`encode` wrote (damaged or crafted)."""


class Encoded(NamedTuple):
    """What :func:`encode` found: the delta object (``None``: store the chunk whole) and the changed
    elements (-1: more than :data:`DENSE` of them, not counted exactly)."""

    data: bytes | None
    changed: int


class Header(NamedTuple):
    kind: int
    elem: int
    base: bytes
    length: int


def element_size(nbytes: int, itemsize: int) -> int:
    """The word a chunk of ``nbytes`` is compared in: the tensor's item size if it divides the chunk, else bytes."""
    return itemsize if itemsize in _WORD and nbytes % itemsize == 0 else 1


def changed_positions(new, old, elem: int, dense: float = 1.0):
    """Indices of the ``elem``-byte words where ``new`` and ``old`` differ (bitwise), or ``None``
    when more than ``dense`` of the words differ (the positions are then not worth listing).

    ``new``/``old``: equal-length byte buffers: uint8 tensors (compared on their device, CUDA or
    CPU, and a tensor of indices returned there) or host bytes-likes (compared with numpy, which
    does it several times faster than torch on the CPU; a numpy array returned).
    """
    if isinstance(new, torch.Tensor):
        mask = new.view(_WORD[elem]) != old.view(_WORD[elem])
        if int(mask.sum()) > dense * mask.numel():
            return None
        return mask.nonzero().flatten()
    a, b = np.frombuffer(new, _NP[elem]), np.frombuffer(old, _NP[elem])
    if dense < 1.0 and _clearly_dense(a, b, min(2 * dense, 1.0)):
        return None  # every word is not compared (most of the time of a dense save's chunk)
    mask = a != b
    if np.count_nonzero(mask) > dense * mask.size:
        return None
    return np.flatnonzero(mask)


def _clearly_dense(a: np.ndarray, b: np.ndarray, above: float) -> bool:
    """Whether a sample of ``a`` and ``b``'s words says that more than a fraction ``above`` differ.

    The sample's first :data:`_FIRST` runs decide alone when more than :data:`_FIRST_DENSE` of
    their words differ (Adam-like changes move every word): a quarter of the sample, read as a
    quarter of its cache misses. For a chunk with at most a fraction f of its words changed that
    happens with a probability below exp(-2 * 32 * (0.75 - f)**2) (Hoeffding over the independent
    runs), 1e-7 at f = 0.25, as for the whole sample's test; otherwise the whole sample decides
    (:func:`_sampled_fraction`'s words, the first runs not read twice)."""
    if a.size < 4 * _SAMPLE:
        return False
    idx = _sample(a.size)
    head, rest = idx[:_FIRST * _BLOCK], idx[_FIRST * _BLOCK:]
    differ = np.count_nonzero(a.take(head) != b.take(head))
    if differ > max(_FIRST_DENSE, above) * head.size:
        return True
    return differ + np.count_nonzero(a.take(rest) != b.take(rest)) > above * _SAMPLE


def _sampled_fraction(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of :data:`_SAMPLE` fixed pseudo-random words where ``a`` and ``b`` differ (0 for
    short buffers). Runs at random places, not a stride, so that no regular pattern of changes
    fools it (a run sees a periodic pattern's own fraction): when at most a fraction f of the words
    differ, the sample's 128 independent runs show more than 2f with a probability below
    exp(-2 * 128 * f**2) (Hoeffding), about 1e-7 at f = 0.25; then a chunk is only written whole."""
    if a.size < 4 * _SAMPLE:
        return 0.0
    idx = _sample(a.size)
    return np.count_nonzero(a.take(idx) != b.take(idx)) / _SAMPLE


def sample_words(buf, elem: int) -> np.ndarray | None:
    """The sampled words of chunk bytes ``buf`` (``elem`` bytes each) that :func:`clearly_dense`
    compares (the sample's first :data:`_FIRST` runs), or ``None`` for a chunk too short to sample."""
    a = np.frombuffer(buf, _NP[elem])
    return a.take(_sample(a.size)[:_FIRST * _BLOCK]) if a.size >= 4 * _SAMPLE else None


def clearly_dense(new: np.ndarray, old: np.ndarray) -> bool:
    """Two chunks' :func:`sample_words` say that more than twice :data:`DENSE` of their words differ.

    For a chunk that changed densely in the previous save (its bytes were not kept): a wrong
    'dense' writes it whole once more, so the first runs alone decide, with the bound
    exp(-2 * 32 * (0.5 - f)**2) at a fraction f of changed words (4e-5 at f = 0.1)."""
    return new.shape == old.shape and np.count_nonzero(new != old) > 2 * DENSE * new.size


@functools.lru_cache(maxsize=16)
def _sample(n: int) -> np.ndarray:
    """:data:`_SAMPLE` word indices of ``n``: :data:`_BLOCK`-word runs at pseudo-random aligned places
    (a run is a cache line or two, where scattered words would each be a miss in memory), the
    first :data:`_FIRST` of them a random subset of their own (each part in address order)."""
    starts = np.random.default_rng(n).choice(n // _BLOCK, _SAMPLE // _BLOCK, replace=False) * _BLOCK
    starts = np.concatenate([np.sort(starts[:_FIRST]), np.sort(starts[_FIRST:])])
    idx = (starts[:, None] + np.arange(_BLOCK)).ravel().astype(np.intp)
    idx.flags.writeable = False
    return idx


def changed_leaves(new: torch.Tensor, old: torch.Tensor, leaf: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The leaves (``leaf`` bytes each, the last one shorter) where ``new`` differs from ``old``.

    Runs where the tensors are (CUDA or CPU, both uint8 and of one length); only the changed leaves'
    indices and bytes come back to the host: ``(indices, bytes)`` with ``bytes`` a ``(k, leaf)``
    host tensor (the last leaf zero-padded). ``old`` is the device-side copy of the previous
    version (MTCheck's fingerprint, exact: a compare, not a hash that could collide).
    """
    n = new.numel()
    if old.numel() != n:
        raise ValueError(f"changed_leaves: {n} B against {old.numel()} B")
    pad = -n % leaf
    a = torch.nn.functional.pad(new, (0, pad)).view(-1, leaf)
    b = torch.nn.functional.pad(old, (0, pad)).view(-1, leaf)
    idx = (a != b).any(dim=1).nonzero().flatten()
    return idx.cpu(), a.index_select(0, idx).cpu()


def _planes(words: np.ndarray, elem: int) -> bytes:
    """The bytes of ``words`` grouped by byte position (all low bytes, then the next ...)."""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, elem).T).tobytes()


def _unplanes(raw: bytes, elem: int, dtype) -> np.ndarray:
    """The words whose byte planes are ``raw`` (shifts and ORs: a strided transpose copy is slower)."""
    planes = np.frombuffer(raw, np.uint8).reshape(elem, -1)
    out = planes[0].astype(dtype)
    for b in range(1, elem):
        out |= planes[b].astype(dtype) << dtype(8 * b)
    return out


def header(obj) -> Header:
    """The checked header of a delta object."""
    if len(obj) < _HEAD.size:
        raise DeltaFormatError(f"delta object of {len(obj)} B is shorter than its header")
    magic, kind, elem, base, length = _HEAD.unpack_from(obj)
    if magic != DELTA_MAGIC or kind not in (SPARSE, XOR, SPARSE16) or elem not in _WORD or length % elem:
        raise DeltaFormatError(f"not a delta object (magic {magic!r}, kind {kind}, element size {elem})")
    return Header(kind, elem, base, length)


def encode(new: memoryview, old: memoryview, base: bytes, elem: int) -> Encoded:
    """The delta turning ``old`` (the chunk ``base``) into ``new``, if clearly smaller than ``new``."""
    n = new.nbytes
    nelem = n // elem
    pos = changed_positions(new, old, elem, DENSE)
    if pos is None:
        return Encoded(None, -1)
    k = len(pos)
    if k == 0:
        return Encoded(None, 0)
    dt = _NP[elem]
    a = np.frombuffer(new, dt)
    b = np.frombuffer(old, dt)
    head = _HEAD.pack(DELTA_MAGIC, SPARSE, elem, base, n)
    cz = _compressor()
    gaps = np.diff(pos, prepend=-1) - 1
    kind = SPARSE16 if gaps.max() < (1 << 16) else SPARSE
    width, gtype = _GAP[kind]
    best = (head[:4] + bytes([kind]) + head[5:] + _COUNT.pack(k)
            + cz.compress(_planes(gaps.astype(gtype), width) + _planes(a[pos] ^ b[pos], elem)))
    if k >= _TRY_XOR * nelem:
        xor = xor_delta(new, old, base, elem)
        if len(xor) < len(best):
            best = xor
    if len(best) > KEEP_BELOW * n:
        return Encoded(None, k)
    return Encoded(best, k)


def xor_delta(new: memoryview, old: memoryview, base: bytes, elem: int) -> bytes:
    """The ``XOR`` form of the delta turning ``old`` (chunk ``base``) into ``new``."""
    dt = _NP[elem]
    x = np.frombuffer(new, dt) ^ np.frombuffer(old, dt)
    return _HEAD.pack(DELTA_MAGIC, XOR, elem, base, new.nbytes) + _compressor().compress(_planes(x, elem))


def _arange(k: int) -> np.ndarray:
    """``np.arange(k)`` (intp), a view of one shared read-only array when ``k`` is small enough."""
    global _ARANGE
    if k > _ARANGE_MAX:
        return np.arange(k, dtype=np.intp)
    have = _ARANGE
    if have.size < k:  # grown, never shrunk: a thread holding the old array keeps a valid one
        have = np.arange(max(k, 2 * have.size), dtype=np.intp)
        have.flags.writeable = False
        _ARANGE = have
    return have[:k]


def apply(obj, out: memoryview, base: bytes) -> None:
    """Turn ``out`` (the bytes of chunk ``base``) into the delta's target, in place.

    A sparse delta is applied by the compiled kernel once it is ready (:func:`warm_kernel`), by
    numpy before; both are bit-exact and check every position.

    Raises:
        DeltaFormatError: the object is damaged or crafted, or not a delta against ``base`` (``out``
            may then be partly changed).
    """
    h = header(obj)
    if h.base != base:
        raise DeltaFormatError(f"it is a delta against chunk {h.base.hex()}, not {base.hex()}")
    if h.length != out.nbytes:
        raise DeltaFormatError(f"it rebuilds {h.length} B, the chunk has {out.nbytes} B")
    dt = _NP[h.elem]
    nelem = h.length // h.elem
    mine = np.frombuffer(out, dt)
    dz = _decompressor()
    body = memoryview(obj)[_HEAD.size:]
    try:
        if h.kind == XOR:
            raw = dz.decompress(body, max_output_size=h.length)
            if len(raw) != h.length:
                raise DeltaFormatError(f"its XOR stream has {len(raw)} B, not {h.length} B")
            mine ^= _unplanes(raw, h.elem, dt)
            return
        (k,) = _COUNT.unpack_from(body)
        if not 0 < k <= nelem:
            raise DeltaFormatError(f"it changes {k} elements of {nelem}")
        width, gtype = _GAP[h.kind]
        want = k * (width + h.elem)
        raw = dz.decompress(body[_COUNT.size:], max_output_size=want)
    except zstandard.ZstdError as exc:
        raise DeltaFormatError(f"its compressed stream is damaged ({exc})") from None
    if len(raw) != want:
        raise DeltaFormatError(f"its sparse stream has {len(raw)} B, not {want} B")
    raw = memoryview(raw)  # the planes are read in place, not sliced into copies
    gaps = _unplanes(raw[:width * k], width, gtype)
    vals = _unplanes(raw[width * k:], h.elem, dt)
    kernel = _READY.get((width, h.elem))
    if kernel is not None:
        bad = kernel(gaps, vals, mine)
        if bad >= 0:
            raise DeltaFormatError(f"it changes element {bad} of a chunk of {nelem}")
        return
    pos = np.cumsum(gaps, dtype=np.intp)  # position i: gaps up to i, plus i
    pos += _arange(k)
    if pos[-1] >= nelem:
        raise DeltaFormatError(f"it changes element {pos[-1]} of a chunk of {nelem}")
    got = mine.take(pos)  # gather, XOR, scatter: faster than mine[pos] ^= ...
    got ^= vals
    mine[pos] = got


def want_kernel(delta_bytes: int) -> None:
    """A restore is about to apply ``delta_bytes`` of deltas: start :func:`warm_kernel` when that pays.

    Loading the kernel costs about half a CPU second (numba's import and its first call, from the
    on-disk cache), in a thread beside the reader's; it saves about 1 ns per delta byte applied. So
    it starts for a version with at least :data:`WARM_BYTES` of deltas, when numba is already
    imported (the codec's kernels), and from the second restore of deltas in a process on (one that
    restores repeatedly: weight syncs, evaluation sweeps); a single small restore applies with numpy.
    """
    global _restores
    _restores += 1
    if _restores > 1 or delta_bytes >= WARM_BYTES or _numba_imported():
        warm_kernel()


def _numba_imported() -> bool:
    return "numba" in sys.modules


def warm_kernel(wait: bool = False) -> None:
    """Make the compiled sparse apply (:mod:`.deltakernel`) ready in a background thread, once per
    process; ``wait``: return when it is (or when it cannot be).

    Importing numba and loading the kernel from its on-disk cache take a few tenths of a second
    (compiling it, the first time on a machine, a few seconds): :func:`apply` never waits for it,
    it applies with numpy until a signature is ready. Nothing happens without numba, or with
    ``SOLAR_CKPT_KERNEL=0``.
    """
    global _warming
    with _warm_lock:
        if _warming is None and os.environ.get("SOLAR_CKPT_KERNEL", "1") != "0":
            _warming = threading.Thread(target=_warm, name="solar-ckpt-kernel")
            os.register_at_fork(before=_finish_warming)
            _warming.start()
        thread = _warming
    if wait and thread is not None:
        thread.join()


def _finish_warming() -> None:
    """Before a fork (DataLoader workers): wait for the warm-up, whose thread would hold import locks
    that a child importing numba could then wait on forever."""
    thread = _warming
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _warm() -> None:
    """Load the kernel's signatures one by one (the commonest first), publishing each when ready."""
    global _READY
    try:
        from . import deltakernel  # optional dependency (numba), heavy import: in the background, see warm_kernel
    except Exception:  # no numba, or one that does not import here: numpy applies  # noqa: BLE001
        log.debug("solar.checkpoint: numba does not import; deltas are applied with numpy", exc_info=True)
        return
    for width, elem in _SIGNATURES:
        gaps, vals = np.zeros(1, _GAP_TYPE[width]), np.zeros(1, _NP[elem])
        try:
            deltakernel.sparse_apply(gaps, vals, vals.copy())
        except Exception:  # a numba that cannot compile here: numpy applies  # noqa: BLE001
            log.debug("solar.checkpoint: no compiled delta apply for %d-byte elements", elem, exc_info=True)
            return
        _READY = {**_READY, (width, elem): deltakernel.sparse_apply}
