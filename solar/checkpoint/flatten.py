"""Flatten a state dict into a JSON skeleton plus a list of storage blobs, and back.

A model + optimizer state dict is a tree of dicts, lists and tuples whose leaves are tensors or
plain Python values. :func:`flatten` replaces each tensor by a reference and each distinct
*storage* by one blob, so tensors that share memory (tied weights, views of one buffer, a tensor
reinterpreted under another dtype) are stored once and come back sharing one storage, which
``torch.save`` also preserves and safetensors refuses. A blob is the byte span of its storage that
its views actually touch, so a small view of a huge buffer does not drag the whole buffer along.

The skeleton is plain JSON (tagged objects for tuples, non-string dict keys, non-finite floats,
dtypes, devices, bytes), so manifests can be read and diffed without unpickling anything; values
JSON cannot express fall back to a base64 pickle, which is only unpickled by :func:`unflatten`.
Subclasses of ``int`` and ``str`` (``IntEnum``, ``StrEnum``, ``IntFlag`` members) take that pickle
path too, so they come back as themselves rather than as plain numbers and strings. ``float``
subclasses (``numpy.float64``) are stored as plain JSON floats and come back as ``float``: a numpy
pickle would tie the manifest to a numpy version and hide the number from ``solar-ckpt show``.
A value that cannot be pickled (a lambda, a lock, an open file) is refused with its key path.
"""

from __future__ import annotations

import base64
import enum
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import torch

from solar.errors import CorruptDataError, InputError, SolarError

from .errors import UntrustedPickleError
from .safepickle import UnsafeGlobalError, safe_loads
from .shard import is_sharded, layout_of

__all__ = ["TensorRef", "BlobSource", "Flat", "flatten", "unflatten", "DTYPES", "dtype_name"]

#: Alignment of a blob's start inside its storage: every element type's byte offset stays aligned.
_ALIGN = 16

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        *(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                      "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32") if hasattr(torch, n)),
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class TensorRef:
    """Where one tensor of the state dict lives: a blob, a byte offset in it, and its geometry."""

    name: str
    blob: int
    offset: int  # bytes from the blob's start to element [0, 0, ...]
    dtype: str
    shape: list[int]
    stride: list[int]
    device: str
    parameter: bool = False
    requires_grad: bool = False
    # a shard (solar.checkpoint.Shard or a DTensor): the global tensor's shape and this piece's
    # offset in it; None for a tensor saved whole
    global_shape: list[int] | None = None
    global_offset: list[int] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def contiguous_extent(self) -> tuple[int, int] | None:
        """``(start, end)`` bytes in the blob if the tensor is C-contiguous there, else ``None``."""
        expected, acc = [], 1
        for size in reversed(self.shape):
            expected.append(acc)
            acc *= size
        if all(s == 1 or st == e for s, st, e in zip(self.shape, self.stride, reversed(expected))):
            return self.offset, self.offset + self.nbytes
        return None

    def to_json(self) -> dict:
        # the shard fields only when set: manifests of unsharded saves keep their exact bytes
        return {k: v for k, v in self.__dict__.items() if v is not None or k not in ("global_shape", "global_offset")}


@dataclass
class BlobSource:
    """A byte span ``[start, end)`` of one storage; the bytes the writer copies, hashes and stores."""

    storage: torch.UntypedStorage
    start: int
    end: int
    device: str
    tensors: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def byte_view(self) -> torch.Tensor:
        """A uint8 tensor over the span, on the storage's device (no copy)."""
        t = torch.empty(0, dtype=torch.uint8, device=self.storage.device)
        return t.set_(self.storage, self.start, (self.nbytes,), (1,))


@dataclass
class Flat:
    skeleton: Any
    tensors: list[TensorRef]
    blobs: list[BlobSource]


class _Member(NamedTuple):
    """A tensor of a storage group: its index in the tensor table and the byte span it touches."""

    index: int
    tensor: torch.Tensor
    start: int
    end: int


def _extent(t: torch.Tensor) -> tuple[int, int]:
    item = t.element_size()
    start = t.storage_offset() * item
    if t.numel() == 0:
        return start, start
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * item


def _prepare(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.layout != torch.strided:
        raise InputError(f"tensor {name!r} has layout {t.layout}; convert it with .to_dense() before saving")
    if t.is_quantized:
        raise InputError(f"tensor {name!r} is quantized; dequantize it (.dequantize()) before saving")
    if t.device.type == "meta":
        raise InputError(f"tensor {name!r} is on the meta device and has no bytes to save; materialize it first "
                         f"(e.g. load real weights or call .to_empty(device='cpu') and initialize it)")
    if t.is_nested:
        # strided layout, so the check above passes it, but it has no sizes or storage span to
        # save: torch's internal error named no key
        raise InputError(f"tensor {name!r} is a nested tensor; save its parts (.unbind()) or a padded copy "
                         f"(.to_padded_tensor(0.0)) instead")
    if dtype_name(t.dtype) not in DTYPES:
        raise InputError(f"tensor {name!r} has unsupported dtype {t.dtype}; "
                         f"cast it to a supported one ({', '.join(DTYPES)})")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.detach()


def flatten(state: Any) -> Flat:
    """Split ``state`` into a JSON skeleton, tensor references and the distinct storage spans.

    Raises:
        InputError: a tensor cannot be saved (sparse, quantized, meta, unsupported dtype), or a
            non-tensor value cannot be pickled (a lambda, a lock ...).
    """
    tensors: list[TensorRef] = []
    groups: dict[tuple, list[_Member]] = {}
    used_names: set[str] = set()

    def unique(name: str) -> str:
        base, n = name or "<root>", 1
        while name in used_names or not name:
            n += 1
            name = f"{base}#{n}"
        used_names.add(name)
        return name

    def enc(obj: Any, path: str) -> Any:
        if is_sharded(obj):
            lay = layout_of(obj)
            out = enc(lay.local, path)
            tensors[out["__tensor__"]].global_shape = list(lay.global_shape)
            tensors[out["__tensor__"]].global_offset = list(lay.offsets)
            return out
        if isinstance(obj, torch.Tensor):
            name = unique(path)
            t = _prepare(obj, name)
            storage = t.untyped_storage()
            lo, hi = _extent(t)
            ptr = storage.data_ptr()
            key = (str(t.device), ptr) if ptr and storage.nbytes() else ("private", len(tensors))
            idx = len(tensors)
            tensors.append(TensorRef(name, -1, lo, dtype_name(t.dtype), list(t.shape), list(t.stride()),
                                     str(obj.device), isinstance(obj, torch.nn.Parameter), bool(obj.requires_grad)))
            groups.setdefault(key, []).append(_Member(idx, t, lo, hi))
            return {"__tensor__": idx}
        if obj is None or type(obj) in (bool, int, str):  # exact types: IntEnum etc. are pickled below
            return obj
        if isinstance(obj, float) and not isinstance(obj, enum.Enum):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, bytes):
            return {"__bytes__": base64.b64encode(obj).decode()}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            items = [enc(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else {"__tuple__": items}
        if isinstance(obj, dict) and type(obj) in (dict, OrderedDict):
            tag = "__odict__" if type(obj) is OrderedDict else "__dict__"
            pairs = [[enc(k, ""), enc(v, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]
            if tag == "__dict__" and all(type(k) is str and not k.startswith("__") for k in obj):
                return {k: v for (k, _), (_, v) in zip(obj.items(), pairs)}
            return {tag: pairs}
        try:
            data = pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # lambda / lock / local class
            where = f"key {path!r}" if path else "the state itself"
            raise InputError(
                f"cannot save {where}: a {type(obj).__module__}.{type(obj).__qualname__} value cannot be pickled "
                f"({exc}); drop it from the state dict, or convert it to a plain value (number, string, list, "
                f"dict, tensor) and rebuild it after load") from exc
        return {"__pickle__": base64.b64encode(data).decode()}

    skeleton = enc(state, "")
    return Flat(skeleton, tensors, _blobs(groups.values(), tensors))


def _blobs(groups: Iterable[list[_Member]], tensors: list[TensorRef]) -> list[BlobSource]:
    """One blob per storage group, spanning the bytes its tensors touch; sets each tensor's blob and offset."""
    blobs: list[BlobSource] = []
    for members in groups:
        # the largest storage of the group: two storages can start at one address (numpy views
        # of one array: torch.from_numpy(a[:10]) and torch.from_numpy(a)), and a span built over
        # the smaller one would reach past its end (torch's bare "storage that is not resizable")
        t0 = max((m.tensor for m in members), key=lambda t: t.untyped_storage().nbytes())
        lo = min(m.start for m in members) // _ALIGN * _ALIGN
        hi = max(m.end for m in members)
        if hi > t0.untyped_storage().nbytes():
            names = ", ".join(tensors[m.index].name for m in members)
            raise InputError(f"tensors {names} share memory but reach past every storage holding it "
                             f"({hi} B > {t0.untyped_storage().nbytes()} B); save .clone()s of them")
        blob = BlobSource(t0.untyped_storage(), lo, max(hi, lo), str(t0.device))
        for m in members:
            tensors[m.index].blob = len(blobs)
            tensors[m.index].offset = m.start - lo
            blob.tensors.append(m.index)
        blobs.append(blob)
    return blobs


def materialize(refs: list[TensorRef],
                blob_buffers: "list[torch.Tensor] | dict[int, torch.Tensor]") -> list[torch.Tensor]:
    """Build the tensors as views over their blobs' (uint8) buffers, so shared storage stays shared.

    ``blob_buffers`` is indexed by blob number: a list of all of them, or a dict of the ones needed.
    """
    out = []
    for ref in refs:
        buf = blob_buffers[ref.blob]
        dtype = DTYPES[ref.dtype]
        t = torch.empty(0, dtype=dtype, device=buf.device)
        t.set_(buf.untyped_storage(), (buf.storage_offset() + ref.offset) // dtype.itemsize, ref.shape, ref.stride)
        if ref.parameter:
            t = torch.nn.Parameter(t, requires_grad=ref.requires_grad)
        elif ref.requires_grad and (t.is_floating_point() or t.is_complex()):  # only these dtypes take grads
            t.requires_grad_(True)
        out.append(t)
    return out


def unflatten(skeleton: Any, tensors: list[torch.Tensor], *, weights_only: bool = True,
              where: str = "the checkpoint") -> Any:
    """Rebuild the state dict from its skeleton and the materialized tensors.

    A skeleton comes from whoever wrote the manifest, so it is decoded as untrusted data: a
    malformed tagged value is a :class:`CorruptDataError` naming its key, and pickled leaves go
    through the allow-list unpickler of :mod:`.safepickle` unless ``weights_only=False`` (the
    full unpickler, which runs whatever code the pickle names: only for checkpoints you trust).

    Raises:
        UntrustedPickleError: a pickled leaf names a global off the allow-list (names the key,
            the global and the opt-in); nothing of that pickle ran.
        CorruptDataError: a malformed skeleton value (names the key); ``where`` starts the message.
    """
    def bad(path: str, why: str) -> CorruptDataError:
        return CorruptDataError(f"{where}: key {path or '<root>'!r} of the skeleton {why}; the manifest is damaged "
                                "or was crafted: load another version or get the checkpoint from a source you trust")

    def unpickle(val: Any, path: str) -> Any:
        data = base64.b64decode(val, validate=True)
        if not weights_only:
            return pickle.loads(data)
        try:
            return safe_loads(data)
        except UnsafeGlobalError as exc:
            raise UntrustedPickleError(
                f"{where}: key {path or '<root>'!r} holds a pickled value that calls {exc.qualname}, which is not on "
                "the allow-list of safe globals (solar.checkpoint.safepickle.SAFE_GLOBALS); unpickling it could run "
                "arbitrary code, so it was not unpickled. Only if you trust this checkpoint and who wrote it, load "
                "it with weights_only=False (solar-ckpt restore --trust-pickle)") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the safe unpickler is bad data
            raise bad(path, f"holds a pickle that cannot be unpickled safely ({type(exc).__name__}: {exc})") from exc

    def tagged(tag: str, val: Any, path: str) -> Any:
        if tag == "__tensor__":
            if type(val) is not int or not 0 <= val < len(tensors):
                raise bad(path, f"refers to tensor {val!r:.80}, but the version has {len(tensors)} tensors")
            return tensors[val]
        if tag == "__tuple__":
            return tuple(dec(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(val))
        if tag in ("__dict__", "__odict__"):
            pairs = []
            for k, v in val:
                key = dec(k, path)
                pairs.append((key, dec(v, f"{path}.{key}" if path else str(key))))
            return OrderedDict(pairs) if tag == "__odict__" else dict(pairs)
        if tag == "__float__":
            return float(val)
        if tag == "__dtype__":
            return DTYPES[val]
        if tag == "__device__":
            return torch.device(val)
        if tag == "__size__":
            return torch.Size(val)
        if tag == "__bytes__":
            return base64.b64decode(val, validate=True)
        return unpickle(val, path)

    def dec(obj: Any, path: str) -> Any:
        if isinstance(obj, list):
            return [dec(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, val), = obj.items()
            if tag in _TAGS:
                try:
                    return tagged(tag, val, path)
                except SolarError:  # from a nested value: it names its own key
                    raise
                except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
                    raise bad(path, f"has a malformed {tag} value ({type(exc).__name__}: {exc})") from exc
        return {k: dec(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}

    try:
        return dec(skeleton, "")
    except RecursionError:
        raise CorruptDataError(f"{where}: the skeleton is nested too deeply to be a state dict; the manifest is "
                               "damaged or was crafted") from None


#: the tags of :func:`flatten`'s one-key objects
_TAGS = frozenset({"__tensor__", "__tuple__", "__dict__", "__odict__", "__float__", "__dtype__", "__device__",
                   "__size__", "__bytes__", "__pickle__"})
