"""Lazy plug-in registries (fsspec's registry is the model).

A registry maps a name to either a class or a dotted ``"package.module:Class"`` string plus an
install hint. Nothing is imported until the name is first asked for, so a missing optional
dependency costs nothing until it is used, and then fails with a message that says what to install.
Outside packages add implementations with :meth:`Registry.register` or through the entry-point
group given to the registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Generic, Iterator, TypeVar

from .errors import BackendNotFoundError, ConfigError, MissingDependencyError

T = TypeVar("T")

__all__ = ["Registry"]


@dataclass
class _Entry:
    target: Any  # a class, or "module:attr"
    hint: str


class Registry(Generic[T]):
    """Name -> implementation, imported lazily.

    Args:
        kind: what the registry holds ("backend", "codec", "cache tier"), used in messages.
        entry_point_group: setuptools entry-point group scanned on first lookup of an unknown name.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.group = entry_point_group
        self._entries: dict[str, _Entry] = {}
        self._loaded: dict[str, T] = {}
        self._scanned = False

    def register(self, name: str, target: Any, *, hint: str = "", clobber: bool = False) -> None:
        """Register ``target`` (a class or ``"module:Class"``) under ``name``."""
        if name in self._entries and not clobber:
            raise ConfigError(
                f"{self.kind} {name!r} is already registered; pass clobber=True to replace it"
            )
        self._entries[name] = _Entry(target, hint)
        self._loaded.pop(name, None)

    def _scan_entry_points(self) -> None:
        if self._scanned or not self.group:
            return
        self._scanned = True
        for ep in importlib.metadata.entry_points(group=self.group):
            if ep.name not in self._entries:
                self._entries[ep.name] = _Entry(ep.value, f"installed by {ep.value}")

    def get(self, name: str) -> T:
        """Return the implementation registered under ``name``, importing it on first use."""
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._entries:
            self._scan_entry_points()
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "none"
            raise BackendNotFoundError(f"no {self.kind} named {name!r}; known: {known}")
        entry = self._entries[name]
        target = entry.target
        if isinstance(target, str):
            module_name, _, attr = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                hint = entry.hint or f"install the package that provides {module_name}"
                raise MissingDependencyError(
                    f"{self.kind} {name!r} needs a missing dependency ({exc}); {hint}"
                ) from exc
            target = getattr(module, attr) if attr else module
        self._loaded[name] = target
        return target

    def available(self, name: str) -> bool:
        """True if ``name`` is registered and its dependencies import."""
        try:
            self.get(name)
        except (BackendNotFoundError, MissingDependencyError):
            return False
        return True

    def names(self) -> list[str]:
        self._scan_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
