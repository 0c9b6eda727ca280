"""Node-local disk tier: one file per key under a directory, every write atomic.

A put writes a hidden temporary file next to its destination, ``fsync``s it and renames it into
place, so a reader (or a process restarted after ``SIGKILL`` or a power cut) sees either the old
value or the new one, never a torn file. That is what lets the checkpoint writer treat a chunk file
that exists as a complete chunk. Temporaries left by a killed writer are invisible to :meth:`keys`
and removed by :meth:`cleanup_temp`.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from abc import abstractmethod
from typing import Any, Hashable, Iterator

from .base import Tier, TierFullError, UnsafePathError

__all__ = ["DiskTier", "FileTier", "key_to_relpath", "relpath_to_key", "write_atomic", "open_regular"]

#: how a value file is opened for reading: never through a final symlink, and without blocking on
#: a FIFO planted under its name (the type is checked on the open descriptor)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

_TMP_MARK = ".tmp-"


def key_to_relpath(key: Hashable) -> str:
    """The relative path (``/``-separated) a key is stored under.

    String keys are paths (``"chunks/ab/abcd..."``); int keys (sample indices) map to ``"#<int>"``.
    Components may not be empty, ``.``/``..`` or start with a dot (dot names are temporaries); a
    string key may not start with ``#`` either: ``"#5"`` would be the file of the int key ``5``.
    """
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"file-backed tiers take str or int keys, got {type(key).__name__} {key!r}")
    if isinstance(key, int):
        return f"#{key}"
    parts = key.split("/")
    if not key or any(not p or p.startswith(".") for p in parts):
        raise ValueError(f"invalid tier key {key!r}: use non-empty '/'-separated names that do not start with '.'")
    if key.startswith("#"):
        raise ValueError(f"invalid tier key {key!r}: a name starting with '#' is how int keys are stored "
                         f"('#5' is the key 5); use another first character, or an int key")
    return key


def relpath_to_key(rel: str) -> Hashable:
    """The key stored at ``rel``: ``"#<int>"`` written by :func:`key_to_relpath` is that int; any
    other name (``"#007"`` put there by hand) stays a string."""
    if rel.startswith("#"):
        try:
            n = int(rel[1:])
        except ValueError:
            return rel
        return n if rel == f"#{n}" else rel
    return rel


def _view(value: Any) -> memoryview:
    return memoryview(value).cast("B")


def write_atomic(path: str, value: Any, *, fsync: bool = True, replace: bool = True, drop: bool = False) -> int:
    """Write ``value`` to ``path`` via a temporary file + fsync + rename; return the bytes written.

    ``drop=True`` (with ``fsync``) drops the file's pages from the page cache once they are on
    disk: for files nobody reads soon (a checkpoint's chunks), whose cached pages would make the
    kernel reclaim memory during every later write (``bench/checkpoint``).

    ``replace=False`` publishes the temporary with ``link`` instead of ``rename``: it fails with
    ``FileExistsError`` (and leaves ``path`` as it was) if ``path`` exists, atomically, so of
    two writers racing to create ``path`` exactly one succeeds.

    Raises:
        TierFullError: the file system is out of space (the temporary is removed, ``path`` untouched).
        FileExistsError: ``replace=False`` and ``path`` exists.
    """
    view = _view(value)
    directory = os.path.dirname(path) or "."
    created, d = [], directory
    while d and not os.path.isdir(d):  # directories this write creates (e.g. a new chunks/xx/)
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(directory, exist_ok=True)
    if fsync:  # a new directory's entry must reach the disk too, or the file in it can vanish
        for c in created:
            fsync_path(os.path.dirname(c) or ".", directory=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < view.nbytes:
                done += os.write(fd, view[done:])
            if fsync:
                os.fsync(fd)
                if drop and hasattr(os, "posix_fadvise"):
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    except OSError:  # advice only: a file system that refuses it keeps its pages
                        pass
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise TierFullError(
                f"no space left on the device writing {path} ({view.nbytes} B); free space or point the "
                f"tier at a larger file system (nothing was replaced)"
            ) from exc
        raise
    if fsync:
        fsync_path(directory, directory=True)
    return view.nbytes


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, not following a symlink there.

    Raises:
        FileNotFoundError, NotADirectoryError: nothing there.
        IsADirectoryError: a directory there.
        UnsafePathError: ``path`` is a symlink, a FIFO or a device.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(errno.ELOOP, "is a symlink; a tier never reads through one", path) from None
        if exc.errno == errno.ENXIO:  # a socket
            raise UnsafePathError(exc.errno, "is not a regular file", path) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        raise UnsafePathError(errno.EINVAL, "is not a regular file", path)
    return fd


def fsync_path(path: str, *, directory: bool = False) -> None:
    """``fsync`` a file (its data reaches the disk) or a directory (the entries made in it do).

    Some file systems cannot fsync a directory (EINVAL); its entries are then as durable as the
    file system allows, and that is not an error."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


class FileTier(Tier):
    """Shared logic of tiers that keep one file (or object) per key: budget, counters, listing.

    Subclasses provide the storage primitives :meth:`path`, :meth:`_size`, :meth:`_read`,
    :meth:`_write` (atomic), :meth:`_unlink` and :meth:`_list`.
    """

    persistent = True

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes)
        self._lock = threading.Lock()  # the byte count and the counters
        # One writer per file at a time (of 64 stripes by path): its old size then stays what was
        # measured while its write runs. Writes of other files run side by side.
        self._stripes = [threading.Lock() for _ in range(64)]
        self._used: int | None = None  # scanned lazily: a large store should not be walked on open

    def _stripe(self, path: str) -> threading.Lock:
        return self._stripes[hash(path) % len(self._stripes)]

    # -- primitives --
    @abstractmethod
    def path(self, key: Hashable) -> str:
        """Where the value of ``key`` lives."""

    @abstractmethod
    def _size(self, path: str) -> int:
        """Size of the file at ``path``; 0 if missing."""

    @abstractmethod
    def _read(self, path: str) -> bytes:
        """The bytes at ``path``; raises FileNotFoundError."""

    @abstractmethod
    def _write(self, path: str, view: memoryview) -> None:
        """Write ``view`` to ``path`` atomically (readers see the old value or the new, never half)."""

    @abstractmethod
    def _unlink(self, path: str) -> None:
        """Remove ``path``; raises FileNotFoundError."""

    @abstractmethod
    def _list(self, head: str) -> Iterator[str]:
        """Relative paths of the visible files below the relative directory ``head``."""

    # -- the Tier contract --
    def _usage(self) -> int:
        if self._used is None:
            self._used = sum(self._size(self.path(k)) for k in self.keys())
        return self._used

    def _count_read(self, nbytes: int | None) -> None:
        if nbytes is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.bytes_out += nbytes

    def get(self, key: Hashable) -> bytes | None:
        try:
            data = self._read(self.path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            data = None
        self._count_read(None if data is None else len(data))
        return data

    def put(self, key: Hashable, value: Any) -> bool:
        return self._store(key, value, create=False)

    def put_new(self, key: Hashable, value: Any) -> bool:
        return self._store(key, value, create=True)

    def _create(self, path: str, view: memoryview) -> bool:
        """Write ``view`` to ``path`` only if it is absent; False if it exists.

        The default checks, then writes (not exclusive); subclasses with an exclusive create
        override it and set :attr:`exclusive_create`."""
        if self._exists_path(path):
            return False
        self._write(path, view)
        return True

    def _exists_path(self, path: str) -> bool:
        try:
            self._read(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        return True

    def _store(self, key: Hashable, value: Any, create: bool) -> bool:
        """Check the budget and reserve the bytes in one step, then write (outside the count's
        lock, so writes of different files overlap), then give the reservation back if the
        write did not happen. The check and the count are one step because concurrent puts must
        not overshoot the budget, and two puts of one key must not both count its old size (the
        count would drift up for good)."""
        path = self.path(key)
        view = _view(value)
        n = view.nbytes
        with self._stripe(path):
            old = self._size(path)
            with self._lock:
                if self.capacity_bytes is not None and self._usage() + n - old > self.capacity_bytes:
                    self.stats.rejected += 1
                    return False
                counted = self._used is not None
                if counted:
                    self._used += n - old  # reserved
            done = False
            try:
                if create:
                    done = self._create(path, view)
                else:
                    self._write(path, view)
                    done = True
            finally:
                with self._lock:
                    if not done and counted:
                        self._used -= n - old
                    if done:
                        self.stats.bytes_in += n
        return done

    def delete(self, key: Hashable) -> bool:
        path = self.path(key)
        with self._stripe(path):
            size = self._size(path)
            try:
                self._unlink(path)
            except FileNotFoundError:
                return False
            with self._lock:
                if self._used is not None:
                    self._used -= size
                self.stats.evictions += 1
        return True

    def __contains__(self, key: object) -> bool:
        try:
            return self.exists(key)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    def keys(self) -> Iterator[Hashable]:
        return (relpath_to_key(r) for r in self._list(""))

    def keys_with_prefix(self, prefix: str) -> Iterator[Hashable]:
        head = prefix.rpartition("/")[0]
        return (relpath_to_key(r) for r in self._list(head) if r.startswith(prefix))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._usage()


class DiskTier(FileTier):
    """Files under ``root``; ``put`` is atomic (temp + fsync + rename) and respects the byte budget.

    Args:
        root: directory (created if missing).
        capacity_bytes: byte budget, or ``None`` for "as much as the file system holds".
        fsync: fsync files and their directory on every put (durable against power loss; turning it
            off keeps atomicity against process crashes only).
        mode: permissions of the root if it is created (less the umask); ``0o700`` for a cache of
            a user's samples (the spill tier). An existing root keeps its own.
        drop_written: with ``fsync``, drop each file's pages from the page cache once on disk
            (``write_atomic``'s ``drop``): for files written to be kept, not read soon (a
            checkpoint root's); a spill tier, read again next epoch, keeps them.

    Paths are kept below the root: a directory in it that is a symlink out of it, or a value
    file that is a symlink or not a regular file, raises :class:`~solar.cache.base.UnsafePathError`
    instead of being read, written or deleted through.
    """

    name = "disk"

    def __init__(self, root: str, capacity_bytes: int | None = None, *, fsync: bool = True,
                 mode: int = 0o777, drop_written: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self.drop_written = drop_written  # write_atomic's drop
        os.makedirs(self.root, mode=mode, exist_ok=True)
        # where the root really is: every value's directory must resolve to a path below it
        self._real_root = os.path.realpath(self.root)

    @classmethod
    def example(cls, scratch_dir: str, capacity_bytes: int | None = None) -> "DiskTier":
        return cls(os.path.join(scratch_dir, "disk-tier"), capacity_bytes)

    keeps_files = True

    @classmethod
    def in_directory(cls, root: str) -> "DiskTier":
        return cls(root, None, fsync=False, mode=0o700)

    def path(self, key: Hashable) -> str:
        return os.path.join(self.root, *key_to_relpath(key).split("/"))

    def file_path(self, key: Hashable) -> str:
        """The file of ``key``, for a caller that opens it itself (with :func:`open_regular`),
        once its directory is known to resolve below the root (:meth:`_inside`).

        Raises:
            UnsafePathError: the directory resolves elsewhere.
        """
        return self._inside(self.path(key))

    def _inside(self, path: str) -> str:
        """``path``, once its directory is known to resolve below the root.

        A root is a directory tree someone else may have prepared (a downloaded checkpoint): a
        directory in it that is a symlink (``chunks/ab -> /elsewhere``) would make writes, reads
        and deletes land outside it. The final component is handled by each operation (reads
        open it with ``O_NOFOLLOW``; writes rename over it, which replaces a symlink rather than
        following it; unlink removes the link itself).

        Raises:
            UnsafePathError: the directory resolves elsewhere.
        """
        directory = os.path.dirname(path)
        want = self._real_root + directory[len(self.root):]
        if os.path.realpath(directory) != want:
            raise UnsafePathError(errno.ELOOP, f"leads out of the tier's root {self.root} through a symlink "
                                               "(a directory in it is a link); nothing is read or written there",
                                  directory)
        return path

    def _size(self, path: str) -> int:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def _read(self, path: str) -> bytes:
        with open(open_regular(self._inside(path)), "rb") as f:
            return f.read()

    def _write(self, path: str, view: memoryview) -> None:
        write_atomic(self._inside(path), view, fsync=self.fsync, drop=self.drop_written)

    exclusive_create = True  # link(2) of a finished temporary fails if the name exists

    def _create(self, path: str, view: memoryview) -> bool:
        try:
            write_atomic(self._inside(path), view, fsync=self.fsync, replace=False, drop=self.drop_written)
        except FileExistsError:
            return False
        return True

    def _unlink(self, path: str) -> None:
        os.unlink(self._inside(path))

    def _list(self, head: str) -> Iterator[str]:
        top = os.path.join(self.root, *head.split("/")) if head else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = os.path.relpath(dirpath, self.root)
            for name in sorted(filenames):
                if not name.startswith("."):
                    yield name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")

    def read_into(self, key: Hashable, out: memoryview) -> int | None:
        path = self._inside(self.path(key))
        try:
            f = open(open_regular(path), "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self._count_read(None)
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > out.nbytes:
                raise ValueError(f"{path} has {size} B, the buffer only {out.nbytes} B")
            done = 0
            while done < size:
                n = f.readinto(out[done:size])
                if not n:
                    break
                done += n
        self._count_read(done)
        return done

    def exists(self, key: Hashable) -> bool:
        """Whether ``key`` has a regular file below the root (a symlink there is not a value)."""
        path = self._inside(self.path(key))
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def cleanup_temp(self) -> int:
        """Remove temporaries left by killed writers; return how many. Call only while no writer runs."""
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(".") and _TMP_MARK in name:
                    try:
                        os.unlink(os.path.join(dirpath, name))
                        removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_bytes is None else f"{self.capacity_bytes} B"
        return f"DiskTier({self.root!r}, {cap})"
