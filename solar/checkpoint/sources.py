"""The inputs of a diff: SOLAR versions (``ROOT@STEP``), ``torch.save``, safetensors and DCP checkpoints.

Every input becomes a :class:`TensorTable`: name -> dtype, shape, bytes, chunk digests and a Merkle
root, plus a way to load one tensor. For a SOLAR version the table comes from the manifest alone,
so building it reads no tensor data. Plain files are loaded and hashed with the other side's chunk
size (:func:`open_table`'s ``chunk_size``/``hash_name``).

Plain (non-tensor) values are part of a checkpoint too (an optimizer's ``lr``, an epoch counter),
so each table also holds them by name in their JSON skeleton form (:func:`plain_values`): from a
SOLAR version's manifest, a ``.pt`` or DCP checkpoint flattened the way a save would, or the
skeleton ``solar-ckpt export`` keeps in a ``.safetensors`` file's metadata. Nothing is unpickled
for that. A safetensors file without that metadata holds tensors only: its plain values are then
``None`` ("not compared", with the reason in ``plain_note``) rather than an empty dict, which
would report them all as removed.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from solar.errors import InputError

from . import merkle
from .chunking import DEFAULT_CHUNK_SIZE, hash_chunks, hasher
from .flatten import DTYPES, dtype_name, flatten, unflatten
from .jobstore import JobStore, is_job_root
from .reader import Reader
from .store import CheckpointStore, parse_ref

__all__ = ["TensorInfo", "TensorTable", "open_table", "plain_values", "c_order_bytes", "tensor_info", "version_ref"]


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


def _from_version(root: str, step: int | None, rank: int | None = None) -> TensorTable:
    """A version's table; on a job root every rank's tensors as ``rank R/NAME`` (or one rank's
    under their own names with ``rank``)."""
    store = CheckpointStore(root)
    if is_job_root(store):
        jobs = JobStore(store)
        jm = jobs.resolve(step)
        parts = [(r, jobs.part(jm, r)) for r in ([rank] if rank is not None else range(jm.world_size))]
    else:
        parts = [(None, store.resolve(step))]
    readers: dict = {}
    where: dict[str, tuple] = {}  # table name -> (rank, its manifest, the name in it)

    def load_tensor(name: str) -> torch.Tensor:
        r, m, local = where[name]
        if r not in readers:
            readers[r] = Reader(root, m.step, store=store, rank=r)
            readers[r].manifest = m
        return readers[r].tensor(local, map_location="cpu")

    tensors, plain = {}, {}
    for r, m in parts:
        prefix = f"rank {r}/" if r is not None and rank is None else ""
        for t in m.tensors:
            b = m.blobs[t.blob]
            exact = t.offset == 0 and t.nbytes == b.nbytes and t.contiguous_extent() is not None
            tensors[prefix + t.name] = TensorInfo(t.dtype, list(t.shape), t.nbytes, m.blob_digests(t.blob),
                                                  bytes.fromhex(b.root), exact)
            where[prefix + t.name] = (r, m, t.name)
        plain.update({prefix + k: v for k, v in plain_values(m.skeleton).items()})
    m = parts[0][1]
    shown = f"{store.root}@{m.step}" + (f" rank {rank}" if rank is not None and parts[0][0] is not None else "")
    logical = sum(p.logical_bytes for _r, p in parts)
    return TensorTable(shown, m.chunk_size, m.hash, tensors, load_tensor, m.step, logical, plain)


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


def load_dcp(path: str, trust_pickle: bool = False) -> Any:
    """A ``torch.distributed.checkpoint`` directory as one state dict (single process, CPU)."""
    # torch.distributed is imported only for a DCP input: it is large and most diffs never need it
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, os.path.join(tmp, "sd.pt"))
        return _torch_load(os.path.join(tmp, "sd.pt"), path, trust_pickle)


class _Loaded(NamedTuple):
    """A plain file's contents as a diff needs them."""

    tensors: dict[str, torch.Tensor]
    plain: dict[str, Any] | None  # plain values by name; None: the file holds none to compare
    plain_note: str  # why ``plain`` is None ("" otherwise)


def _load_safetensors(path: str) -> _Loaded:
    """Tensors and plain values of a ``.safetensors`` file.

    The format holds tensors only. A file ``solar-ckpt export`` wrote keeps the version's JSON
    skeleton in its metadata (``solar_skeleton``), so its plain values are compared; for any other
    file they are not compared (``None``) instead of all reported as removed.
    """
    # safetensors is an optional dependency (the `safetensors` extra), needed only for these inputs
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    tensors = dict(load_file(path))
    try:
        return _Loaded(tensors, plain_values(json.loads(meta["solar_skeleton"])), "")
    except (KeyError, ValueError, TypeError):
        return _Loaded(tensors, None, (f"{path} is a .safetensors file without a SOLAR skeleton (it holds tensors "
                                       f"only; `solar-ckpt export` keeps one)"))


def _load_file(path: str, trust_pickle: bool = False) -> _Loaded:
    """Tensors, plain values (``None``: none to compare) and why not, of a ``.pt``, ``.safetensors`` or DCP input."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        obj = load_dcp(path, trust_pickle)
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
    return _Loaded(out, plain_values(flat.skeleton), "")


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


def tensor_info(t: torch.Tensor, chunk_size: int, digest: Callable) -> TensorInfo:
    """Chunk digests and Merkle root of a tensor's own (C-contiguous) bytes."""
    raw = c_order_bytes(t)
    leaves = hash_chunks(raw, chunk_size, digest)
    return TensorInfo(dtype_name(t.dtype), list(t.shape), raw.nbytes, leaves, merkle.root(merkle.build(leaves, digest)))


def _from_file(path: str, chunk_size: int, hash_name: str, trust_pickle: bool = False) -> TensorTable:
    loaded = _load_file(path, trust_pickle)
    tensors = loaded.tensors
    digest = hasher(hash_name)
    infos = {name: tensor_info(t, chunk_size, digest) for name, t in tensors.items()}
    return TensorTable(path, chunk_size, hash_name, infos, lambda n: tensors[n], None,
                       sum(i.nbytes for i in infos.values()), loaded.plain, loaded.plain_note)


def version_ref(ref: str) -> tuple[str, int | None] | None:
    root, step = parse_ref(ref)
    if step is not None:
        return root, step
    if (os.path.isdir(ref) and not os.path.isfile(os.path.join(ref, ".metadata"))) or "://" in ref:
        return ref, None
    return None


def open_table(ref: str, *, chunk_size: int | None = None, hash_name: str | None = None,
               trust_pickle: bool = False, rank: int | None = None) -> TensorTable:
    """The tensor table of ``ref``: ``ROOT@STEP``, ``ROOT`` (newest), ``.pt`` or ``.safetensors``.

    ``trust_pickle`` loads a ``.pt`` (or DCP) input with ``weights_only=False``: only for files
    you trust, since unpickling can run arbitrary code. ``rank``: one rank of a job root.
    """
    version = version_ref(ref)
    if version is not None:
        return _from_version(*version, rank=rank)
    return _from_file(ref, chunk_size or DEFAULT_CHUNK_SIZE, hash_name or "xxh3_128", trust_pickle)
