"""Garbage collection: drop old versions and every chunk no kept version references.

Chunks stored as deltas live as long as a kept version reads them, and so do their bases (the delta
tables of kept manifests list every base, bases of bases included), whether or not a kept version
uses the base itself.

Order matters for crash safety: manifests go first, chunks after, so a ``gc`` killed half-way can
leave unreferenced chunks behind (the next ``gc`` removes them) but never a manifest whose chunks
are gone. A referenced chunk is never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from solar.errors import ConfigError

from .deltastore import delete_delta, delta_keys
from .jobstore import JobStore, is_job_root
from .manifest import Manifest
from .pack import delete_pack, located, pack_names, packs_of
from .store import CheckpointStore, referenced

__all__ = ["GcReport", "collect", "collect_job", "gc"]


@dataclass
class GcReport:
    kept: list[int] = field(default_factory=list)
    removed_versions: list[int] = field(default_factory=list)
    removed_torn: list[int] = field(default_factory=list)
    removed_chunks: int = 0
    kept_chunks: int = 0
    removed_packs: int = 0
    live: set = field(default_factory=set, repr=False)  # digests the kept versions reference
    locations: dict = field(default_factory=dict, repr=False)  # where the kept versions' packed chunks are

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("live", "locations")}


def collect(store: CheckpointStore, keep_last: int | None = None, *, dry_run: bool = False,
            full_sweep: bool = True, protect: "set[int] | frozenset[int]" = frozenset()) -> GcReport:
    """Collect garbage in ``store``; the caller must hold the root's writer lock.

    Args:
        keep_last: keep the newest ``keep_last`` complete versions (``None``: keep every version and
            only sweep chunks no version references, e.g. left by an interrupted save).
        dry_run: report what would be removed without removing it.
        full_sweep: list every chunk in the store (also finds chunks of interrupted saves); without
            it only the chunks of the removed versions are candidates, which costs O(manifests)
            instead of a listing of the store: what the writer does after each commit.
        protect: steps kept whatever ``keep_last`` says (the writer's versions not yet drained
            from its staging root).
    """
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 (or None to keep every version), got {keep_last}")
    manifests = store.valid_manifests(warn=False)
    valid = {m.step for m in manifests}
    newest = {m.step for m in manifests[-keep_last:]} if keep_last is not None else valid
    keep = [m for m in manifests if m.step in newest or m.step in protect]
    report = GcReport(kept=[m.step for m in keep])
    report.removed_versions = [m.step for m in manifests if m.step not in set(report.kept)]
    report.removed_torn = [s for s in store.steps() if s not in valid]
    live = referenced(keep) | chained(keep)
    report.kept_chunks = len(live)
    if not dry_run:
        for step in report.removed_versions + report.removed_torn:
            store.delete_manifest(step)
    report.live = live
    dropped = [m for m in manifests if m.step in set(report.removed_versions)]
    report.locations = located(keep)
    _sweep_packs(store, packs_of(keep), packs_of(dropped), report, dry_run, full_sweep)
    packed = located(dropped)
    candidates = list(store.chunk_digests()) if full_sweep else sorted(d for d in referenced(dropped) | chained(dropped)
                                                                         if d not in packed)
    _sweep_deltas(store, keep, dropped, dry_run, full_sweep)
    if full_sweep and not dry_run:
        for digest in store.damaged_digests() - live:  # no kept version needs that chunk any more
            store.clear_damaged(digest)
    for digest in candidates:
        if digest not in live:
            report.removed_chunks += 1
            if not dry_run:
                store.delete_chunk(digest)
    return report


def chained(manifests: list[Manifest]) -> set[bytes]:
    """The chunks the given versions' delta tables name: each delta's target and base."""
    out: set[bytes] = set()
    for m in manifests:
        for d, ref in m.deltas.items():
            out.add(d)
            out.add(ref.base)
    return out


def _sweep_deltas(store: CheckpointStore, keep: list[Manifest], dropped: list[Manifest], dry_run: bool,
                  full_sweep: bool) -> None:
    """Delete the delta objects no kept version reads: of the dropped versions', or every one stored."""
    live = {(d, ref.base) for m in keep for d, ref in m.deltas.items()}
    if full_sweep:
        candidates = set(delta_keys(store))
    else:
        candidates = {(d, ref.base) for m in dropped for d, ref in m.deltas.items()}
    if not dry_run:
        for target, base in sorted(candidates - live):
            delete_delta(store, target, base)


def _sweep_packs(store: CheckpointStore, live: set[str], dropped: set[str], report: GcReport, dry_run: bool,
                 full_sweep: bool) -> None:
    """Delete the packs no kept version uses: of the dropped versions', or every pack stored."""
    for name in sorted((set(pack_names(store)) if full_sweep else dropped) - live):
        report.removed_packs += 1
        if not dry_run:
            delete_pack(store, name)


def gc(root, keep_last: int | None = None, *, dry_run: bool = False, storage_options: dict | None = None) -> GcReport:
    """Take the writer lock on ``root`` and :func:`collect` (fails if a writer is running there).

    Raises:
        NotACheckpointRootError: ``root`` holds neither manifests nor chunks (checked before the
            lock, which would leave a ``.lock`` there).
    """
    store = CheckpointStore(root, **(storage_options or {}))
    store.require_root()
    lock = store.lock()
    try:
        if is_job_root(store):
            return collect_job(JobStore(store), keep_last, dry_run=dry_run)
        return collect(store, keep_last, dry_run=dry_run)
    finally:
        lock.release()


def collect_job(jobs: JobStore, keep_last: int | None = None, *, dry_run: bool = False, full_sweep: bool = True,
                protect: "set[int] | frozenset[int]" = frozenset()) -> GcReport:
    """:func:`collect` for a job root; the caller holds its lock (rank 0 of the writing job does).

    Order, for crash safety: the global manifests of removed versions first (the versions are gone
    from then on), then every part no kept version pins (also the parts of saves that never
    committed), then the chunks no kept part references. ``full_sweep=False`` (the writer's
    retention, which runs while no rank writes) considers only the removed versions' chunks.
    """
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 (or None to keep every version), got {keep_last}")
    store = jobs.store
    valid = jobs.valid()
    steps = {jm.step for jm in valid}
    newest = {jm.step for jm in valid[-keep_last:]} if keep_last is not None else steps
    keep = [jm for jm in valid if jm.step in newest or jm.step in protect]
    kept = {jm.step for jm in keep}
    dropped = [jm for jm in valid if jm.step not in kept]
    report = GcReport(kept=sorted(kept), removed_versions=[jm.step for jm in dropped],
                      removed_torn=[s for s in jobs.steps() if s not in steps])
    live: set[bytes] = set()
    for jm in keep:
        live |= jobs.referenced(jm)
    candidates: set[bytes] = set()
    for jm in dropped:
        candidates |= jobs.referenced(jm)
    kept_parts = [jobs.part(jm, r) for jm in keep for r in range(jm.world_size)]
    dropped_parts = [jobs.part(jm, r) for jm in dropped for r in range(jm.world_size)]
    live |= chained(kept_parts)
    candidates |= chained(dropped_parts)
    report.locations = located(kept_parts)
    candidates -= set(located(dropped_parts))
    report.kept_chunks = len(live)
    if not dry_run:
        for step in report.removed_versions + report.removed_torn:
            jobs.delete_global(step)
        jobs.forget(report.removed_versions)
    parts = jobs.part_steps()
    for step in sorted(parts):
        if step not in kept and not dry_run:
            for rank in parts[step]:
                jobs.delete_part(step, rank)
    _sweep_packs(store, packs_of(kept_parts), packs_of(dropped_parts), report, dry_run, full_sweep)
    _sweep_deltas(store, kept_parts, dropped_parts, dry_run, full_sweep)
    if full_sweep:
        candidates = set(store.chunk_digests())
        if not dry_run:
            for digest in store.damaged_digests() - live:
                store.clear_damaged(digest)
    for digest in sorted(candidates - live):
        report.removed_chunks += 1
        if not dry_run:
            store.delete_chunk(digest)
    report.live = live
    return report
