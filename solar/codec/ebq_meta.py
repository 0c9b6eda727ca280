"""The ``ebq`` codec's private header metadata: :class:`EbqMeta`, its byte layouts, its checks.

Every format version's metadata is a fixed little-endian struct (:data:`_METAS`); a reader turns
any of them into one :class:`EbqMeta` (fields a version lacks take the value that version
implied), so the decoder reads every version by field name. Only the newest layout is written.
The struct layouts are part of the on-disk format: golden fixtures in ``tests/fixtures/codec``
must keep decoding bit-exactly.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from solar.errors import CorruptDataError

from . import lossless as ll
from .bitpack import blocks, head
from .header import Header
from .predict import Predictor

__all__ = ["EbqMeta", "NIBBLES", "BITPACK", "WIDTHS", "fold_axes", "code_len"]

# Metadata layout per format version, in EbqMeta's field order. v1 lacks ``cubic_levels`` (its
# predictor id says linear or cubic for every level), ``n_side``, ``fold`` and ``kshift``; v2 adds
# ``cubic_levels``, v3 ``n_side``, v4 ``fold``, v5 ``kshift``. v6 has v5's layout (only the
# interpolation pass order differs: innermost axis first); v7 too (it adds code width BITPACK).
_METAS = {1: struct.Struct("<BBBBddQQQQQ"), 2: struct.Struct("<BBBBddQQQQQQ"), 3: struct.Struct("<BBBBddQQQQQQQ"),
          4: struct.Struct("<BBBBddQQQQQQQB"), 5: struct.Struct("<BBBBddQQQQQQQBB"),
          6: struct.Struct("<BBBBddQQQQQQQBB"), 7: struct.Struct("<BBBBddQQQQQQQBB")}
#: Code width 0: 4-bit pairs with an int8 side stream (ebq/3+); other widths are bytes per code.
NIBBLES = 0
#: Code width 255 (ebq/7+): the codes section is :mod:`solar.codec.bitpack`'s fixed-length blocks,
#: stored without a byte-oriented lossless stage (``lossless`` none), with no escapes or side stream.
BITPACK = 255
WIDTHS = (1, 2, 4, 8)
#: Leading axes of at most this size (channels: amplitude/phase, velocity components) are folded
#: into the batch: each channel is predicted on its own instead of from its neighbour channel.
_FOLD_MAX = 4
_FMAX = {4: float(np.finfo(np.float32).max), 8: float(np.finfo(np.float64).max)}
_ALL_LEVELS = (1 << 64) - 1


class EbqMeta(NamedTuple):
    """One blob's metadata (the newest layout's fields; see the module docstring)."""

    predictor: Predictor
    lossless: ll.Lossless
    width: int  # code width: NIBBLES or bytes per code (WIDTHS); raw blobs: the dtype's itemsize
    qint: int  # bytes of the decoder's integers (4 or 8)
    step: float  # the quantization bin (``fine``: the unit bin / 2**kshift)
    offset: float
    cubic_levels: int  # bit l set: cubic interpolation on level l (interpolation predictors)
    codes_len: int  # compressed length of the codes section
    n_esc: int  # residuals that escape their code width
    esc_len: int  # compressed length of the escapes section
    n_out: int  # values stored verbatim (exact outliers)
    out_len: int  # compressed length of the outliers section
    n_side: int  # nibble mode: residuals carried by the int8 side stream
    fold: int  # leading axes treated as a batch (channels)
    kshift: int  # the ``fine`` predictor's K = 2**kshift units per bin; 0 otherwise

    def pack(self) -> bytes:
        """The newest layout's bytes."""
        return _METAS[max(_METAS)].pack(*self)

    @classmethod
    def unpack(cls, version: int, raw: bytes) -> "EbqMeta":
        """Any version's bytes as an EbqMeta, unchecked (:meth:`parse` checks): ids no encoder
        writes stay plain ints."""
        m = _METAS[version].unpack(raw)
        if version == 1:
            m = m[:6] + (_ALL_LEVELS if m[0] == Predictor.CUBIC else 0,) + m[6:]
        m += (0,) * (_NFIELDS - len(m))
        return tuple.__new__(cls, (_PREDICTOR.get(m[0], m[0]), _LOSSLESS.get(m[1], m[1])) + m[2:])

    @classmethod
    def parse(cls, h: Header, what: str) -> "EbqMeta":
        """The checked metadata of a blob with header ``h`` (runs once per blob: kept cheap).

        Raises:
            CorruptDataError: wrong length, unknown ids, counts or sizes no encoder writes, or
                sections that could not expand to the sizes they claim (checked before the
                decoder allocates anything).
        """
        fmt = _METAS[h.version]
        if len(h.meta) != fmt.size:
            raise CorruptDataError(f"{what}: ebq metadata is {len(h.meta)} bytes, expected {fmt.size}")
        m = cls.unpack(h.version, h.meta)
        bad = m._problem(h)
        if bad:
            raise CorruptDataError(f"{what}: corrupted ebq header metadata ({bad})")
        name = ll.LOSSLESS[m.lossless]  # sizes must be reachable before anything is allocated
        raw = m.predictor == _RAW
        if m.width != BITPACK:  # a bitpack section's length is checked against its block widths
            ll.check_expansion(m.codes_len, h.nbytes if raw else code_len(m.width, h.size) + m.n_side, name, what)
        ll.check_expansion(m.esc_len, m.n_esc * 16, name, what)
        ll.check_expansion(m.out_len, m.n_out * (8 + h.dtype.itemsize), name, what)
        return m

    def _problem(self, h: Header) -> str | None:
        """What no encoder of ``h``'s version writes (None: nothing)."""
        pred, lossless, w, qint, step, offset, _, c_len, n_esc, e_len, n_out, o_len, n_side, fold, kshift = self
        n, v = h.size, h.version
        # ids LINEAR and CUBIC exist only in ebq/1, INTERP only from ebq/2 on
        if pred not in _PREDICTOR or lossless not in _LOSSLESS or pred in _ONE_KIND and (pred == _INTERP) != (v >= 2):
            return f"unknown predictor {int(pred)} or lossless stage {int(lossless)}"
        if c_len + e_len + o_len != h.payload_len:
            return "section lengths do not add up to the payload length"
        if pred == _RAW:
            if w != h.dtype.itemsize or n_esc or n_out or e_len or o_len:
                return "inconsistent lossless-mode metadata"
            return None
        if (w not in WIDTHS and not (w == NIBBLES and v >= 3) and not (w == BITPACK and v >= 7)) \
                or qint not in (4, 8) or (qint == 4 and w == 8):
            return f"invalid code width {w} / integer width {qint}"
        if w == BITPACK and (lossless != ll.Lossless.NONE or n_esc or n_side
                             or not head(n) <= c_len <= head(n) + blocks(n) * 32 * qint):
            return "inconsistent bitpack metadata"
        if (pred == _FINE) != (kshift > 0) or kshift > 16 or (pred == _FINE and v < 5):
            return f"invalid fine-predictor resolution {kshift} for predictor {int(pred)}"
        if fold > max(len(h.shape) - 1, 0) or fold > fold_axes(h.shape):
            return f"invalid folded axis count {fold} for shape {h.shape}"
        if n_side > n or (n_side and w != NIBBLES):
            return f"impossible side-stream count {n_side} for {n} values"
        fmax = _FMAX[h.dtype.itemsize]
        if not (0 < step <= fmax and abs(offset) <= fmax):
            return f"invalid step {step} / offset {offset}"
        if n_esc > n or n_out > n or (n_esc == 0) != (e_len == 0) or (n_out == 0) != (o_len == 0):
            return f"impossible escape/outlier counts {n_esc}/{n_out} for {n} values"
        return None


_NFIELDS = len(EbqMeta._fields)
_PREDICTOR = {int(p): p for p in Predictor}
_LOSSLESS = {int(s): s for s in ll.Lossless}
_RAW, _INTERP, _FINE = Predictor.RAW, Predictor.INTERP, Predictor.FINE
_ONE_KIND = frozenset({Predictor.LINEAR, Predictor.CUBIC, Predictor.INTERP})


def fold_axes(shape: tuple[int, ...]) -> int:
    """How many leading axes are small enough to be channels (at least one axis stays spatial)."""
    k = 0
    while k < len(shape) - 1 and shape[k] <= _FOLD_MAX:
        k += 1
    return k


def code_len(w: int, n: int) -> int:
    """Bytes of the fixed-width part of the codes section (nibbles: two codes per byte)."""
    return (n + 1) // 2 if w == NIBBLES else n * w
