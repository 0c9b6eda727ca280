"""Memory for the rows a buffer keeps: large blocks, each row's slot reused once nobody holds it.

NOTE [ Kept rows in an arena ]
    A pass puts the misses it keeps into the rank's buffer, one row each (``FetchPass.finish``).
    Made one ``np.array`` at a time, every row is a fresh allocation of tens to hundreds of KiB:
    glibc hands such blocks back to the kernel when they are freed (or serves them from pages
    it has to fault in), so each put pays for its allocation and the faults and zeroing of its
    pages besides the copy, all of it at the end of the first epoch, when the pass's rows have
    arrived. :class:`RowArena` cuts rows of one shape
    and dtype out of blocks of ``BLOCK_BYTES`` (backed by huge pages where the kernel gives
    them), and a row's slot comes back to the arena when the last reference to its memory goes.

    When is a slot free? Each row handed out is a view of a one-dimensional array made over a
    ``memoryview`` of the slot (``np.frombuffer``). numpy collapses a view's ``base`` to the
    nearest array whose own base is not an array of the same type, so every view made from the
    row (a reshape, a slice, ``torch.from_numpy``) keeps that one-dimensional array alive. A
    weak reference to it puts the slot back on the free list when it dies: the buffer dropped
    the row and no batch, view or tensor reads it any more. A row is never handed out twice
    while anything can still read it.

    Bounds: an arena holds the most rows that were alive at once, rounded up to a block (the
    buffer's budget plus the rows batches still read), and lives as long as the buffer it is
    kept for (:func:`arena_for`): it never shrinks in between.

    Rows whose bytes never change need no copy at all: those of a staged copy of a remote file
    (NOTE [ Staging a remote file ] in io_backends/fsspec_stage.py) are views of this process's
    own nameless file, written once, or of the bytes a direct request received (kept whole while
    any row of them is kept: a request's rows are all rows of the same read). A backend says
    so with the ``stable`` attribute of its ``mapped_rows`` check, and ``FetchPass.finish``
    puts those views in the buffer as they are: the buffer counts their bytes against its
    budget as any row's (the plan, its hits and its evictions are the same), and the memory is
    the copy's page cache, already there. A mapped local file's rows are copied: someone else
    may rewrite that file, and the buffer must keep the bytes that were read.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from typing import Any, Hashable

import numpy as np

__all__ = ["RowArena", "SlotBlocks", "arena_for", "slot_releaser", "BLOCK_BYTES", "MIN_ROW_BYTES"]

#: Bytes per block of an arena (a row larger than this gets a block of its own).
BLOCK_BYTES = 16 << 20
#: Rows smaller than this are allocated one by one: glibc serves them from memory it keeps.
MIN_ROW_BYTES = 16 << 10

# buffer -> {(shape, dtype): RowArena}: an arena lives as long as the buffer it serves
_ARENAS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_ARENAS_LOCK = threading.Lock()


class SlotBlocks:
    """Blocks of slots of ``nbytes`` bytes (``per_block`` each unless a subclass adds blocks of
    other sizes); a slot is handed out as one array (an uninitialized row, or a value just
    written) and is free again once that array and every view of it are gone (NOTE [ Kept rows
    in an arena ]). Subclasses add the blocks."""

    def __init__(self, nbytes: int, per_block: int) -> None:
        self.nbytes, self.per_block = int(nbytes), int(per_block)
        self._blocks: list[memoryview] = []
        self._starts: list[int] = []  # each block's first slot (ascending)
        self._slots = 0
        # free slots: appended by weak-reference callbacks from any thread, popped by the one
        # handing out (both atomic on a deque, so no callback waits for a lock)
        self._free: collections.deque = collections.deque()
        self._refs: dict[int, weakref.ref] = {}

    @property
    def slots(self) -> int:
        """Slots the blocks hold, in use or free."""
        return self._slots

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def _add(self, block: memoryview, count: int | None = None) -> None:
        """A new block of ``count`` slots (default ``per_block``): its slots become free, the
        first on top. (A slot on the free list always lies in a block already listed.)"""
        first, count = self._slots, self.per_block if count is None else int(count)
        self._starts.append(first)
        self._blocks.append(block)
        self._slots = first + count
        self._free.extend(range(first + count - 1, first - 1, -1))

    def _locate(self, slot: int) -> tuple[int, int]:
        """The block holding ``slot`` and the slot's index in it."""
        block = bisect.bisect_right(self._starts, slot) - 1
        return block, slot - self._starts[block]

    def _hand_out(self, slot: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        """Slot ``slot`` as an array of ``dtype`` and ``shape``, the slot's one base array."""
        block, i = self._locate(slot)
        flat = np.frombuffer(self._blocks[block][i * self.nbytes:(i + 1) * self.nbytes], dtype)
        self._refs[slot] = weakref.ref(flat, slot_releaser(slot, self._refs, self._free))
        return flat.reshape(shape)


class RowArena(SlotBlocks):
    """Rows of ``shape`` and ``dtype`` (NOTE [ Kept rows in an arena ]): :meth:`row` hands out
    one writable, uninitialized row, in a free slot of a block or in a new block."""

    def __init__(self, shape: tuple, dtype: np.dtype, block_bytes: int = BLOCK_BYTES) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        row_bytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        super().__init__(row_bytes, max(1, block_bytes // max(1, row_bytes)))
        self._grow = threading.Lock()

    def row(self) -> np.ndarray:
        """A row of ``shape`` and ``dtype`` nobody else references, its bytes uninitialized."""
        while True:
            try:
                slot = self._free.pop()  # (the most recently freed: likeliest still in cache)
                break
            except IndexError:
                with self._grow:
                    if not self._free:
                        self._add(memoryview(np.empty(self.per_block * self.nbytes, np.uint8)))
        return self._hand_out(slot, self.dtype, self.shape)


def slot_releaser(slot: Hashable, refs: dict, free: collections.deque):
    """The weak-reference callback that frees ``slot`` (it holds the arena's free list, not the
    arena: an arena nobody uses goes with its blocks at once, not at the next garbage collection)."""
    def release(_ref) -> None:
        refs.pop(slot, None)
        free.append(slot)
    return release


def arena_for(buffer: Any, shape: tuple, dtype: np.dtype) -> RowArena | None:
    """The arena for rows of ``shape`` and ``dtype`` kept in ``buffer`` (made on first use);
    None for rows under ``MIN_ROW_BYTES`` or a ``buffer`` that cannot be weakly referenced (rows
    are then allocated one by one)."""
    if int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize < MIN_ROW_BYTES:
        return None
    key = (tuple(shape), np.dtype(dtype).str)
    with _ARENAS_LOCK:
        try:
            arenas = _ARENAS.get(buffer)
            if arenas is None:
                arenas = _ARENAS[buffer] = {}
        except TypeError:
            return None
        arena = arenas.get(key)
        if arena is None:
            arena = arenas[key] = RowArena(shape, dtype)
        return arena
