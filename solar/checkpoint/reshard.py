"""Load sharded state on any world size: :func:`load_into` fills a template in place.

Each tensor of the template names the box it wants: a :class:`~.shard.Shard` or a DTensor its
local box of the global tensor, a plain tensor the whole of it. The box is assembled from the
saved pieces it overlaps (the pieces of every rank that saved the version, each with its global
offset): for each, only the chunks holding the overlap are read (a contiguous piece's overlap is
one byte range). The rank's own piece is tried first, so on the world size and layout it was
saved with, a rank reads its own shards and nothing else; a piece saved by several ranks
(a replicated placement) is read once.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from solar.errors import CheckpointError

from .flatten import DTYPES, TensorRef, unflatten
from .jobstore import JobStore, is_job_root
from .manifest import Manifest
from .reader import Reader, agreed_step
from .shard import is_sharded, layout_of
from .store import CheckpointStore

__all__ = ["load_into", "Loaded", "Whole", "whole_state", "whole_tensors"]


class Loaded(NamedTuple):
    step: int
    tensors: int  # template tensors filled
    bytes_read: int  # chunk bytes read from the store


class _Target(NamedTuple):
    name: str
    local: torch.Tensor
    offsets: tuple[int, ...] | None  # None: a plain tensor, which receives the whole global tensor


def _targets(obj: Any, path: str, out: list[_Target]) -> None:
    """The template's tensors by the names :func:`.flatten.flatten` gives them."""
    if is_sharded(obj):
        lay = layout_of(obj)
        out.append(_Target(path, lay.local, lay.offsets))
    elif isinstance(obj, torch.Tensor):
        out.append(_Target(path, obj, None))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _targets(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _targets(v, f"{path}.{i}" if path else str(i), out)


def _parts(store: CheckpointStore, step: int | None) -> dict[int, Manifest]:
    if not is_job_root(store):
        return {0: store.resolve(step)}
    jobs = JobStore(store)
    jm = jobs.resolve(step)
    return {r: jobs.part(jm, r) for r in range(jm.world_size)}


def _box(t: _Target, ref: TensorRef) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global box (offsets, shape) the target wants, checked against the saved global shape."""
    gshape = tuple(ref.global_shape if ref.global_shape is not None else ref.shape)
    if t.offsets is None:
        if tuple(t.local.shape) != gshape:
            raise CheckpointError(f"key {t.name!r}: the template's tensor has shape {list(t.local.shape)} but the "
                                  f"saved global tensor {list(gshape)}; pass a tensor of that shape, or a Shard or "
                                  "DTensor")
        return (0,) * len(gshape), gshape
    if len(t.offsets) != len(gshape) or any(o + s > g for o, s, g in zip(t.offsets, t.local.shape, gshape)):
        raise CheckpointError(f"key {t.name!r}: the template's shard (offsets {list(t.offsets)}, shape "
                              f"{list(t.local.shape)}) does not fit the saved global shape {list(gshape)}")
    return tuple(t.offsets), tuple(t.local.shape)


def _piece(reader: Reader, ref: TensorRef, lo: list[int], hi: list[int]) -> torch.Tensor:
    """Elements ``[lo, hi)`` (global coordinates) of a saved piece, reading only their byte range."""
    off = ref.global_offset or [0] * len(ref.shape)
    rel_lo, rel_hi = [a - o for a, o in zip(lo, off)], [b - o for b, o in zip(hi, off)]
    if ref.contiguous_extent() is None:  # read the whole piece, then cut
        whole = reader._tensor(ref.name, "cpu")
        return whole[tuple(slice(a, b) for a, b in zip(rel_lo, rel_hi))]
    first = sum(a * st for a, st in zip(rel_lo, ref.stride))
    last = sum((b - 1) * st for b, st in zip(rel_hi, ref.stride))
    item = ref.itemsize
    span = reader.read_span(ref.blob, ref.offset + first * item, ref.offset + (last + 1) * item)
    flat = span.view(DTYPES[ref.dtype])
    return flat.as_strided([b - a for a, b in zip(rel_lo, rel_hi)], ref.stride, flat.storage_offset())


def _fill(t: _Target, pieces: list[tuple[Reader, TensorRef]]) -> None:
    t_lo, t_shape = _box(t, pieces[0][1])
    covered = torch.zeros(t.local.shape, dtype=torch.bool)
    for reader, ref in pieces:
        off = ref.global_offset or [0] * len(ref.shape)
        lo = [max(a, b) for a, b in zip(t_lo, off)]
        hi = [min(a + s, b + s2) for a, s, b, s2 in zip(t_lo, t_shape, off, ref.shape)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        region = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t_lo))
        if bool(covered[region].all()):
            continue  # another rank's copy of the same elements was read already
        with torch.no_grad():
            t.local[region].copy_(_piece(reader, ref, lo, hi))
        covered[region] = True
    if not bool(covered.all()):
        raise CheckpointError(f"key {t.name!r}: the saved pieces cover {int(covered.sum())} of the "
                              f"{covered.numel()} elements the template asks for")


def load_into(root: "str | os.PathLike", state: Any, step: int | None = None, *, comm: Any = None,
              rank: int | None = None, storage_options: dict | None = None) -> Loaded:
    """Fill the tensors of ``state`` in place from version ``step`` (default: the newest), on any
    world size (see the module doc). Non-tensor values are left as they are.

    ``comm``: in every rank of a job, makes all load the same version; ``rank``: this rank (its
    own pieces are read first). Neither is needed in one process.

    Raises:
        CheckpointError: a key of the template is not in the version, its shape does not fit the
            saved global shape, or the saved pieces do not cover what it asks for.
    """
    if comm is not None:
        rank, step = agreed_step(root, step, comm, storage_options)
    store = CheckpointStore(root, **(storage_options or {}))
    parts = _parts(store, step)
    step = next(iter(parts.values())).step
    readers = {r: Reader(root, step, store=store, rank=r if is_job_root(store) else None) for r in parts}
    order = sorted(parts, key=lambda r: (r != rank, r))  # this rank's own pieces first
    by_name: dict[str, list[tuple[Reader, TensorRef]]] = {}
    for r in order:
        readers[r].manifest = parts[r]
        for ref in parts[r].tensors:
            by_name.setdefault(ref.name, []).append((readers[r], ref))
    targets: list[_Target] = []
    _targets(state, "", targets)
    for t in targets:
        if t.name not in by_name:
            raise CheckpointError(f"key {t.name!r} of the template is not in step {step} of {root}")
        _fill(t, by_name[t.name])
    return Loaded(step, len(targets), sum(r.bytes_read for r in readers.values()))


class Whole(NamedTuple):
    """A version's tensors as one process sees them: every sharded tensor reassembled."""

    manifest: Manifest  # the first rank's part (a single root's manifest): names, skeleton, dtypes
    tensors: list[torch.Tensor]  # in ``manifest.tensors`` order
    where: str  # "step S of ROOT", for messages


def whole_tensors(root: "str | os.PathLike", step: int | None = None, *, storage_options: dict | None = None,
                  check: Any = None) -> Whole:
    """The version's tensors in one process: on a job root, rank 0's with every sharded tensor (a
    saved ``Shard`` or DTensor) replaced by the whole global tensor, reassembled from every rank's
    pieces; on a single root, the tensors as saved. ``check(manifest, where)`` runs before any
    chunk is read."""
    store = CheckpointStore(root, **(storage_options or {}))
    parts = _parts(store, step)
    first = parts[min(parts)]
    where = f"step {first.step} of {store.root}"
    if check is not None:
        check(first, where)
    reader = Reader(root, first.step, store=store, rank=min(parts) if is_job_root(store) else None)
    reader.manifest = first
    sharded = {t.name: torch.zeros(t.global_shape, dtype=DTYPES[t.dtype]) for t in first.tensors
               if t.global_shape is not None}
    if sharded:
        load_into(root, sharded, first.step, rank=min(parts), storage_options=storage_options)
    return Whole(first, [sharded[t.name] if t.name in sharded else reader.tensor(t.name) for t in first.tensors],
                 where)


def whole_state(root: "str | os.PathLike", step: int | None = None, *, weights_only: bool = True,
                storage_options: dict | None = None) -> Any:
    """The version as one process's state dict (:func:`whole_tensors` in the structure it was saved
    with); what ``solar-ckpt restore`` writes."""
    def check(first: Manifest, where: str) -> None:
        if weights_only:  # the allow-list check before any chunk is read, as load does
            unflatten(first.skeleton, [None] * len(first.tensors), where=where)  # type: ignore[list-item]

    whole = whole_tensors(root, step, storage_options=storage_options, check=check)
    return unflatten(whole.manifest.skeleton, whole.tensors, weights_only=weights_only, where=whole.where)
