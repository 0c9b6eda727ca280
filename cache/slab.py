"""Spilled arrays of one size in one file, read back as views of its map.

NOTE [ Spilled rows in slab files ]
    A value spilled to a file of its own is read back by opening, reading and closing that file
    into fresh bytes on every hit. :class:`Slab` keeps the spilled arrays of one byte size in
    one file under the spill tier's private directory, each value written with ``pwrite`` into
    a free slot; a hit is a read-only view of a map of the slot's block: no system call, no
    allocation, the page cache's bytes as a local file's rows are (NOTE [ Mapped reads ] in
    io_backends/mapped.py).

    Blocks. The file grows a block at a time, its disk space reserved up front with
    ``posix_fallocate`` (a full disk shows at the grow, not at a later write to the map), and
    each block is one map. Blocks grow geometrically from ``block_bytes`` (doubling, up to
    ``max_block_bytes``), so a slab of any size holds O(log) maps: each map holds a duplicate of
    the file's descriptor (CPython's mmap before 3.13), and blocks of one fixed size would hold
    one per block (a thousand for 16 GiB of 16 MiB blocks). A put may bound the next block's bytes (``room``): the spill
    tier charges every block to its byte budget when it is grown and never grows one past it.

    When a block cannot be had: a failed map or reservation (a file system that cannot map or
    reserve files, no descriptor left) turns the slab off for good, with a warning naming the
    cause (its free slots still take values); a full disk
    (``ENOSPC``) makes it check the file system's free space before it tries again, so a full
    disk costs a ``statvfs`` per put, not a reservation. Either way the put returns None and
    the tier spills that value to a file of its own.

    A slot is written again only when nothing reads it: a put returns the slot's one array, made
    over a ``memoryview`` of it, which the tier's index keeps and every hit hands out; every
    array derived from it keeps that one alive, and a weak reference to it frees the slot when
    it goes (NOTE [ Kept rows in an arena ] in cache/arena.py says why): a value deleted while a
    batch still reads it keeps its slot until that batch is done. The file has a dot name (the
    disk tier lists no dot names) and goes with the tier's directory; its maps stay valid while
    views of them live, and its descriptor is closed by :meth:`Slab.close` or, for a slab
    dropped without it, when the slab is collected.

    Where: slabs need ``os.posix_fallocate``, ``os.pwrite`` and ``mmap.madvise``
    (:func:`available`: not on macOS or Windows, where every value is a file of its own).
    Pages written are mapped into the block's map at once with ``MADV_POPULATE_READ`` on Linux
    (5.14 or later; older kernels refuse the advice and the first read faults them in).
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import warnings
import weakref

import numpy as np

from .arena import SlotBlocks

__all__ = ["Slab", "available", "BLOCK_BYTES", "MAX_BLOCK_BYTES", "MIN_BYTES", "MADV_POPULATE_READ"]

#: Bytes of a slab's first block (at least one value), unless the caller bounds it.
BLOCK_BYTES = 16 << 20
#: The largest block a slab grows by (blocks double up to it).
MAX_BLOCK_BYTES = 1 << 30
#: Arrays smaller than this stay one file each: a block would be mostly slack for few of them.
MIN_BYTES = 16 << 10
#: madvise advice mapping pages of the page cache into a map (Linux only, value from
#: <linux/mman.h>; Python names it from 3.12). None: no such advice here.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
_GRANULE = mmap.ALLOCATIONGRANULARITY  # a map's offset is a multiple of it
_NO_ROOM = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def available() -> bool:
    """Whether this platform has what a slab needs (else spilled values are a file each)."""
    return hasattr(os, "posix_fallocate") and hasattr(os, "pwrite") and hasattr(mmap.mmap, "madvise")


class Slab(SlotBlocks):
    """Values of ``nbytes`` bytes each in the file ``.slab-<nbytes>`` under ``directory``, in
    blocks of ``block_bytes`` doubling up to ``max_block_bytes`` (default: ``block_bytes``,
    blocks of one size)."""

    def __init__(self, directory: str, nbytes: int, block_bytes: int = BLOCK_BYTES,
                 max_block_bytes: int | None = None) -> None:
        super().__init__(nbytes, max(1, block_bytes // int(nbytes)))
        self.first_bytes = _granules(self.per_block * self.nbytes)
        self.max_block_bytes = max(self.first_bytes, _granules(max_block_bytes or block_bytes, up=False))
        self.path = os.path.join(directory, f".slab-{self.nbytes}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._close = weakref.finalize(self, os.close, self._fd)  # a slab dropped without close()
        self._maps: list[mmap.mmap] = []
        self._offsets: list[int] = []  # each block's offset in the file
        self.reserved = 0  # bytes of the file's blocks (all reserved on disk)
        self.off: OSError | None = None  # why the slab takes no more blocks, for good
        self._full = False  # the last grow found the disk full
        self._lock = threading.Lock()

    def put(self, data: np.ndarray, dtype: np.dtype, shape: tuple, room: int | None = None) -> np.ndarray | None:
        """Write ``data`` (``nbytes`` contiguous bytes) into a free slot and return it as a
        read-only array of ``dtype`` and ``shape`` (the slot is free again once that array and
        every view of it are gone); None when no slot is free and no block can be added (of at
        most ``room`` bytes, None: any)."""
        with self._lock:
            if not self._free and not self._grow(room):
                return None
            slot = self._free.pop()
        block, i = self._locate(slot)
        try:
            _pwrite_all(self._fd, memoryview(data).cast("B"), self._offsets[block] + i * self.nbytes)
        except BaseException:
            self._free.append(slot)
            raise
        self._map_in(block, i * self.nbytes)
        return self._hand_out(slot, dtype, shape)

    def _map_in(self, block: int, at: int) -> None:
        """Map the pages just written into the block's map now, so that the first epoch reading
        them takes no page faults. Advice only: without it they are faulted in at first read."""
        if MADV_POPULATE_READ is None:
            return
        page, m = mmap.PAGESIZE, self._maps[block]
        start = at // page * page
        try:
            m.madvise(MADV_POPULATE_READ, start, min(len(m), at + self.nbytes) - start)
        except (OSError, ValueError, AttributeError):  # (EINVAL before Linux 5.14)
            pass

    def next_block(self, room: int | None = None) -> int:
        """Bytes of the block the slab grows by next: twice the last (the first: ``first_bytes``),
        at most ``max_block_bytes`` and ``room``, whole allocation granules; 0 when not one
        value fits in ``room``."""
        size = min(self.max_block_bytes, 2 * len(self._maps[-1]) if self._maps else self.first_bytes)
        if room is not None:
            size = min(size, _granules(max(0, room), up=False))
        return size if size >= self.nbytes else 0

    def _grow(self, room: int | None) -> bool:
        """Add a block (under the lock): its disk space reserved, its map made; False when none
        can be had (NOTE [ Spilled rows in slab files ], 'When a block cannot be had')."""
        size = self.next_block(room)
        if self.off is not None or size == 0 or (self._full and not self._room_on_disk(size)):
            return False
        at = self.reserved
        try:
            # (glibc writes zeros where the file system cannot reserve blocks: room is checked either way)
            os.posix_fallocate(self._fd, at, size)
        except OSError as exc:
            os.ftruncate(self._fd, at)
            if exc.errno in _NO_ROOM:
                self._full = True
            else:
                self._turn_off(exc, "its file system cannot reserve it")
            return False
        self._full = False
        try:
            m = _map(self._fd, size, at)
        except (OSError, ValueError) as exc:
            os.ftruncate(self._fd, at)
            self._turn_off(exc if isinstance(exc, OSError) else OSError(errno.EINVAL, str(exc)),
                           "its file system cannot map it")
            return False
        self._maps.append(m)
        self._offsets.append(at)
        self.reserved = at + size
        self._add(memoryview(m), size // self.nbytes)
        return True

    def _room_on_disk(self, size: int) -> bool:
        try:
            st = os.fstatvfs(self._fd)
        except (OSError, AttributeError):
            return True
        return st.f_bavail * st.f_frsize >= size

    def _turn_off(self, exc: OSError, why: str) -> None:
        self.off = exc
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            why = ("the process has no file descriptor left for another map of it: raise the limit "
                   "(ulimit -n), or pass a smaller spill size")
        warnings.warn(f"solar: the spill file {self.path} takes no more values ({exc}): {why}; arrays of "
                      f"{self.nbytes} bytes spill to a file each from now on", RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        """Close the file (its maps go with their last view)."""
        with self._lock:
            self._fd = -1
            self._close()


def _granules(n: int, up: bool = True) -> int:
    """``n`` bytes rounded to whole allocation granules (up, or down)."""
    return (-(-int(n) // _GRANULE) if up else int(n) // _GRANULE) * _GRANULE


def _map(fd: int, size: int, at: int) -> mmap.mmap:
    """A read-only map of ``size`` bytes of ``fd`` at ``at`` (keeping no descriptor of its own
    where Python can: 3.13 and later)."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ, offset=at, trackfd=False)
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ, offset=at)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n
