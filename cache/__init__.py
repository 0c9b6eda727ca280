"""Storage tiers shared by the loader's rank buffers and the checkpoint writer.

Tiers are looked up by name in :data:`registry` (lazy imports, install hints).
"""

from __future__ import annotations

from solar.registry import Registry

from .base import Tier, TierFullError, TierStats
from .memory import MemoryTier

__all__ = ["Tier", "TierStats", "TierFullError", "MemoryTier", "registry", "get_tier"]

registry: Registry[type[Tier]] = Registry("cache tier", entry_point_group="solar.caches")
registry.register("memory", MemoryTier)
registry.register("disk", "solar.cache.disk:DiskTier")
registry.register("spill", "solar.cache.spill:SpillTier")
registry.register("fsspec", "solar.cache.fsspec_tier:FsspecTier", hint="pip install fsspec (and s3fs for s3:// URLs)")


def get_tier(name: str) -> type[Tier]:
    """The tier class registered under ``name``."""
    return registry.get(name)
