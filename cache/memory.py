"""In-process memory tier: a dict under a byte budget (the loader's rank buffer)."""

from __future__ import annotations

from typing import Any, Hashable, Iterator

from .base import Tier, _nbytes

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """Keeps values in a dict; ``put`` refuses values that would exceed the budget.

    It never evicts on its own: *what* stays is the client's decision (the loader's schedule
    knows the future, an LRU would not), so eviction is an explicit :meth:`delete`.
    """

    name = "memory"
    exclusive_create = True  # within the process: dict.setdefault is one atomic step under the GIL

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes)
        self._data: dict[Hashable, Any] = {}
        self._used = 0

    def get(self, key: Hashable) -> Any | None:
        return self._counted(self._data.get(key))

    def put(self, key: Hashable, value: Any) -> bool:
        n = _nbytes(value)
        old = self._data.get(key)
        delta = n - (_nbytes(old) if old is not None else 0)
        if self.capacity_bytes is not None and self._used + delta > self.capacity_bytes:
            self.stats.rejected += 1
            return False
        self._data[key] = value
        self._used += delta
        self.stats.bytes_in += n
        return True

    def put_new(self, key: Hashable, value: Any) -> bool:
        n = _nbytes(value)
        if key in self._data:
            return False
        if self.capacity_bytes is not None and self._used + n > self.capacity_bytes:
            self.stats.rejected += 1
            return False
        if self._data.setdefault(key, value) is not value:  # another thread created it meanwhile
            return False
        self._used += n
        self.stats.bytes_in += n
        return True

    def delete(self, key: Hashable) -> bool:
        value = self._data.pop(key, None)
        if value is None:
            return False
        self._used -= _nbytes(value)
        self.stats.evictions += 1
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        return self._used

    def clear(self) -> None:
        self._data.clear()
        self._used = 0
