"""The loader's own options: ``buffer=`` and ``spill=``, parsed once into specs.

``buffer=`` takes samples per rank (``int``), bytes per rank (``"2GiB"``) or a fraction of the
dataset over all ranks (``float``): the memory part of the rank buffer. ``spill=`` extends a byte
budget onto node-local disk, in files of a registered cache tier (``solar.cache.registry``). Bad
values are ``ConfigError`` naming the option and what to pass.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from solar.cache import Tier, registry as tier_registry
from solar.cache.spill import spill_level
from solar.errors import ConfigError

__all__ = ["BufferSpec", "SpillSpec", "parse_buffer", "parse_spill"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class BufferSpec:
    """A parsed ``buffer=`` option: ``samples`` per rank, or ``nbytes`` per rank, or a ``fraction``
    of the dataset summed over ranks."""

    samples: int | None = None
    nbytes: int | None = None
    fraction: float | None = None

    def per_rank(self, num_samples: int, world_size: int) -> int | None:
        """Samples each of ``world_size`` ranks keeps of ``num_samples``, for a spec in samples
        (capped at a rank's share) or a fraction; ``None`` for bytes, whose count depends on the
        samples' sizes (``solar.ownership.capacity_for_bytes``)."""
        if self.samples is not None:
            return min(self.samples, -(-num_samples // world_size))
        if self.fraction is not None:
            return int(self.fraction * num_samples // world_size)
        return None


def parse_buffer(value: Any) -> BufferSpec:
    """``int`` samples per rank, ``"2GiB"``/``"500MB"`` bytes per rank, or a float fraction in (0, 1]
    of the dataset held by all ranks together; ``0``/``None`` disables the buffer."""
    if value is None:
        return BufferSpec(samples=0)
    if isinstance(value, bool):
        raise ConfigError(f"buffer= takes samples, bytes or a fraction, got {value!r}")
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ConfigError(f"buffer={value} is negative; pass a number of samples per rank >= 0, "
                              "a size like '2GiB', or a fraction of the dataset like 0.5")
        return BufferSpec(samples=int(value))
    if isinstance(value, float):
        if not 0 <= value <= 1:
            raise ConfigError(f"buffer={value} as a float is a fraction of the dataset and must be in [0, 1]; "
                              "pass an int for samples per rank or a string like '2GiB' for bytes")
        return BufferSpec(fraction=value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return BufferSpec(nbytes=int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
    tier = _tier_named(value)
    if tier is not None:
        files = tier_registry.available(tier) and tier_registry.get(tier).keeps_files
        todo = (f"to keep samples in the {tier!r} tier pass spill={{'tier': {tier!r}, 'dir': <local directory>, "
                "'size': '100GiB'}} with buffer= in bytes (buffer='0B' keeps every buffered sample there)" if files
                else "the loader builds the buffer itself: a memory tier of buffer= bytes ('2GiB'), and a spill tier "
                "when spill=(directory, size) is given too")
        raise ConfigError(f"buffer={value!r}: buffer= is the memory part of the rank buffer (samples, bytes or a "
                          f"fraction), not a cache tier; {todo}")
    raise ConfigError(f"buffer={value!r} is not understood; use samples per rank (int), bytes per rank "
                      "('2GiB', '500MB') or a fraction of the dataset (0.5)")


def _tier_named(value: Any) -> str | None:
    """The cache tier a wrong ``buffer=`` value means (a tier, a registered tier's name, or a
    spill-like dict naming one), or ``None``."""
    tier = value.get("tier") if isinstance(value, dict) else value
    if isinstance(tier, Tier):
        return tier.name
    if isinstance(tier, str) and tier.strip() in tier_registry:
        return tier.strip()
    return None


@dataclass(frozen=True)
class SpillSpec:
    """A parsed ``spill=`` option: a directory on node-local disk, a byte budget per rank, and the
    registered cache tier that keeps the spilled files there (``"disk"`` unless named)."""

    directory: str
    nbytes: int
    tier: str = "disk"


_SPILL_FORMS = ("pass (directory, size) on node-local disk, e.g. spill=('/local/nvme/solar', '100GiB'), "
                "{'dir': ..., 'size': ...}, or {'tier': 'fsspec', 'dir': ..., 'size': ...} to keep the files "
                "in another registered cache tier")


def _spill_parts(value: Any) -> tuple[Any, Any, str]:
    """(directory, size, tier name) of a ``spill=`` value, or ConfigError saying which forms it takes."""
    if isinstance(value, Tier) or (isinstance(value, dict) and isinstance(value.get("tier"), Tier)):
        tier = value if isinstance(value, Tier) else value["tier"]
        raise ConfigError(f"spill={value!r}: spill= names a registered cache tier, not a {type(tier).__name__} "
                          "instance: the loader makes a fresh one per buffer in a private directory under 'dir' "
                          f"and removes it with the buffer; pass {{'tier': {tier.name!r}, 'dir': ..., "
                          "'size': ...}")
    if isinstance(value, dict):
        if not {"dir", "size"} <= set(value) <= {"dir", "size", "tier"}:
            raise ConfigError(f"spill={value!r}: a dict takes the keys 'dir' and 'size', and 'tier' if the files go "
                              f"to another registered cache tier than 'disk'; {_SPILL_FORMS}")
        parts = (value["dir"], value["size"], value.get("tier", "disk"))
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        parts = (*value, "disk")
    else:
        parts = None
    if parts is None or not isinstance(parts[0], (str, os.PathLike)):
        raise ConfigError(f"spill={value!r}: {_SPILL_FORMS}")
    return parts


def parse_spill(value: Any, buffer: BufferSpec) -> SpillSpec | None:
    """The ``spill=`` option: the rank buffer keeps ``buffer=`` bytes in memory and spills up to
    ``size`` more to files in a fresh directory under ``dir`` on node-local disk (NOTE in
    ``cache/spill.py``). Forms:

    * ``None``: no spill;
    * ``(dir, size)`` or ``{"dir": dir, "size": size}``: files of the ``"disk"`` cache tier;
    * ``{"tier": name, "dir": dir, "size": size}``: files of the cache tier registered as ``name``
      (``solar.cache.registry``) that keeps files (``"disk"``, ``"fsspec"``; a plug-in sets
      ``Tier.keeps_files``), built through the registry for each buffer.

    ``size`` is bytes: a number (``1.5e9``) or a string as in ``buffer=`` (``"100GiB"``). It
    extends a byte budget, so ``buffer=`` must be bytes too (``"0B"`` keeps every buffered sample
    in the spill tier). ``dir`` is a local directory, never a URL: a spill is there for the
    node-local disk's bandwidth, and a remote store would be read as slowly as the dataset.
    Wrong values raise ``ConfigError`` naming the value and the forms it takes."""
    if value is None:
        return None
    directory, size, tier = _spill_parts(value)
    try:
        spill_level(tier)
    except ConfigError as exc:
        raise ConfigError(f"spill={value!r}: {exc}") from None
    try:  # bytes: a number (1.5e9) or a string with a unit ('100GiB'); never samples, unlike buffer=
        nbytes = parse_buffer(size).nbytes if isinstance(size, str) else size
    except ConfigError:
        nbytes = None
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float, np.integer)) or not nbytes >= 1:
        raise ConfigError(f"spill size {size!r} is not a positive byte size; use bytes (1.5e9) or a string "
                          "like '100GiB'")
    if buffer.nbytes is None:
        raise ConfigError("spill= extends the buffer's byte budget onto disk, so give buffer= in bytes too "
                          "(e.g. buffer='4GiB', or buffer='0B' to keep every sample on disk), not "
                          f"{'samples' if buffer.samples is not None else 'a fraction'}")
    directory = os.fspath(directory)
    if "://" in directory:
        raise ConfigError(f"spill directory {directory} is a URL; a spill keeps its files on node-local disk "
                          "(a remote store would be read as slowly as the dataset itself): pass a local "
                          "directory such as /local/nvme/$USER, for any tier")
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ConfigError(f"spill directory {directory} is not a writable directory; create it on node-local "
                          "disk (e.g. /local/nvme/$USER) or pass spill=None")
    return SpillSpec(directory, int(nbytes), tier)
