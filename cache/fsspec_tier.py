"""Shared or remote storage through fsspec: a local path or any URL (``s3://``, ``memory://`` ...).

Writes are atomic where the file system allows it: on file systems with a real rename (local,
NFS/Lustre mounted paths) a value is written to a hidden temporary and moved into place; on object
stores a single PUT is already all-or-nothing, so the value is written directly. Either way a key
that :meth:`exists` holds a complete value.
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
import threading
import uuid
from typing import Hashable, Iterator

from .base import TierFullError
from .disk import FileTier, key_to_relpath, write_atomic

__all__ = ["FsspecTier"]

#: Protocols whose single-object writes are atomic (no temporary + rename needed).
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory", "http", "https"}
#: Protocols whose ``pipe_file(mode="create")`` is an exclusive create: S3's conditional PUT
#: (``If-None-Match: *``, which s3fs sends) and the in-process memory file system.
_EXCLUSIVE_PIPE = {"s3", "s3a", "memory"}
#: Local file systems: exclusive create by link(2), as in :class:`~solar.cache.DiskTier`.
_LOCAL = {"file", "local"}
#: memory:// is one dict per process; its "create" is a check then a write, so creates take this.
_MEMORY_CREATE = threading.Lock()


class FsspecTier(FileTier):
    """Keys are paths below ``url`` on an fsspec file system.

    Args:
        url: a local directory or an fsspec URL.
        capacity_bytes: byte budget, or ``None`` for unbounded.
        storage_options: passed to fsspec (credentials, endpoint ...).
    """

    name = "fsspec"

    def __init__(self, url: str, capacity_bytes: int | None = None, *, storage_options: dict | None = None) -> None:
        super().__init__(capacity_bytes)
        from fsspec.core import url_to_fs

        self.url = str(url)
        self.fs, root = url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/") or "/"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.rename_atomic = not (set(protocols) & _OBJECT_STORES)
        self._protocols = set(protocols)
        self._local = bool(self._protocols & _LOCAL)
        self.exclusive_create = self._local or bool(set(protocols) & _EXCLUSIVE_PIPE)
        self.fs.makedirs(self.root, exist_ok=True)

    @classmethod
    def example(cls, scratch_dir: str, capacity_bytes: int | None = None) -> "FsspecTier":
        return cls(f"file://{scratch_dir}/fsspec-tier", capacity_bytes)

    keeps_files = True

    @classmethod
    def in_directory(cls, root: str) -> "FsspecTier":
        """Files under ``root`` through fsspec's local file system (written to a temporary and moved)."""
        return cls(f"file://{root}")

    def path(self, key: Hashable) -> str:
        return posixpath.join(self.root, key_to_relpath(key))

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(path) or 0)
        except (FileNotFoundError, OSError):
            return 0

    def _read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def _write(self, path: str, view: memoryview) -> None:
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
                raise TierFullError(f"no space left writing {path} on {self.url} ({view.nbytes} B); "
                                    "free space on that storage") from exc
            raise

    def _create(self, path: str, view: memoryview) -> bool:
        if self._local:
            try:
                write_atomic(path, view, replace=False)
            except FileExistsError:
                return False
            return True
        if not self.exclusive_create:
            return super()._create(path, view)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            # memory://'s own "create" checks, then writes; one process-wide lock makes it exclusive
            with _MEMORY_CREATE if "memory" in self._protocols else contextlib.nullcontext():
                self.fs.pipe_file(path, bytes(view), mode="create")
        except FileExistsError:
            return False
        return True

    def _unlink(self, path: str) -> None:
        if not self.fs.isfile(path):  # object stores delete missing keys without an error
            raise FileNotFoundError(path)
        self.fs.rm_file(path)

    def _list(self, head: str) -> Iterator[str]:
        top = posixpath.join(self.root, head) if head else self.root
        try:
            found = self.fs.find(top)
        except FileNotFoundError:
            return
        strip = len(self.root.rstrip("/")) + 1
        rels = (p[strip:] if p.startswith(self.root) else p for p in (x.rstrip("/") for x in found))
        yield from (r for r in sorted(rels) if r and not any(c.startswith(".") for c in r.split("/")))

    def exists(self, key: Hashable) -> bool:
        return self._exists_path(self.path(key))

    def _exists_path(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_bytes is None else f"{self.capacity_bytes} B"
        return f"FsspecTier({self.url!r}, {cap})"
