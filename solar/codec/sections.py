"""An ``ebq`` group's sections after the CPU lossless stage: codes, escapes, exact outliers.

:func:`gather` decompresses every blob's sections and checks the sparse ones (escapes, outliers,
nibble side values) for the whole group at once; every decoder path (reference torch ops,
compiled graph, ``cpu-kernel``) starts from its :class:`Gathered` result, so all of them refuse
the same damaged blobs with the same :class:`~solar.errors.CorruptDataError`.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Sequence

import numpy as np

from solar.errors import CorruptDataError

from . import bitpack
from . import lossless as ll
from .base import Parsed
from .ebq_meta import BITPACK, NIBBLES, EbqMeta, code_len

__all__ = ["Gathered", "gather", "check_side"]


class Gathered(NamedTuple):
    """A group's sections after the CPU lossless stage, before any tensor op."""

    planes: dict  # code width -> (rows of that width, code bytes) uint8 array; BITPACK: a Packed
    rows: dict  # code width -> the group rows with that width
    kinds: list  # per row: its code width
    marks: np.ndarray | None  # nibble codes: flat positions of the side markers in the unpacked stream
    side: np.ndarray | None  # nibble codes: the side values, in marker order
    esc_idx: list  # escapes: flat positions in (B, n) and true residuals (at most one array each)
    esc_val: list
    out_idx: list  # exact outliers: flat positions in (B, n), in input order, and verbatim values
    out_val: list
    steps: np.ndarray  # per row, in the decoded (sorted) order
    offs: np.ndarray


def gather(blobs: Sequence[Parsed], metas: list[EbqMeta], n: int, order, int8_stream: bool) -> Gathered:
    """Decompress every blob's sections and check the sparse ones for the whole group at once."""
    h0, m0, B = blobs[0].header, metas[0], len(blobs)
    kinds = [m.width for m in metas] if int8_stream else [m0.width] * B
    rows = {k: [i for i, kk in enumerate(kinds) if kk == k] for k in sorted(set(kinds))}
    if m0.width == BITPACK:  # a group never mixes bitpack and other codes (ebq's group_key)
        rows = {}
    planes = {k: np.empty((len(r), code_len(k, n)), np.uint8) for k, r in rows.items()}
    slot = {i: j for r in rows.values() for j, i in enumerate(r)}
    esc_idx, esc_val, out_idx, out_val, sides, esc, outl = [], [], [], [], [], [], []
    steps = np.empty(B, h0.dtype)
    offs = np.empty(B, h0.dtype)
    for i, (b, m) in enumerate(zip(blobs, metas)):
        steps[i], offs[i] = m.step, m.offset
        name, p, c_len, e_len = ll.LOSSLESS[m.lossless], b.payload, m.codes_len, m.esc_len
        if m.width == BITPACK:
            bitpack.check(p[:c_len], n, m.qint, b.what)
        else:
            nb = code_len(m.width, n)
            raw = np.frombuffer(ll.decompress(p[:c_len], name, nb + m.n_side, b.what), np.uint8)
            planes[m.width][slot[i]] = raw[:nb]
        if m.n_side:
            sides.append(raw[nb:])
        if m.n_esc:
            esc.append((p[c_len:c_len + e_len], name, m.n_esc, b.what, i))
        if m.n_out:
            outl.append((p[c_len + e_len:], name, m.n_out, b.what, i if order is None else int(order[i])))
    if esc:  # all blobs' sparse sections checked and placed with a few array ops (not per blob)
        pos, val = _sparse_group(esc, np.dtype("<i8"), n, limit=1 << 31 if m0.qint == 4 else None)
        esc_idx, esc_val = [pos], [val.astype(np.int32 if m0.qint == 4 else np.int64)]
    if outl:
        pos, val = _sparse_group(outl, h0.dtype, n)
        out_idx, out_val = [pos], [val]
    if m0.width == BITPACK:
        planes[BITPACK] = bitpack.concat([b.payload[:m.codes_len] for b, m in zip(blobs, metas)])
        rows = {BITPACK: list(range(B))}
    marks = side = None
    if NIBBLES in planes:  # where the side values go: found on the packed bytes, before they leave the CPU
        nib = rows[NIBBLES]
        marks, side = check_side(planes[NIBBLES], np.concatenate(sides) if sides else np.empty(0, np.uint8),
                                 [blobs[i].what for i in nib], [metas[i].n_side for i in nib])
    return Gathered(planes, rows, kinds, marks, side, esc_idx, esc_val, out_idx, out_val, steps, offs)


def check_side(packed: np.ndarray, side: np.ndarray, names: list[str],
               counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The side markers' positions in nibble codes and the side values, which must be as many.

    ``packed``: one row of packed nibbles per blob, named by ``names``, whose side values (``side``
    holds them all, blob after blob) number ``counts``. A mismatch names the first blob whose own
    markers and side values disagree, the blob that is damaged, not the group's first."""
    marks = _nibble_markers(packed)
    if marks.size != side.size:
        found = np.bincount(marks // (2 * packed.shape[1]), minlength=len(names))  # markers per blob (row)
        at = next((j for j, (f, c) in enumerate(zip(found, counts)) if f != c), 0)
        raise CorruptDataError(f"{names[at]}: nibble stream has {int(found[at])} side markers for {counts[at]} side "
                               "values; corrupted payload")
    return marks, side


def _nibble_markers(packed: np.ndarray) -> np.ndarray:
    """Flat positions (in the unpacked ``(B, 2k)`` stream) of the -8 markers in packed nibbles.

    Byte masks and one flatnonzero on the CPU cost a fraction of a full-stream ``nonzero``
    after unpacking, and the positions come out sorted, matching the side streams' order. The
    bytes are scanned contiguously once; the per-nibble split is done on the few candidate bytes
    only (far less work than flagging both nibbles through strided views of the whole stream).
    """
    p = packed.reshape(-1)
    hit = (p & 0x0F) == 0x08
    hit |= (p & 0xF0) == 0x80
    c = np.flatnonzero(hit)
    pc = p[c]
    which = np.stack([(pc & 0x0F) == 0x08, (pc & 0xF0) == 0x80], axis=1)
    return (2 * c[:, None] + np.arange(2))[which]


def _sparse_group(items: list, vdtype: np.dtype, n: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse sections of a group's blobs -> flat positions in ``(B, n)`` and their values.

    ``items``: ``(section, lossless, count, what, row)`` per blob that has one. A section is
    ``count`` delta-coded int64 positions then ``count`` values. Every position is checked for
    all blobs at once: strictly increasing, so patching is order-free; every delta and every sum
    below ``n`` (with deltas below ``n`` the first sum past ``n`` is below ``2n``, so a later
    int64 wrap-around cannot hide it). With ``limit``, every value must lie in
    ``[-limit, limit)``. An error names the first offending blob.
    """
    if len(items) == 1:
        return _sparse_one(items[0], vdtype, n, limit)
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

    check((d < later) | (d >= n), _UNORDERED)
    pos = np.cumsum(d)
    pos -= np.repeat(pos[starts] - d[starts], counts)  # restart the sum at each blob's section
    check(pos >= n, f"sparse position out of range for {n} values")  # every entry: see above
    if limit is not None:
        check((vals < -limit) | (vals >= limit), _ESCAPE_RANGE)
    pos += np.repeat(np.fromiter((it[4] for it in items), np.int64, len(items)) * n, counts)
    return pos, vals


_UNORDERED = "sparse positions are not strictly increasing or out of range"
_ESCAPE_RANGE = "escape value out of range"


def _sparse_one(item: tuple, vdtype: np.dtype, n: int, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_sparse_group` of one blob's section (a one-blob decode): the same checks and
    errors, as a few reductions instead of the group's concatenations and masks. The largest
    sum decides the range check: the first sum past ``n`` is below ``2n`` and no earlier one
    wraps, so the maximum sees it."""
    sec, name, cnt, what, row = item
    raw = ll.decompress(sec, name, cnt * (8 + vdtype.itemsize), what)
    d = np.frombuffer(raw, "<i8", cnt)
    vals = np.frombuffer(raw, vdtype, cnt, offset=8 * cnt)
    if cnt <= _FEW:  # a few entries: Python ints beat numpy's per-call cost, same checks
        why, pos = _few_problem(d.tolist(), vals.tolist() if limit is not None else (), n, limit)
    else:
        why = None
        if d[0] < 0 or d.max() >= n or (cnt > 1 and d[1:].min() < 1):
            why = _UNORDERED
        else:
            pos = np.cumsum(d)
            if pos.max() >= n:
                why = f"sparse position out of range for {n} values"
            elif limit is not None and (vals.min() < -limit or vals.max() >= limit):
                why = _ESCAPE_RANGE
    if why:
        raise CorruptDataError(f"{what}: {why}; corrupted payload")
    if row:
        pos += row * n
    return pos, vals


_FEW = 32


def _few_problem(d: list, vals: list, n: int, limit: int | None):
    """:func:`_sparse_one`'s checks on a few deltas and values as Python ints -> (what is wrong or
    None, the positions)."""
    if d[0] < 0 or max(d) >= n or min(d[1:], default=1) < 1:
        return _UNORDERED, None
    pos = list(accumulate(d))
    if pos[-1] >= n:
        return f"sparse position out of range for {n} values", None
    if limit is not None and (min(vals) < -limit or max(vals) >= limit):
        return _ESCAPE_RANGE, None
    return None, np.array(pos, np.int64)
