"""Spilled arrays of one size in one file, read back as views of its map.

NOTE [ Spilled rows in slab files ]
    A spill tier kept each spilled value as a file of its own (the disk tier's): every hit from
    disk opened, read and closed its file into a fresh byte string, several times what copying
    the same row out of a mapped file costs, so an epoch served from a spill tier on node-local
    disk took about three times the local file's. :class:`Slab` keeps the spilled arrays of one
    byte size in one file under the spill tier's private directory, grown a block of
    ``BLOCK_BYTES`` at a time (reserved up front with ``fallocate`` where the file system does
    so, else written out), each value written with ``pwrite`` into a free slot. A hit is a
    read-only view of a map of its block: no system call, no allocation, the page cache's bytes
    as a local file's rows are (NOTE [ Mapped reads ] in io_backends/mapped.py).

    A slot is written again only when nothing reads it: a put returns the slot's one array, made
    over a ``memoryview`` of it, which the tier's index keeps and every hit hands out; every
    array derived from it keeps that one alive, and a weak reference to it frees the slot when
    it goes (NOTE [ Kept rows in an arena ] in cache/arena.py says why): a value deleted while a
    batch still reads it keeps its slot until that batch is done. The file has a dot name (the
    disk tier lists no dot names) and goes with the tier's directory; its maps stay valid while
    views of them live.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from .arena import SlotBlocks

__all__ = ["Slab", "BLOCK_BYTES", "MIN_BYTES"]

#: Bytes a slab file grows by at a time (at least one value).
BLOCK_BYTES = 16 << 20
#: Arrays smaller than this stay one file each: a block would be mostly slack for few of them.
MIN_BYTES = 16 << 10
#: madvise advice mapping pages of the page cache into a map (Linux 5.14; Python names it from 3.12).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class Slab(SlotBlocks):
    """Values of ``nbytes`` bytes each in the file ``.slab-<nbytes>`` under ``directory``."""

    def __init__(self, directory: str, nbytes: int, block_bytes: int = BLOCK_BYTES) -> None:
        super().__init__(nbytes, max(1, block_bytes // int(nbytes)))
        page = mmap.ALLOCATIONGRANULARITY
        self.stride = -(-self.per_block * self.nbytes // page) * page  # a block's offset: a map's
        self.path = os.path.join(directory, f".slab-{self.nbytes}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def put(self, data: np.ndarray, dtype: np.dtype, shape: tuple) -> np.ndarray | None:
        """Write ``data`` (``nbytes`` contiguous bytes) into a free slot and return it as a
        read-only array of ``dtype`` and ``shape`` (the slot is free again once that array and
        every view of it are gone); None when the disk has no room for another block."""
        with self._lock:
            if not self._free and not self._grow():
                return None
            slot = self._free.pop()
        block, i = divmod(slot, self.per_block)
        try:
            _pwrite_all(self._fd, memoryview(data).cast("B"), block * self.stride + i * self.nbytes)
        except BaseException:
            self._free.append(slot)
            raise
        self._map_in(block, i * self.nbytes)
        return self._hand_out(slot, dtype, shape)

    def _map_in(self, block: int, at: int) -> None:
        """Map the pages just written into the block's map now, so that the first epoch reading
        them takes no page faults. Advice only: an older kernel leaves them to be faulted in."""
        page = mmap.PAGESIZE
        start = at // page * page
        try:
            self._maps[block].madvise(MADV_POPULATE_READ, start, min(self.stride, at + self.nbytes) - start)
        except (OSError, ValueError):  # (EINVAL before Linux 5.14)
            pass

    def _grow(self) -> bool:
        """Add a block (under the lock): its disk space reserved, its map made; False when the
        disk has no room for it."""
        b = len(self._blocks)
        try:
            # (glibc writes zeros where the file system cannot reserve blocks: room is checked either way)
            os.posix_fallocate(self._fd, b * self.stride, self.stride)
            m = mmap.mmap(self._fd, self.stride, access=mmap.ACCESS_READ, offset=b * self.stride)
        except OSError:
            os.ftruncate(self._fd, b * self.stride)
            return False
        self._maps.append(m)
        self._add(memoryview(m))
        return True

    def close(self) -> None:
        """Close the file (its maps go with their last view)."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n
