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
values. The private header metadata is :data:`_METAS` (per format version).

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
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import torch

from solar.errors import ConfigError, CorruptDataError

from . import fused
from . import lossless as ll
from . import predict as pr
from .base import Codec, Parsed
from .header import pack_header
from .quantize import Quantized, quantize
from .torch_ops import (TORCH_DTYPES, copy_rows_, dequantize, join_planes, patch_, scratch, take_rows, unpack_nibbles,
                        unzigzag_)

__all__ = ["EBQCodec"]

# Private metadata per format version. v1: predictor, lossless, code_bytes, qint_bytes, step,
# offset, codes_clen, n_esc, esc_clen, n_out, out_clen. v2 adds ``cubic_levels`` (bit l = cubic
# interpolation on level l) after offset. v3 appends ``n_side`` (nibble mode: count of residuals
# carried by the int8 side stream). v4 appends ``fold`` (leading axes treated as a batch), v5
# ``kshift`` (the ``fine`` predictor's K = 2**kshift; ``step`` is then the unit u = bin / K).
# v6 has v5's layout; only the interpolation pass order differs (innermost axis first).
_METAS = {1: struct.Struct("<BBBBddQQQQQ"), 2: struct.Struct("<BBBBddQQQQQQ"), 3: struct.Struct("<BBBBddQQQQQQQ"),
          4: struct.Struct("<BBBBddQQQQQQQB"), 5: struct.Struct("<BBBBddQQQQQQQBB"),
          6: struct.Struct("<BBBBddQQQQQQQBB")}
#: Leading axes of at most this size (channels: amplitude/phase, velocity components) are folded
#: into the batch: each channel is predicted on its own instead of from its neighbour channel.
_FOLD_MAX = 4
_WIDTHS = (1, 2, 4, 8)
_FMAX = {4: float(np.finfo(np.float32).max), 8: float(np.finfo(np.float64).max)}
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
        return 0, c, esc, n_side
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
    from .quantize import QMAX, verify

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


def _fold(shape: tuple[int, ...]) -> int:
    """How many leading axes are small enough to be channels (at least one axis stays spatial)."""
    k = 0
    while k < len(shape) - 1 and shape[k] <= _FOLD_MAX:
        k += 1
    return k


def _zigzag(r: np.ndarray) -> np.ndarray:
    r = r.astype(np.int64, copy=False)
    return ((r << 1) ^ (r >> 63)).view(np.uint64)


def _choose_width(u: np.ndarray) -> int:
    limit = u.size * _ESCAPE_FRACTION
    for w in _WIDTHS[:-1]:
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
        lossless: ``"zstd"`` (default when installed: best ratio), ``"lz4"`` (fastest), ``"none"``.
        level: lossless compression level (zstd 1..22, default 9; decode speed barely changes).
    """

    codec_id = "ebq"
    version = 6
    decodes = frozenset({1, 2, 3, 4, 5, 6})

    def __init__(self, predictor: str = "auto", lossless: str | None = None, level: int | None = None):
        if predictor != "auto" and predictor not in pr.PREDICTOR_IDS or predictor == "raw":
            raise ConfigError("ebq predictor must be 'auto', 'fine', 'interp', 'cubic', 'linear' or 'lorenzo', "
                              f"got {predictor!r}")
        lossless = lossless or ll.default_lossless()
        if lossless not in ll.LOSSLESS_IDS:
            raise ConfigError(f"ebq lossless must be one of {sorted(ll.LOSSLESS_IDS)}, got {lossless!r}")
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

    def _pack_raw(self, array: np.ndarray, abs_error: float) -> bytes:
        data = ll.compress(np.ascontiguousarray(array).tobytes(), self.lossless, self.level)
        meta = _METAS[6].pack(0, ll.LOSSLESS_IDS[self.lossless], array.dtype.itemsize, 0, 0.0, 0.0, 0,
                              len(data), 0, 0, 0, 0, 0, 0, 0)
        return self._blob(array, abs_error, meta, [data])

    def _pack(self, array: np.ndarray, abs_error: float, qz: Quantized, name: str) -> bytes | None:
        fold = _fold(qz.q.shape)
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
        lvl = self.level
        w, codes, esc_pos, n_side = _codes(r)
        s_codes = ll.compress(codes, self.lossless, lvl)
        if w == 1 and np.count_nonzero((r < -7) | (r > 7)) <= r.size * _NIBBLE_FRACTION:
            alt = _codes(r, nibble=True)
            s_alt = ll.compress(alt[1], self.lossless, lvl)
            if len(s_alt) < len(s_codes):
                (w, codes, esc_pos, n_side), s_codes = alt, s_alt
        esc_val = r[esc_pos].astype(np.int64)
        s_esc = ll.compress(_deltas(esc_pos).tobytes() + esc_val.tobytes(), self.lossless, lvl) if esc_pos.size else b""
        out_vals = array.reshape(-1)[outliers]
        s_out = ll.compress(_deltas(outliers).tobytes() + out_vals.tobytes(), self.lossless, lvl) \
            if outliers.size else b""
        qint = 4 if qmax <= (1 << 26) else 8
        pid = pr.PREDICTOR_IDS[name if name in ("lorenzo", "fine") else "interp"]
        meta = _METAS[6].pack(pid, ll.LOSSLESS_IDS[self.lossless], w, qint, step, qz.offset, mask,
                              len(s_codes), esc_pos.size, len(s_esc), outliers.size, len(s_out), n_side, fold, kshift)
        return self._blob(array, abs_error, meta, [s_codes, s_esc, s_out])

    # ------------------------------------------------------------------ decoder
    def _meta(self, blob: Parsed) -> tuple:
        """Validated metadata as the v4 tuple (v1 blobs: ``cubic_levels`` from the predictor id)."""
        if blob.meta is None:
            blob.meta = self._parse_meta(blob)
        return blob.meta

    def _parse_meta(self, blob: Parsed) -> tuple:
        self.check_version(blob)
        h, what = blob.header, blob.what
        fmt = _METAS[h.version]
        if len(h.meta) != fmt.size:
            raise CorruptDataError(f"{what}: ebq metadata is {len(h.meta)} bytes, expected {fmt.size}")
        m = fmt.unpack(h.meta)
        if h.version == 1:
            m = m[:6] + ((1 << 64) - 1 if m[0] == 2 else 0,) + m[6:]
        if h.version < 3:
            m = m + (0,)
        if h.version < 4:
            m = m + (0,)
        if h.version < 5:
            m = m + (0,)
        pred, lossless, w, qint, step, offset, _, c_len, n_esc, e_len, n_out, o_len, n_side, fold, kshift = m
        n = h.size
        bad = None
        if pred not in pr.PREDICTORS or lossless not in ll.LOSSLESS or (pred in (1, 2, 4)) and (pred == 4) != (h.version >= 2):
            bad = f"unknown predictor {pred} or lossless stage {lossless}"
        elif c_len + e_len + o_len != h.payload_len:
            bad = "section lengths do not add up to the payload length"
        elif pred == 0:
            if w != h.dtype.itemsize or n_esc or n_out or e_len or o_len:
                bad = "inconsistent lossless-mode metadata"
        elif (w not in _WIDTHS and not (w == 0 and h.version >= 3)) or qint not in _INT or (qint == 4 and w == 8):
            bad = f"invalid code width {w} / integer width {qint}"
        elif (pred == 5) != (kshift > 0) or kshift > 16 or (pred == 5 and h.version < 5):
            bad = f"invalid fine-predictor resolution {kshift} for predictor {pred}"
        elif fold > max(len(h.shape) - 1, 0) or fold > _fold(h.shape):
            bad = f"invalid folded axis count {fold} for shape {h.shape}"
        elif n_side > n or (n_side and w != 0):
            bad = f"impossible side-stream count {n_side} for {n} values"
        elif not (0 < step <= _FMAX[h.dtype.itemsize] and abs(offset) <= _FMAX[h.dtype.itemsize]):
            bad = f"invalid step {step} / offset {offset}"
        elif n_esc > n or n_out > n or (n_esc == 0) != (e_len == 0) or (n_out == 0) != (o_len == 0):
            bad = f"impossible escape/outlier counts {n_esc}/{n_out} for {n} values"
        if bad:
            raise CorruptDataError(f"{what}: corrupted ebq header metadata ({bad})")
        name = ll.LOSSLESS[lossless]  # sizes must be reachable before anything is allocated
        ll.check_expansion(c_len, h.nbytes if pred == 0 else _code_len(w, n) + n_side, name, what)
        ll.check_expansion(e_len, n_esc * 16, name, what)
        ll.check_expansion(o_len, n_out * (8 + h.dtype.itemsize), name, what)
        return m

    def group_key(self, blob: Parsed):
        """Blobs decoded together: int8 and nibble codes mix (both become an int8 stream), and so
        do per-level cubic/linear choices of the interpolation predictors (selected per row)."""
        pred, _, w, qint, _, _, mask, *_, fold, kshift = self._meta(blob)
        v2 = blob.header.version >= 2
        wkey = "int8" if v2 and w in (0, 1) else w
        return (pred, wkey, qint, None if v2 and pred in (4, 5) else mask, fold, kshift)

    def decode_group(self, blobs: Sequence[Parsed], device, out=None):
        metas = [self._meta(b) for b in blobs]
        if len(blobs) > 1 and metas[0][0] in (4, 5) and len({m[6] for m in metas}) > 1 and not self._fusable(blobs[0]):
            # mixed per-level cubic/linear choices: decode in an order where equal choices are
            # contiguous row slices (one prediction kind each), then put rows back in input order
            order = pr.mask_order([m[6] for m in metas])
            return self._decode_sorted([blobs[i] for i in order], device, out, order)
        return self._decode_sorted(blobs, device, out)

    def _decode_sorted(self, blobs: Sequence[Parsed], device, out=None, order: np.ndarray | None = None):
        """Decode ``blobs``, which are the input's blobs permuted by ``order`` (None: not permuted).

        The integers are put back in input order before dequantizing, so the output is written
        once, in place, in the caller's order.
        """
        h0 = blobs[0].header
        metas = [self._meta(b) for b in blobs]
        pred, _, w, qint = metas[0][:4]
        shape = h0.shape or (1,)
        n, B = math.prod(shape), len(blobs)
        dev = torch.device(device)
        if pred == 0:
            raw = np.empty((B, n), h0.dtype)
            for i, (b, m) in enumerate(zip(blobs, metas)):
                raw[i] = np.frombuffer(ll.decompress(b.payload, ll.LOSSLESS[m[1]], h0.nbytes, b.what), h0.dtype)
            return _into(out, torch.from_numpy(raw).to(dev).view((B,) + h0.shape))
        np_int, t_int = _INT[qint]
        int8_stream = h0.version >= 2 and w in (0, 1)
        kinds = [m[2] for m in metas] if int8_stream else [w] * B
        rows = {k: [i for i, kk in enumerate(kinds) if kk == k] for k in sorted(set(kinds))}
        planes = {k: np.empty((len(r), _code_len(k, n)), np.uint8) for k, r in rows.items()}
        slot = {i: j for r in rows.values() for j, i in enumerate(r)}
        esc_idx, esc_val, out_idx, out_val, sides, esc, outl = [], [], [], [], [], [], []
        steps = np.empty(B, h0.dtype)
        offs = np.empty(B, h0.dtype)
        for i, (b, m) in enumerate(zip(blobs, metas)):
            _, lid, wi, _, steps[i], offs[i], _, c_len, n_esc, e_len, n_out, o_len, n_side, _, _ = m
            name, p = ll.LOSSLESS[lid], b.payload
            nb = _code_len(wi, n)
            raw = np.frombuffer(ll.decompress(p[:c_len], name, nb + n_side, b.what), np.uint8)
            planes[wi][slot[i]] = raw[:nb]
            if n_side:
                sides.append(raw[nb:])
            if n_esc:
                esc.append((p[c_len:c_len + e_len], name, n_esc, b.what, i))
            if n_out:
                outl.append((p[c_len + e_len:], name, n_out, b.what, i if order is None else int(order[i])))
        if esc:  # all blobs' sparse sections checked and placed with a few array ops (not per blob)
            pos, val = _sparse_group(esc, np.dtype("<i8"), n, limit=1 << 31 if qint == 4 else None)
            esc_idx, esc_val = [pos], [val.astype(np_int)]
        if outl:
            pos, val = _sparse_group(outl, h0.dtype, n)
            out_idx, out_val = [pos], [val]
        marks = side = None
        if 0 in planes:  # where the side values go: found on the packed bytes, before they leave the CPU
            marks = _nibble_markers(planes[0])
            side = np.concatenate(sides) if sides else np.empty(0, np.uint8)
            if marks.size != side.size:
                raise CorruptDataError(
                    f"{blobs[0].what}: nibble stream has {marks.size} side markers for {side.size} "
                    "side values; corrupted payload")
        # folded leading (channel) axes: each channel is one more batch row of the predictor
        fold = metas[0][13]
        lead = math.prod(shape[:fold])
        Bp, inner_shape = B * lead, shape[fold:]
        K = 1 << metas[0][14]
        masks = np.repeat(np.array([m[6] for m in metas], dtype=np.uint64), lead)
        rev = h0.version >= 6
        if n and self._fusable(blobs[0]):
            x = self._decode_fused(planes, rows, kinds, marks, side, esc_idx, esc_val, masks, steps, lead,
                                   inner_shape, K, rev, t_int, TORCH_DTYPES[h0.dtype.itemsize], dev)
            if x is not None:
                if offs.any():
                    x.add_(torch.from_numpy(offs).to(dev).view(B, 1))
                patch_(x.view(-1), *_cat(out_idx, out_val, dev))
                return _into(out, x.view((B,) + h0.shape))
        # ---- from here on: one sequence of tensor ops for the whole group, on `device`
        t = _code_stream(planes, rows, kinds, marks, side, n, dev)
        if int8_stream and pred in (4, 5):
            # int8 codes go straight into the predictor (widened inside its adds); escapes are
            # corrections (true residual - marker) applied pass by pass
            escapes = None
            if esc_idx:
                escapes = (np.concatenate(esc_idx), np.concatenate(esc_val).astype(np.int64) + 128)
            # widened once up front: one contiguous conversion pass is ~3x cheaper on a CPU than
            # letting every pass's add promote int8 on the fly
            codes = scratch.get("codes", B * n, t_int, dev).view(B, n)
            codes.copy_(t.view(torch.int8))
            q = pr.interp_decode(codes.view(Bp, n // lead), inner_shape, masks, t_int, escapes, K, rev)
        else:
            if int8_stream:
                r = t.view(torch.int8).reshape(B, n).to(t_int)
            else:
                r = unzigzag_(join_planes(t.view(B, w, n), t_int))
            patch_(r.view(-1), *_cat(esc_idx, esc_val, dev))
            if pred == 3:
                q = pr.lorenzo_reconstruct(r.view((Bp,) + inner_shape))
            else:
                r = pr.natural_to_stream(r, shape) if h0.version == 1 else r.view(Bp, n // lead)
                q = pr.interp_decode(r, inner_shape, masks, K=K, reverse=rev)
        if order is not None:  # back to input order (int rows into scratch; the output is written once)
            inv = np.argsort(order)
            q = take_rows(q.reshape(B, n).contiguous(), inv, scratch.get("unsorted", B * n, q.dtype, dev).view(B, n))
            steps, offs = steps[inv], offs[inv]
        q = q.view((B,) + shape)  # Lorenzo's result is a padded strided view: never flattened (a copy)
        bshape = (B,) + (1,) * len(shape)
        offset = None if not offs.any() else torch.from_numpy(offs).to(dev).view(bshape)
        x = dequantize(q, torch.from_numpy(steps).to(dev).view(bshape), offset, TORCH_DTYPES[h0.dtype.itemsize])
        patch_(x.view(-1), *_cat(out_idx, out_val, dev))
        return _into(out, x.view((B,) + h0.shape))

    def _fusable(self, blob: Parsed) -> bool:
        """Whether ``blob``'s group takes the compiled graph: codes of the interpolation
        predictors (the graph selects cubic/linear per row, so no mask-sorted batch), of any
        width (nibbles, int8, or wider byte planes)."""
        pred, _, w, *_ = self._meta(blob)
        return fused.enabled() and pred in (4, 5) and blob.header.version >= 2 and w in (0,) + _WIDTHS

    @staticmethod
    def _decode_fused(planes, rows, kinds, marks, side, esc_idx, esc_val, masks, steps, lead, inner_shape, K, rev,
                      t_int, dtype, dev):
        """Decode with the compiled graph -> ``(B, n)`` floats, or None (then decode eagerly).

        A group of nibble blobs goes in packed (unpacked inside the graph), an int8 group as is,
        and wider codes as their byte planes (joined inside the graph); the side values and
        escapes become one sparse list of residual corrections added inside the graph. A group
        mixing nibble and int8 blobs is first joined into one int8 stream.
        """
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
        if width == 0:
            w2 = 2 * planes[0].shape[1]  # markers are positions in the (B, w2) unpacked stream
            r, c = np.divmod(marks, w2)
            keep = c < n  # a marker on the padding nibble of an odd-length blob is dropped, as eagerly
            pos.append(r[keep] * n + c[keep])
            corr.append(side.view(np.int8)[keep].astype(np.int64) + 8)  # side value - marker (-8)
            codes = torch.from_numpy(planes[0]).to(dev).view(torch.int8)
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
        if k == 0:
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


def _nibble_markers(packed: np.ndarray) -> np.ndarray:
    """Flat positions (in the unpacked ``(B, 2k)`` stream) of the -8 markers in packed nibbles.

    Byte masks and one flatnonzero on the CPU cost a fraction of a full-stream ``nonzero``
    after unpacking, and the positions come out sorted, matching the side streams' order. The
    bytes are scanned contiguously once; the per-nibble split is done on the few candidate bytes
    only (3x faster than flagging both nibbles through strided views of the whole stream).
    """
    p = packed.reshape(-1)
    hit = (p & 0x0F) == 0x08
    hit |= (p & 0xF0) == 0x80
    c = np.flatnonzero(hit)
    pc = p[c]
    which = np.stack([(pc & 0x0F) == 0x08, (pc & 0xF0) == 0x80], axis=1)
    return (2 * c[:, None] + np.arange(2))[which]


def _code_len(w: int, n: int) -> int:
    """Bytes of the fixed-width part of the codes section (nibbles: two codes per byte)."""
    return (n + 1) // 2 if w == 0 else n * w


def _deltas(pos: np.ndarray) -> np.ndarray:
    return np.diff(pos.astype(np.int64), prepend=np.int64(0))


def _sparse_group(items: list, vdtype: np.dtype, n: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse sections of a group's blobs -> flat positions in ``(B, n)`` and their values.

    ``items``: ``(section, lossless, count, what, row)`` per blob that has one. A section is
    ``count`` delta-coded int64 positions then ``count`` values. Every position is checked for
    all blobs at once: strictly increasing, so patching is order-free; every delta and every sum
    below ``n`` (with deltas below ``n`` the first sum past ``n`` is below ``2n``, so a later
    int64 wrap-around cannot hide it). With ``limit``, every value must lie in
    ``[-limit, limit)``. An error names the first offending blob.
    """
    raws = [ll.decompress(sec, name, cnt * (8 + vdtype.itemsize), what) for sec, name, cnt, what, _ in items]
    counts = np.fromiter((it[2] for it in items), np.int64, len(items))
    d = np.concatenate([np.frombuffer(r, "<i8", c) for r, c in zip(raws, counts)])
    vals = np.concatenate([np.frombuffer(r, vdtype, c, offset=8 * c) for r, c in zip(raws, counts)])
    ends = np.cumsum(counts)
    starts = ends - counts
    later = np.ones(d.size, bool)
    later[starts] = False  # a blob's first delta is its first position (may be 0); later ones >= 1

    def check(bad: np.ndarray, why: str):
        at = np.flatnonzero(bad)
        if at.size:
            what = items[int(np.searchsorted(ends, at[0], "right"))][3]
            raise CorruptDataError(f"{what}: {why}; corrupted payload")

    check((d < later) | (d >= n), "sparse positions are not strictly increasing or out of range")
    pos = np.cumsum(d)
    pos -= np.repeat(pos[starts] - d[starts], counts)  # restart the sum at each blob's section
    check(pos >= n, f"sparse position out of range for {n} values")  # every entry: see above
    if limit is not None:
        check((vals < -limit) | (vals >= limit), "escape value out of range")
    pos += np.repeat(np.fromiter((it[4] for it in items), np.int64, len(items)) * n, counts)
    return pos, vals


def _cat(idx: list, val: list, dev):
    if not idx:
        return None, None
    return (torch.from_numpy(np.concatenate(idx)).to(dev), torch.from_numpy(np.concatenate(val)).to(dev))


def _into(out, x):
    if out is None:
        return x
    out.copy_(x.view(out.shape))
    return out
