"""The interpolation decoder as one fusible graph, compiled by ``torch.compile`` when asked.

Why a second formulation: the eager decoder (:func:`solar.codec.predict.interp_decode`) issues
a handful of tensor ops per (level, axis) pass, and each op is one memory pass; on a CPU that
is the floor of the eager design. Here every pass is written *pointwise over its output*: the
odd points' prediction (cubic and linear for every row, chosen with ``where`` on a per-row flag
and on the border columns), the ``+ K * residual`` and the interleave with the even points are
one expression, so inductor emits one vectorized loop per pass (C++ on the CPU, Triton on
CUDA). Nibble unpacking (or joining wider codes' byte planes), the sparse residual corrections
(side values, escapes), widening and the ``G * u`` dequantization are in the graph too; the
lossless stage and per-blob work stay eager. Compiled and eager decode speeds side by side:
bench/codec/results.json.

The integers are the eager decoder's, bit for bit: the same plan, the same border rules and the
same arithmetic-shift rounding; ``tests/test_codec_fused.py`` compares both on random and
golden blobs. The multiply by ``u`` is the only float op in the graph, so no FMA contraction can
change a rounding; a nonzero offset is added outside it, as a separate op.

Compiling costs seconds per new (sample shape, code kind, dtype) signature (tens of seconds
with a cold inductor cache). A mini-batch runs whole through a graph specialized on its batch
size (faster kernels) when that is the first batch size the signature saw (a training loop's);
other sizes (the epoch's last batch) run through one graph with a dynamic batch size, and very
large batches in fixed-size chunks (a graph of the chunk's size). So a signature compiles up to
four variants (its batch size, any other size, a single blob, the chunk size). The compiled
code is cached on disk by inductor and in memory here. So
it pays off where one signature repeats, as in a training loop, and is **off by default**:
``decode(..., compile=True)``, ``decode_batch(..., compile=True)``, ``H5Dataset(decode_compile=
True)`` or ``SOLAR_CODEC_COMPILE=1`` turn it on. When compiling fails (no C++ compiler, no
Triton), the decoder warns once and stays eager.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
import threading
import types
import warnings
from typing import TYPE_CHECKING

from . import predict as pr
from .decoders import getenv

if TYPE_CHECKING:
    import torch

__all__ = ["interp_graph", "enabled", "use", "run"]

_MODE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("solar_codec_compile", default=None)


def enabled() -> bool:
    """Whether this decode should use the compiled graph (per-call flag, else ``SOLAR_CODEC_COMPILE``)."""
    mode = _MODE.get()
    if mode is None:
        raw = getenv("SOLAR_CODEC_COMPILE")
        on = _ON.get(raw)
        if on is None:
            on = _ON[raw] = (raw or "0").strip().lower() in ("1", "true", "yes", "on")
        return on
    return mode


_ON: dict[str | None, bool] = {}  # SOLAR_CODEC_COMPILE's raw values, parsed (a decode asks per call)


@contextlib.contextmanager
def use(mode: bool | None):
    """Within the block, decode with (True) or without (False) the compiled graph; None: the env."""
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def interp_graph(codes: torch.Tensor, pos: torch.Tensor, corr: torch.Tensor, cubic_rows: torch.Tensor,
                 step: torch.Tensor, n: int, lead: int, shape: tuple[int, ...], K: int, reverse: bool,
                 itype: torch.dtype, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Residual codes of ``B`` blobs -> dequantized ``(B * lead, n // lead)`` values, ``G * step``.

    ``codes`` by code ``width``: 1, ``(B, n)`` int8 residuals; 0, the ``(B, (n + 1) // 2)`` bytes
    of 4-bit pairs (low nibble first), unpacked here; 2 and up, ``(B, width, n)`` little-endian
    byte planes of zigzag codes, joined and unzigzagged here with the eager decoder's ops
    (:func:`~solar.codec.torch_ops.join_planes`, :func:`~solar.codec.torch_ops.unzigzag_`).
    ``pos``/``corr``: sparse corrections added to
    the widened residuals at flat positions of ``(B, n)`` (nibble side values, escapes; an escape
    added to a residual is the same as ``K * escape`` added after its pass); at least two
    entries, zeros allowed, so one graph serves every count. ``lead`` folded channel rows per
    blob. ``cubic_rows``: ``(B * lead, levels)`` bool, cubic interpolation per row and level.
    ``step``: ``(B * lead, 1)`` of ``dtype``. Shape-like arguments are Python constants: the
    graph is specialized on them (except the batch size, which the caller marks dynamic).
    """
    import torch  # decode only: solar.codec imports this module and stays numpy-only
    import torch.nn.functional as F

    B0 = codes.shape[0]
    if width == 0:
        v = codes.to(itype)
        R = torch.stack([(v << 28) >> 28 if itype == torch.int32 else (v << 60) >> 60, v >> 4], dim=2)
        R = R.reshape(B0, -1)[:, :n]
    elif width == 1:
        R = codes.to(itype)
    else:
        u = codes[:, 0].to(itype)
        for k in range(1, width):
            u = u | (codes[:, k].to(itype) << (8 * k))
        R = (u >> 1) ^ -(u & 1)
    R = R.reshape(-1).index_add(0, pos, corr.to(itype))
    B = B0 * lead
    R = R.view(B, n // lead)
    C = (R[:, :1] * K).reshape((B,) + (1,) * len(shape))
    pos = 1
    for st in _plan(tuple(shape), reverse):
        n_o, n_e, m, ax = st.m // 2, (st.m + 1) // 2, st.m, st.axis
        outer = math.prod(C.shape[1:ax])
        inner = math.prod(C.shape[ax + 1:])
        cnt = outer * n_o * inner
        O = R[:, pos:pos + cnt].reshape(B, outer, n_o, inner)
        pos += cnt
        E = C.reshape(B, outer, n_e, inner)
        Ep = F.pad(E, (0, 0, 1, 2))  # E[k-1], E[k], E[k+1], E[k+2] as shifted views, zero outside
        a, b, c, d = (Ep[:, :, i:i + n_o] for i in range(4))
        P = (b + c) >> 1
        j = torch.arange(n_o, device=codes.device).view(1, 1, n_o, 1)
        if n_e >= 4:
            cub = (9 * (b + c) - (a + d) + 8) >> 4
            use_cub = cubic_rows[:, st.level].view(B, 1, 1, 1) & (j != 0) & (j != n_e - 2)
            P = torch.where(use_cub, cub, P)
        if m % 2 == 0:  # the last odd point has no right neighbour: copy
            P = torch.where(j == n_e - 1, b, P)
        odd = P + K * O
        if inner == 1 and m % 2 == 0 and itype == torch.int32 and _LITTLE:
            # innermost axis: each (even, odd) pair is one int64 whose int32 halves are the two
            # values, so the interleave is a contiguous vector store, not a stride-2 scalar one
            # (10-15% off the whole graph). Built by exact arithmetic (no overflow, no shift of
            # a negative value): odd * 2**32 + (even mod 2**32).
            pair = odd.to(torch.int64) * (1 << 32) + (b.to(torch.int64) & 0xFFFFFFFF)
            out = pair.reshape(B, outer, n_o).view(torch.int32).reshape(B, outer, m, 1)
        else:
            out = torch.stack([b, odd], dim=3).reshape(B, outer, 2 * n_o, inner)
            if m % 2:
                out = torch.cat([out, E[:, :, n_e - 1:]], dim=2)
        C = out.reshape(C.shape[:ax] + (m,) + C.shape[ax + 1:])
    return C.reshape(B, n // lead).to(dtype) * step


def _plan(shape: tuple[int, ...], reverse: bool):
    return pr.interp_plan.__wrapped__(shape, reverse)  # uncached: nothing for dynamo to warn about


_LITTLE = sys.byteorder == "little"  # the int64 pair trick below relies on the halves' order
_lock = threading.Lock()
_VARIANTS = 256
_compiled: dict[bool, object] = {}
_failed: str | None = None

#: Batches of up to this many values run whole; larger ones in chunks of about this many
#: (8 MiB per int32 intermediate grid). A mini-batch (64-256 PtychoNN samples, 0.26-2.1 M
#: values) runs as one call, faster than smaller chunks, whose outputs must be joined and each
#: chunk's corrections selected.
CHUNK_VALUES = 1 << 21
#: The batch size that gets the static graph, per signature: the first one seen (in a training
#: loop, the batch size; the epoch's last, smaller batch then takes the dynamic graph instead of
#: compiling a static variant of its own).
_static_batch: dict[tuple, int] = {}


def _get(static: bool):
    """The compiled graph: ``static`` specializes on the batch size, else the size is dynamic.

    Why two: inductor's CPU kernels for a fixed batch size are faster than the same kernels
    with a symbolic one, and so are the loader's compiled epochs with fixed-size chunks
    (bench/loader). A mini-batch of the signature's batch size therefore runs through the static
    graph (one more compiled variant per signature), other sizes through the dynamic one (see
    :func:`run`). They are separate functions because dynamo would otherwise serve a fixed-size
    call from a cached dynamic variant.
    Dynamo's config is per thread and decoding runs in loader prefetch threads too, so the
    recompile limit is raised in the calling thread (the default of 8 variants per function
    would fail the ninth decode signature).
    """
    import torch._dynamo.config as dcfg  # torch.compile machinery: only a compiled decode loads it

    if dcfg.recompile_limit < _VARIANTS:
        dcfg.recompile_limit = _VARIANTS
    fn = _compiled.get(static)
    if fn is None:
        import torch  # decode only: solar.codec imports this module and stays numpy-only

        with _lock:
            fn = _compiled.get(static)
            if fn is None:
                g = interp_graph
                if static:  # its own code object: its own dynamo cache
                    g = types.FunctionType(g.__code__.replace(), g.__globals__, "interp_graph_static",
                                           g.__defaults__, g.__closure__)
                fn = _compiled[static] = torch.compile(g, dynamic=False, fullgraph=True)
    return fn


def chunk_rows(n: int) -> int:
    """Blobs per fixed-size chunk for blobs of ``n`` values (at least 2)."""
    return max(2, CHUNK_VALUES // max(n, 1))


def run(codes, pos, corr, cubic_rows, step, n, lead, shape, K, reverse, itype, dtype, width):
    """The compiled graph (arguments of :func:`interp_graph`), or None when compiling is
    impossible here (warned once).

    ``B <= C = chunk_rows(n)`` blobs run in one call: through the static graph when ``B`` is
    the signature's batch size (:data:`_static_batch`) or 1, else through the dynamic one. More
    run as ``B // C`` fixed-size chunks of ``C`` blobs through the static graph and the rest
    through the dynamic one (a single blob through the static one); each chunk gets the
    corrections that fall in its rows."""
    global _failed
    if _failed is not None:
        return None
    try:
        import torch  # torch.compile machinery: only a compiled decode loads it
        from torch._dynamo import mark_dynamic

        B = codes.shape[0]
        C = chunk_rows(n)
        args = (n, lead, tuple(shape), K, reverse, itype, dtype, width)

        def call(static: bool, r0: int, r1: int):
            if (r0, r1) == (0, B):
                p, c = pos, corr
            else:
                sel = (pos >= r0 * n) & (pos < r1 * n)
                p, c = torch.cat([pos[:2] * 0, pos[sel] - r0 * n]), torch.cat([corr[:2] * 0, corr[sel]])
            parts = (codes[r0:r1], p, c, cubic_rows[r0 * lead:r1 * lead], step[r0 * lead:r1 * lead])
            for i, t in enumerate(parts):
                if i in (1, 2) or (not static and r1 - r0 > 1):
                    mark_dynamic(t, 0)  # the correction count; the dynamic graph's batch size
            return _get(static)(*parts, *args)

        if B <= C:
            sb = _static_batch.setdefault(args, B)
            return call(B in (sb, 1), 0, B)
        full = B // C * C
        outs = [call(True, r0, r0 + C) for r0 in range(0, full, C)]
        if full < B:
            outs.append(call(B - full == 1, full, B))  # a single blob: a fixed size of its own
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    except Exception as e:  # noqa: BLE001 - any compiler failure means "stay eager"
        if os.environ.get("SOLAR_STRICT") == "1":  # under `make test` a failure is a failure
            raise
        _failed = f"{type(e).__name__}: {e}"
        warnings.warn(f"solar.codec: compiled decoding is unavailable here ({_failed.splitlines()[0]}); "
                      "decoding eagerly. Install a C++ compiler (CPU) or Triton (CUDA), or unset "
                      "SOLAR_CODEC_COMPILE.", RuntimeWarning, stacklevel=3)
        return None
