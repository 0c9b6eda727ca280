"""A memory tier that spills to a node-local disk tier: the loader's rank buffer past RAM.

Why: a rank buffer's hit-rate bound is ``min(1, P * C / N)``; RAM caps ``C``, but HPC nodes
often carry a local NVMe drive with ten times the room and, read locally, far more bandwidth per
rank than the shared parallel file system (NoPFS stages samples on both). With ``spill=`` the
schedule plans one capacity for RAM and disk together; values go to RAM while it has room and to
the disk after, and a hit from either saves a read from shared storage.

The tier keeps its own index of what it spilled (key -> file number, dtype and shape), so keys
may be any hashable (the loader uses ``(field, sample)``) and NumPy arrays come back as arrays
of their dtype and shape (read-only views of the file's bytes: arrays of ``slab.MIN_BYTES``
or more are slots of one file per size, read as views of its map, NOTE [ Spilled rows in slab
files ] in slab.py); other values come back as ``bytes``. Its files live in a fresh directory
under the given one, removed when the tier is garbage collected or the process exits (never by
a forked child); a job killed before that (SIGKILL at its time limit) leaves its directory,
which the next tier made on the same host removes (the directory names the host and the
process, and that process is gone).

One budget covers both parts (the schedule plans one capacity): a value goes to memory while the
memory tier has room and the total allows it, else to disk while the total allows it, charged
there at whole file-system blocks (a value in a file of its own; small values cost a block each)
or, for a value in a slab, nothing more than the slab's blocks, each charged in full when the
slab grows (never past the budget).

Which sizes get a slab: a slab's first block is reserved whole, so a size seen once would waste
most of it. The first ``EAGER_SLABS`` sizes get one at their first value (a dataset's fixed-size
fields); any other size once it repeats (``REPEATS`` values), and at most ``MAX_SLABS`` slabs in
all. Compressed blobs, whose sizes rarely repeat, stay a file each. A slab's first block is at
most ``1/FIRST_BLOCK_SHARE`` of the disk budget, and its blocks at most ``1/MAX_BLOCK_SHARE``.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import socket
import threading
import uuid
import warnings
import weakref
from typing import Any, Hashable, Iterator, NamedTuple

import numpy as np

from solar.errors import BackendNotFoundError, ConfigError

from . import registry
from .base import Tier, TierFullError, _nbytes
from .memory import MemoryTier
from .slab import BLOCK_BYTES, MAX_BLOCK_BYTES, MIN_BYTES, Slab, available

__all__ = ["SpillTier", "spill_level", "file_tiers"]

#: Sizes that get a slab at their first value; other sizes get one once they repeat.
EAGER_SLABS = 2
#: Values of one size after which that size gets a slab.
REPEATS = 2
#: Slabs a tier keeps at most (other sizes are a file each).
MAX_SLABS = 8
#: A slab's first block is at most the disk budget over this; its blocks, over MAX_BLOCK_SHARE.
FIRST_BLOCK_SHARE, MAX_BLOCK_SHARE = 64, 4
#: Sizes counted while waiting for a repeat (the count starts over past this many).
_SIZES_COUNTED = 4096


def file_tiers() -> list[str]:
    """The registered tiers a buffer can spill to (:attr:`Tier.keeps_files`) whose dependencies import."""
    return [n for n in registry.names() if registry.available(n) and registry.get(n).keeps_files]


def spill_level(name: str) -> type[Tier]:
    """The cache tier registered as ``name``, checked to keep its values as files in a directory.

    Raises:
        ConfigError: no tier has that name, or that tier keeps no files (memory, spill).
        MissingDependencyError: its optional dependency is missing (the message says what to install).
    """
    if not isinstance(name, str):
        raise ConfigError(f"a spill names a registered cache tier ({', '.join(file_tiers())}), not "
                          f"{type(name).__name__} {name!r}: the loader makes a fresh one per buffer in a private "
                          "directory and removes it with the buffer")
    try:
        cls = registry.get(name)
    except BackendNotFoundError as exc:
        raise ConfigError(f"{exc}; a buffer spills to one that keeps files: {', '.join(file_tiers())}") from None
    if not cls.keeps_files:
        raise ConfigError(f"the {name!r} cache tier keeps no files in a directory, so a buffer cannot spill to it; "
                          f"name one that does: {', '.join(file_tiers())}")
    return cls


def _remove_dir(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked worker exiting must not take its parent's files
        shutil.rmtree(path, ignore_errors=True)


_DIR = re.compile(r"^solar-spill-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Remove the spill directories under ``directory`` that processes of this host left when
    they were killed (their process is gone); returns their paths."""
    host, gone = socket.gethostname(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return gone
    for name in names:
        m = _DIR.match(name)
        if m and m["host"] == host and not _alive(int(m["pid"])):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            gone.append(os.path.join(directory, name))
    return gone


class InSlab(NamedTuple):
    """A spilled array in a slot of a :class:`Slab`: the slot's array (read-only)."""

    view: np.ndarray


class Spilled(NamedTuple):
    """A value the tier spilled: where it is (the disk tier's key, or its slot), the dtype and
    shape it comes back as (None: bytes), and what it costs the budget besides its slab's blocks."""

    where: "int | InSlab"
    dtype: np.dtype | None
    shape: tuple | None
    cost: int


class SpillTier(Tier):
    """``first`` (memory) while it has room, then ``second`` (a disk tier), under one budget.

    Args:
        first: the fast tier (usually a :class:`MemoryTier` with a byte budget).
        second: the tier values spill to (usually a ``DiskTier`` with ``fsync=False``: a cache
            needs atomic files, not durable ones; :meth:`on_disk` builds any registered tier that
            keeps files). Keys there are the tier's own file numbers, so it may take only str or
            int keys while this tier takes any hashable.
        capacity_bytes: budget of the two together (``None``: unbounded); ``first`` keeps its
            own budget too, ``second`` should have none (:meth:`on_disk` makes it so).
        block: disk values are charged whole blocks of this many bytes (the file system's).
    """

    name = "spill"
    exclusive_create = True  # put_new checks and stores under the tier's lock

    def __init__(self, first: Tier, second: Tier, capacity_bytes: int | None = None, *, block: int = 1) -> None:
        super().__init__(capacity_bytes)
        self.first, self.second = first, second
        self.block = max(1, int(block))
        self._spilled: dict[Hashable, Spilled] = {}
        self._names = itertools.count()
        self._used_second = 0  # charged: whole file-system blocks per file, and the slabs' blocks
        self._lock = threading.RLock()
        self._warned = False
        self._slab_dir: str | None = None  # where arrays spill to slab files (on_disk's tiers)
        self._slabs: dict[int, Slab] = {}
        self._sizes: dict[int, int] = {}  # values seen per size that has no slab (yet)

    @classmethod
    def on_disk(cls, directory: str, memory_bytes: int | None, disk_bytes: int | None,
                block: int | None = None, *, tier: str = "disk") -> "SpillTier":
        """A :class:`MemoryTier` of ``memory_bytes`` spilling up to ``disk_bytes`` more (charged in
        blocks of ``block``, default the file system's) to files in a fresh directory under
        ``directory``, removed with the tier; stale directories of killed processes go first.
        ``tier``: the registered cache tier that keeps those files (:func:`spill_level`)."""
        level = spill_level(tier)
        directory = os.path.abspath(os.fspath(directory))
        # 0700: the files hold the user's samples, and the directory may be on a shared node-local
        # disk; an existing ``directory`` (e.g. /tmp) keeps its mode, the tier's own one is private
        os.makedirs(directory, mode=0o700, exist_ok=True)
        remove_stale(directory)
        root = os.path.join(directory, f"solar-spill-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(root, mode=0o700)
        second = level.in_directory(root)  # unbounded: the budget is the SpillTier's, over both parts
        if block is None:
            block = os.statvfs(root).f_bsize
        total = None if memory_bytes is None or disk_bytes is None else memory_bytes + disk_bytes
        tier = cls(MemoryTier(memory_bytes), second, total, block=block)
        tier._slab_dir = root  # NOTE [ Spilled rows in slab files ] in slab.py
        tier._finalizer = weakref.finalize(tier, _remove_dir, root, os.getpid())
        return tier

    @classmethod
    def example(cls, scratch_dir: str, capacity_bytes: int | None = None) -> "SpillTier":
        # half the budget in memory (64 B when unbounded), so the suite's values land on both sides
        memory = 64 if capacity_bytes is None else capacity_bytes // 2
        tier = cls.on_disk(scratch_dir, memory, None, block=1)
        tier.capacity_bytes = capacity_bytes
        return tier

    def charge(self, nbytes: int) -> int:
        """What a value of ``nbytes`` costs on the disk part: whole blocks."""
        return -(-nbytes // self.block) * self.block

    def _room(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or self.nbytes + nbytes <= self.capacity_bytes

    # -- the index of spilled values ---------------------------------------------------------------
    def _spill(self, key: Hashable, value: Any) -> bool:
        if self.__dict__.get("_closed"):  # its directory is gone: a write would make it again, for good
            return False
        arr = value if isinstance(value, np.ndarray) else None
        data = np.ascontiguousarray(arr).view(np.uint8).reshape(-1) if arr is not None else value
        meta = (arr.dtype, arr.shape) if arr is not None else (None, None)
        try:
            slot = self._to_slab(data, arr) if arr is not None else None
            if slot is not None:
                entry = Spilled(slot, *meta, 0)
            else:
                entry = Spilled(next(self._names), *meta, self.charge(_nbytes(data)))
                if not self._room(entry.cost) or not self.second.put(entry.where, data):
                    return False
        except (OSError, TierFullError) as exc:  # disk full or gone: a cache keeps less, it does not fail
            self._warn(exc)
            return False
        self._spilled[key] = entry
        self._used_second += entry.cost
        return True

    def _warn(self, exc: Exception) -> None:
        """Say once that the spill directory refused a write, and why."""
        if self._warned:
            return
        if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):
            what = "the process has no file descriptor left: raise the limit (ulimit -n)"
        else:
            what = "free space there, or pass a smaller spill size"
        warnings.warn(f"solar: the buffer's spill directory {getattr(self.second, 'root', self.second)} "
                      f"refused a write ({exc}); samples that do not fit in memory are read again instead "
                      f"({what})", RuntimeWarning, stacklevel=4)
        self._warned = True

    def _to_slab(self, data: np.ndarray, arr: np.ndarray) -> "InSlab | None":
        """Write array ``arr``'s bytes ``data`` to the slab file of their size (NOTE [ Spilled
        rows in slab files ] in slab.py): the slot's array, or None where it goes to a file of its
        own (no slab directory or no slabs on this platform, a small array, a size without a slab,
        or no room for another block). A block grown is charged to the budget in full."""
        n = data.nbytes
        if self._slab_dir is None or n < MIN_BYTES:
            return None
        slab = self._slabs.get(n) or self._new_slab(n)
        if slab is None:
            return None
        before = slab.reserved
        room = None if self.capacity_bytes is None else self.capacity_bytes - self.nbytes
        try:
            view = slab.put(data, arr.dtype, arr.shape, room)
        finally:
            self._used_second += slab.reserved - before
        return None if view is None else InSlab(view)

    def _new_slab(self, n: int) -> Slab | None:
        """A slab for values of ``n`` bytes, where that size gets one now (module docstring:
        'Which sizes get a slab'); None where it does not."""
        seen = self._sizes.get(n, 0) + 1
        eager = len(self._slabs) < EAGER_SLABS
        if len(self._slabs) >= MAX_SLABS or not (eager or seen >= REPEATS) or not available():
            if len(self._sizes) >= _SIZES_COUNTED:
                self._sizes.clear()
            self._sizes[n] = seen
            return None
        self._sizes.pop(n, None)
        disk = self._disk_budget()
        first = BLOCK_BYTES if disk is None else min(BLOCK_BYTES, disk // FIRST_BLOCK_SHARE)
        most = MAX_BLOCK_BYTES if disk is None else min(MAX_BLOCK_BYTES, disk // MAX_BLOCK_SHARE)
        slab = self._slabs[n] = Slab(self._slab_dir, n, first, most)
        return slab

    def _disk_budget(self) -> int | None:
        """The budget's bytes beyond the memory tier's own (None: unbounded)."""
        memory = getattr(self.first, "capacity_bytes", None)
        if self.capacity_bytes is None:
            return None
        return max(0, self.capacity_bytes - (memory or 0))

    def _load(self, key: Hashable) -> Any | None:
        """A spilled value, as the array (dtype, shape) it was when put, or bytes."""
        entry = self._spilled.get(key)
        if entry is not None and isinstance(entry.where, InSlab):
            return entry.where.view
        value = None if entry is None else self.second.get(entry.where)
        if value is not None and entry.dtype is not None:
            value = np.frombuffer(value, entry.dtype).reshape(entry.shape)
        return value

    def _unspill(self, key: Hashable) -> bool:
        entry = self._spilled.pop(key, None)
        if entry is None:
            return False
        if not isinstance(entry.where, InSlab):  # (a slab's slot is free once its array is gone)
            self.second.delete(entry.where)
        self._used_second -= entry.cost
        return True

    # -- Tier -------------------------------------------------------------------------------------
    def get(self, key: Hashable) -> Any | None:
        entry = self._spilled.get(key)
        if entry is not None and type(entry.where) is InSlab:  # a lookup (a loader asks once per field of every hit)
            view, stats = entry.where.view, self.stats
            stats.hits += 1
            stats.bytes_out += view.nbytes
            return view
        with self._lock:
            value = self.first.get(key) if key in self.first else self._load(key)
            if value is None and key in self._spilled:  # its file went (removed by hand): forget it
                self._unspill(key)
        return self._counted(value)

    def put(self, key: Hashable, value: Any) -> bool:
        n = _nbytes(value)
        with self._lock:
            saved = self._take(key)
            if (self._room(n) and self.first.put(key, value)) or self._spill(key, value):
                self.stats.bytes_in += n
                return True
            if saved is not None:  # neither part had room: the old value stays
                self._restore(key, saved)
            self.stats.rejected += 1
            return False

    def put_new(self, key: Hashable, value: Any) -> bool:
        with self._lock:
            if key in self:
                return False
            return self.put(key, value)

    def delete(self, key: Hashable) -> bool:
        with self._lock:
            return self.first.delete(key) | self._unspill(key)

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self._spilled

    def keys(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self.first.keys()) + list(self._spilled))

    @property
    def nbytes(self) -> int:
        return self.first.nbytes + self._used_second

    def close(self) -> None:
        """Drop every value and remove the spill directory; afterwards values are kept in memory
        only (a put that spilled made the directory again, and nothing removed it at exit)."""
        with self._lock:
            self._closed = True
            self.first.clear()
            for key in list(self._spilled):
                self._unspill(key)
            for slab in self._slabs.values():
                self._used_second -= slab.reserved
                slab.close()
            self._slabs.clear()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    # -- overwrites -------------------------------------------------------------------------------
    def _peek(self, key: Hashable) -> Any:
        """``first``'s value for ``key`` without counting a hit (a MemoryTier's dict) where it can."""
        data = getattr(self.first, "_data", None)
        return data.get(key) if isinstance(data, dict) else self.first.get(key)

    def _take(self, key: Hashable) -> Any:
        """Remove ``key``'s current value, returning it (to put back if the new one fits nowhere)."""
        if key in self.first:
            value = self._peek(key)
            self.first.delete(key)
            return ("first", value)
        if key not in self._spilled:
            return None
        value = self._load(key)
        self._unspill(key)
        return ("second", value)

    def _restore(self, key: Hashable, saved: tuple) -> None:
        where, value = saved
        if value is not None and not (where == "first" and self.first.put(key, value)):
            self._spill(key, value)
