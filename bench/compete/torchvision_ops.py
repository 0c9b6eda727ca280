"""The two torchvision operators MosaicML Streaming needs to import, for a CPU-only torch.

NOTE [ torchvision without its compiled operators ]
    Streaming imports torchvision (for its vision datasets, unused here). PyPI's torchvision
    wheel for this torch is built for CUDA: its compiled operators do not load beside a CPU
    torch, and then ``import torchvision`` fails registering fake kernels for ``torchvision::nms``
    and ``torchvision::qnms``, which no library defined. Defining their schemas first (no
    kernels: nothing here calls them) lets torchvision, and so Streaming, import. Import this
    module before ``streaming``.
"""

from __future__ import annotations

import torch

_LIB = None


def define() -> None:
    """Define the schemas once, unless torchvision's own operators loaded."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{op}", "")
        except RuntimeError:  # not defined: torchvision's operators did not load
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB = lib


define()
