"""``ebq``: error-bounded prediction on integers + compact residual codes + a CPU lossless stage.

Pipeline (encoder, numpy, CPU)::

    x --predict level by level (interpolation from reconstructed values, "fine"; or Lorenzo on
        pre-quantized integers), quantize the prediction error--> integer residuals r
      --exact bound check with the decoder's arithmetic--> exact outliers
      --4-bit pairs / int8 / zigzag byte planes (rare large residuals escape)--> codes
      --> zstd / lz4 / none

Decoder: lossless stage on the CPU per blob, then one sequence of torch ops per batch: unpack
codes, inverse prediction (level-by-level interpolation, or one prefix sum per axis) with escape
corrections, ``G * u (+ offset)``, patch exact outliers.

Payload: ``codes | escapes | outliers``, each section compressed on its own. ``escapes`` holds
int64 position deltas then int64 residuals; ``outliers`` int64 position deltas then the verbatim
values. The private header metadata is :class:`~solar.codec.ebq_meta.EbqMeta` (every format
version's layout read into one named tuple).

Format versions (all still decode; golden fixtures in ``tests/fixtures/codec``):

* ``ebq/1``: residuals in natural (C) order, zigzag codes in 1/2/4/8-byte planes, one
  interpolation kind (linear or cubic) for every level.
* ``ebq/2``: interpolation residuals in *stream order* (anchor, then level by level and axis by
  axis, each pass's block contiguous: homogeneous statistics for the entropy stage and contiguous
  reads for the decoder), linear or cubic chosen per level, and 1-byte codes stored as int8 two's
  complement (escape -128) so the decoder widens them with a single conversion.
* ``ebq/3``: adds nibble mode (code width 0) for low-entropy residuals: 4-bit pairs, with an
  int8 side stream for the values that do not fit (see :func:`_nibbles`).
* ``ebq/4``: small leading (channel) axes are folded into the batch, so every channel is
  predicted on its own (``fold`` in the metadata).
* ``ebq/5``: the ``fine`` predictor (SZ-style: predict from reconstructed values, quantize the
  prediction error; integers in units of bin / 2**kshift, see
  :func:`solar.codec.predict.interp_fine_stream`). It removes the white rounding noise that
  pre-quantization leaves on smooth fields at loose bounds.
* ``ebq/6``: interpolation passes refine the innermost axis first within each level
  (:func:`solar.codec.predict.interp_plan`, ``reverse``): fewer strided decoder passes.
* ``ebq/7``: adds code width ``BITPACK`` (``lossless="bitpack"``): the residuals in
  :mod:`solar.codec.bitpack`'s fixed-length blocks, no byte-oriented lossless stage, so every
  decoder path (a GPU's included) unpacks them itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from solar.errors import ConfigError

from . import bitpack, fused
from . import lossless as ll
from . import paths
from . import predict as pr
from .base import Codec, Parsed
from .ebq_meta import BITPACK, NIBBLES, WIDTHS, EbqMeta, fold_axes
from .header import pack_header
from .predict import Predictor
from .quantize import QMAX, Quantized, quantize, verify
from .sections import Gathered, _sparse_group, gather  # noqa: F401  (tests import _sparse_group from here)
from .torch_ops import (TORCH_DTYPES, copy_rows_, dequantize, join_planes, patch_, scratch, take_rows, unpack_nibbles,
                        unzigzag_)

__all__ = ["EBQCodec"]

_INT = {4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}
#: A residual width is used when at most this fraction of residuals must escape it.
_ESCAPE_FRACTION = 1 / 64
#: Nibble mode is tried when at most this fraction of residuals needs the side stream.
_NIBBLE_FRACTION = 0.1


def _int8(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 two's complement codes with -128 marking an escape, and the escape positions."""
    esc = np.flatnonzero((r < -127) | (r > 127))
    c = r.astype(np.int8)
    c[esc] = -128
    return c, esc


def _nibbles(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Nibble mode (width 0): 4-bit two's complement pairs, -8 = "next value of the int8 side stream".

    Returns (code bytes = packed nibbles then the side stream, escape positions, side count).
    Residual entropy of smooth fields is ~2-3 bits: byte symbols waste most of the entropy
    coder's Huffman alphabet, nibble pairs halve both its redundancy and the bytes to decode.
    """
    big = (r < -7) | (r > 7)
    side, esc = _int8(r[big])
    nib = np.where(big, -8, r).astype(np.uint8) & 15
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    packed = nib[0::2] | (nib[1::2] << 4)
    return np.concatenate([packed, side.view(np.uint8)]), np.flatnonzero(big)[esc], int(side.size)


def _codes(r: np.ndarray, nibble: bool = False) -> tuple[int, np.ndarray, np.ndarray, int]:
    """Residuals -> (width, code bytes, escape positions, side count) in the ebq/3 code format.

    Width 0: nibbles (:func:`_nibbles`). Width 1: int8 two's complement, -128 = escape. Wider:
    zigzag codes as little-endian byte planes (the high planes of small residuals are all zero and
    compress to nothing), all-ones = escape. Width 8 never escapes.
    """
    if nibble:
        c, esc, n_side = _nibbles(r)
        return NIBBLES, c, esc, n_side
    if r.size == 0 or (np.count_nonzero((r < -127) | (r > 127)) <= r.size * _ESCAPE_FRACTION):
        c, esc = _int8(r)
        return 1, c, esc, 0
    u = _zigzag(r)
    w = _choose_width(u)
    esc = np.flatnonzero(u >= (1 << (8 * w)) - 1) if w < 8 else np.empty(0, np.int64)
    codes = np.minimum(u, np.uint64((1 << (8 * w)) - 1)) if w < 8 else u
    return w, np.ascontiguousarray(codes.astype(f"<u{w}").view(np.uint8).reshape(-1, w).T), esc, 0


def _best_levels(q: np.ndarray, reverse: bool = False) -> int:
    """Per level, cubic or linear interpolation: whichever gives cheaper residuals (log-magnitude proxy)."""
    cost: dict[int, list[float]] = {}
    for st in pr.interp_plan(tuple(q.shape[1:]), reverse):
        V = q[st.sel]
        E = np.ascontiguousarray(pr._take(V, st.axis, 0, (st.m + 1) // 2, 2, 0))
        O = pr._3d(np.ascontiguousarray(pr._take(V, st.axis, 0, st.m // 2, 2, 1)), st.axis).astype(np.int64)
        c = cost.setdefault(st.level, [0.0, 0.0])
        for i, cubic in enumerate((False, True)):
            P, sign = pr.predict_odd(E, st.axis, st.m, cubic)
            res = O - sign * P[:, :st.m // 2]
            c[i] += float(np.log2(1.0 + 2.0 * np.abs(res)).sum())
    return sum(1 << lv for lv, (lin, cub) in cost.items() if cub < lin)


#: The ``fine`` predictor's sub-bin resolution: K = 2**_KSHIFT units per bin.
_KSHIFT = 4


def _fine(array: np.ndarray, eb: float, qz: Quantized, bshape: tuple[int, ...]):
    """Residuals of the ``fine`` predictor, or None when the data's range does not fit its grid."""
    dtype = array.dtype
    K = 1 << _KSHIFT
    u = float(dtype.type(qz.step / K))
    gmax = QMAX[dtype]
    x = array.reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        xu = (x.astype(np.float64) - qz.offset) / u
    fin = np.isfinite(xu)
    if u < float(np.finfo(dtype).tiny) or (fin.any() and np.abs(xu[fin]).max() >= gmax - K):
        return None
    r, G, mask = pr.interp_fine_stream(xu.reshape(bshape), K, gmax, reverse=True)
    outliers = verify(x, G.reshape(-1), u, qz.offset, eb)
    return r, mask, _KSHIFT, u, outliers, int(np.abs(G).max(initial=0))


def _zigzag(r: np.ndarray) -> np.ndarray:
    r = r.astype(np.int64, copy=False)
    return ((r << 1) ^ (r >> 63)).view(np.uint64)


def _choose_width(u: np.ndarray) -> int:
    limit = u.size * _ESCAPE_FRACTION
    for w in WIDTHS[:-1]:
        if np.count_nonzero(u >= (1 << (8 * w)) - 1) <= limit:
            return w
    return 8


class EBQCodec(Codec):
    """Error-bounded quantizer with a GPU-parallel (torch ops) decoder.

    Args:
        predictor: ``"auto"`` (try the ``fine`` interpolation predictor and Lorenzo, keep the
            smaller blob), ``"fine"`` (SZ-style interpolation from reconstructed values),
            ``"interp"`` (interpolation on pre-quantized integers, cubic/linear per level),
            ``"cubic"``, ``"linear"`` (the same, one kind everywhere), ``"lorenzo"``.
        lossless: ``"zstd"`` (default when installed: best ratio), ``"lz4"``, ``"none"``, or
            ``"bitpack"`` (fixed-length blocks every decoder path unpacks itself, a GPU's included:
            the fastest decode, a lower ratio); ``SOLAR_CODEC_LOSSLESS`` sets the default.
        level: lossless compression level (zstd 1..22, default 9; decode speed barely changes).
    """

    codec_id = "ebq"
    version = 7
    decodes = frozenset({1, 2, 3, 4, 5, 6, 7})

    def __init__(self, predictor: str = "auto", lossless: str | None = None, level: int | None = None):
        if predictor != "auto" and predictor not in pr.PREDICTOR_IDS or predictor == "raw":
            raise ConfigError("ebq predictor must be 'auto', 'fine', 'interp', 'cubic', 'linear' or 'lorenzo', "
                              f"got {predictor!r}")
        source = "lossless=" if lossless else "SOLAR_CODEC_LOSSLESS"
        lossless = lossless or ll.default_lossless()
        if lossless not in ll.LOSSLESS_IDS and lossless != "bitpack":
            raise ConfigError(f"ebq lossless must be one of {sorted(ll.LOSSLESS_IDS) + ['bitpack']}, got "
                              f"{lossless!r} (from {source})")
        if level is not None and not isinstance(level, int):
            raise ConfigError(f"ebq level must be an int, got {level!r}")
        self.predictor, self.lossless, self.level = predictor, lossless, level

    def get_config(self):
        return {"id": self.codec_id, "predictor": self.predictor, "lossless": self.lossless, "level": self.level}

    # ------------------------------------------------------------------ encoder
    def encode(self, array: np.ndarray, abs_error: float) -> bytes:
        x = np.ascontiguousarray(array).reshape(-1) if array.ndim == 0 else np.ascontiguousarray(array)
        qz = quantize(x, abs_error)
        if qz is None:
            return self._pack_raw(array, abs_error)
        names = ["fine", "lorenzo"] if self.predictor == "auto" else [self.predictor]
        if self.predictor == "auto" and x.size < 64:
            names = ["lorenzo"]
        blobs = [self._pack(array, abs_error, qz, name) for name in names]
        best = min((b for b in blobs if b is not None), key=len, default=None)
        if best is None:  # "fine" alone, and the data's range does not fit its integer grid
            best = self._pack(array, abs_error, qz, "interp")
        if len(best) * 8 < array.nbytes:  # raw lossless is only worth trying when quantizing did poorly
            return best
        raw = self._pack_raw(array, abs_error)  # e.g. very tight bounds: quantizing does not pay
        return best if len(best) < len(raw) else raw

    def _blob(self, array, abs_error, meta: bytes, sections: list[bytes]) -> bytes:
        payload = b"".join(sections)
        return pack_header(self.descriptor, array.dtype, tuple(array.shape), abs_error, meta, payload) + payload

    @property
    def _bytes_stage(self) -> str:
        """The byte-oriented stage of the sections that are not bit-packed codes."""
        return "none" if self.lossless == "bitpack" else self.lossless

    def _pack_raw(self, array: np.ndarray, abs_error: float) -> bytes:
        data = ll.compress(np.ascontiguousarray(array).tobytes(), self._bytes_stage, self.level)
        meta = EbqMeta(Predictor.RAW, ll.LOSSLESS_IDS[self._bytes_stage], array.dtype.itemsize, 0, 0.0, 0.0, 0,
                       codes_len=len(data), n_esc=0, esc_len=0, n_out=0, out_len=0, n_side=0, fold=0, kshift=0)
        return self._blob(array, abs_error, meta.pack(), [data])

    def _pack(self, array: np.ndarray, abs_error: float, qz: Quantized, name: str) -> bytes | None:
        fold = fold_axes(qz.q.shape)
        q = qz.q.reshape((-1,) + (qz.q.shape[fold:] or (1,)))
        mask, kshift, step, outliers, qmax = 0, 0, qz.step, qz.outliers, int(np.abs(qz.q).max(initial=0))
        if name == "fine":
            fine = _fine(array, abs_error, qz, q.shape)
            if fine is None:
                return None
            r, mask, kshift, step, outliers, qmax = fine
            r = r.reshape(-1)
        elif name == "lorenzo":
            r = pr.lorenzo_residuals(q).reshape(-1)
        else:
            mask = {"cubic": -1, "linear": 0}.get(name)  # "interp": chosen per level
            if mask is None:
                mask = _best_levels(q, reverse=True)
            mask &= (1 << 64) - 1
            r = pr.interp_stream(q, mask, reverse=True).reshape(-1)
        lvl, stage = self.level, self._bytes_stage
        qint = 4 if qmax <= (1 << 26) else 8
        if self.lossless == "bitpack":
            w, s_codes, esc_pos, n_side = BITPACK, bitpack.pack(r), np.empty(0, np.int64), 0
            if qint == 4 and r.size and not (-(1 << 31) <= r.min() and r.max() < (1 << 31)):
                qint = 8  # int32 codes decode into int32 exactly: wider residuals need int64
        else:
            w, codes, esc_pos, n_side = _codes(r)
            s_codes = ll.compress(codes, stage, lvl)
        if w == 1 and np.count_nonzero((r < -7) | (r > 7)) <= r.size * _NIBBLE_FRACTION:
            alt = _codes(r, nibble=True)
            s_alt = ll.compress(alt[1], stage, lvl)
            if len(s_alt) < len(s_codes):
                (w, codes, esc_pos, n_side), s_codes = alt, s_alt
        esc_val = r[esc_pos].astype(np.int64)
        s_esc = ll.compress(_deltas(esc_pos).tobytes() + esc_val.tobytes(), stage, lvl) if esc_pos.size else b""
        out_vals = array.reshape(-1)[outliers]
        s_out = ll.compress(_deltas(outliers).tobytes() + out_vals.tobytes(), stage, lvl) if outliers.size else b""
        pid = pr.PREDICTOR_IDS[name if name in ("lorenzo", "fine") else "interp"]
        meta = EbqMeta(pid, ll.LOSSLESS_IDS[stage], w, qint, step, qz.offset, cubic_levels=mask,
                       codes_len=len(s_codes), n_esc=esc_pos.size, esc_len=len(s_esc), n_out=outliers.size,
                       out_len=len(s_out), n_side=n_side, fold=fold, kshift=kshift)
        return self._blob(array, abs_error, meta.pack(), [s_codes, s_esc, s_out])

    # ------------------------------------------------------------------ decoder
    def _meta(self, blob: Parsed) -> EbqMeta:
        """The blob's checked metadata, every version read into the newest layout's fields
        (parsed once per blob, then cached on it)."""
        if blob.meta is None:
            self.check_version(blob)
            blob.meta = EbqMeta.parse(blob.header, blob.what)
        return blob.meta

    def group_key(self, blob: Parsed):
        """Blobs decoded together: int8 and nibble codes mix (both become an int8 stream), and so
        do per-level cubic/linear choices of the interpolation predictors (selected per row)."""
        m = self._meta(blob)
        v2 = blob.header.version >= 2
        wkey = "int8" if v2 and m.width in (NIBBLES, 1) else m.width
        levels = None if v2 and m.predictor.per_level else m.cubic_levels
        return (m.predictor, wkey, m.qint, levels, m.fold, m.kshift)

    def decode_group(self, blobs: Sequence[Parsed], device, out=None):
        metas = [self._meta(b) for b in blobs]
        levels = [m.cubic_levels for m in metas]
        if len(blobs) > 1 and metas[0].predictor.per_level and len(set(levels)) > 1 and not self._fusable(blobs[0]) \
                and paths.choose(torch.device(device), blobs[0].header.version, metas[0].predictor, 1) == "reference":
            # mixed per-level cubic/linear choices: decode in an order where equal choices are
            # contiguous row slices (one prediction kind each), then put rows back in input order
            order = pr.mask_order(levels)
            return self._decode_sorted([blobs[i] for i in order], device, out, order)
        return self._decode_sorted(blobs, device, out)

    def _decode_sorted(self, blobs: Sequence[Parsed], device, out=None, order: np.ndarray | None = None):
        """Decode ``blobs``, which are the input's blobs permuted by ``order`` (None: not permuted).

        The integers are put back in input order before dequantizing, so the output is written
        once, in place, in the caller's order.
        """
        h0 = blobs[0].header
        metas = [self._meta(b) for b in blobs]
        m0 = metas[0]
        dev = torch.device(device)
        if m0.predictor == Predictor.RAW:
            return _into(out, _decode_raw(blobs, metas, dev))
        shape = h0.shape or (1,)
        n, B = math.prod(shape), len(blobs)
        int8_stream = h0.version >= 2 and m0.width in (NIBBLES, 1)
        lead = math.prod(shape[:m0.fold])  # folded channels: each is one more batch row of the predictor
        cubic = np.repeat(np.array([m.cubic_levels for m in metas], np.uint64), lead)
        lay = _Layout(shape, lead, shape[m0.fold:], cubic,
                      1 << m0.kshift, h0.version >= 6, _INT[m0.qint][1])
        path = paths.choose(dev, h0.version, m0.predictor, n) if order is None else "reference"
        if path == "cpu-kernel":
            return _into(out, paths.decode_cpu(blobs, metas, lay, int8_stream).to(dev).view((B,) + h0.shape))
        g = gather(blobs, metas, n, order, int8_stream)
        dtype = TORCH_DTYPES[h0.dtype.itemsize]
        if n and self._fusable(blobs[0]):
            x = self._decode_fused(g, lay, dtype, dev)
            if x is not None:
                if g.offs.any():
                    x.add_(torch.from_numpy(g.offs).to(dev).view(B, 1))
                patch_(x.view(-1), *_cat(g.out_idx, g.out_val, dev))
                return _into(out, x.view((B,) + h0.shape))
        # ---- from here on: one sequence of tensor ops for the whole group, on `device`
        if path == "triton":
            q = _triton_integers(g, m0, int8_stream, lay, dev)
        else:
            q = _eager_integers(g, m0, int8_stream, h0.version, lay, dev)
        steps, offs = g.steps, g.offs
        if order is not None:  # back to input order (int rows into scratch; the output is written once)
            inv = np.argsort(order)
            q = take_rows(q.reshape(B, n).contiguous(), inv, scratch.get("unsorted", B * n, q.dtype, dev).view(B, n))
            steps, offs = steps[inv], offs[inv]
        q = q.view((B,) + shape)  # Lorenzo's result is a padded strided view: never flattened (a copy)
        bshape = (B,) + (1,) * len(shape)
        offset = None if not offs.any() else torch.from_numpy(offs).to(dev).view(bshape)
        x = dequantize(q, torch.from_numpy(steps).to(dev).view(bshape), offset, dtype)
        patch_(x.view(-1), *_cat(g.out_idx, g.out_val, dev))
        return _into(out, x.view((B,) + h0.shape))

    def _fusable(self, blob: Parsed) -> bool:
        """Whether ``blob``'s group takes the compiled graph: codes of the interpolation
        predictors (the graph selects cubic/linear per row, so no mask-sorted batch), of any
        width (nibbles, int8, or wider byte planes)."""
        m = self._meta(blob)
        return fused.enabled() and m.predictor.per_level and blob.header.version >= 2 \
            and m.width in (NIBBLES,) + WIDTHS

    @staticmethod
    def _decode_fused(g: Gathered, lay: _Layout, dtype, dev):
        """Decode with the compiled graph -> ``(B, n)`` floats, or None (then decode eagerly).

        A group of nibble blobs goes in packed (unpacked inside the graph), an int8 group as is,
        and wider codes as their byte planes (joined inside the graph); the side values and
        escapes become one sparse list of residual corrections added inside the graph. A group
        mixing nibble and int8 blobs is first joined into one int8 stream.
        """
        planes, rows, kinds, marks, side, esc_idx, esc_val = g[:7]
        masks, steps, lead, inner_shape, K, rev, t_int = lay.masks, g.steps, lay.lead, lay.inner_shape, lay.K, \
            lay.reverse, lay.t_int
        n = math.prod(inner_shape) * lead
        B = len(kinds)
        pos, corr = [np.zeros(2, np.int64)], [np.zeros(2, np.int64)]  # >= 2 entries: one graph for all
        width = kinds[0] if len(set(kinds)) == 1 else 1
        if esc_idx:
            at = np.concatenate(esc_idx)
            pos.append(at)
            # an escape's correction is its true residual minus what the code at its position
            # decodes to: the -128 marker in int8 streams; for byte planes the code itself, put
            # through the eager decoder's join/unzigzag (so a forged position replaces, as eagerly)
            corr.append(np.concatenate(esc_val).astype(np.int64) - (
                -128 if width <= 1 else _wide_codes(planes[width].reshape(B, width, n), at, n, t_int)))
        if width == NIBBLES:
            w2 = 2 * planes[NIBBLES].shape[1]  # markers are positions in the (B, w2) unpacked stream
            r, c = np.divmod(marks, w2)
            keep = c < n  # a marker on the padding nibble of an odd-length blob is dropped, as eagerly
            pos.append(r[keep] * n + c[keep])
            corr.append(side.view(np.int8)[keep].astype(np.int64) + 8)  # side value - marker (-8)
            codes = torch.from_numpy(planes[NIBBLES]).to(dev).view(torch.int8)
        elif width >= 2:
            codes = torch.from_numpy(planes[width]).to(dev).view(B, width, n)
        else:
            codes = _code_stream(planes, rows, kinds, marks, side, n, dev).view(torch.int8)
        bits = (masks[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)  # (rows, level)
        x = fused.run(codes, torch.from_numpy(np.concatenate(pos)).to(dev),
                      torch.from_numpy(np.concatenate(corr)).to(dev, t_int),
                      torch.from_numpy(bits.astype(bool)).to(dev),
                      torch.from_numpy(np.repeat(steps, lead)).to(dev).view(B * lead, 1),
                      n, lead, inner_shape, K, rev, t_int, dtype, width)
        return None if x is None else x.view(B, n)


class _Layout(NamedTuple):
    """How a group's integers are predicted."""

    shape: tuple[int, ...]  # one blob's shape (at least 1-d)
    lead: int  # rows per blob: the product of the folded leading (channel) axes
    inner_shape: tuple[int, ...]  # the predicted axes
    masks: np.ndarray  # per predictor row: its blob's cubic_levels
    K: int  # units per bin (1 unless ``fine``)
    reverse: bool  # interpolation passes refine the innermost axis first (ebq/6+)
    t_int: torch.dtype


def _decode_raw(blobs: Sequence[Parsed], metas: list[EbqMeta], dev) -> torch.Tensor:
    """Blobs of the RAW predictor: the values themselves behind the lossless stage."""
    h0 = blobs[0].header
    raw = np.empty((len(blobs), h0.size), h0.dtype)
    for i, (b, m) in enumerate(zip(blobs, metas)):
        raw[i] = np.frombuffer(ll.decompress(b.payload, ll.LOSSLESS[m.lossless], h0.nbytes, b.what), h0.dtype)
    return torch.from_numpy(raw).to(dev).view((len(blobs),) + h0.shape)


def _eager_integers(g: Gathered, m0: EbqMeta, int8_stream: bool, version: int, lay: _Layout, dev):
    """The group's quantized integers, ``(B * lead, *inner_shape)``, by eager tensor ops."""
    B, n = len(g.kinds), math.prod(lay.shape)
    rows = (B * lay.lead, n // lay.lead)
    t = None if m0.width == BITPACK else _code_stream(g.planes, g.rows, g.kinds, g.marks, g.side, n, dev)
    if int8_stream and m0.predictor.per_level:
        # int8 codes go straight into the predictor (widened inside its adds); escapes are
        # corrections (true residual - marker) applied pass by pass
        escapes = None
        if g.esc_idx:
            escapes = (np.concatenate(g.esc_idx), np.concatenate(g.esc_val).astype(np.int64) + 128)
        # widened once up front: one contiguous conversion pass is ~3x cheaper on a CPU than
        # letting every pass's add promote int8 on the fly
        codes = scratch.get("codes", B * n, lay.t_int, dev).view(B, n)
        codes.copy_(t.view(torch.int8))
        return pr.interp_decode(codes.view(rows), lay.inner_shape, lay.masks, lay.t_int, escapes, lay.K, lay.reverse)
    if int8_stream:
        r = t.view(torch.int8).reshape(B, n).to(lay.t_int)
    elif m0.width == BITPACK:
        r = bitpack.unpack_torch(g.planes[BITPACK], n, lay.t_int, dev)
    else:
        r = unzigzag_(join_planes(t.view(B, m0.width, n), lay.t_int))
    patch_(r.view(-1), *_cat(g.esc_idx, g.esc_val, dev))
    if m0.predictor == Predictor.LORENZO:
        return pr.lorenzo_reconstruct(r.view((rows[0],) + lay.inner_shape))
    r = pr.natural_to_stream(r, lay.shape) if version == 1 else r.view(rows)
    return pr.interp_decode(r, lay.inner_shape, lay.masks, K=lay.K, reverse=lay.reverse)


def _triton_integers(g: Gathered, m0: EbqMeta, int8_stream: bool, lay: _Layout, dev):
    """The group's integers, ``(B * lead, n // lead)``, by the Triton passes
    (:mod:`solar.codec.kernels_triton`): one residual stream, widened with the eager ops, escape
    corrections added to it (int8 codes: true residual - marker) or put in place (wider codes);
    the passes then choose cubic/linear per row, so mixed groups need no sorting."""
    B, n = len(g.kinds), math.prod(lay.shape)
    kt = paths.triton_kernels(dev)
    if m0.width == BITPACK:  # unpacked on the device: no CPU stage in front of the passes
        r = kt.unpack(g.planes[BITPACK], B, n, lay.t_int, dev)
        return kt.interp_decode(r.view(B * lay.lead, n // lay.lead), lay.inner_shape, lay.masks, lay.K, lay.reverse)
    t = _code_stream(g.planes, g.rows, g.kinds, g.marks, g.side, n, dev)
    if int8_stream:
        r = t.view(torch.int8).reshape(B, n).to(lay.t_int)
        if g.esc_idx:
            corr = torch.from_numpy(np.concatenate(g.esc_val).astype(np.int64) + 128).to(dev, lay.t_int)
            r.view(-1).index_add_(0, torch.from_numpy(np.concatenate(g.esc_idx)).to(dev), corr)
    else:
        r = unzigzag_(join_planes(t.view(B, m0.width, n), lay.t_int))
        patch_(r.view(-1), *_cat(g.esc_idx, g.esc_val, dev))
    return kt.interp_decode(r.view(B * lay.lead, n // lay.lead), lay.inner_shape, lay.masks, lay.K, lay.reverse)


def _wide_codes(planes: np.ndarray, at: np.ndarray, n: int, itype) -> np.ndarray:
    """Signed residuals that the ``(B, w, n)`` byte planes hold at flat positions ``at``."""
    r, c = np.divmod(at, n)
    g = torch.from_numpy(np.ascontiguousarray(planes[r, :, c].T))[None]  # (1, w, len(at))
    return unzigzag_(join_planes(g, itype))[0].numpy().astype(np.int64)


def _code_stream(planes: dict, rows: dict, kinds: list, marks, side, n: int, dev) -> "torch.Tensor":
    """The group's codes as one ``(B, n)`` stream: nibble rows unpacked (side values patched in),
    int8 rows as they are, or ``(B, w, n)`` byte planes of a wider code."""
    parts = {}
    for k, arr in planes.items():
        t = torch.from_numpy(arr).to(dev, non_blocking=True)
        if k == NIBBLES:
            t = unpack_nibbles(t.view(torch.int8))
            t.view(-1)[torch.from_numpy(marks).to(dev)] = torch.from_numpy(side).to(dev).view(torch.int8)
            t = t[:, :n]
        parts[k] = t
    if len(parts) == 1:
        return parts[kinds[0]]
    t = torch.empty((len(kinds), n), dtype=torch.int8, device=dev)  # int8 and nibble blobs: one int8 stream
    for k, part in parts.items():
        copy_rows_(t, rows[k], part.view(torch.int8).contiguous())
    return t


def _deltas(pos: np.ndarray) -> np.ndarray:
    return np.diff(pos.astype(np.int64), prepend=np.int64(0))


def _cat(idx: list, val: list, dev):
    if not idx:
        return None, None
    return (torch.from_numpy(np.concatenate(idx)).to(dev), torch.from_numpy(np.concatenate(val)).to(dev))


def _into(out, x):
    if out is None:
        return x
    out.copy_(x.view(out.shape))
    return out
