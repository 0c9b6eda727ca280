"""Recompute every hash of a checkpoint root and name what is corrupt.

``verify`` checks each manifest's own checksum, recomputes every Merkle root from the manifest's
digests, then reads every distinct chunk once and re-hashes it. A bad chunk is reported with the
versions and tensors it touches, which is what a user needs to decide which version to restore.

``repair=True`` also deletes the chunks whose bytes are damaged and marks them, and missing
ones, under ``damaged/``. Why: chunks are content addressed, so a damaged copy can never serve
any version, and a writer trusts the chunks its root's manifests reference (its known-chunk set,
built without probing the store) and would never write those bytes again. A writer started after
the repair (e.g. the relaunched job) treats marked chunks as absent: the next save that produces
the same bytes writes them afresh, which heals every version that references them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from tqdm import tqdm

from solar.cache.base import UnsafePathError
from solar.errors import CorruptDataError

from . import merkle
from .chunking import chunk_spans, hasher
from .deltastore import ChunkReadError, rebuild
from .errors import CheckpointVersionRemovedError
from .jobstore import JobStore, is_job_root
from .manifest import Location, Manifest
from .pack import read_packed
from .store import CheckpointStore, chunk_key

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    root: str
    steps: list[int] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[dict] = field(default_factory=list)  # {"kind", "chunk"?, "step", "tensors", "detail"}
    incomplete: list[dict] = field(default_factory=list)  # manifests failing their checksum (also in problems)
    removed_chunks: list[str] = field(default_factory=list)  # repair=True: damaged chunks deleted (hex digests)
    marked_chunks: list[str] = field(default_factory=list)  # repair=True: damaged or missing, to be rewritten
    # versions removed by a writer's keep_last retention (or a gc) while being verified: not
    # damage, and not counted in ``steps``
    skipped: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(root, step: int | None = None, *, progress: bool = False, repair: bool = False,
           storage_options: dict | None = None) -> VerifyReport:
    """Verify version ``step`` of ``root``, or every version if ``step`` is ``None``.

    ``repair=True`` takes the root's writer lock (``CheckpointLockedError`` while a writer runs
    there), deletes every chunk whose stored bytes are damaged and marks those and the missing
    ones for rewriting (see the module docstring); they stay listed in ``problems`` and are named
    in ``removed_chunks`` (deleted) and ``marked_chunks`` (both).

    Returns a report; it never raises for corrupt data (a missing root or step still raises, and
    so does a directory without any manifest: :class:`NotACheckpointRootError`).
    ``verify`` may run while a ``keep_last`` writer commits to the root: a version removed while
    it is checked is skipped (listed in ``skipped``), never reported as damaged; an explicit
    ``step`` removed meanwhile raises :class:`CheckpointVersionRemovedError`.
    A manifest that fails its checksum is a problem (also listed in ``incomplete``): manifests
    are committed by an atomic write (temporary, fsync, rename), so one under its final name can
    only be damage, or a ``durable=False`` save cut by a power loss. Loaders skip it (``load``
    falls back to the newest good version, with a warning); the report says so.
    """
    store = CheckpointStore(root, **(storage_options or {}))
    if not repair:
        return _verify(store, step, progress)
    store.require_root()  # before the lock, which would create .lock in any directory
    lock = store.lock()
    try:
        report = _verify(store, step, progress)
        for p in report.problems:
            if p["kind"] != "chunk":
                continue
            digest = bytes.fromhex(p["chunk"])
            store.mark_damaged(digest)  # marked first: a repair killed between the two is redone
            if p["detail"] != "missing" and not p.get("packed"):
                store.delete_chunk(digest)
                report.removed_chunks.append(p["chunk"])
            report.marked_chunks.append(p["chunk"])
        return report
    finally:
        lock.release()


class _Chunk(NamedTuple):
    """A distinct chunk to check: its expected size, the versions and tensors using it, its hash."""

    size: int
    uses: list[tuple[int, list[str]]]  # (step, names of the tensors of the blob holding it)
    hash: str
    loc: Location | None  # where a packed chunk lives
    chain: Manifest | None = None  # a version reading the chunk through deltas (rebuilt, bases checked)


def _job_manifests(store: CheckpointStore, step: int | None, report: VerifyReport) -> tuple[list, list, Callable]:
    """A job root's parts to check (tensors named ``rank R/NAME``), its damaged global manifests or
    parts, and whether a version is still stored (its global manifest is)."""
    jobs = JobStore(store)
    steps = [step] if step is not None else jobs.steps()
    if not steps and step is None:
        raise store.not_a_root()
    manifests, damaged, roots = [], [], {}
    for s in steps:
        try:
            jm = jobs.read_global(s)
        except CorruptDataError as exc:
            damaged.append((s, exc))
            continue
        roots[s] = jm.root
        for r in range(jm.world_size):
            try:
                part = jobs.part(jm, r)
            except CorruptDataError as exc:
                report.problems.append({"kind": "part", "step": s, "rank": r, "tensors": [], "detail": str(exc)})
                continue
            manifests.append(replace(part, tensors=[replace(t, name=f"rank {r}/{t.name}") for t in part.tensors]))

    def holds(m: Manifest) -> bool:
        try:
            jm = jobs.find_global(m.step)
        except CorruptDataError:
            return True
        return jm is not None and jm.root == roots.get(m.step)

    return manifests, damaged, holds


def _verify(store: CheckpointStore, step: int | None, progress: bool) -> VerifyReport:
    report = VerifyReport(store.root)
    manifests: list[Manifest] = []
    damaged: list[tuple[int, CorruptDataError]] = []
    holds = store.holds
    if is_job_root(store):
        manifests, damaged, holds = _job_manifests(store, step, report)
    elif step is not None:
        try:
            manifests.append(store.read_manifest(step))
        except CorruptDataError as exc:
            damaged.append((step, exc))
    else:
        listed = store.listed_manifests()  # skips versions retention removed after the listing
        if not (listed.good or listed.damaged or listed.removed):
            # "OK: 0 versions" would pass a script gating on verify for a mistyped path
            raise store.not_a_root()
        manifests, damaged, report.skipped = listed.good, listed.damaged, list(listed.removed)
    for s, exc in damaged:
        entry = {"kind": "manifest", "step": s, "tensors": [],
                 "detail": f"{exc}; load() skips this version (damaged, or a durable=False save cut by a "
                           "power loss); restore it from a copy, or `solar-ckpt gc` removes it"}
        report.problems.append(entry)
        if step is None:
            report.incomplete.append(entry)
    chunks = _check_trees(manifests, report)
    bar = None
    if progress:
        bar = tqdm(total=sum(c.size for c in chunks.values()), unit="B", unit_scale=True, desc="verify", leave=False,
                   disable=None)
    by_step = {m.step: m for m in manifests}
    gone: set[int] = set()  # versions found removed (retention) while their chunks were checked
    view = memoryview(bytearray(max((c.size for c in chunks.values()), default=0)))
    fns = {h: hasher(h) for h in {c.hash for c in chunks.values()}}
    for d, (size, uses, hname, loc, chain) in chunks.items():
        if chain is not None:
            try:
                rebuild(store, chain, d, view[:size], fns[hname])
                detail = None
            except ChunkReadError as exc:
                detail = exc.what
        else:
            detail = _chunk_problem(store, d, size, view, fns[hname], loc)
        report.chunks_checked += 1
        report.bytes_checked += size
        if bar is not None:
            bar.update(size)
        if detail:
            uses = _uses_still_stored(holds, uses, by_step, gone)
            if not uses:
                continue  # every version using it was removed while this ran: nothing is damaged
            tensors = sorted({t for _s, names in uses for t in names})
            problem = {"kind": "chunk", "chunk": d.hex(), "steps": sorted({s for s, _n in uses}),
                       "tensors": tensors, "detail": detail}
            if loc is not None:
                problem["packed"] = loc.pack
            report.problems.append(problem)
    if bar is not None:
        bar.close()
    if gone and step is not None:
        raise CheckpointVersionRemovedError(
            f"step {step} of {store.root} was removed while it was being verified: a CheckpointWriter's keep_last "
            f"retention (or a gc) deleted it after committing newer versions. Nothing is corrupt; verify a newer "
            f"version (there now: {store.versions() or 'none'}) or give the writer a larger keep_last")
    report.steps = sorted({s for s in report.steps if s not in gone})
    report.skipped = sorted(set(report.skipped) | gone)
    return report


def _check_trees(manifests: list[Manifest], report: VerifyReport) -> dict[bytes, _Chunk]:
    """Check every blob's Merkle root against its digests (a ``tree`` problem if not); return the
    distinct chunks of ``manifests`` with their uses, so each is read once however many use it."""
    chunks: dict[bytes, _Chunk] = {}
    for m in manifests:
        report.steps.append(m.step)
        digest = hasher(m.hash)
        for i, b in enumerate(m.blobs):
            rows = m.blob_digests(i)
            levels = merkle.build(rows, digest)
            if merkle.root(levels).hex() != b.root:
                report.problems.append({"kind": "tree", "step": m.step, "tensors": m.tensors_of_blob(i),
                                        "detail": f"Merkle root of blob {i} does not match its digests"})
            names = m.tensors_of_blob(i)
            for j, (a, e) in enumerate(chunk_spans(b.nbytes, m.chunk_size)):
                d = rows[j].tobytes()
                chain = m if d in m.deltas else None
                chunks.setdefault(d, _Chunk(e - a, [], m.hash, m.locations.get(d), chain)).uses.append((m.step, names))
    return chunks


def _chunk_problem(store: CheckpointStore, d: bytes, size: int, view: memoryview,
                   digest: Callable[[memoryview], bytes], loc: Location | None = None) -> str | None:
    """What is wrong with chunk ``d`` as stored (read into ``view``), or ``None`` if it is intact."""
    try:
        if loc is not None:
            try:
                n: int | None = read_packed(store, d, loc, view)
            except CorruptDataError:
                n = None
        else:
            n = store.tier.read_into(chunk_key(d), view)
    except ValueError:  # tiers refuse a value bigger than the buffer (sized for the largest chunk)
        return f"larger than expected ({size} B)"
    except UnsafePathError as exc:  # a planted symlink or FIFO: never read through
        return f"{exc.strerror}, not a chunk file"
    if n is None:
        return "missing"
    if n != size:
        return f"has {n} B, expected {size} B"
    if digest(view[:n]) != d:
        return "content does not match its hash"
    return None


def _uses_still_stored(holds: Callable[[Manifest], bool], uses: list, by_step: dict[int, Manifest],
                       gone: set[int]) -> list:
    """The ``(step, tensors)`` uses of a chunk that failed its check whose version is still stored.

    A writer's ``keep_last`` retention (or a ``gc``) deletes a version's manifest first and its
    chunks after, so a chunk that went missing while ``verify`` ran belongs to a removed version
    if that version's manifest is gone now; a missing chunk whose manifest is still there is damage.
    Asked after the chunk was read, never from an earlier answer: a version held then may be gone
    since. Steps found removed are added to ``gone`` (a removed step does not come back).
    """
    held: dict[int, bool] = {}
    out = []
    for s, names in uses:
        if s not in gone and s not in held:
            held[s] = holds(by_step[s])
            if not held[s]:
                gone.add(s)
        if s not in gone:
            out.append((s, names))
    return out
