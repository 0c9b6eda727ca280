"""Which decoder decodes a group of ``ebq`` blobs, and the ``cpu-kernel`` path's driver.

Decoder paths (every one bit-exact with the reference; ``docs/codec.md``):

* ``"reference"``: the torch-ops decoder (:mod:`solar.codec.predict`, any device), or the
  ``torch.compile``-d graph when compiling is asked for (:mod:`solar.codec.fused`);
* ``"cpu-kernel"``: numba kernels (:mod:`solar.codec.kernels_cpu`, the optional ``fast`` extra),
  one compiled call per group or per thread's share of it; the result is moved to the device;
* ``"triton"``: the interpolation predictors' passes as Triton kernels
  (:mod:`solar.codec.kernels_triton`) on CUDA, or on the CPU under Triton's interpreter
  (``TRITON_INTERPRET=1``); codes, escapes, dequantization and outliers in the reference's ops;
* ``"auto"`` (default): ``cpu-kernel`` for CPU decodes when numba imports and compiling was not
  asked for, ``triton`` for CUDA decodes of the interpolation predictors when Triton imports and
  compiling was not asked for, else ``reference``.

A named path is a preference: blobs it does not cover (format ``ebq/1``, lossless-only blobs,
empty arrays) and machines without its dependency decode with the reference. The path comes from
the ``decoder=`` argument of :func:`solar.codec.decode` / :func:`~solar.codec.decode_batch`, else
``SOLAR_CODEC_DECODER`` (:mod:`solar.codec.decoders`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch

from . import fused
from .. import codec as api  # the package's API (it imports this module only when decoding)
from .decoders import current
from .ebq_meta import BITPACK, NIBBLES
from .passes import NDIM, interp_passes
from .predict import Predictor
from .sections import gather
from .torch_ops import TORCH_DTYPES

__all__ = ["choose", "decode_cpu", "kernel_available", "triton_kernels", "warm"]

_KERNELS = None
_LOCK = threading.Lock()
log = logging.getLogger("solar.codec")


def _kernels():
    """:mod:`solar.codec.kernels_cpu`, or None without numba (imported on first use: numba is
    optional and takes a moment to import, which encoding and ``solar ingest`` never need)."""
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            try:
                from . import kernels_cpu  # optional dependency (numba), heavy import: see above
            except ImportError:
                kernels_cpu = False
            else:
                _notice_compiles(kernels_cpu.__name__)
            _KERNELS = kernels_cpu
    return _KERNELS or None


class _Compiling(threading.local):
    depth = 0


def _notice_compiles(module: str) -> None:
    """Log one line when numba starts compiling a kernel of ``module`` (its on-disk cache is cold:
    the first decode on a machine, or after an upgrade, waits tens of seconds; no line when the
    cache has it). One line per outermost compile: the kernels it compiles on the way are quiet."""
    from numba.core import event  # numba imports: kernels_cpu just imported it

    class Notice(event.Listener):
        def __init__(self) -> None:
            self.local = _Compiling()

        def on_start(self, ev) -> None:
            if ev.data["dispatcher"].py_func.__module__ != module:
                return
            self.local.depth += 1
            if self.local.depth == 1:
                log.warning("solar.codec: compiling the cpu-kernel decoder %s for %s (numba's cache is cold; "
                            "once per machine and solar version, tens of seconds; `make setup` does it ahead)",
                            ev.data["dispatcher"].py_func.__name__, ", ".join(map(str, ev.data["args"]))[:160])

        def on_end(self, ev) -> None:
            if ev.data["dispatcher"].py_func.__module__ == module:
                self.local.depth -= 1

    event.register("numba:compile", Notice())


_TRITON = None


def triton_kernels(device: torch.device):
    """:mod:`solar.codec.kernels_triton` when it can run on ``device`` (CUDA, or the CPU under
    Triton's interpreter), else None (imported on first use: Triton is optional and heavy)."""
    global _TRITON
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if _TRITON is None:
        with _LOCK:
            try:
                from . import kernels_triton  # optional dependency (triton), heavy import: see above
            except ImportError:
                kernels_triton = False
            _TRITON = kernels_triton
    return _TRITON or None


def kernel_available() -> bool:
    """Whether the ``cpu-kernel`` path can run here (numba imports)."""
    return _kernels() is not None


def warm() -> bool:
    """Compile the ``cpu-kernel`` decoder for float32 and float64 blobs now, into numba's on-disk
    cache (``make setup`` calls it), so the first decode of a run does not stall for the cold
    compile (tens of seconds). False when numba is missing (nothing to compile)."""
    if not kernel_available():
        return False
    ramp = np.linspace(0.0, 1.0, 64)
    for dtype in (np.float32, np.float64):
        blob = api.encode(ramp.astype(dtype), rel_error=1e-3)
        api.decode(blob, decoder="cpu-kernel")  # the one-blob fast path (solar.codec.fast)
        api.decode_batch([blob, blob], decoder="cpu-kernel")  # the group driver
    return True


def choose(device: torch.device, version: int, predictor: Predictor, n: int) -> str:
    """The path that decodes a group of ``n``-value blobs of ``version`` and ``predictor`` on ``device``."""
    decoder, _ = current()
    covered = n > 0 and version >= 2 and predictor in (Predictor.INTERP, Predictor.FINE, Predictor.LORENZO)
    if decoder == "reference" or not covered or (decoder == "auto" and fused.enabled()):
        return "reference"
    if decoder == "triton" or (decoder == "auto" and device.type == "cuda"):
        ok = predictor.per_level and triton_kernels(device) is not None
        return "triton" if ok else "reference"
    return "cpu-kernel" if kernel_available() else "reference"


_POOLS: dict[int, ThreadPoolExecutor] = {}
# a forked child (a DataLoader worker) inherits the pools without their threads: work submitted
# there would never run, so the child starts without pools
os.register_at_fork(after_in_child=_POOLS.clear)


def _pool(threads: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(threads)
    if pool is None:
        with _LOCK:
            pool = _POOLS.setdefault(threads, ThreadPoolExecutor(threads, thread_name_prefix="solar-decode"))
    return pool


def decode_cpu(blobs, metas, lay, int8_stream: bool) -> torch.Tensor:
    """Decode a group with the ``cpu-kernel`` path -> ``(B, n)`` CPU tensor.

    ``lay`` is the group's layout (:class:`solar.codec.ebq._Layout`). Blobs are split into one
    contiguous share per thread; each share runs the lossless stage and the kernel (both release
    the GIL) and writes its own rows of the result.
    """
    h0 = blobs[0].header
    B, n = len(blobs), math.prod(lay.shape)
    x = torch.empty((B, n), dtype=TORCH_DTYPES[h0.dtype.itemsize])
    xa = x.numpy()
    threads = min(current().threads, B) if B > 1 else 1
    if threads <= 1:
        _share(blobs, metas, lay, int8_stream, 0, B, xa)
        return x
    cuts = np.linspace(0, B, threads + 1).astype(int)
    jobs = [_pool(threads).submit(_share, blobs, metas, lay, int8_stream, a, b, xa[a:b])
            for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    for j in jobs:
        j.result()
    return x


_I8 = np.empty((0, 1), np.uint8)
_WIDE = np.empty((0, 1, 1), np.uint8)
_I64 = np.empty(0, np.int64)
_U8 = np.empty(0, np.uint8)
_U32 = np.zeros(2, np.uint32)
_WORK_DTYPES = {4: np.dtype(np.int32), 8: np.dtype(np.int64)}
_EMPTY = {np.dtype("<f4"): np.empty(0, "<f4"), np.dtype("<f8"): np.empty(0, "<f8")}
for _e in (_I8, _WIDE, _I64, _U8, _U32, *_EMPTY.values()):
    _e.setflags(write=False)  # every array the kernel reads goes in read-only (see _readonly)


class _Work(threading.local):
    def __init__(self) -> None:
        self.arrays: dict[int, np.ndarray] = {}


_WORK = _Work()
#: A thread keeps scratch integers up to this size for its next decode; larger ones are one-off.
WORK_KEEP = 64 << 20


def work(qint: int, count: int) -> np.ndarray:
    """At least ``count`` scratch integers of ``qint`` bytes for the kernel (its residuals and two
    grids), this thread's from its last decode when large enough. Why kept: freshly allocated
    megabytes come back from the allocator as untouched pages, and the kernel's first write to
    each page faults; measured, that was most of a 128^3 field's decode."""
    a = _WORK.arrays.get(qint)
    if a is None or a.size < count:
        a = np.empty(count, _WORK_DTYPES[qint])
        if a.nbytes <= WORK_KEEP:
            _WORK.arrays[qint] = a
    return a


def _readonly(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view: arrays come read-only from one blob's section and writable from
    a group's, and numba compiles a kernel per combination of flags (tens of seconds each)."""
    v = a.view()
    v.setflags(write=False)
    return v


_KIND = {NIBBLES: 0, 1: 1, BITPACK: 3}  # the kernel's code kinds: 0 nibbles, 1 int8, 2 byte planes, 3 bitpack


@lru_cache(maxsize=256)
def _geometry(inner_shape: tuple[int, ...], reverse: bool) -> tuple[np.ndarray, np.ndarray]:
    """One predictor row's shape padded to :data:`NDIM` axes, and its interpolation passes."""
    dims = np.ones(NDIM, np.int64)
    if inner_shape:
        dims[NDIM - len(inner_shape):] = inner_shape
    dims.setflags(write=False)
    return dims, interp_passes(inner_shape, reverse)


def _codes(g, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per blob its code kind and its row in its kind's array, and the byte planes (or none)."""
    if len(g.planes) == 1:  # one kind, rows in blob order
        w, p = next(iter(g.planes.items()))
        kinds = np.full(len(g.kinds), _KIND.get(w, 2), np.int8)
        wide = p.reshape(p.shape[0], w, n) if w not in _KIND else _WIDE  # (a bitpack group: no planes)
        return kinds, np.arange(len(g.kinds), dtype=np.int64), wide
    kinds = np.array([_KIND.get(w, 2) for w in g.kinds], np.int8)
    slots = np.empty(len(g.kinds), np.int64)
    for rows in g.rows.values():
        slots[rows] = np.arange(len(rows))
    return kinds, slots, _WIDE  # several kinds: nibbles and int8 (byte planes never mix)


def _share(blobs, metas, lay, int8_stream: bool, b0: int, b1: int, out: np.ndarray) -> None:
    """Blobs ``b0 .. b1 - 1`` into ``out`` (their rows of the group's result). Every array but
    ``out`` goes in read-only, as :mod:`solar.codec.fast`'s do: one compiled kernel serves both."""
    bl, ms = blobs[b0:b1], metas[b0:b1]
    m0, n = ms[0], out.shape[1]
    g = gather(bl, ms, n, None, int8_stream)
    kinds, slots, wide = _codes(g, n)
    bp = g.planes.get(BITPACK)
    bpw, bp_at = (bp.buf.view(np.uint32), bp.starts // 4) if bp is not None else (_U32, _I64)
    dims, plan = _geometry(tuple(lay.inner_shape), lay.reverse)
    esc_pos, esc_val = (g.esc_idx[0], g.esc_val[0].astype(np.int64)) if g.esc_idx else (_I64, _I64)
    out_pos, out_val = (g.out_idx[0], g.out_val[0]) if g.out_idx else (_I64, _EMPTY[out.dtype])
    ro = _readonly
    _KERNELS.decode_rows(0, b1 - b0, n, lay.lead, dims, m0.predictor == Predictor.LORENZO, plan,
                         ro(lay.masks[b0 * lay.lead:b1 * lay.lead]), lay.K, work(m0.qint, n + 2 * (n // lay.lead)),
                         ro(kinds), ro(slots),
                         ro(g.planes.get(NIBBLES, _I8)), ro(g.planes.get(1, _I8)), ro(wide), ro(bpw), ro(bp_at),
                         ro(_I64 if g.marks is None else g.marks), ro(_U8 if g.side is None else g.side), ro(esc_pos),
                         ro(esc_val), int8_stream and m0.predictor.per_level, ro(out_pos), ro(out_val),
                         ro(g.steps), ro(g.offs), bool(g.offs.any()), out)
