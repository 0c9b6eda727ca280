"""Diff two checkpoints: SOLAR versions (``ROOT@STEP``), ``torch.save``, safetensors or DCP checkpoints.

Every input becomes a :class:`TensorTable`: name -> dtype, shape, bytes, chunk digests and a Merkle
root. For a SOLAR version that table comes from the manifest alone, so the default diff reads no
tensor data: tensors with equal roots are skipped after one comparison, changed ones are compared
digest-array against digest-array (vectorised). Plain files are hashed on the fly with the other
side's chunk size. ``values=True`` then loads only the changed tensors and adds max absolute and
relative difference and the number of elements outside ``atol + rtol * |b|``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from solar.errors import CheckpointError, InputError

from . import merkle
from .chunking import DEFAULT_CHUNK_SIZE, hash_chunks, hasher
from .flatten import DTYPES, dtype_name, flatten
from .store import CheckpointStore, parse_ref

__all__ = ["TensorInfo", "TensorTable", "open_table", "diff", "DiffReport", "format_report", "table", "fmt_bytes"]


@dataclass
class TensorInfo:
    dtype: str
    shape: list[int]
    nbytes: int
    digests: np.ndarray  # (n, 16) chunk digests of the tensor's bytes (or its blob's)
    root: bytes
    exact: bool = True  # digests are of this tensor's own bytes (False: of a larger blob it views)


@dataclass
class TensorTable:
    """What a diff knows about one side: tensors by name, plus how to load one."""

    source: str
    chunk_size: int
    hash: str
    tensors: dict[str, TensorInfo]
    loader: Callable[[str], torch.Tensor]
    step: int | None = None
    logical_bytes: int = 0


def _from_version(root: str, step: int | None) -> TensorTable:
    from .loader import Reader

    store = CheckpointStore(root)
    m = store.resolve(step)
    reader: Reader | None = None

    def load_tensor(name: str) -> torch.Tensor:
        nonlocal reader
        if reader is None:
            reader = Reader(root, m.step, store=store)
            reader.manifest = m
        return reader.tensor(name, map_location="cpu")

    tensors = {}
    for t in m.tensors:
        b = m.blobs[t.blob]
        exact = t.offset == 0 and t.nbytes == b.nbytes and t.contiguous_extent() is not None
        tensors[t.name] = TensorInfo(t.dtype, list(t.shape), t.nbytes, m.blob_digests(t.blob), bytes.fromhex(b.root), exact)
    return TensorTable(f"{store.root}@{m.step}", m.chunk_size, m.hash, tensors, load_tensor, m.step, m.logical_bytes)


def _load_dcp(path: str) -> Any:
    """A ``torch.distributed.checkpoint`` directory as one state dict (single process, CPU)."""
    import tempfile
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, os.path.join(tmp, "sd.pt"))
        return torch.load(os.path.join(tmp, "sd.pt"), map_location="cpu", weights_only=True)


def _load_file(path: str) -> dict[str, torch.Tensor]:
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        obj = _load_dcp(path)
    elif not os.path.isfile(path):
        raise InputError(f"{path}: no such file, and not a ROOT@STEP checkpoint reference")
    elif path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return dict(load_file(path))
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds
            raise InputError(f"{path}: cannot read as a torch.save file ({exc}); diff takes ROOT@STEP, .pt, "
                             f".safetensors or a torch.distributed.checkpoint directory") from exc
    flat = flatten(obj)
    out = {}
    for ref in flat.tensors:
        blob = flat.blobs[ref.blob]
        t = torch.empty(0, dtype=DTYPES[ref.dtype])
        out[ref.name] = t.set_(blob.storage, (blob.start + ref.offset) // t.element_size(), ref.shape, ref.stride)
    return out


def c_order_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's C-order bytes as a uint8 array (a view when already dense, else one copy).

    ``contiguous()`` alone is not enough: a dimension of size 1 may keep any stride (torch still
    calls the tensor contiguous), and viewing as bytes needs a unit last stride.
    """
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, np.uint8)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def _tensor_info(t: torch.Tensor, chunk_size: int, digest: Callable) -> TensorInfo:
    """Chunk digests and Merkle root of a tensor's own (C-contiguous) bytes."""
    raw = c_order_bytes(t)
    leaves = hash_chunks(raw, chunk_size, digest)
    return TensorInfo(dtype_name(t.dtype), list(t.shape), raw.nbytes, leaves, merkle.root(merkle.build(leaves, digest)))


def _from_file(path: str, chunk_size: int, hash_name: str) -> TensorTable:
    tensors = _load_file(path)
    digest = hasher(hash_name)
    infos = {name: _tensor_info(t, chunk_size, digest) for name, t in tensors.items()}
    return TensorTable(path, chunk_size, hash_name, infos, lambda n: tensors[n], None,
                       sum(i.nbytes for i in infos.values()))


def _is_version_ref(ref: str) -> tuple[str, int | None] | None:
    root, step = parse_ref(ref)
    if step is not None:
        return root, step
    if (os.path.isdir(ref) and not os.path.isfile(os.path.join(ref, ".metadata"))) or "://" in ref:
        return ref, None
    return None


def open_table(ref: str, *, chunk_size: int | None = None, hash_name: str | None = None) -> TensorTable:
    """The tensor table of ``ref``: ``ROOT@STEP``, ``ROOT`` (newest), ``.pt`` or ``.safetensors``."""
    version = _is_version_ref(ref)
    if version is not None:
        return _from_version(*version)
    return _from_file(ref, chunk_size or DEFAULT_CHUNK_SIZE, hash_name or "xxh3_128")


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

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def to_json(self) -> dict:
        return {
            "a": self.a, "b": self.b, "identical": self.identical, "added": self.added, "removed": self.removed,
            "changed": self.changed, "unchanged": self.unchanged, "changed_chunks": self.changed_chunks,
            "changed_bytes": self.changed_bytes, "prefix": list(self.prefix),
        }


def _strip(table: TensorTable, prefix: str) -> TensorTable:
    if not prefix:
        return table
    names = {n[len(prefix):]: n for n in table.tensors if n.startswith(prefix)}
    loader = table.loader
    return TensorTable(table.source, table.chunk_size, table.hash, {k: table.tensors[v] for k, v in names.items()},
                       lambda k: loader(names[k]), table.step, table.logical_bytes)


def _align(ta: TensorTable, tb: TensorTable) -> tuple[TensorTable, TensorTable, tuple[str, str]]:
    """Match a full training checkpoint against a bare model file.

    ``{"model": ..., "optim": ...}`` saved by SOLAR names tensors ``model.layer.weight``, while a
    ``model.safetensors`` names them ``layer.weight``. If stripping one top-level prefix from one
    side matches more names than the sides share as they are, compare under that prefix only.
    """
    best = (len(ta.tensors.keys() & tb.tensors.keys()), "", "")
    for side in ("a", "b"):
        mine, other = (ta, tb) if side == "a" else (tb, ta)
        for prefix in {n.split(".", 1)[0] + "." for n in mine.tensors if "." in n}:
            overlap = sum(1 for n in mine.tensors if n.startswith(prefix) and n[len(prefix):] in other.tensors)
            if overlap > best[0]:
                best = (overlap, prefix if side == "a" else "", prefix if side == "b" else "")
    _, pa, pb = best
    return _strip(ta, pa), _strip(tb, pb), (pa, pb)


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


def diff(a: "str | TensorTable", b: "str | TensorTable", *, values: bool = False, atol: float = 0.0, rtol: float = 0.0) -> DiffReport:
    """Compare ``a`` and ``b`` (refs or tables); manifest-only unless ``values``.

    Raises:
        InputError / CheckpointError: a side cannot be opened.
    """
    ta = a if isinstance(a, TensorTable) else None
    tb = b if isinstance(b, TensorTable) else None
    if ta is None and tb is None:
        va, vb = _is_version_ref(a), _is_version_ref(b)
        if va is None and vb is not None:
            tb = open_table(b)
        else:
            ta = open_table(a)
    if ta is None:
        ta = open_table(a, chunk_size=tb.chunk_size, hash_name=tb.hash)
    if tb is None:
        tb = open_table(b, chunk_size=ta.chunk_size, hash_name=ta.hash)
    comparable = ta.chunk_size == tb.chunk_size and ta.hash == tb.hash
    rep = DiffReport(ta.source, tb.source, values=values)
    ta, tb, rep.prefix = _align(ta, tb)
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
                ia = _tensor_info(ta.loader(name), tb.chunk_size, digest)
            if not ib.exact:
                ib = _tensor_info(tb.loader(name), tb.chunk_size, digest)
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
    return rep


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def table(head: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns; short rows are padded."""
    rows = [list(r) + [""] * (len(head) - len(r)) for r in rows]
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows)


def format_report(rep: DiffReport) -> str:
    """A readable table of a :class:`DiffReport`."""
    lines = [f"--- {rep.a}" + (f" (tensors under {rep.prefix[0]!r})" if rep.prefix[0] else ""),
             f"+++ {rep.b}" + (f" (tensors under {rep.prefix[1]!r})" if rep.prefix[1] else "")]
    if rep.identical:
        lines.append(f"identical ({rep.unchanged} tensors)")
        return "\n".join(lines)
    head = ["status", "tensor", "chunks", "bytes", "detail"]
    if rep.values:
        head += ["max|Δ|", "max rel", "changed elems"]
    rows = [["added", n, "", "", ""] for n in rep.added] + [["removed", n, "", "", ""] for n in rep.removed]
    for e in rep.changed:
        detail = []
        if "dtype" in e:
            detail.append(f"dtype {e['dtype'][0]} -> {e['dtype'][1]}")
        if "shape" in e:
            detail.append(f"shape {e['shape'][0]} -> {e['shape'][1]}")
        row = ["changed", e["name"], f"{e['chunks']}/{e['total_chunks']}", fmt_bytes(e["bytes"]), ", ".join(detail)]
        if rep.values:
            row += [f"{e['max_abs']:.3g}", f"{e['max_rel']:.3g}", f"{e['changed_elements']}/{e['elements']}"] if "max_abs" in e else ["", "", ""]
        rows.append(row)
    lines.append(table(head, rows))
    lines.append(
        f"{len(rep.added)} added, {len(rep.removed)} removed, {len(rep.changed)} changed, {rep.unchanged} unchanged; "
        f"{rep.changed_chunks} changed chunks ({fmt_bytes(rep.changed_bytes)})"
    )
    return "\n".join(lines)
