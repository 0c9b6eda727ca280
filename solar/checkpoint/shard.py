"""Sharded state: a rank's piece of a larger tensor, saved with its global layout.

Two forms are saved with their layout, so a version can be loaded on another world size:

- :class:`Shard` ``(local, global_shape, offsets)``: rank-local rows (or any box) of a global
  tensor, the plain form FSDP/ZeRO-style code can build by hand;
- a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel): its local tensor, global shape
  and offset (a replicated placement is every rank's full copy, stored once by de-duplication).

The manifest part of each rank records, per such tensor, ``global_shape`` and ``global_offset``
beside its local shape. :func:`solar.checkpoint.load_into` fills a template state dict in place on
any world size: each target box is assembled from the saved pieces it overlaps, reading only the
chunks that hold the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from solar.errors import InputError

__all__ = ["Shard", "Layout", "layout_of", "is_sharded"]


@dataclass
class Shard:
    """Elements ``[offsets, offsets + local.shape)`` of a tensor of shape ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape, self.offsets = tuple(int(v) for v in self.global_shape), tuple(int(v) for v in self.offsets)
        shape = tuple(self.local.shape)
        if not (len(shape) == len(self.global_shape) == len(self.offsets)
                and all(0 <= o and o + s <= g for s, g, o in zip(shape, self.global_shape, self.offsets))):
            raise InputError(f"Shard of local shape {list(shape)} at offsets {list(self.offsets)} does not fit in the "
                             f"global shape {list(self.global_shape)}; give one offset per dimension, each with "
                             "offset + local size <= global size")


class Layout(NamedTuple):
    """A local tensor and where it sits in its global tensor."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "to_local") and hasattr(obj, "placements")


def is_sharded(obj: Any) -> bool:
    return isinstance(obj, Shard) or _is_dtensor(obj)


def layout_of(obj: Any) -> Layout:
    """The local tensor, global shape and offsets of a :class:`Shard` or a DTensor."""
    if isinstance(obj, Shard):
        return Layout(obj.local, obj.global_shape, obj.offsets)
    # DTensor: torch.distributed.tensor is imported only for a state that holds one
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
    local = obj.to_local()
    if tuple(local.shape) != tuple(shape):
        raise InputError(f"a DTensor of global shape {list(obj.shape)} has a local tensor of shape "
                         f"{list(local.shape)}, not {list(shape)} as its placements say (uneven sharding SOLAR cannot "
                         "place); save its full_tensor() or a Shard")
    return Layout(local, tuple(obj.shape), tuple(int(o) for o in offsets))
