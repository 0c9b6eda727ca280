"""A local file's bytes through a read-only memory map of it.

NOTE [ Mapped reads ]
    A row read with ``preadv`` from the page cache is a system call and a copy made by the
    kernel: about a third of ``memcpy``'s speed here (``bench/io/mapped.py``, ``mapped.json``).
    Mapped once, read-only, for the backend's life, the same bytes are plain memory: after the
    first touch of a page (the first epoch) a row is one copy from the mapping into its place,
    with no system call and no fault, the GIL released during the copy as for any large numpy
    copy. So the hdf5 backend serves the rows of its plain-bytes datasets (NOTE [ Reads outside
    h5py's lock ] in hdf5.py) from a map of the file when the file lies on a local file system
    (:data:`LOCAL_FS`, from ``/proc/self/mountinfo``); elsewhere (network and parallel file
    systems, whose clients cache and lock pages their own way, a platform without the mount
    table) it keeps ``preadv``. ``backend_options={"mmap": True}`` maps any file, ``False`` none.
    MPI-IO (``mpi-hdf5``) and remote files (``fsspec``) never map: their bytes are not a local
    file's.

    A mapped file cut shorter while mapped (truncated, rewritten in place) kills the process
    with ``SIGBUS`` when a row past the cut is touched, where ``preadv`` returns a short read.
    So every read first checks the file's size (one ``fstat``) and raises ``StorageError`` for
    rows past its end, as the ``preadv`` path does; a cut landing between that check and the
    copy cannot be caught, and only then does the process die. Files replaced by renaming a new
    one over them are safe (the map keeps the old file's pages). A job whose files may be
    rewritten in place while it reads them should pass ``mmap=False``.

    The map is of a descriptor opened here, checked to be the same file as HDF5's (device and
    inode), not a duplicate of HDF5's: a duplicate would share HDF5's file lock and hold it
    after the file is closed. It is never closed explicitly: the map goes with its last
    reference, so a read in flight on another thread keeps it alive through a ``close()``.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

from solar.errors import ConfigError

__all__ = ["MappedFile", "LOCAL_FS", "fs_type", "mappable"]

#: File systems whose files are mapped by default: local disks and memory.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "zfs", "tmpfs", "ramfs",
                      "overlay", "bcachefs"})


def fs_type(path: str) -> str | None:
    """The type of the file system ``path`` lies on (``/proc/self/mountinfo``), or None where
    there is no mount table."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), right.split()[0]
    return kind


def mappable(path: str, option) -> bool:
    """Whether the file at ``path`` is mapped, by the backend's ``mmap`` option (True, False, or
    ``"auto"``: on a local file system)."""
    if option is True or option is False:
        return option
    if option not in ("auto", None):
        raise ConfigError(f"{path}: backend_options mmap={option!r}; pass True, False or 'auto'")
    return fs_type(path) in LOCAL_FS


#: the bytes :meth:`MappedFile.populate` remembers as one (more for files over 2**24 of them)
_GRAIN = 64 << 10

_SHARED: "weakref.WeakValueDictionary[tuple, MappedFile]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def _after_fork() -> None:  # (a fork while another thread held the lock left it held in the child)
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class MappedFile:
    """The first ``size`` bytes of a file, mapped read-only (:meth:`open`).

    One map per file, size and process, shared by every backend that opens it (the request
    threads' clones): each map's pages are faulted in once, not once per clone."""

    __slots__ = ("size", "flat", "_map", "_known", "_grain", "_all_known", "__weakref__")

    def __init__(self, m: mmap.mmap) -> None:
        self._map, self.flat = m, np.frombuffer(m, dtype=np.uint8)
        self.size = len(self.flat)
        self._known: np.ndarray | None = None  # per _grain bytes: advised by populate()
        self._grain = _GRAIN
        self._all_known = False  # every grain advised: nothing to do

    @classmethod
    def open(cls, path: str, fd: int, size: int) -> "MappedFile | None":
        """The map of the file HDF5 has open as ``fd`` (``size`` bytes), through ``path``; None
        when the file there is another one now, is shorter, or cannot be mapped."""
        if size <= 0:
            return None
        b = os.fstat(fd)
        key = (b.st_dev, b.st_ino, size, os.getpid())
        with _LOCK:
            got = _SHARED.get(key)
            if got is not None:
                return got
            try:
                own = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return None
            try:
                a = os.fstat(own)
                if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or a.st_size < size:
                    return None
                got = _SHARED[key] = cls(mmap.mmap(own, size, access=mmap.ACCESS_READ))
            except (OSError, ValueError):
                return None
            finally:
                os.close(own)  # (the map keeps a descriptor of its own)
        return got

    def drop_pages(self) -> None:
        """Unmap this process's pages of the file (``MADV_DONTNEED``); the next touch maps them
        again from the page cache, or reads them from storage if they were evicted meanwhile. A
        mapped page cannot be evicted from the page cache, so a cold-cache measurement drops
        them first."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
        if self._known is not None:
            self._known[:] = False
        self._all_known = False

    def populate(self, pieces: list) -> None:
        """Start reading the pages of the ``(file offset, bytes)`` pieces into the page cache
        (``MADV_WILLNEED``: the kernel's read-ahead, in the background), so that the caller
        that copies them later waits for no storage (NOTE [ Rows copied when the batch is
        taken ] in solar/slots.py). ``MADV_POPULATE_READ`` would also map them, but reads them
        one after the other on the calling thread, more slowly from a cold page cache. A second
        ``madvise`` of pages already cached costs about what the first did, so the map
        remembers, per ``_grain`` bytes, what it advised (until :meth:`drop_pages`). Advice
        only: without it (or where it fails) the copy faults the pages in."""
        if not pieces or self.size <= 0 or not hasattr(mmap, "MADV_WILLNEED") or self._all_known:
            return
        if self._known is None:
            self._grain = max(_GRAIN, 1 << max(0, (self.size >> 24).bit_length()))  # (at most 2**24 places)
            self._known = np.zeros(-(-self.size // self._grain), dtype=bool)
        known, g = self._known, self._grain
        at = np.fromiter((p[0] for p in pieces), np.int64, len(pieces))
        end = at + np.fromiter((p[1] for p in pieces), np.int64, len(pieces))
        a, b = at // g, np.minimum(-(-end // g), len(known))
        need = ~(known[a] & known[b - 1])
        for i in np.flatnonzero(~need & (b - a > 2)).tolist():
            need[i] = not known[a[i]:b[i]].all()
        for lo, hi in zip(a[need].tolist(), b[need].tolist()):
            try:
                self._map.madvise(mmap.MADV_WILLNEED, lo * g, min(hi * g, self.size) - lo * g)
            except (OSError, ValueError):  # (refused, or closed)
                return
            known[lo:hi] = True
        self._all_known = bool(need.any()) and bool(known.all())

    def file_size(self) -> int:
        """The mapped file's size now (one ``fstat``)."""
        return self._map.size()

    def rows(self, at: int, n: int, dtype: np.dtype, row_shape: tuple) -> np.ndarray:
        """The ``n`` bytes at ``at`` as rows of ``row_shape`` and ``dtype`` (a view of the map)."""
        return self.flat[at:at + n].view(dtype).reshape(-1, *row_shape)

    def copy_pieces(self, pieces: list, out, dtype: np.dtype, row_shape: tuple, row: int) -> None:
        """``(file offset, bytes)`` pieces of whole rows into consecutive rows of ``out``: an array,
        or a list of row places (one copy each)."""
        if isinstance(out, np.ndarray):
            flat, pos = out.reshape(-1).view(np.uint8), 0
            for at, n in pieces:
                flat[pos:pos + n] = self.flat[at:at + n]
                pos += n
            return
        pos = 0
        for at, n in pieces:
            src = self.rows(at, n, dtype, row_shape)
            for j in range(n // row):
                out[pos + j][...] = src[j]
            pos += n // row
