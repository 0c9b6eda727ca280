"""Shared or remote storage through fsspec: a local path or any URL (``s3://``, ``memory://`` ...).

Writes are atomic where the file system allows it: on file systems with a real rename (local,
NFS/Lustre mounted paths) a value is written to a hidden temporary and moved into place; on object
stores a single PUT is already all-or-nothing, so the value is written directly. Either way a key
that :meth:`exists` holds a complete value.
"""

from __future__ import annotations

import errno
import posixpath
import threading
import uuid
from typing import Any, Hashable, Iterator

from .base import Tier, TierFullError
from .disk import key_to_relpath, relpath_to_key

__all__ = ["FsspecTier"]

#: Protocols whose single-object writes are atomic (no temporary + rename needed).
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory", "http", "https"}


class FsspecTier(Tier):
    """Keys are paths below ``url`` on an fsspec file system.

    Args:
        url: a local directory or an fsspec URL.
        capacity_bytes: byte budget, or ``None`` for unbounded.
        storage_options: passed to fsspec (credentials, endpoint ...).
    """

    name = "fsspec"
    persistent = True

    def __init__(self, url: str, capacity_bytes: int | None = None, *, storage_options: dict | None = None) -> None:
        super().__init__(capacity_bytes)
        from fsspec.core import url_to_fs

        self.url = str(url)
        self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.rename_atomic = not (set(protocols) & _OBJECT_STORES)
        self.fs.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._used: int | None = None

    @classmethod
    def example(cls, scratch_dir: str, capacity_bytes: int | None = None) -> "FsspecTier":
        return cls(f"file://{scratch_dir}/fsspec-tier", capacity_bytes)

    def path(self, key: Hashable) -> str:
        return posixpath.join(self.root, key_to_relpath(key))

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(path) or 0)
        except (FileNotFoundError, OSError):
            return 0

    def _usage(self) -> int:
        if self._used is None:
            self._used = sum(self._size(self.path(k)) for k in self.keys())
        return self._used

    def get(self, key: Hashable) -> bytes | None:
        try:
            data = self.fs.cat_file(self.path(key))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_out += len(data)
        return data

    def put(self, key: Hashable, value: Any) -> bool:
        path = self.path(key)
        view = memoryview(value).cast("B")
        n = view.nbytes
        with self._lock:
            if self.capacity_bytes is not None:
                if self._usage() + n - self._size(path) > self.capacity_bytes:
                    self.stats.rejected += 1
                    return False
        old = self._size(path) if self._used is not None else 0
        parent = posixpath.dirname(path)
        target = path
        if self.rename_atomic:
            target = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            self.fs.makedirs(parent, exist_ok=True)
            with self.fs.open(target, "wb") as f:
                f.write(view)
            if target != path:
                self.fs.mv(target, path)
        except OSError as exc:
            if target != path:
                try:
                    self.fs.rm_file(target)
                except (OSError, FileNotFoundError):
                    pass
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"no space left writing {self.url}/{key} ({n} B); free space on that storage") from exc
            raise
        with self._lock:
            if self._used is not None:
                self._used += n - old
            self.stats.bytes_in += n
        return True

    def delete(self, key: Hashable) -> bool:
        path = self.path(key)
        size = self._size(path)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        with self._lock:
            if self._used is not None:
                self._used -= size
            self.stats.evictions += 1
        return True

    def exists(self, key: Hashable) -> bool:
        return bool(self.fs.isfile(self.path(key)))

    def __contains__(self, key: object) -> bool:
        try:
            return self.exists(key)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    def _find(self, top: str) -> Iterator[str]:
        try:
            found = self.fs.find(top)
        except FileNotFoundError:
            return iter(())
        strip = len(self.root.rstrip("/")) + 1
        rels = (p[strip:] if p.startswith(self.root) else p for p in (x.rstrip("/") for x in found))
        return (r for r in sorted(rels) if r and not any(c.startswith(".") for c in r.split("/")))

    def keys(self) -> Iterator[Hashable]:
        return (relpath_to_key(r) for r in self._find(self.root))

    def keys_with_prefix(self, prefix: str) -> Iterator[Hashable]:
        head, _, _ = prefix.rpartition("/")
        top = posixpath.join(self.root, head) if head else self.root
        return (relpath_to_key(r) for r in self._find(top) if r.startswith(prefix))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._usage()

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_bytes is None else f"{self.capacity_bytes} B"
        return f"FsspecTier({self.url!r}, {cap})"
