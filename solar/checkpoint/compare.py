"""The diff engine: compare two :class:`~solar.checkpoint.sources.TensorTable` objects, tensors and plain values.

Tensors with equal Merkle roots are skipped after one comparison; changed ones are compared
digest-array against digest-array (vectorised), so the default diff of two SOLAR versions reads no
tensor data. ``values=True`` then loads only the changed tensors and adds max absolute and
relative difference and the number of elements outside ``atol + rtol * |b|``. Plain values are
compared by their JSON skeleton form. :mod:`~solar.checkpoint.report` turns the
:class:`DiffReport` into text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from solar.errors import InputError

from .chunking import hasher
from .deltastats import increment, saved_stats
from .sources import TensorTable, open_table, tensor_info, version_ref

__all__ = ["DiffReport", "diff"]


@dataclass
class DiffReport:
    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[dict] = field(default_factory=list)
    unchanged: int = 0
    changed_chunks: int = 0
    changed_bytes: int = 0
    values: bool = False
    prefix: tuple[str, str] = ("", "")  # name prefixes stripped to match the sides (see _align)
    # plain (non-tensor) values: added/removed {"name", "value"}, changed {"name", "a", "b"}
    plain_added: list[dict] = field(default_factory=list)
    plain_removed: list[dict] = field(default_factory=list)
    plain_changed: list[dict] = field(default_factory=list)
    plain_unchanged: int = 0
    plain_compared: bool = True
    plain_note: str = ""  # why plain values were not compared
    # two versions of one root: what each save after a up to b wrote (report.increment, with "step")
    increments: list[dict] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.plain_added or self.plain_removed
                    or self.plain_changed)

    def to_json(self) -> dict:
        return {
            "a": self.a, "b": self.b, "identical": self.identical, "added": self.added, "removed": self.removed,
            "changed": self.changed, "unchanged": self.unchanged, "changed_chunks": self.changed_chunks,
            "changed_bytes": self.changed_bytes, "prefix": list(self.prefix),
            "plain": {"compared": self.plain_compared, "note": self.plain_note, "added": self.plain_added,
                      "removed": self.plain_removed, "changed": self.plain_changed,
                      "unchanged": self.plain_unchanged},
            "increments": self.increments,
        }


class _Aligned(NamedTuple):
    """The two sides of a diff with the name prefix each was stripped of (see :func:`_align`)."""

    a: TensorTable
    b: TensorTable
    prefix: tuple[str, str]  # (stripped from a, stripped from b); "" where nothing was


def _strip(table: TensorTable, prefix: str) -> TensorTable:
    if not prefix:
        return table
    names = {n[len(prefix):]: n for n in table.tensors if n.startswith(prefix)}
    loader = table.loader
    plain = (None if table.plain is None
             else {k[len(prefix):]: v for k, v in table.plain.items() if k.startswith(prefix)})
    return TensorTable(table.source, table.chunk_size, table.hash, {k: table.tensors[v] for k, v in names.items()},
                       lambda k: loader(names[k]), table.step, table.logical_bytes, plain, table.plain_note)


def _overlap(mine: TensorTable, other: TensorTable, prefix: str) -> int:
    """How many of ``mine``'s names under ``prefix`` are names of ``other`` once it is stripped."""
    return sum(1 for n in mine.tensors if n.startswith(prefix) and n[len(prefix):] in other.tensors)


def _align(ta: TensorTable, tb: TensorTable, prefix: str | None = None) -> _Aligned:
    """Match a full training checkpoint against a bare model file.

    ``{"model": ..., "optim": ...}`` saved by SOLAR names tensors ``model.layer.weight``, while a
    ``model.safetensors`` names them ``layer.weight``. If stripping one top-level prefix from one
    side matches more names than the sides share as they are, compare under that prefix only.

    Two prefixes that match equally many names (``model.*`` and ``ema.*`` with the same parameter
    names: EMA, teacher/student, GAN checkpoints) are ambiguous, and :class:`InputError` lists
    them: taking either would compare a sub-model the user may not mean, and which one a set
    yields first depends on ``PYTHONHASHSEED``. ``prefix`` chooses one (``""``:
    compare the names as they are); it is stripped from the side where it matches more names.
    """
    sides = (("a", ta, tb), ("b", tb, ta))
    if prefix is not None:
        if not prefix:
            return _Aligned(ta, tb, ("", ""))
        prefix = prefix if prefix.endswith(".") else prefix + "."
        overlap, side = max((_overlap(mine, other, prefix), -i) for i, (_s, mine, other) in enumerate(sides))
        if not overlap:
            raise InputError(f"prefix {prefix!r} matches no tensor of {ta.source} or {tb.source} that the other side "
                             f"holds without it; `solar-ckpt show` lists the names (or pass --prefix '' to compare "
                             f"them as they are)")
        return _stripped(ta, tb, prefix if side == 0 else "", prefix if side == -1 else "")
    best = len(ta.tensors.keys() & tb.tensors.keys())
    tied: list[tuple[str, str]] = []  # (side, prefix) matching ``best`` names, in sorted order
    for side, mine, other in sides:
        for p in sorted({n.split(".", 1)[0] + "." for n in mine.tensors if "." in n}):
            overlap = _overlap(mine, other, p)
            if overlap > best:
                best, tied = overlap, [(side, p)]
            elif overlap == best and tied:
                tied.append((side, p))
    if not tied:
        return _Aligned(ta, tb, ("", ""))
    if len(tied) > 1:
        names = ", ".join(f"{p!r} (in {ta.source if s == 'a' else tb.source})" for s, p in tied)
        raise InputError(f"ambiguous prefix: {names} each match {best} tensor names of the other side once stripped "
                         f"(e.g. a model and its EMA copy); choose one with --prefix, e.g. --prefix {tied[0][1]} "
                         f"(diff(..., prefix={tied[0][1]!r}) in Python), "
                         f"or --prefix '' to compare the names as they are")
    side, p = tied[0]
    return _stripped(ta, tb, p if side == "a" else "", p if side == "b" else "")


def _stripped(ta: TensorTable, tb: TensorTable, pa: str, pb: str) -> _Aligned:
    return _Aligned(_strip(ta, pa), _strip(tb, pb), (pa, pb))


def _value_stats(ta: torch.Tensor, tb: torch.Tensor, atol: float, rtol: float) -> dict:
    a = ta.detach().cpu()
    b = tb.detach().cpu()
    if not (a.is_floating_point() or a.is_complex() or b.is_floating_point() or b.is_complex()):
        # integers compare exactly (float64 would merge values above 2**53)
        a, b = a.to(torch.int64), b.to(torch.int64)
        delta = (a - b).abs()
        outside = delta.to(torch.float64) > (atol + rtol * b.abs().to(torch.float64))
        rel = delta.to(torch.float64) / b.abs().to(torch.float64).clamp_min(1)
        return {
            "max_abs": float(delta.max()) if delta.numel() else 0.0,
            "max_rel": float(rel.max()) if rel.numel() else 0.0,
            "changed_elements": int(outside.sum()),
            "elements": int(delta.numel()),
        }
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(b)
    delta = (a - b).abs()
    delta = torch.where(both_nan | (a == b), torch.zeros_like(delta), delta)  # equal infinities, matching NaNs
    delta = torch.nan_to_num(delta, nan=math.inf)
    # rtol * |b| is NaN for an infinite b with rtol = 0; an infinite delta (NaN or inf on one side
    # only) is a change whatever the tolerance
    outside = (delta > (atol + (rtol * b.abs() if rtol else 0.0))) | torch.isinf(delta)
    rel = delta / b.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(delta == 0, torch.zeros_like(rel), rel)
    rel = torch.where(torch.isinf(delta), torch.full_like(rel, math.inf), rel)  # inf/inf would be NaN
    return {
        "max_abs": float(delta.max()) if delta.numel() else 0.0,
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
        "changed_elements": int(outside.sum()),
        "elements": int(delta.numel()),
    }


def _number(v: Any) -> "int | float | None":
    """A plain value as a number for ``--values`` tolerances (bools and strings are not numbers)."""
    if type(v) in (int, float):
        return v
    if isinstance(v, dict) and len(v) == 1 and "__float__" in v:
        return float(v["__float__"])
    return None


def _plain_equal(va: Any, vb: Any, values: bool, atol: float, rtol: float) -> bool:
    """Equal JSON forms; with ``values``, numbers also within ``atol + rtol * |b|`` (as tensors are)."""
    if json.dumps(va) == json.dumps(vb):
        return True
    if not values:
        return False
    na, nb = _number(va), _number(vb)
    if na is None or nb is None:
        return False
    if isinstance(na, float) and isinstance(nb, float) and math.isnan(na) and math.isnan(nb):
        return True
    if na == nb:  # also equal infinities, and 1 == 1.0
        return True
    delta = abs(na - nb)  # exact for two ints
    return not math.isnan(delta) and not math.isinf(delta) and delta <= atol + rtol * abs(nb)


def _diff_plain(rep: DiffReport, ta: TensorTable, tb: TensorTable, atol: float, rtol: float) -> None:
    if ta.plain is None or tb.plain is None:
        rep.plain_compared = False
        rep.plain_note = "; ".join(n for n in (ta.plain_note, tb.plain_note) if n) or "a side holds no plain values"
        return
    rep.plain_added = [{"name": n, "value": v} for n, v in tb.plain.items() if n not in ta.plain]
    rep.plain_removed = [{"name": n, "value": v} for n, v in ta.plain.items() if n not in tb.plain]
    for name, va in ta.plain.items():
        if name not in tb.plain:
            continue
        vb = tb.plain[name]
        if _plain_equal(va, vb, rep.values, atol, rtol):
            rep.plain_unchanged += 1
        else:
            rep.plain_changed.append({"name": name, "a": va, "b": vb})


def diff(a: "str | TensorTable", b: "str | TensorTable", *, values: bool = False, atol: float = 0.0, rtol: float = 0.0,
         trust_pickle: bool = False, prefix: str | None = None, rank: int | None = None) -> DiffReport:
    """Compare ``a`` and ``b`` (refs or tables), tensors and plain values; manifest-only unless ``values``.

    With ``values``, numeric plain values (ints and floats, not bools) within ``atol + rtol * |b|``
    count as unchanged, as tensor elements do. ``trust_pickle``: see :func:`open_table`.
    ``prefix``: compare the tensors under this name prefix of one side (``"ema."``) with the other
    side's; ``None`` finds it (see :func:`_align`), ``""`` compares names as they are.
    ``rank``: on job roots, compare that rank's states (default: every rank's, as ``rank R/NAME``).

    Raises:
        InputError / CheckpointError: a side cannot be opened, or the prefix is ambiguous (or given
            and matches nothing).
    """
    ta = a if isinstance(a, TensorTable) else None
    tb = b if isinstance(b, TensorTable) else None
    if ta is None and tb is None:
        va, vb = version_ref(a), version_ref(b)
        if va is None and vb is not None:
            tb = open_table(b, trust_pickle=trust_pickle, rank=rank)
        else:
            ta = open_table(a, trust_pickle=trust_pickle, rank=rank)
    if ta is None:
        ta = open_table(a, chunk_size=tb.chunk_size, hash_name=tb.hash, trust_pickle=trust_pickle, rank=rank)
    if tb is None:
        tb = open_table(b, chunk_size=ta.chunk_size, hash_name=ta.hash, trust_pickle=trust_pickle, rank=rank)
    comparable = ta.chunk_size == tb.chunk_size and ta.hash == tb.hash
    rep = DiffReport(ta.source, tb.source, values=values)
    aligned = _align(ta, tb, prefix)
    ta, tb, rep.prefix = aligned.a, aligned.b, aligned.prefix
    _diff_plain(rep, ta, tb, atol, rtol)
    rep.added = [n for n in tb.tensors if n not in ta.tensors]
    rep.removed = [n for n in ta.tensors if n not in tb.tensors]
    for name, ia in ta.tensors.items():
        ib = tb.tensors.get(name)
        if ib is None:
            continue
        if not comparable or not ia.exact or not ib.exact:
            # different chunkings, or a view inside a larger SOLAR blob (tensors sharing storage):
            # the blob's digests also cover the other views' bytes, so hash what is needed of the
            # tensors themselves with B's chunking
            digest = hasher(tb.hash)
            if not comparable or not ia.exact:
                ia = tensor_info(ta.loader(name), tb.chunk_size, digest)
            if not ib.exact:
                ib = tensor_info(tb.loader(name), tb.chunk_size, digest)
        if ia.root == ib.root and ia.dtype == ib.dtype and ia.shape == ib.shape:
            rep.unchanged += 1
            continue
        entry: dict[str, Any] = {"name": name}
        if ia.dtype != ib.dtype:
            entry["dtype"] = [ia.dtype, ib.dtype]
        if ia.shape != ib.shape:
            entry["shape"] = [ia.shape, ib.shape]
        if len(ia.digests) == len(ib.digests):
            nchg = int((ia.digests != ib.digests).any(axis=1).sum())
        else:
            nchg = max(len(ia.digests), len(ib.digests))
        if nchg == 0 and "dtype" not in entry and "shape" not in entry:
            rep.unchanged += 1  # same bytes (e.g. a view into an unchanged part of a changed blob)
            continue
        entry["chunks"] = nchg
        entry["total_chunks"] = len(ib.digests)
        entry["bytes"] = min(nchg * tb.chunk_size, max(ia.nbytes, ib.nbytes))
        if values and "shape" not in entry:
            stats = _value_stats(ta.loader(name), tb.loader(name), atol, rtol)
            entry.update(stats)
            if stats["changed_elements"] == 0 and "dtype" not in entry:
                rep.unchanged += 1  # equal within tolerance
                continue
        rep.changed.append(entry)
        rep.changed_chunks += nchg
        rep.changed_bytes += entry["bytes"]
    rep.increments = increments_between(a, b, rank) if isinstance(a, str) and isinstance(b, str) else []
    return rep


def increments_between(a: str, b: str, rank: int | None = None) -> list[dict]:
    """What each save after version ``a`` up to version ``b`` wrote, when both are versions of one
    root (``ROOT@S``, ``ROOT@T`` with ``S < T``); on a job root summed over the ranks (or ``rank``'s)."""
    va, vb = version_ref(a), version_ref(b)
    if va is None or vb is None or va[1] is None or vb[1] is None or va[0] != vb[0] or va[1] >= vb[1]:
        return []
    out = []
    for stats, step in saved_stats(va[0], va[1], vb[1], rank):
        summed: dict = {"step": step}
        for inc in (increment(s) for s in stats):
            for k, v in inc.items():
                summed[k] = None if v is None or summed.get(k, 0) is None else summed.get(k, 0) + v
        out.append(summed)
    return out
