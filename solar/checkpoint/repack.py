"""Repack: compact the pack files whose chunks are partly dead.

``gc`` deletes a pack once no kept version locates a chunk in it; a pack only some of whose chunks
are dead (the chunks of removed versions, beside chunks later versions still de-duplicate against)
stays whole. :func:`repack_store` rewrites the live chunks of every pack at least ``min_dead`` of
whose bytes are dead into new rolling packs, points the kept versions at the new copies, then
deletes the old packs. Packs stay immutable: nothing is ever rewritten in place.

Order, for crash safety (a process killed at any point leaves every kept version loading, with the
same bytes; the named points of :data:`REPACK_POINTS` are where ``on_point`` is called, and crash
tests kill the process there):

1. every live chunk of the chosen packs is read and checked against its digest (a pack with a
   damaged chunk is left alone, for ``verify`` to report), then written into new packs, durable
   (``after-packs``: a crash leaves new packs no version uses; the next ``gc`` deletes them);
2. each version that locates a chunk in a chosen pack is pointed at the new packs by one atomic
   write (``after-version``, after each): a single root's manifest is replaced by the same
   manifest with new ``locations`` (tensors, digests and Merkle root unchanged); a job root's
   parts are written under a new generation key (``parts/<step>/<rank>.<gen>``), then the global
   manifest is replaced by one pinning them, then the old parts are deleted. Until then the
   version reads the old packs, which still exist;
3. the old packs are deleted (``after-delete``): no version locates anything in them any more.

The caller holds the root's writer lock (``solar-ckpt gc`` does, and a writer's ``keep_last``
retention runs it after each commit's collection, in the thread that writes the root, then hands
the chunks' new locations to every rank), so no save runs meanwhile. A
reader that opened a version before step 2 and reads its chunks after step 3 finds the old pack
gone, and is told to load again.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .chunking import hasher
from .jobstore import JobStore, is_job_root, part_digest
from .manifest import Location, Manifest, encode
from .pack import PACK_BYTES, Packer, delete_pack, pack_key
from .store import CheckpointStore

__all__ = ["REPACK_POINTS", "RepackReport", "repack", "repack_store", "MIN_DEAD"]

#: where ``on_point(point)`` is called, in order (``after-version`` once per version rewritten)
REPACK_POINTS = ("after-packs", "after-version", "after-delete")
#: a pack is rewritten once this fraction of its bytes is dead: rewriting costs its live bytes, so
#: waiting for a quarter bounds both the space wasted (at most a third over the live bytes) and
#: the bytes rewritten per byte freed (at most three)
MIN_DEAD = 0.25


@dataclass
class RepackReport:
    packs_rewritten: list[str] = field(default_factory=list)  # the old packs, now deleted
    packs_written: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    bytes_copied: int = 0
    versions_rewritten: list[int] = field(default_factory=list)
    damaged_packs: list[str] = field(default_factory=list)  # left alone: a chunk in them fails its digest
    moved: dict = field(default_factory=dict, repr=False)  # digest -> its new Location (a writer's map)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "moved"}


class _Version(NamedTuple):
    """A kept version as repack sees it: its manifests (one, or one per rank of a job)."""

    step: int
    manifests: list[Manifest]


def _versions(store: CheckpointStore, jobs: JobStore | None) -> list[_Version]:
    if jobs is None:
        return [_Version(m.step, [m]) for m in store.valid_manifests(warn=False)]
    return [_Version(jm.step, [jobs.part(jm, r) for r in range(jm.world_size)]) for jm in jobs.valid()]


def _pack_size(store: CheckpointStore, name: str) -> int:
    if store.local_dir is not None:
        try:
            return os.path.getsize(store.tier.path(pack_key(name)))
        except OSError:
            return 0
    data = store.tier.get(pack_key(name))
    return 0 if data is None else len(data)


class _Live(NamedTuple):
    """A live chunk of a pack: where it is, and the hash its digest was made with."""

    loc: Location
    hash: str


def _chosen(store: CheckpointStore, versions: list[_Version], min_dead: float) -> dict[str, dict[bytes, _Live]]:
    """The packs worth rewriting, each with the live chunks in it."""
    live: dict[str, dict[bytes, _Live]] = {}
    for v in versions:
        for m in v.manifests:
            for d, loc in m.locations.items():
                live.setdefault(loc.pack, {})[d] = _Live(loc, m.hash)
    out = {}
    for name, chunks in sorted(live.items()):
        size = _pack_size(store, name)
        used = sum(c.loc.length for c in chunks.values())
        if size and size - used > 0 and size - used >= min_dead * size:
            out[name] = chunks
    return out


def _copy_live(store: CheckpointStore, chosen: dict[str, dict[bytes, _Live]], limit: float,
               report: RepackReport) -> dict[bytes, Location]:
    """Write the chosen packs' live chunks into new packs; return their new locations. A pack
    missing or with a chunk that fails its digest is dropped from ``chosen`` and left alone."""
    def now(fn, *args) -> Future:  # one pack at a time: memory is one old pack and one new one
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as exc:  # raised by Packer.finish
            f.set_exception(exc)
        return f

    packer = Packer(store, now, limit)
    for name in list(chosen):
        data = store.tier.get(pack_key(name))
        view = memoryview(data) if data is not None else None
        pieces = []
        for d, (loc, hash_name) in sorted(chosen[name].items(), key=lambda kv: kv[1].loc.offset):
            piece = view[loc.offset:loc.offset + loc.length] if view is not None else None
            if piece is None or piece.nbytes != loc.length or hasher(hash_name)(piece) != d:
                pieces = None
                break
            pieces.append((d, piece))
        if pieces is None:
            report.damaged_packs.append(name)
            del chosen[name]
            continue
        for d, piece in pieces:
            packer.add(d, piece)
            report.bytes_copied += piece.nbytes
    done = packer.finish()
    report.packs_written = sorted(set(done.names))
    return done.locations


def _moved(m: Manifest, chosen: dict, new: dict[bytes, Location]) -> Manifest | None:
    if not any(loc.pack in chosen for loc in m.locations.values()):
        return None
    locs = {d: (new[d] if loc.pack in chosen else loc) for d, loc in m.locations.items()}
    return dataclasses.replace(m, locations=locs)


def _rewrite(store: CheckpointStore, jobs: JobStore | None, v: _Version, chosen: dict,
             new: dict[bytes, Location]) -> bool:
    """Point version ``v`` at the new packs (one atomic write commits it); False if it used none."""
    moved = [_moved(m, chosen, new) for m in v.manifests]
    if not any(moved):
        return False
    if jobs is None:
        store.put_manifest(moved[0])
        return True
    jm = jobs.read_global(v.step)
    old = list(jm.parts)
    parts = []
    for entry, m in zip(old, moved):
        if m is None:
            parts.append(entry)
            continue
        data = encode(m)
        gen = max(jobs.part_gens(v.step).get(entry.rank, [0])) + 1
        jobs.put_part(m, entry.rank, data, gen)
        parts.append(dataclasses.replace(entry, nbytes=len(data), digest=part_digest(data), gen=gen))
    jobs.put_global(dataclasses.replace(jm, parts=parts))
    for a, b in zip(old, parts):
        if a.gen != b.gen:
            jobs.delete_part(v.step, a.rank, a.gen)
    return True


def _drop_stale_parts(jobs: JobStore) -> None:
    """Delete the parts of kept versions their global manifests do not pin (left by a repack
    killed between its global manifest and the deletion of the old parts, or before the former)."""
    for jm in jobs.valid():
        for rank, gens in jobs.part_gens(jm.step).items():
            for g in gens:
                if rank >= jm.world_size or g != jm.parts[rank].gen:
                    jobs.delete_part(jm.step, rank, g)


def repack_store(store: CheckpointStore, *, min_dead: float = MIN_DEAD, limit: float = PACK_BYTES,
                 dry_run: bool = False, on_point: Callable[[str], None] | None = None) -> RepackReport:
    """Repack the partly dead packs of ``store`` (a single-process or a job root); the caller holds
    its writer lock. ``min_dead``: the fraction of a pack's bytes that must be dead for it to be
    rewritten (0 rewrites every pack with any dead chunk). See the module doc for the order."""
    point = on_point or (lambda _name: None)
    jobs = JobStore(store) if is_job_root(store) else None
    versions = _versions(store, jobs)
    report = RepackReport()
    if jobs is not None and not dry_run:
        _drop_stale_parts(jobs)
    chosen = _chosen(store, versions, min_dead)
    if not chosen or not versions:
        return report
    if dry_run:
        report.packs_rewritten = sorted(chosen)
        report.bytes_freed = sum(_pack_size(store, n) - sum(c.loc.length for c in live.values())
                                 for n, live in chosen.items())
        return report
    sizes = {n: _pack_size(store, n) for n in chosen}
    new = _copy_live(store, chosen, limit, report)
    if not chosen:
        return report
    point("after-packs")
    report.moved = dict(new)
    for v in versions:
        if _rewrite(store, jobs, v, chosen, new):
            report.versions_rewritten.append(v.step)
            point("after-version")
    for name in sorted(chosen):
        delete_pack(store, name)
        report.bytes_freed += sizes[name]
    report.bytes_freed -= report.bytes_copied
    report.packs_rewritten = sorted(chosen)
    point("after-delete")
    return report


def repack(root, *, min_dead: float = MIN_DEAD, dry_run: bool = False, storage_options: dict | None = None,
           on_point: Callable[[str], None] | None = None) -> RepackReport:
    """Take the writer lock on ``root`` and :func:`repack_store` (fails if a writer is running there).

    Raises:
        NotACheckpointRootError: ``root`` is not a checkpoint root.
        CheckpointLockedError: a writer holds ``root``.
    """
    store = CheckpointStore(root, **(storage_options or {}))
    store.require_root()
    lock = store.lock()
    try:
        return repack_store(store, min_dead=min_dead, dry_run=dry_run, on_point=on_point)
    finally:
        lock.release()
