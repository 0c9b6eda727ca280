"""Restore any version straight from its manifest and the chunk store (no increment chains).

Every chunk is re-hashed as it is read, so :func:`load` never returns corrupt data: a flipped byte
raises :class:`~solar.errors.CorruptDataError` naming the chunk and the tensors it touches.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from solar.errors import CheckpointError, CorruptDataError

from .chunking import chunk_spans, hasher
from .flatten import materialize, unflatten
from .manifest import Manifest
from .store import CheckpointStore

__all__ = ["load", "list_versions", "Reader"]


def _target_device(saved: str, map_location: Any) -> torch.device:
    if map_location is None:
        dev = torch.device(saved)
    elif isinstance(map_location, dict):
        dev = torch.device(map_location.get(saved, saved))
    elif callable(map_location):
        dev = torch.device(map_location(saved))
    else:
        dev = torch.device(map_location)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"tensors were saved on {saved} but CUDA is not available here; pass map_location='cpu'")
    return dev


class Reader:
    """Reads blobs and tensors of one version, checking every chunk against its digest.

    Args:
        root: checkpoint root (path, URL or tier).
        step: version; ``None`` for the newest complete one.
        verify: re-hash chunks as they are read (on by default; the cost is a few percent of a read).
    """

    def __init__(self, root: Any, step: int | None = None, *, verify: bool = True, store: CheckpointStore | None = None,
                 storage_options: dict | None = None) -> None:
        self.store = store or CheckpointStore(root, **(storage_options or {}))
        self.manifest: Manifest = self.store.resolve(step)
        self.verify = verify
        self._digest = hasher(self.manifest.hash)
        self._blobs: dict[int, torch.Tensor] = {}

    def corrupt(self, blob: int, digest: bytes, what: str) -> CorruptDataError:
        m = self.manifest
        names = ", ".join(m.tensors_of_blob(blob)) or "(no tensor)"
        return CorruptDataError(
            f"chunk {digest.hex()} of step {m.step} in {self.store.root} {what}; it holds bytes of tensor(s) "
            f"{names}. Run `solar-ckpt verify {self.store.root}` and restore from an older version"
        )

    def read_blob(self, i: int) -> torch.Tensor:
        """Blob ``i`` as a CPU uint8 tensor (verified)."""
        if i in self._blobs:
            return self._blobs[i]
        m = self.manifest
        entry = m.blobs[i]
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy()) if entry.nbytes else memoryview(bytearray())
        digests = m.blob_digests(i)
        for j, (a, e) in enumerate(chunk_spans(entry.nbytes, m.chunk_size)):
            d = digests[j].tobytes()
            try:
                n = self.store.read_chunk_into(d, view[a:e])
            except ValueError as exc:  # longer than expected, or missing
                raise self.corrupt(i, d, "is missing or has the wrong size") from exc
            if n != e - a:
                raise self.corrupt(i, d, f"has {n} B instead of {e - a} B")
            if self.verify and self._digest(view[a:e]) != d:
                raise self.corrupt(i, d, "fails its hash (the stored bytes changed)")
        self._blobs[i] = buf
        return buf

    def tensor(self, name: str, map_location: Any = "cpu") -> torch.Tensor:
        """One tensor by its flattened name, reading only the chunks of its blob."""
        refs = [t for t in self.manifest.tensors if t.name == name]
        if not refs:
            raise CheckpointError(f"no tensor {name!r} in step {self.manifest.step} of {self.store.root}")
        ref = refs[0]
        buf = self.read_blob(ref.blob)
        dev = _target_device(ref.device, map_location)
        return materialize([ref], {ref.blob: buf if dev.type == "cpu" else buf.to(dev)})[0]

    def state_dict(self, map_location: Any = None, *, progress: bool = False) -> Any:
        m = self.manifest
        buffers = []
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=m.logical_bytes, unit="B", unit_scale=True, desc=f"load step {m.step}", leave=False, disable=None)
        for i, entry in enumerate(m.blobs):
            buf = self.read_blob(i)
            dev = _target_device(entry.device, map_location)
            buffers.append(buf if dev.type == "cpu" else buf.to(dev))
            if bar is not None:
                bar.update(entry.nbytes)
        if bar is not None:
            bar.close()
        self._blobs.clear()
        return unflatten(m.skeleton, materialize(m.tensors, buffers))


def load(root: "str | os.PathLike", step: int | None = None, map_location: Any = None, *, verify: bool = True,
         storage_options: dict | None = None) -> Any:
    """Load the state dict of version ``step`` (default: the newest complete one).

    Args:
        root: checkpoint root: local path or fsspec URL.
        step: version to load; ``None`` for the newest whose manifest is complete.
        map_location: like ``torch.load``: a device, a ``{saved: target}`` dict or a callable.
        verify: re-hash every chunk (default); corrupt data raises instead of being returned.
        storage_options: fsspec options for a URL ``root``.

    Raises:
        CheckpointError: no such version, or nothing complete to load.
        CorruptDataError: a chunk is missing or does not match its digest (names it and its tensors).
    """
    return Reader(root, step, verify=verify, storage_options=storage_options).state_dict(map_location)


def list_versions(root: "str | os.PathLike", *, storage_options: dict | None = None) -> list[int]:
    """Steps of the complete versions in ``root``, oldest first (torn manifests are ignored)."""
    return CheckpointStore(root, **(storage_options or {})).versions()
