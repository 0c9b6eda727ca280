"""Diff two checkpoints: SOLAR versions (``ROOT@STEP``), ``torch.save``, safetensors or DCP checkpoints.

Every input becomes a :class:`TensorTable`: name -> dtype, shape, bytes, chunk digests and a Merkle
root. For a SOLAR version that table comes from the manifest alone, so the default diff reads no
tensor data: tensors with equal roots are skipped after one comparison, changed ones are compared
digest-array against digest-array (vectorised). Plain files are hashed on the fly with the other
side's chunk size. ``values=True`` then loads only the changed tensors and adds max absolute and
relative difference and the number of elements outside ``atol + rtol * |b|``.

Plain (non-tensor) values are part of a checkpoint too (an optimizer's ``lr``, an epoch counter),
so they are compared as well, by their JSON form in the skeleton: a SOLAR version's manifest, a
``.pt`` or DCP checkpoint flattened the way a save would, or the skeleton ``solar-ckpt export``
keeps in a ``.safetensors`` file's metadata. Nothing is unpickled for that. A safetensors file
without that metadata holds tensors only: its plain values are then "not compared" (said in the
report) rather than all reported as removed.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from solar.errors import CheckpointError, InputError

from . import merkle
from .chunking import DEFAULT_CHUNK_SIZE, hash_chunks, hasher
from .flatten import DTYPES, dtype_name, flatten, unflatten
from .store import CheckpointStore, parse_ref

__all__ = ["TensorInfo", "TensorTable", "open_table", "diff", "DiffReport", "format_report", "table", "fmt_bytes",
           "plain_values"]


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
    # plain values by name, as in the JSON skeleton; None: this source holds none to compare
    # (a safetensors file without a SOLAR skeleton), and ``plain_note`` says why
    plain: dict[str, Any] | None = None
    plain_note: str = ""


def _key_name(k: Any) -> str:
    """A dict key of the skeleton as flatten spelled it in names (``f"{path}.{key}"`` of the raw key).

    Encoded keys (tuples, non-finite floats) are decoded; a pickled key is not (diff unpickles
    nothing) and is shown by its JSON form.
    """
    if not isinstance(k, dict):
        return str(k)
    text = json.dumps(k)
    return text if "__pickle__" in text else str(unflatten(k, []))


def plain_values(skeleton: Any) -> dict[str, Any]:
    """The non-tensor leaves of a skeleton by flattened name (``optim.param_groups.0.lr``), each in
    its JSON skeleton form (tagged objects such as ``{"__float__": "nan"}`` or ``{"__pickle__": ...}``
    stay as they are: nothing is unpickled).

    Empty containers count as leaves, so ``[]`` -> ``[1]`` or ``{}`` vanishing is seen too. Names
    follow :func:`~solar.checkpoint.flatten.flatten`'s tensor names, with ``#2`` ... for repeats.
    """
    out: dict[str, Any] = {}

    def add(path: str, value: Any) -> None:
        base, name, n = path or "<root>", path or "<root>", 1
        while name in out:
            n += 1
            name = f"{base}#{n}"
        out[name] = value

    def walk(obj: Any, path: str) -> None:
        def sub(k: Any) -> str:
            return f"{path}.{k}" if path else str(k)

        if isinstance(obj, list):
            if not obj:
                add(path, obj)
            for i, v in enumerate(obj):
                walk(v, sub(i))
            return
        if not isinstance(obj, dict):
            add(path, obj)
            return
        if len(obj) == 1:
            (tag, val), = obj.items()
            if tag == "__tensor__":
                return
            if tag == "__tuple__":
                if not val:
                    add(path, obj)
                for i, v in enumerate(val):
                    walk(v, sub(i))
                return
            if tag in ("__dict__", "__odict__"):
                if not val:
                    add(path, obj)
                for k, v in val:
                    walk(v, sub(_key_name(k)))
                return
            if tag.startswith("__"):  # a tagged scalar: __float__, __dtype__, __bytes__, __pickle__ ...
                add(path, obj)
                return
        if not obj:
            add(path, obj)
        for k, v in obj.items():
            walk(v, sub(k))

    walk(skeleton, "")
    return out


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
    return TensorTable(f"{store.root}@{m.step}", m.chunk_size, m.hash, tensors, load_tensor, m.step, m.logical_bytes,
                       plain_values(m.skeleton))


def _torch_load(file: str, shown: str, trust_pickle: bool, **kw: Any) -> Any:
    """``torch.load`` of ``file`` (named ``shown`` in errors), with ``weights_only=True`` unless trusted.

    A ``.pt`` whose state holds arbitrary objects (``np.random.get_state()`` in a training
    checkpoint, which ``solar-ckpt restore`` writes back as saved) fails torch's safe loader with a
    long multi-line error that names neither this tool's way out nor, in one line, the file.
    Unpickling it for real can run code, so that only happens on request (``trust_pickle``).
    """
    if trust_pickle:
        return torch.load(file, map_location="cpu", weights_only=False, **kw)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, **kw)
    except pickle.UnpicklingError as exc:
        try:
            unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        except Exception:  # noqa: BLE001 - only for the message
            unsafe = ""
        raise InputError(
            f"{shown}: holds non-tensor objects{f' ({unsafe})' if unsafe else ''} that torch will not load "
            f"safely (weights_only=True refuses them: unpickling can run arbitrary code); diff the SOLAR "
            f"version it came from directly (ROOT@STEP), or, if you trust this file, pass --trust-pickle "
            f"(diff(..., trust_pickle=True))") from exc


def _load_dcp(path: str, trust_pickle: bool = False) -> Any:
    """A ``torch.distributed.checkpoint`` directory as one state dict (single process, CPU)."""
    import tempfile
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, os.path.join(tmp, "sd.pt"))
        return _torch_load(os.path.join(tmp, "sd.pt"), path, trust_pickle)


def _load_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, str]:
    """Tensors and plain values of a ``.safetensors`` file.

    The format holds tensors only. A file ``solar-ckpt export`` wrote keeps the version's JSON
    skeleton in its metadata (``solar_skeleton``), so its plain values are compared; for any other
    file they are not compared (``None``) instead of all reported as removed.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    tensors = dict(load_file(path))
    try:
        return tensors, plain_values(json.loads(meta["solar_skeleton"])), ""
    except (KeyError, ValueError, TypeError):
        return tensors, None, (f"{path} is a .safetensors file without a SOLAR skeleton (it holds tensors only; "
                               f"`solar-ckpt export` keeps one)")


def _load_file(path: str, trust_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, str]:
    """Tensors, plain values (``None``: none to compare) and why not, of a ``.pt``, ``.safetensors`` or DCP input."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        obj = _load_dcp(path, trust_pickle)
    elif not os.path.isfile(path):
        raise InputError(f"{path}: no such file, and not a ROOT@STEP checkpoint reference")
    elif path.endswith(".safetensors"):
        return _load_safetensors(path)
    else:
        try:
            obj = _torch_load(path, path, trust_pickle, mmap=True)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds
            raise InputError(f"{path}: cannot read as a torch.save file ({exc}); diff takes ROOT@STEP, .pt, "
                             f".safetensors or a torch.distributed.checkpoint directory") from exc
    flat = flatten(obj)
    out = {}
    for ref in flat.tensors:
        blob = flat.blobs[ref.blob]
        t = torch.empty(0, dtype=DTYPES[ref.dtype])
        out[ref.name] = t.set_(blob.storage, (blob.start + ref.offset) // t.element_size(), ref.shape, ref.stride)
    return out, plain_values(flat.skeleton), ""


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


def _from_file(path: str, chunk_size: int, hash_name: str, trust_pickle: bool = False) -> TensorTable:
    tensors, plain, note = _load_file(path, trust_pickle)
    digest = hasher(hash_name)
    infos = {name: _tensor_info(t, chunk_size, digest) for name, t in tensors.items()}
    return TensorTable(path, chunk_size, hash_name, infos, lambda n: tensors[n], None,
                       sum(i.nbytes for i in infos.values()), plain, note)


def _is_version_ref(ref: str) -> tuple[str, int | None] | None:
    root, step = parse_ref(ref)
    if step is not None:
        return root, step
    if (os.path.isdir(ref) and not os.path.isfile(os.path.join(ref, ".metadata"))) or "://" in ref:
        return ref, None
    return None


def open_table(ref: str, *, chunk_size: int | None = None, hash_name: str | None = None,
               trust_pickle: bool = False) -> TensorTable:
    """The tensor table of ``ref``: ``ROOT@STEP``, ``ROOT`` (newest), ``.pt`` or ``.safetensors``.

    ``trust_pickle`` loads a ``.pt`` (or DCP) input with ``weights_only=False``: only for files
    you trust, since unpickling can run arbitrary code.
    """
    version = _is_version_ref(ref)
    if version is not None:
        return _from_version(*version)
    return _from_file(ref, chunk_size or DEFAULT_CHUNK_SIZE, hash_name or "xxh3_128", trust_pickle)


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
        }


def _strip(table: TensorTable, prefix: str) -> TensorTable:
    if not prefix:
        return table
    names = {n[len(prefix):]: n for n in table.tensors if n.startswith(prefix)}
    loader = table.loader
    plain = None if table.plain is None else {k[len(prefix):]: v for k, v in table.plain.items() if k.startswith(prefix)}
    return TensorTable(table.source, table.chunk_size, table.hash, {k: table.tensors[v] for k, v in names.items()},
                       lambda k: loader(names[k]), table.step, table.logical_bytes, plain, table.plain_note)


def _overlap(mine: TensorTable, other: TensorTable, prefix: str) -> int:
    """How many of ``mine``'s names under ``prefix`` are names of ``other`` once it is stripped."""
    return sum(1 for n in mine.tensors if n.startswith(prefix) and n[len(prefix):] in other.tensors)


def _align(ta: TensorTable, tb: TensorTable, prefix: str | None = None) -> tuple[TensorTable, TensorTable, tuple[str, str]]:
    """Match a full training checkpoint against a bare model file.

    ``{"model": ..., "optim": ...}`` saved by SOLAR names tensors ``model.layer.weight``, while a
    ``model.safetensors`` names them ``layer.weight``. If stripping one top-level prefix from one
    side matches more names than the sides share as they are, compare under that prefix only.

    Two prefixes that match equally many names (``model.*`` and ``ema.*`` with the same parameter
    names: EMA, teacher/student, GAN checkpoints) are ambiguous, and :class:`InputError` lists
    them: taking either would compare a sub-model the user may not mean, and the answer (even
    "identical") depended on set order, i.e. on ``PYTHONHASHSEED``. ``prefix`` chooses one (``""``:
    compare the names as they are); it is stripped from the side where it matches more names.
    """
    sides = (("a", ta, tb), ("b", tb, ta))
    if prefix is not None:
        if not prefix:
            return ta, tb, ("", "")
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
        return ta, tb, ("", "")
    if len(tied) > 1:
        names = ", ".join(f"{p!r} (in {ta.source if s == 'a' else tb.source})" for s, p in tied)
        raise InputError(f"ambiguous prefix: {names} each match {best} tensor names of the other side once stripped "
                         f"(e.g. a model and its EMA copy); choose one with --prefix, e.g. --prefix {tied[0][1]} "
                         f"(diff(..., prefix={tied[0][1]!r}) in Python), or --prefix '' to compare the names as they are")
    side, p = tied[0]
    return _stripped(ta, tb, p if side == "a" else "", p if side == "b" else "")


def _stripped(ta: TensorTable, tb: TensorTable, pa: str, pb: str) -> tuple[TensorTable, TensorTable, tuple[str, str]]:
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
         trust_pickle: bool = False, prefix: str | None = None) -> DiffReport:
    """Compare ``a`` and ``b`` (refs or tables), tensors and plain values; manifest-only unless ``values``.

    With ``values``, numeric plain values (ints and floats, not bools) within ``atol + rtol * |b|``
    count as unchanged, as tensor elements do. ``trust_pickle``: see :func:`open_table`.
    ``prefix``: compare the tensors under this name prefix of one side (``"ema."``) with the other
    side's; ``None`` finds it (see :func:`_align`), ``""`` compares names as they are.

    Raises:
        InputError / CheckpointError: a side cannot be opened, or the prefix is ambiguous (or given
            and matches nothing).
    """
    ta = a if isinstance(a, TensorTable) else None
    tb = b if isinstance(b, TensorTable) else None
    if ta is None and tb is None:
        va, vb = _is_version_ref(a), _is_version_ref(b)
        if va is None and vb is not None:
            tb = open_table(b, trust_pickle=trust_pickle)
        else:
            ta = open_table(a, trust_pickle=trust_pickle)
    if ta is None:
        ta = open_table(a, chunk_size=tb.chunk_size, hash_name=tb.hash, trust_pickle=trust_pickle)
    if tb is None:
        tb = open_table(b, chunk_size=ta.chunk_size, hash_name=ta.hash, trust_pickle=trust_pickle)
    comparable = ta.chunk_size == tb.chunk_size and ta.hash == tb.hash
    rep = DiffReport(ta.source, tb.source, values=values)
    ta, tb, rep.prefix = _align(ta, tb, prefix)
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


def _short(v: Any, width: int = 40) -> str:
    text = json.dumps(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def format_report(rep: DiffReport) -> str:
    """A readable table of a :class:`DiffReport`: tensors, then plain values."""
    lines = [f"--- {rep.a}" + (f" (tensors under {rep.prefix[0]!r})" if rep.prefix[0] else ""),
             f"+++ {rep.b}" + (f" (tensors under {rep.prefix[1]!r})" if rep.prefix[1] else "")]
    not_compared = f"plain values not compared: {rep.plain_note}"
    if rep.identical:
        if rep.plain_compared:
            lines.append(f"identical ({rep.unchanged} tensors, {rep.plain_unchanged} plain values)")
        else:
            lines.append(f"identical ({rep.unchanged} tensors; {not_compared})")
        return "\n".join(lines)
    if rep.added or rep.removed or rep.changed:
        lines += _tensor_lines(rep)
    else:
        lines.append(f"tensors identical ({rep.unchanged} tensors)")
    if rep.plain_added or rep.plain_removed or rep.plain_changed:
        rows = ([["added", e["name"], "", _short(e["value"])] for e in rep.plain_added]
                + [["removed", e["name"], _short(e["value"]), ""] for e in rep.plain_removed]
                + [["changed", e["name"], _short(e["a"]), _short(e["b"])] for e in rep.plain_changed])
        lines.append(table(["status", "plain value", "a", "b"], rows))
        lines.append(f"plain values: {len(rep.plain_added)} added, {len(rep.plain_removed)} removed, "
                     f"{len(rep.plain_changed)} changed, {rep.plain_unchanged} unchanged")
    elif rep.plain_compared:
        lines.append(f"plain values identical ({rep.plain_unchanged})")
    else:
        lines.append(not_compared)
    return "\n".join(lines)


def _tensor_lines(rep: DiffReport) -> list[str]:
    lines = []
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
    return lines
