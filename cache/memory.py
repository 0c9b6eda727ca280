"""In-process memory tier: a dict under a byte budget (the loader's rank buffer)."""

from __future__ import annotations

import threading
from typing import Any, Hashable, Iterator

from .base import Tier, _nbytes

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """Keeps values in a dict; ``put`` refuses values that would exceed the budget.

    It never evicts on its own: *what* stays is the client's decision (the loader's schedule
    knows the future, an LRU would not), so eviction is an explicit :meth:`delete`.
    """

    name = "memory"
    exclusive_create = True  # put_new checks and stores under the tier's lock

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes)
        self._data: dict[Hashable, Any] = {}
        self._used = 0
        # puts, deletes and the byte count move together: the loader's read-ahead thread and a
        # second iterator's may change one buffer at once, and a count that drifts refuses puts
        # (or overfills the budget) for the rest of the run
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        value = self._data.get(key)
        stats = self.stats  # (Tier._counted, inlined: the loader asks once per field of every hit)
        if value is None:
            stats.misses += 1
            return None
        stats.hits += 1
        n = getattr(value, "nbytes", None)
        stats.bytes_out += int(n) if n is not None else len(value)
        return value

    def put(self, key: Hashable, value: Any) -> bool:
        return self._store(key, value, create=False)

    def put_new(self, key: Hashable, value: Any) -> bool:
        return self._store(key, value, create=True)

    def _store(self, key: Hashable, value: Any, create: bool) -> bool:
        n = _nbytes(value)
        with self._lock:
            old = self._data.get(key)
            if create and old is not None:
                return False
            delta = n - (_nbytes(old) if old is not None else 0)
            if self.capacity_bytes is not None and self._used + delta > self.capacity_bytes:
                self.stats.rejected += 1
                return False
            self._data[key] = value
            self._used += delta
            self.stats.bytes_in += n
        return True

    def delete(self, key: Hashable) -> bool:
        with self._lock:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._used -= _nbytes(value)
            self.stats.evictions += 1
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> Iterator[Hashable]:
        with self._lock:  # a snapshot: another thread's put must not change the dict mid-copy
            return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        return self._used

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._used = 0
