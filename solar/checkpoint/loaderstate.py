"""The data loader's position, stored in the same version as the model (CheckFreq's lesson: a data
iterator that resumes exactly is half of a checkpoint).

``writer.save(state, step, loader=loader)`` stores ``loader.state_dict()`` in the version's
manifest (``meta["solar.loader"]``, per rank in a job root); ``load(..., loader=loader)`` hands
it back to ``loader.load_state_dict``. The state is small (a sampler position, an RNG state): it
goes into the manifest's JSON as a skeleton (:func:`.flatten.flatten`'s encoding), tensors (the
RNG state of a loader without a DistributedSampler) as their bytes.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from solar.errors import ConfigError, CorruptDataError

from .flatten import DTYPES, dtype_name, flatten, unflatten

__all__ = ["LOADER_KEY", "encode_loader", "decode_loader", "loader_state_of"]

LOADER_KEY = "solar.loader"
_TENSOR = "__solar_tensor__"


def _tensors_out(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {_TENSOR: [dtype_name(t.dtype), list(t.shape), base64.b64encode(t.numpy().tobytes()).decode()]}
    if isinstance(obj, dict):
        return type(obj)((k, _tensors_out(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_tensors_out(v) for v in obj)
    return obj


def _tensors_in(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            dtype, shape, data = obj[_TENSOR]
            raw = bytearray(base64.b64decode(data, validate=True))
            return torch.frombuffer(raw, dtype=DTYPES[dtype]).reshape(shape) if raw else \
                torch.empty(shape, dtype=DTYPES[dtype])
        return type(obj)((k, _tensors_in(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_tensors_in(v) for v in obj)
    return obj


def loader_state_of(loader: Any) -> dict:
    """``loader.state_dict()``, checked to be a dict.

    Raises:
        ConfigError: ``loader`` has no ``state_dict`` (pass a ``solar.DataLoader``).
    """
    fn = getattr(loader, "state_dict", None)
    if not callable(fn):
        raise ConfigError(f"loader= must be a solar.DataLoader (or anything with state_dict()), got "
                          f"{type(loader).__name__}")
    state = fn()
    if not isinstance(state, dict):
        raise ConfigError(f"loader.state_dict() returned a {type(state).__name__}, not a dict")
    return state


def encode_loader(state: dict) -> Any:
    """A JSON skeleton of the loader's state (no tensors left in it)."""
    return flatten(_tensors_out(state)).skeleton


def decode_loader(skeleton: Any, where: str) -> dict:
    """The loader state :func:`encode_loader` encoded.

    Raises:
        CorruptDataError: a malformed skeleton (names ``where``).
    """
    try:
        return _tensors_in(unflatten(skeleton, [], where=where))
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptDataError(f"{where}: the stored loader state is malformed ({exc})") from exc
