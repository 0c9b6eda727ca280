"""The SOLAR HDF5 layout (``solar-h5/1``): how fields, compressed samples and checksums are stored.

A SOLAR file is a plain HDF5 file that h5py reads without SOLAR. Any HDF5 file whose datasets have
a leading sample axis is also accepted (as "raw" fields).

Root attributes
    ``solar_format``  ``"solar-h5/1"``
    ``num_samples``   N
    ``fields``        JSON list of field names, in order
    ``provenance``    JSON: inputs (paths/URLs, per-input sample counts), tool version, time
    ``complete``      True once every sample is written (set last, before the atomic rename)

A raw field ``NAME``
    dataset ``/NAME`` of shape ``(N, *sample_shape)`` and the sample dtype.

A compressed field ``NAME`` (variable-length codec blobs)
    group ``/NAME`` with attrs ``codec`` (versioned descriptor, e.g. ``"ebq/1"``), ``codec_config``
    (JSON), ``sample_shape``, ``dtype``, and ``abs_error`` (the guaranteed absolute bound);
    dataset ``/NAME/data``: uint8, all blobs back to back in sample order;
    dataset ``/NAME/offsets``: int64, shape ``(N + 1,)``; blob i is ``data[offsets[i]:offsets[i+1]]``.

Checksums
    dataset ``/_solar/checksum/NAME``: uint64, shape ``(N,)``: xxh3-64 of sample i's stored bytes
    (the raw sample's C-order bytes, or the blob).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import xxhash

from solar.errors import DatasetFormatError

__all__ = ["FORMAT", "FieldSpec", "describe_fields", "checksum_key", "sample_checksum"]

FORMAT = "solar-h5/1"
CHECKSUM_GROUP = "_solar/checksum"


def checksum_key(field: str) -> str:
    return f"{CHECKSUM_GROUP}/{field}"


def sample_checksum(buf: bytes | memoryview | np.ndarray) -> int:
    """xxh3-64 of a sample's stored bytes (C order for arrays)."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    return xxhash.xxh3_64_intdigest(memoryview(buf))


@dataclass(frozen=True)
class FieldSpec:
    """What one field of a dataset is and where its bytes live."""

    name: str
    kind: Literal["raw", "codec"]
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    #: raw: the dataset path; codec: the ``data`` dataset path (offsets at ``offsets_key``)
    data_key: str
    offsets_key: str | None = None
    codec: str | None = None
    codec_config: dict[str, Any] | None = None
    abs_error: float | None = None


def tensor_dtype_ok(dtype: np.dtype) -> bool:
    """Whether a torch tensor can hold ``dtype`` (in either byte order)."""
    import torch  # heavy; ingest imports this module without needing torch

    try:
        torch.from_numpy(np.empty(0, np.dtype(dtype).newbyteorder("=")))
    except (TypeError, ValueError):
        return False
    return True


def name_matches(name: str, entries) -> list[str]:
    """The entries (dataset paths) ``name`` may mean: itself, a leading ``/`` optional as in h5py,
    else every entry whose last path component it is (``images`` for ``entry/data/images``); a
    caller takes a single match and reports none or several."""
    key = name.strip("/")
    return [key] if key in entries else [e for e in entries if e.rsplit("/", 1)[-1] == key]


def _resolve(name: str, keys: list[str]) -> str:
    """The dataset path ``name`` means (:func:`name_matches` among the datasets that are not
    SOLAR's own or a compressed field's parts), or ``name`` itself when that is not one path."""
    hits = name_matches(name, [k for k in keys if not k.startswith("_solar") and not k.endswith(("/data", "/offsets"))])
    return hits[0] if len(hits) == 1 else name.strip("/")


def _available(backend, keys: list[str], order: list[str]) -> str:
    """What ``fields=`` can name: the top-level fields and nested datasets with a sample axis."""
    usable = []
    for k in order + [k for k in keys if "/" in k and k.split("/")[0] not in order and not k.startswith("_solar")]:
        if k in keys:
            info = backend.info(k)
            if len(info.shape) < 1 or not tensor_dtype_ok(info.dtype):
                continue
        usable.append(k)
    return (f"available: {', '.join(usable)} (a nested dataset by its path, or its last name if unique)"
            if usable else "no dataset with a leading sample axis in the file")


def describe_fields(backend, fields=None) -> tuple[int, list[FieldSpec]]:
    """Parse the layout of an opened :class:`solar.io_backends.Backend`.

    Returns ``(num_samples, specs)`` for ``fields`` (``None``: every field, in file order).
    Raises :class:`solar.DatasetFormatError` naming the file and field when the layout is not
    usable (no leading sample axis, fields of different lengths, unknown field).
    """
    root = backend.attrs("/")
    keys = backend.keys()
    if root.get("solar_format") == FORMAT and "fields" in root:
        order = list(json.loads(root["fields"]))
    else:
        order = [k for k in keys if "/" not in k and not k.startswith("_solar")]
        # a compressed field is a group with data and offsets; other groups (NeXus /entry/data) are not fields
        order += sorted({k.split("/")[0] for k in keys if k.endswith("/data") and k.count("/") == 1
                         and f"{k.split('/')[0]}/offsets" in keys and k.split("/")[0] not in order
                         and not k.startswith("_solar")})
    every = fields is None
    if every:
        fields = order
    elif isinstance(fields, str):
        fields = [fields]
    broken = backend.broken_links()
    specs: list[FieldSpec] = []
    for name in fields:
        key = _resolve(name, keys) if not every else name
        if key in keys:
            info = backend.info(key)
            problem = None
            if len(info.shape) < 1:
                problem = "is a scalar; fields need a leading sample axis"
            elif not tensor_dtype_ok(info.dtype):
                problem = (f"has dtype {info.dtype}, which a torch tensor cannot hold (strings, compound "
                           "and object types); read it with h5py")
            if problem and every:  # "every field": the ones a sample can have; a scalar attribute-like
                continue           # dataset (a version, a string table) does not make the file unusable
            if problem:
                raise DatasetFormatError(f"{backend.url}: field {name!r} {problem}; pass fields=... without it")
            specs.append(FieldSpec(name, "raw", info.row_shape, info.dtype, key))
        elif f"{key}/data" in keys and f"{key}/offsets" in keys:
            a = backend.attrs(key)
            specs.append(FieldSpec(
                name, "codec", tuple(int(s) for s in a["sample_shape"]), np.dtype(a["dtype"]),
                f"{key}/data", f"{key}/offsets", str(a["codec"]),
                json.loads(a.get("codec_config", "{}")), float(a["abs_error"]) if "abs_error" in a else None))
        elif key in broken:
            raise DatasetFormatError(
                f"{backend.url}: field {name!r} is a link to {broken[key]}, which cannot be resolved "
                "(the file is missing, or a relative link cannot be followed from this URL); copy the "
                "target next to the file, open the file by its local path, or pass fields=... without it")
        else:
            raise DatasetFormatError(f"{backend.url}: no field {name!r}; {_available(backend, keys, order)}")
    if every and broken:
        warnings.warn(f"{backend.url}: skipped {', '.join(f'{k} (-> {v})' for k, v in broken.items())}: "
                      "links that cannot be resolved", RuntimeWarning, stacklevel=3)
    if not specs:
        raise DatasetFormatError(f"{backend.url}: no fields with a leading sample axis found at the top level; "
                                 f"{_available(backend, keys, order)}")
    lengths = {}
    for s in specs:
        lengths[s.name] = (backend.info(s.data_key).shape[0] if s.kind == "raw"
                           else backend.info(s.offsets_key).shape[0] - 1)
    if len(set(lengths.values())) != 1:
        raise DatasetFormatError(f"{backend.url}: fields have different numbers of samples: {lengths}; "
                                 "pass fields=... to pick fields of one length")
    return next(iter(lengths.values())), specs
