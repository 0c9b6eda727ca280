"""The storage-tier contract shared by the loader's rank buffers and the checkpoint writer.

A tier is a byte-budgeted key -> bytes store. It knows nothing about who uses it: the loader
keeps (compressed) sample bytes in it under sample keys, the checkpoint writer keeps
content-addressed chunks and manifests in it. Tiers stack from fast and small to slow and large:
memory -> node-local disk -> shared or remote storage through fsspec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable, Iterator

__all__ = ["Tier", "TierStats", "TierFullError", "UnsafePathError"]

from solar.errors import ConfigError
from solar.errors import TierFullError, UnsafePathError  # noqa: F401 (re-exported: the tier API)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    rejected: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def _nbytes(value: Any) -> int:
    """Bytes of a stored value (an array's ``nbytes``, else its length)."""
    n = getattr(value, "nbytes", None)
    return int(n) if n is not None else len(value)


class Tier(ABC):
    """A key -> bytes store with an optional byte budget and hit/miss/byte counters.

    Args:
        capacity_bytes: byte budget, or ``None`` for unbounded.
    """

    name: ClassVar[str] = "abstract"
    #: True if values survive the process (disk, remote); False for memory tiers.
    persistent: ClassVar[bool] = False
    #: True if :meth:`put_new` is an atomic create: of callers racing for one key, exactly one wins.
    exclusive_create: bool = False
    #: True if :meth:`in_directory` makes an instance: the tier can keep its values as files in a
    #: local directory, so a :class:`~solar.cache.spill.SpillTier` (the loader's ``spill=``) can
    #: spill to it.
    keeps_files: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @abstractmethod
    def get(self, key: Hashable) -> Any | None:
        """The value under ``key`` or ``None``; counts a hit or a miss."""

    def _counted(self, value: Any | None) -> Any | None:
        """Count a ``get``'s hit (with its bytes) or miss; return ``value``."""
        if value is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_out += _nbytes(value)
        return value

    @abstractmethod
    def put(self, key: Hashable, value: Any) -> bool:
        """Store ``value`` (bytes-like); return False (and store nothing) if it does not fit."""

    @abstractmethod
    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; return whether it was present."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[Hashable]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently stored."""

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def free_bytes(self) -> int | None:
        return None if self.capacity_bytes is None else self.capacity_bytes - self.nbytes

    def fits(self, nbytes: int) -> bool:
        free = self.free_bytes()
        return free is None or nbytes <= free

    def clear(self) -> None:
        for key in list(self.keys()):
            self.delete(key)

    def close(self) -> None:
        """Release resources; the default does nothing."""

    # -- optional extensions (compatible defaults; persistent tiers override them for speed) --

    def exists(self, key: Hashable) -> bool:
        """Whether ``key`` is stored, without counting a hit or a miss (dedup probes are not reads)."""
        return key in self

    def put_new(self, key: Hashable, value: Any) -> bool:
        """Store ``value`` only if ``key`` is absent; return True iff this call stored it.

        Why: a lock object on shared storage must be created by exactly one of two writers that
        race for it; a check followed by a :meth:`put` lets both pass the check and the second
        overwrite the first. Tiers whose storage has an exclusive create (``O_EXCL``/``link`` on a
        file system, ``If-None-Match: *`` on S3) override this and set :attr:`exclusive_create`.
        This default checks and then puts: callers that need exclusion read the value back.
        Like :meth:`put`, returns False (storing nothing) when the value does not fit the budget.
        """
        if self.exists(key):
            return False
        return self.put(key, value)

    def cleanup_temp(self) -> int:
        """Remove temporaries that killed writers left in the tier; return how many.

        Call only while no writer uses the tier (the checkpoint writer calls it under its root
        lock). The default does nothing: only tiers that write through temporary files (the disk
        tier) leave any.
        """
        return 0

    def keys_with_prefix(self, prefix: str) -> Iterator[Hashable]:
        """Keys that are strings starting with ``prefix`` (e.g. ``"chunks/"``)."""
        return (k for k in self.keys() if isinstance(k, str) and k.startswith(prefix))

    def read_into(self, key: Hashable, out: memoryview) -> int | None:
        """Copy the value under ``key`` into ``out`` (a writable byte view); return its size or ``None``.

        Lets a reader fill a preallocated buffer without an intermediate ``bytes`` object where the
        tier can (a disk tier reads straight into it); the default goes through :meth:`get`.
        """
        value = self.get(key)
        if value is None:
            return None
        src = memoryview(value).cast("B")
        if src.nbytes > out.nbytes:
            raise ValueError(f"value under {key!r} has {src.nbytes} B, the buffer only {out.nbytes} B")
        out[: src.nbytes] = src
        return src.nbytes

    @classmethod
    def example(cls, scratch_dir: str, capacity_bytes: int | None = None) -> "Tier":
        """A fresh, empty instance for the conformance suite (:mod:`solar.testing.tiers`).

        Tiers that need a location (a directory, a URL) override this to put it under ``scratch_dir``.
        """
        return cls(capacity_bytes=capacity_bytes)

    @classmethod
    def in_directory(cls, root: str) -> "Tier":
        """An unbounded instance keeping its values as files under the local directory ``root``
        (made by the caller, private to it, removed by it): the level a spill tier spills to.

        A cache does not need durable files, only atomic ones. Tiers that set :attr:`keeps_files`
        override this; the others raise :class:`~solar.errors.ConfigError`.
        """
        raise ConfigError(f"the {cls.name!r} cache tier keeps no files in a directory, so a buffer cannot "
                          "spill to it; name a tier that does (its class sets keeps_files)")

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_bytes is None else f"{self.capacity_bytes} B"
        return f"{type(self).__name__}({cap}, {self.nbytes} B used)"
