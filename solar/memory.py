"""The memory a rank's buffer may take: what the node has available, shared by its ranks.

``solar.DataLoader`` refuses a ``buffer=`` that cannot fit (:func:`check_buffer_memory`) when it
is built, instead of failing much later: numpy's ``MemoryError`` about one 16 MiB array deep in an
epoch, or the OOM killer taking the node's ranks. The node's available memory is ``solar plan``'s
(``MemAvailable``, capped by a cgroup limit); the ranks sharing it come from the launcher.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from solar.errors import ConfigError

__all__ = ["NodeRanks", "ranks_on_node", "available_memory", "check_buffer_memory", "RANKS_ENV"]

#: Launcher variables holding the number of ranks on this node, in the order they are trusted:
#: Open MPI, MPICH/Hydra, Slurm (``--ntasks-per-node``), torchrun.
RANKS_ENV = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE")


class NodeRanks(NamedTuple):
    """How many ranks share this node's memory, and the launcher variable that said so (None:
    none was set, and the rank is taken to be alone)."""

    count: int
    source: str | None


def ranks_on_node() -> NodeRanks:
    """The ranks on this node from the launcher's environment (:data:`RANKS_ENV`), else 1."""
    for var in RANKS_ENV:
        m = re.match(r"\s*(\d+)", os.environ.get(var, ""))  # Slurm may write "4(x2)"
        if m and int(m.group(1)) > 0:
            return NodeRanks(int(m.group(1)), var)
    return NodeRanks(1, None)


def available_memory() -> int | None:
    """Bytes this process can still allocate (MemAvailable, capped by a cgroup limit), or None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail


def human(nbytes: float) -> str:
    """``nbytes`` in binary units with one decimal: ``'10.0 TiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def _option(nbytes: float) -> str:
    """A ``buffer=`` value of at most ``nbytes``: ``'10.6GiB'`` (rounded down)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{int(nbytes / size * 10) / 10:g}{unit}"
    return f"{int(nbytes)}B"


def check_buffer_memory(in_memory: int, option: str, samples: int, sample_bytes: float) -> None:
    """Refuse a buffer of ``in_memory`` bytes per rank that the node cannot give each of its ranks.

    ``in_memory``: the bytes the rank's buffer keeps in memory at most: the smaller of what
    ``buffer=`` asks and what the rank's share of the dataset fills (``samples`` of about
    ``sample_bytes`` each); a ``spill=`` part is on disk and not counted. ``option``: how
    ``buffer=`` was given, for the message. Nothing is checked when the available memory is
    unknown.

    Raises:
        ConfigError: ``in_memory`` is more than the node's available memory over its ranks.
    """
    avail = available_memory()
    if avail is None or in_memory <= 0:
        return
    ranks = ranks_on_node()
    per_rank = avail / ranks.count
    if in_memory <= per_rank:
        return
    count = f"{ranks.count} rank{'s' if ranks.count != 1 else ''}"
    source = f"from {ranks.source}" if ranks.source else \
        f"none of {', '.join(RANKS_ENV)} is set, so this rank is taken to be alone"
    raise ConfigError(
        f"solar.DataLoader: {option} keeps {human(in_memory)} in memory per rank ({samples} samples of about "
        f"{human(sample_bytes)}, the most the rank's share of the dataset fills), but this node has "
        f"{human(avail)} available over {count} ({source}): {human(per_rank)} per rank. Pass buffer="
        f"'{_option(per_rank / 2)}' or less (half of a rank's memory, leaving room for the model and the "
        "batches), or a smaller fraction; spill=(directory, size) keeps more of the dataset on node-local "
        "disk, which is not memory and not counted here")
