"""What each save wrote, read back from manifests: elements changed, bytes as whole chunks and as deltas.

Feeds ``solar-ckpt log`` (one row per version) and ``solar-ckpt diff ROOT@S ROOT@T`` (the saves
between the two versions). Reads manifests only, never chunk data.
"""

from __future__ import annotations

from typing import Iterator

from solar.errors import CorruptDataError

from .jobstore import JobStore, is_job_root
from .store import CheckpointStore

__all__ = ["increment", "saved_stats"]


def increment(stats: dict) -> dict:
    """What one save wrote, from its manifest's statistics: the elements that changed (``None`` where
    the writer did not count them: saves without ``deltas=True``), and the bytes written as whole
    chunks and as deltas."""
    delta = int(stats.get("delta_bytes", 0))
    changed = stats.get("elements_changed")
    return {"elements_changed": changed if isinstance(changed, int) and not isinstance(changed, bool) else None,
            "chunk_bytes": max(int(stats.get("bytes_written", 0)) - delta, 0), "delta_bytes": delta,
            "delta_chunks": int(stats.get("delta_chunks", 0))}


def saved_stats(root: str, after: int, upto: int, rank: int | None = None) -> Iterator[tuple[list[dict], int]]:
    """``(statistics of each part, step)`` of every committed version of ``root`` in ``(after, upto]``,
    oldest first: one manifest's on a single root, every rank's part (or ``rank``'s) on a job root.
    Versions that cannot be read are left out (``verify`` reports them)."""
    store = CheckpointStore(root)
    if not is_job_root(store):
        for m in store.valid_manifests(warn=False):
            if after < m.step <= upto:
                yield [m.stats], m.step
        return
    jobs = JobStore(store)
    for jm in jobs.valid():
        if not after < jm.step <= upto:
            continue
        try:
            parts = [jobs.part(jm, r) for r in ([rank] if rank is not None else range(jm.world_size))]
        except CorruptDataError:
            continue
        yield [p.stats for p in parts], jm.step
