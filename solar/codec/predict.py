"""Integer predictors shared by the numpy encoder and the torch decoder.

The codec quantizes first (``q = round((x - offset) / step)``) and predicts afterwards, on exact
integers ("dual quantization", cuSZ). Because the encoder predicts from the *same* integers the
decoder will have reconstructed, the encoder computes every residual at once, and the decoder
needs no per-element loop: only a loop over a handful of levels and axes.

Two predictor families:

* **Multi-level interpolation** (SZ3 / cuSZ-i style, ``"cubic"`` or ``"linear"``): level by
  level, coarse to fine, and axis by axis within a level, the points at odd multiples of the
  stride ``s`` along one axis are predicted from their already-known neighbours at even
  multiples (cubic ``(-a + 9b + 9c - d) / 16`` in the interior, linear near the borders, copy at
  the far edge). Integer rounding is by arithmetic shift, which numpy and torch (CPU and CUDA)
  define identically for signed integers.
* **Lorenzo** (``"lorenzo"``): the first-order N-D Lorenzo predictor, whose inverse is one
  inclusive prefix sum per axis.

Residuals are stored in the array's natural (C) order; the decoder rebuilds ``q`` in place.
Arrays carry a leading batch axis here (size 1 in the encoder), so one sequence of tensor ops
decodes a whole mini-batch of same-shaped samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

import numpy as np

__all__ = ["Predictor", "PREDICTORS", "Step", "interp_plan", "predict_odd", "interp_stream", "interp_decode",
           "natural_to_stream", "lorenzo_residuals", "lorenzo_reconstruct", "scan_layout"]


class Predictor(IntEnum):
    """The predictor id in an ebq blob's metadata. Never renumber: ids are part of the on-disk format."""

    RAW = 0  # no prediction: the values themselves through the lossless stage
    LINEAR = 1  # ebq/1 only: linear interpolation on every level
    CUBIC = 2  # ebq/1 only: cubic interpolation on every level
    LORENZO = 3  # prefix-sum predictor on pre-quantized integers
    INTERP = 4  # ebq/2+: linear or cubic per level, chosen by the metadata's ``cubic_levels``
    FINE = 5  # ebq/5+: interpolation from reconstructed values, K = 2**kshift units per bin

    @property
    def per_level(self) -> bool:
        """Whether the interpolation kind is chosen per level (``cubic_levels``), not per blob."""
        return self in (Predictor.INTERP, Predictor.FINE)


#: id in the blob -> name (the ``predictor=`` option's spelling).
PREDICTORS = {int(p): p.name.lower() for p in Predictor}
PREDICTOR_IDS = {v: k for k, v in PREDICTORS.items()}


@dataclass(frozen=True)
class Step:
    """One (level, axis) pass of the interpolation predictor.

    ``sel`` selects the grid refined by this pass from the batched array (stride ``s`` on the
    axes up to ``axis``, ``2s`` after it); along ``axis`` its even points are known and its
    ``m // 2`` odd points are predicted. ``level`` is log2(s).
    """

    sel: tuple[slice, ...]
    axis: int
    level: int
    m: int


@lru_cache(maxsize=256)
def interp_plan(shape: tuple[int, ...], reverse: bool = False) -> tuple[Step, ...]:
    """The ordered passes that refine the anchor ``q[0, ..., 0]`` into the full grid.

    ``reverse`` (format ``ebq/6``): within a level, refine the innermost axis first. Its passes
    are the only ones with strided, latency-bound interleaves; done first they touch a grid that
    is still coarse along the other axes (a quarter of the points in 3-D instead of all of them),
    and the last, largest pass of each level becomes the outermost axis, whose interleave is a
    copy of long contiguous blocks.
    """
    if not shape or min(shape) == 0:
        return ()
    level = 0
    while (1 << level) < max(shape):
        level += 1
    steps: list[Step] = []
    axes = list(range(len(shape)))[::-1] if reverse else list(range(len(shape)))
    for lv in range(level - 1, -1, -1):
        s = 1 << lv
        for j, a in enumerate(axes):
            done = set(axes[:j + 1])
            sel = (slice(None),) + tuple(slice(0, None, s if b in done else 2 * s) for b in range(len(shape)))
            m = len(range(0, shape[a], s))
            if m // 2:
                steps.append(Step(sel, a + 1, lv, m))
    return tuple(steps)


def _3d(t, axis: int):
    """View a contiguous array as (outer, n, inner) around ``axis``."""
    outer = math.prod(t.shape[:axis])
    return t.reshape(outer, t.shape[axis], -1)


def predict_odd(E, axis: int, m: int, cubic: bool, positive: bool = False):
    """Integer predictions of the ``m // 2`` odd points from the ``(m + 1) // 2`` even points ``E``.

    ``E`` is contiguous (numpy or torch). Returns ``(P, sign)``: an ``(outer, n_e, inner)`` array
    whose first ``m // 2`` columns hold ``sign * prediction``. The bulk is computed with *flat*
    shifted slices (long contiguous vector ops even when ``axis`` is the last one); the few border
    columns where a flat shift would read the next row are then overwritten with the border
    formulas.

    * interior (cubic levels, ``n_e >= 4``): ``(-E[k-1] + 9 E[k] + 9 E[k+1] - E[k+2] + 8) >> 4``,
      computed as ``-(((E[k-1] + E[k+2]) - 9 (E[k] + E[k+1]) + 7) >> 4)`` (sign -1): the same
      integer (floor identities), in 5 vector passes instead of 7
    * ``k = 0`` and ``k = n_e - 2`` on cubic levels, every ``k`` on linear ones: ``(E[k] + E[k+1]) >> 1``
    * ``k = n_e - 1`` (only when ``m`` is even): ``E[k]``

    ``positive=True`` computes the cubic bulk directly (6 passes, sign +1), for callers that
    cannot absorb the sign in their final op.
    """
    n_e = (m + 1) // 2
    E3 = _3d(E, axis)
    inner = E3.shape[2]
    Ef = E3.reshape(-1)
    L = Ef.shape[0]
    is_np = isinstance(Ef, np.ndarray)
    if is_np:
        P = np.empty_like(Ef)
        add = np.add
    else:
        import torch  # a tensor argument: torch is loaded; numpy-only encoding never gets here

        from .torch_ops import scratch  # imports torch, as above

        P = scratch.get("pred", L, Ef.dtype, Ef.device)
        add = torch.add
    P3 = P.reshape(E3.shape)
    if cubic and n_e >= 4 and positive:
        sign = 1
        lo, hi = inner, L - 2 * inner
        t = P[lo:hi]
        add(Ef[lo:hi], Ef[lo + inner:hi + inner], out=t)
        t *= 9
        t -= Ef[lo - inner:hi - inner]
        t -= Ef[lo + 2 * inner:hi + 2 * inner]
        t += 8
        t >>= 4
        cols = (0, n_e - 2)
    elif cubic and n_e >= 4:
        sign = -1
        lo, hi = inner, L - 2 * inner
        t = P[lo:hi]
        add(Ef[lo - inner:hi - inner], Ef[lo + 2 * inner:hi + 2 * inner], out=t)
        if is_np:
            t -= 9 * (Ef[lo:hi] + Ef[lo + inner:hi + inner])
        else:
            T = scratch.get("pred2", hi - lo, Ef.dtype, Ef.device)
            torch.add(Ef[lo:hi], Ef[lo + inner:hi + inner], out=T)
            t.sub_(T, alpha=9)
        t += 7
        t >>= 4
        cols = (0, n_e - 2)
    else:
        sign = 1
        t = P[:L - inner]
        add(Ef[:L - inner], Ef[inner:], out=t)
        t >>= 1
        cols = ()
    if cols:  # columns 0 and n_e - 2 as one strided view: two ops instead of a loop of four
        d = n_e - 2
        c = P3[:, 0:n_e - 1:d]
        add(E3[:, 0:n_e - 1:d], E3[:, 1:n_e:d], out=c)
        c >>= 1
        if sign < 0:
            c *= -1
    if m % 2 == 0:
        c = P3[:, n_e - 1]
        c[...] = E3[:, n_e - 1]
        if sign < 0:
            c *= -1
    return P3, sign


def interp_stream(q, cubic_levels: int, reverse: bool = False):
    """Encoder: the residual stream of batched ``q`` (anchor, then each pass's odd block in C order).

    ``cubic_levels`` is a bit mask: bit ``l`` set = cubic interpolation on level ``l``.
    """
    B = q.shape[0]
    parts = [q.reshape(B, -1)[:, :1]]
    for st in interp_plan(tuple(q.shape[1:]), reverse):
        V = q[st.sel]
        E = np.ascontiguousarray(_take(V, st.axis, 0, (st.m + 1) // 2, 2, 0))
        O = _3d(np.ascontiguousarray(_take(V, st.axis, 0, st.m // 2, 2, 1)), st.axis)
        P, sign = predict_odd(E, st.axis, st.m, bool(cubic_levels >> st.level & 1))
        parts.append((O - sign * P[:, :st.m // 2]).reshape(B, -1))
    return np.concatenate(parts, axis=1)


def interp_fine_stream(xu: np.ndarray, K: int, gmax: int, cubic_levels: int | None = None,
                       reverse: bool = False):
    """Encoder of the ``fine`` predictor: SZ-style prediction from *reconstructed* values.

    ``xu`` (batched, float64) is the data in units of ``u = step / K``. Every pass predicts its odd
    points from the reconstructed grid ``G`` (integers in units of ``u``), quantizes the
    prediction error to ``r = round((xu - pred) / K)`` and reconstructs ``G = pred + K r``, so
    ``|xu - G| <= K / 2`` (half a bin). Unlike pre-quantization, a smooth field whose prediction
    error is below the bound costs zero residuals instead of the white noise of rounding every
    value to a bin. The decoder repeats the integer passes exactly (:func:`interp_decode` with
    ``K``). ``cubic_levels=None`` chooses cubic or linear per level by residual cost.

    Returns ``(stream (B, n) int64, G, cubic_levels)``.
    """
    B = xu.shape[0]
    shape = tuple(xu.shape[1:])
    G = np.zeros(xu.shape, np.int64)
    anchor = (slice(None),) + (0,) * len(shape)
    r0 = _round_residual(xu[anchor], 0, K, gmax)
    G[anchor] = r0 * K
    parts = [r0.reshape(B, 1)]
    plan = interp_plan(shape, reverse)
    mask = 0
    for level in sorted({st.level for st in plan}, reverse=True):
        steps = [st for st in plan if st.level == level]
        if cubic_levels is None:  # decided on the level's first pass (its points depend on no other)
            cost = {c: _fine_level(xu, G, K, gmax, steps[:1], c)[1] for c in (False, True)}
            cubic = cost[True] < cost[False]
        else:
            cubic = bool(cubic_levels >> level & 1)
        level_parts, _ = _fine_level(xu, G, K, gmax, steps, cubic)
        parts += level_parts
        mask |= int(cubic) << level
    return np.concatenate(parts, axis=1), G, mask


def _round_residual(xo: np.ndarray, pred, K: int, gmax: int) -> np.ndarray:
    """``round((xo - pred) / K)``, keeping ``pred + K r`` inside ``[-gmax, gmax]``.

    Finite ``xo`` (the caller guarantees ``|xo| < gmax - K``) already satisfy that; NaN/Inf get
    ``r = 0`` (their exact value is stored as an outlier) and the clip, so repeated predictions
    over a run of non-finite values cannot grow without bound.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.rint((xo - pred) / K)
    fin = np.isfinite(r)
    if fin.all():
        return r.astype(np.int64)
    r[~fin] = 0.0
    lim_lo, lim_hi = np.floor((-gmax - pred) / K), np.floor((gmax - pred) / K)
    return np.clip(r, lim_lo, lim_hi).astype(np.int64)


def _fine_level(xu, G, K, gmax, steps, cubic):
    """Run one level's passes in place on ``G``; returns (residual blocks, log-magnitude cost)."""
    B = xu.shape[0]
    parts, cost = [], 0.0
    for st in steps:
        n_o = st.m // 2
        V = G[st.sel]
        E = np.ascontiguousarray(_take(V, st.axis, 0, (st.m + 1) // 2, 2, 0))
        P, _ = predict_odd(E, st.axis, st.m, cubic, positive=True)
        pred = P[:, :n_o]
        xo = _3d(np.ascontiguousarray(_take(xu[st.sel], st.axis, 0, n_o, 2, 1)), st.axis)
        r = _round_residual(xo, pred, K, gmax)
        odd = _take(V, st.axis, 0, n_o, 2, 1)
        odd[...] = (pred + K * r).reshape(odd.shape)
        parts.append(r.reshape(B, -1))
        cost += float(np.log2(1.0 + 2.0 * np.abs(r)).sum())
    return parts, cost


def _escape_targets(esc: np.ndarray, n: int, shape: tuple[int, ...], reverse: bool = False):
    """Host side: map escape positions of a ``(B, n)`` stream to (pass id, flat index in that pass's grid).

    Pass id -1 is the anchor. Escapes are rare, so this small numpy computation replaces a full
    widening pass over the stream.
    """
    b, j = np.divmod(esc, n)
    plan = interp_plan(tuple(shape), reverse)
    starts, geo = [1], []
    sizes = [1] * len(shape)  # grid extent per axis so far
    for st in plan:
        a = st.axis - 1
        outer_b, inner = math.prod(sizes[:a]), math.prod(sizes[a + 1:])
        geo.append((outer_b, st.m // 2, inner, st.m))
        starts.append(starts[-1] + outer_b * (st.m // 2) * inner)
        sizes[a] = st.m
    sid = np.searchsorted(np.asarray(starts), j, side="right") - 1
    flat = b.copy()  # the anchor: grid of one value per batch row
    for s in np.unique(sid[sid >= 0]):
        sel = sid == s
        outer_b, n_o, inner, m = geo[s]
        o, rest = np.divmod(j[sel] - starts[s], n_o * inner)
        k, i = np.divmod(rest, inner)
        flat[sel] = ((b[sel] * outer_b + o) * m + 2 * k + 1) * inner + i
    return sid, flat


def interp_decode(R, shape: tuple[int, ...], cubic_levels, itype=None, escapes=None, K: int = 1,
                  reverse: bool = False):
    """Decoder: residual stream ``R`` (``(B, n)`` integer tensor) -> ``q`` of ``(B, *shape)``.

    Polyphase: the grid refined so far is kept contiguous; each pass predicts its odd points
    with contiguous vector ops and writes ``residual +- prediction`` straight into the odd slots
    of the next grid, next to a strided copy of the even ones. ``R`` may be int8 (1-byte codes):
    the add widens it on the fly to ``itype``. ``escapes`` = (positions in the flattened stream,
    int64 corrections) for codes that did not fit; each is added right after its pass.
    ``K > 1`` decodes the ``fine`` predictor: ``odd = prediction + K * residual``.
    ``cubic_levels`` is one mask, or a numpy array of one mask per batch row (blobs whose
    encoders chose differently still decode together). Rows sorted by :func:`mask_order` make
    each pass's choices a few contiguous row slices, each predicted with its own kind; only a
    pass with more than ``_MAX_RUNS`` slices computes both predictions and selects per row.
    """
    import torch  # decode only: solar.codec imports this module and stays numpy-only

    from .torch_ops import scratch  # imports torch, as above

    itype = itype or R.dtype
    B, n = R.shape
    dev = R.device
    fix: dict[int, tuple] = {}
    if escapes is not None and len(escapes[0]):
        sid, flat = _escape_targets(escapes[0], n, shape, reverse)
        for s in np.unique(sid):
            sel = sid == s
            fix[int(s)] = (torch.from_numpy(flat[sel]).to(dev),
                           torch.from_numpy(escapes[1][sel] * K).to(dev, itype))
    C = R[:, :1].to(itype).reshape((B,) + (1,) * len(shape))
    if K != 1:
        C *= K
    if -1 in fix:
        C.view(-1).index_add_(0, *fix[-1])
    masks = np.atleast_1d(np.asarray(cubic_levels, dtype=np.uint64))
    uniform = int(masks[0]) if bool((masks == masks[0]).all()) else None
    pos = 1
    for i, st in enumerate(interp_plan(tuple(shape), reverse)):
        n_o, n_e = st.m // 2, (st.m + 1) // 2
        outer = C.numel() // (n_e * math.prod(C.shape[st.axis + 1:]))
        inner = C.numel() // (outer * n_e)
        cnt = outer * n_o * inner // B
        O = R[:, pos:pos + cnt].reshape(outer, n_o, inner)
        pos += cnt
        out = scratch.get("grid%d" % (i % 2), outer * st.m * inner, itype, dev).view(outer, st.m, inner)
        out[:, 0::2] = C.reshape(outer, n_e, inner)
        runs = [(0, B, bool(uniform >> st.level & 1))] if uniform is not None else _runs(masks, st.level)
        if len(runs) <= _MAX_RUNS:
            rb = outer // B  # grid rows per batch row
            for r0, r1, cubic in runs:  # batch rows sorted by mask: a run is a contiguous slice
                P, sign = predict_odd(C[r0:r1], st.axis, st.m, cubic, positive=K != 1)
                dst, res = out[r0 * rb:r1 * rb, 1::2], O[r0 * rb:r1 * rb]
                if K != 1:
                    torch.add(P[:, :n_o], res, alpha=K, out=dst)
                else:
                    (torch.add if sign > 0 else torch.sub)(res, P[:, :n_o], out=dst)
        else:  # many interleaved choices: both predictions, chosen per row
            bits = (masks >> np.uint64(st.level)) & np.uint64(1)
            Pc = predict_odd(C, st.axis, st.m, True, positive=True)[0].clone()
            Pl, _ = predict_odd(C, st.axis, st.m, False, positive=True)
            rows = torch.from_numpy(bits.astype(bool)).to(dev).view(B, 1)
            P = torch.where(rows, Pc.view(B, -1), Pl.view(B, -1)).view(Pl.shape)
            torch.add(P[:, :n_o], O, alpha=K, out=out[:, 1::2])
        if i in fix:
            out.view(-1).index_add_(0, *fix[i])
        C = out.reshape(C.shape[:st.axis] + (st.m,) + C.shape[st.axis + 1:])
    return C


#: Above this many runs of equal cubic/linear choice among a pass's batch rows, the pass
#: computes both predictions for every row and selects (fewer ops than many small slices).
_MAX_RUNS = 4


def _runs(masks: np.ndarray, level: int) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(first row, end row, cubic)`` of equal level-``level`` bits among batch rows."""
    bits = ((masks >> np.uint64(level)) & np.uint64(1)).astype(bool)
    cuts = np.flatnonzero(bits[1:] != bits[:-1]) + 1
    edges = [0, *cuts.tolist(), bits.size]
    return [(a, b, bool(bits[a])) for a, b in zip(edges[:-1], edges[1:])]


def mask_order(masks) -> np.ndarray:
    """Batch order that makes equal per-level choices contiguous, finest (largest) level first.

    Sorting rows by their cubic/linear bits, lowest level as the primary key, turns a mixed
    mini-batch's level-0 passes (three quarters of the work) into at most two row slices, each
    decoded with one kind of prediction instead of computing both everywhere and selecting.
    """
    m = np.asarray(masks, dtype=np.uint64)
    rev = np.zeros(m.shape, np.uint64)
    for lv in range(int(m.max(initial=0)).bit_length()):  # bit-reversed key: level 0 most significant
        rev |= ((m >> np.uint64(lv)) & np.uint64(1)) << np.uint64(63 - lv)
    return np.argsort(rev, kind="stable")


def natural_to_stream(r, shape: tuple[int, ...]):
    """Reorder residuals stored in natural (C) order (format version 1) into stream order."""
    import torch  # decode only: solar.codec imports this module and stays numpy-only

    B = r.shape[0]
    r = r.reshape((B,) + tuple(shape))
    parts = [r.reshape(B, -1)[:, :1]]
    for st in interp_plan(tuple(shape)):
        parts.append(_take(r[st.sel], st.axis, 0, st.m // 2, 2, 1).reshape(B, -1))
    return torch.cat(parts, dim=1)


def _take(arr, axis: int, lo: int, hi: int, step: int = 1, start: int = 0):
    idx = [slice(None)] * arr.ndim
    idx[axis] = slice(start + step * lo, start + step * hi, step) if hi > lo else slice(0, 0)
    return arr[tuple(idx)]


def lorenzo_residuals(q):
    """Encoder: first-order N-D Lorenzo residuals (backward difference along every axis)."""
    r = q
    for ax in range(1, q.ndim):
        r = np.diff(r, axis=ax, prepend=np.zeros_like(_take(r, ax, 0, 1)))
    return r


def scan_layout(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Padded extents for ``shape`` (batch axis excluded) whose outer-axis strides do not alias.

    Why: a prefix sum along an outer axis walks each column with the axis's stride. When that
    stride is a multiple of 256 bytes (any power-of-two row: 64, 128, 256 ... values), the walk
    keeps hitting the same few cache sets and evicts its own lines (torch's CPU ``cumsum`` along
    dim 1 of a (B, 128, 128) int32 tensor is several times slower than with rows padded to
    144). Padding each inner extent until the next stride is not a multiple of 256 bytes
    costs at most 64 bytes per row (and one extra row per plane), and keeps the walk spread over
    all sets. Extents that already avoid the alias are kept.
    """
    out = list(shape)
    inner = itemsize  # bytes per step along axis k
    for k in range(len(out) - 1, 0, -1):
        grow = max(1, 64 // inner)
        while (out[k] * inner) % 256 == 0:
            out[k] += grow
        inner *= out[k]
    return tuple(out)


def lorenzo_reconstruct(r, pad: bool | None = None):
    """Decoder: inclusive prefix sum along every axis, in the residuals' integer dtype.

    ``r`` is ``(B, *shape)``. The first sum (innermost axis, contiguous) is written into a reused
    buffer laid out by :func:`scan_layout`; the outer-axis sums then run in place on that buffer.
    The result is a strided view of the buffer (valid until the calling thread decodes again);
    the dequantizer reads it once into the returned tensor. ``pad`` None pads on CPU only (cache
    sets are a CPU concern; a GPU scan gains nothing from it).
    """
    import torch  # decode only: solar.codec imports this module and stays numpy-only

    from .torch_ops import scratch  # imports torch, as above

    axes = [ax for ax in range(1, r.ndim) if r.shape[ax] > 1]  # a length-1 prefix sum is the identity
    if not axes:
        return r
    if pad is None:
        pad = r.device.type == "cpu"
    shape = tuple(r.shape[1:])
    ext = scan_layout(shape, r.element_size()) if pad else shape
    B = r.shape[0]
    y = scratch.get("lorenzo", B * math.prod(ext), r.dtype, r.device).view((B,) + ext)
    y = y[(slice(None),) + tuple(slice(0, s) for s in shape)]
    torch.cumsum(r, dim=axes[-1], dtype=r.dtype, out=y)
    for ax in axes[:-1]:
        y.cumsum_(dim=ax)
    return y
