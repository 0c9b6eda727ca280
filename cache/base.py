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

__all__ = ["Tier", "TierStats", "TierFullError"]

from solar.errors import SolarError


class TierFullError(SolarError, MemoryError):
    """A value does not fit in the tier's byte budget."""


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


class Tier(ABC):
    """A key -> bytes store with an optional byte budget and hit/miss/byte counters.

    Args:
        capacity_bytes: byte budget, or ``None`` for unbounded.
    """

    name: ClassVar[str] = "abstract"
    #: True if values survive the process (disk, remote); False for memory tiers.
    persistent: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @abstractmethod
    def get(self, key: Hashable) -> Any | None:
        """The value under ``key`` or ``None``; counts a hit or a miss."""

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

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_bytes is None else f"{self.capacity_bytes} B"
        return f"{type(self).__name__}({cap}, {self.nbytes} B used)"
