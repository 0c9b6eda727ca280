"""The job-wide writer: every rank of a job saves into one root, and one version commits for all.

A save runs on every rank, in the same order, in each rank's background thread (the caller blocks
only for the host copy, as a single-process save does)::

    agree                        allgather of (step, digest of the tensor names, local failure):
                                 a different step, other keys or a failing rank refuse the save
                                 on every rank before anything is written (the future fails; a
                                 rank whose own state cannot be saved also raises from save())
    hash                         each rank hashes its blobs and finds the chunks the store lacks
    exchange                     allgather of those digests; each is written by ONE of the ranks
                                 holding it (so a replicated tensor is stored once)
    chunks, part                 each rank writes its chunks, then its manifest part
                                 (``parts/<step>/<rank>``), each durable before the next
    gather                       allgather of the parts' digests (or of a rank's failure)
    commit                       rank 0 writes the global manifest (``versions/<step>``), LAST
    outcome                      broadcast of the commit's outcome; then ``keep_last`` retention
                                 on rank 0 and a broadcast of the chunks it removed

Every phase ends in a collective that carries each rank's failure, so a rank that fails fails
every rank's future with that rank's error, and nothing is committed: no global manifest, and each
rank deletes the chunks and the part it wrote. A killed rank kills the job (mpirun and torchrun
abort the others); the version it was saving has no global manifest and does not exist. The named
points between the phases (``after-chunks``, ``after-part``, ``before-global``, ``after-global``)
are where ``on_commit_point`` is called: tests kill a rank there, each point with one expected
outcome (only ``after-global`` keeps the version).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait as wait_futures
from typing import Any, Callable, NamedTuple

import numpy as np
import xxhash

from solar.errors import CheckpointError, ConfigError

from . import merkle
from .chunking import hasher
from .collect import collect_job
from .comm import job_comm
from .deltajob import open_job_deltas, write_deltas
from .deltasave import DEFAULT_MAX_CHAIN
from .flatten import Flat
from .host import host_pool
from .jobstore import JobManifest, JobStore, PartEntry, part_digest
from .manifest import encode
from .pack import PACK_BYTES, Packer, delete_pack, locate, located, pack_policy, stream_limit
from .repack import repack_store
from .store import CheckpointStore
from .writer import JOB_WRITER, CheckpointWriter, SaveResult

__all__ = ["JobWriter", "COMMIT_POINTS"]

#: where ``on_commit_point(point, step)`` is called, in commit order (the last two on rank 0 only)
COMMIT_POINTS = ("after-chunks", "after-part", "before-global", "after-global")


class _Report(NamedTuple):
    """One rank's outcome of a phase, as every rank receives it."""

    ok: bool
    error: str  # "ExceptionType: message" of a failure, else ""
    payload: Any


class _Vote(NamedTuple):
    """What each rank says before a save: its step, its tensor names' digest, its failure."""

    step: int
    keys: str
    error: str


class _Owned(NamedTuple):
    """What a rank wrote of a save's new chunks."""

    bytes: int
    chunks: int
    locations: dict  # digest -> Location of the ones it packed
    deltas: dict  # digest -> DeltaRef of the ones it wrote as deltas


class _PartGen(NamedTuple):
    """The key of the part a save writes: its generation, and those of older parts of the step."""

    step: int
    gen: int
    old: list


class _NoLock:
    def release(self) -> None:
        pass


class _JobSink:
    """The shared store as one rank sees it: the chunks known to be committed (the same set on
    every rank: each adds every rank's new chunks after a commit and drops what retention removed)."""

    def __init__(self, store: CheckpointStore, lock: Any, known: set[bytes], damaged: set[bytes], rank: int) -> None:
        self.store, self.lock, self.known, self.damaged, self.rank = store, lock, known, damaged, rank
        self.locations: dict = {}  # the known chunks that are packed, and where
        self.steps: set[int] = set()  # committed, then every step saved (check_new_step)

    def add_known(self, digests: set[bytes]) -> None:
        self.known |= digests
        for d in digests & self.damaged:
            if self.rank == 0:  # one rank clears the shared marker
                self.store.clear_damaged(d)
            self.damaged.discard(d)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class JobWriter(CheckpointWriter):
    """``CheckpointWriter(root, comm=...)``: one checkpoint for the whole job (see the module doc).

    Every rank constructs it (collectively) on the same ``root``, a directory all ranks see, and
    calls ``save`` with the same steps in the same order. ``comm`` is an mpi4py communicator or a
    torch.distributed process group (``"torch"``: the default group); the writer talks over private
    duplicates of it. The other arguments are :class:`CheckpointWriter`'s, except ``staging``
    (not supported with ``comm=``) and ``pack``, :data:`.pack.PACK_BYTES` here: each rank writes a
    save's chunks into a few rolling pack files (:mod:`.pack`), because a job root lives on a
    parallel file system, where every file is a metadata operation on servers all ranks share;
    ``io_threads`` packs are written at once (a save smaller than that many full packs is split
    into that many smaller ones, see :func:`.pack.stream_limit`), each assembled in memory only
    when its chunks are not back to back in the staging copy, so the extra memory is at most
    ``io_threads`` packs.
    ``on_commit_point(point, step)`` is called at each of :data:`COMMIT_POINTS` (instrumentation;
    crash tests kill a rank there).

    Raises:
        CheckpointLockedError: another writer (or job) holds ``root`` (raised on every rank).
        CheckpointError: ``root`` holds a single-process writer's versions (on every rank).
    """

    def __init__(self, root: "str | os.PathLike", *, comm: Any, chunk_size: int = 1 << 20,
                 keep_last: int | None = None, hash: str = "xxh3_128", max_in_flight: int = 1,
                 staging: "str | os.PathLike | None" = None, io_threads: int = 4,
                 storage_options: dict | None = None, durable: bool = True,
                 on_commit_point: Callable[[str, int], None] | None = None, pack: "bool | int" = PACK_BYTES,
                 deltas: bool = False, max_chain: int = DEFAULT_MAX_CHAIN) -> None:
        if staging is not None:
            raise ConfigError("staging= is not supported with comm= (a job root is committed by all ranks at once); "
                              "leave staging out")
        self._check_args(chunk_size, keep_last, max_in_flight)
        self.chunk_size, self.keep_last, self.hash = int(chunk_size), keep_last, hash
        self._digest = hasher(hash)
        self._sync, self._bg = job_comm(comm, 2)
        self.rank, self.world_size = self._sync.rank, self._sync.size
        self._hook = on_commit_point
        self.pack, self._packing = pack, pack_policy(pack, int(chunk_size))
        store = CheckpointStore(root, create=True, durable=durable, **(storage_options or {}))
        self.jobs = JobStore(store)
        self.root = store.root
        opened = self._open_root(store)
        self._main = _JobSink(store, opened["lock"] if self.rank == 0 else _NoLock(), opened["known"],
                              opened["damaged"], self.rank)
        self._main.locations, self._main.steps = opened["locations"], set(opened["versions"])
        self._committed = set(opened["versions"])  # the steps with a global manifest (this writer's view)
        self._part: _PartGen | None = None  # the part of the save being committed
        self._stage = None
        self._prev_step = opened["latest"]
        self._prev_trees: dict[str, list[np.ndarray]] = {}
        if self._prev_step is not None:
            self._load_trees(self.jobs.read_global(self._prev_step))
        self._deltas = open_job_deltas(self.jobs, self._sync, self.chunk_size, max_chain, self._digest) \
            if deltas else None
        self._spots: dict = {}  # with deltas: where each new chunk of the save was found
        self._start_threads(max_in_flight, io_threads)

    def _start_threads(self, max_in_flight: int, io_threads: int) -> None:
        self._pool = host_pool(max_in_flight, self.chunk_size, self.hash)
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="solar-ckpt-job")
        self._drain = None
        self._streams = max(1, io_threads)
        self._io = ThreadPoolExecutor(self._streams, thread_name_prefix="solar-ckpt-io")
        self._futures, self._staged, self._undrained = [], [], set()
        self._closed = False
        self._mutex = threading.Lock()

    def _open_root(self, store: CheckpointStore) -> dict:
        """Rank 0 locks the root, checks what it is and reads what it holds; every rank gets the outcome."""
        lock, out, exc = None, None, None
        if self.rank == 0:
            try:
                lock = store.lock()
                if store.steps():
                    raise CheckpointError(
                        f"{store.root} holds versions of a single-process CheckpointWriter (manifests/); a job writer "
                        "would commit versions that load() of this root does not see. Give the job its own root, or "
                        "save from one process (CheckpointWriter(root) without comm=)")
                if self.jobs.marker() is None:
                    self.jobs.write_marker(self.world_size)
                store.tier.cleanup_temp()  # temporaries of a killed job; safe under the lock
                damaged = store.damaged_digests()
                known: set[bytes] = set()
                valid = self.jobs.valid()
                for jm in valid:
                    known |= self.jobs.referenced(jm)
                locations = located([self.jobs.part(jm, r) for jm in valid for r in range(jm.world_size)])
                latest = self.jobs.latest()
                out = {"known": known - damaged, "damaged": damaged, "latest": latest.step if latest else None,
                       "locations": locations, "versions": [jm.step for jm in valid]}
            except Exception as e:  # every rank raises it
                exc = e
                if lock is not None:
                    lock.release()
        got = self._sync.bcast(out if exc is None else _failure(exc))
        if exc is not None:
            self._close_comms()
            raise exc
        if isinstance(got, str):
            self._close_comms()
            raise CheckpointError(f"rank 0 could not open job root {store.root}: {got}")
        got["lock"] = lock
        return got

    def _load_trees(self, jm: JobManifest) -> None:
        """This rank's Merkle trees of the newest version: the next save's diff base."""
        if self.rank >= jm.world_size or jm.chunk_size != self.chunk_size:
            return
        part = self.jobs.part(jm, self.rank)
        for i in range(len(part.blobs)):
            names = part.tensors_of_blob(i)
            if names:
                self._prev_trees[names[0]] = merkle.build(part.blob_digests(i), self._digest)

    # -- agreement (background thread, first phase of every save) --
    def _refuse(self, step: Any, exc: BaseException) -> None:
        """This rank's save raises ``exc`` on the caller's thread; its vote still goes out (in save
        order, like every save's), so the other ranks' futures fail with this rank's error."""
        self._persist.submit(self._vote, step, None, exc)

    def _vote(self, step: Any, flat: Flat | None, failure: BaseException | None) -> None:
        """Every rank says its step, its tensor names' digest and its failure; a different step,
        other keys or a failing rank refuse the save on every rank, before anything is written."""
        names = [t.name for t in flat.tensors] if flat is not None else []
        keys = xxhash.xxh3_128_hexdigest(json.dumps(names).encode())
        vote = _Vote(step, keys, _failure(failure) if failure is not None else "")
        votes = [_Vote(*v) for v in self._bg.allgather(tuple(vote))]
        for r, v in enumerate(votes):
            if v.error:
                if failure is not None:
                    raise failure
                raise CheckpointError(f"rank {r} cannot save step {v.step}: {v.error}; no rank saved step {step}")
        for r, v in enumerate(votes):
            if v.step != votes[0].step:
                raise ConfigError(f"the ranks disagree on the step: rank 0 saves step {votes[0].step} but rank {r} "
                                  f"step {v.step}; every rank must call save() with the same step (nothing was saved)")
        if any(v.keys != votes[0].keys for v in votes):
            lists = self._bg.allgather(names)
            base = set(lists[0])
            for r, other in enumerate(lists):
                extra, missing = sorted(set(other) - base), sorted(base - set(other))
                if extra or missing:
                    what = (f"has key {extra[0]!r} that rank 0's lacks" if extra
                            else f"lacks key {missing[0]!r} that rank 0's has")
                    raise ConfigError(
                        f"rank {r}'s state for step {step} {what}; every rank must save the same keys (a sharded "
                        "tensor is saved as the rank's own shard under the same key): nothing was saved")
            raise ConfigError(f"the ranks' states for step {step} list their keys in different orders; save them in "
                              "one order on every rank (nothing was saved)")

    # -- the commit (background thread) --
    def _together(self, what: str, step: int, fn: Callable[[], Any], payload: Callable[[Any], Any]):
        """Run ``fn`` here, then learn every rank's outcome; raise the first failure on every rank."""
        try:
            out, exc = fn(), None
            mine = _Report(True, "", payload(out))
        except Exception as e:  # delivered to every rank below
            out, exc = None, e
            mine = _Report(False, _failure(e), None)
        reports = [_Report(*r) for r in self._bg.allgather(tuple(mine))]
        if exc is not None:
            raise exc
        for r, rep in enumerate(reports):
            if not rep.ok:
                raise CheckpointError(f"rank {r} failed {what} of step {step}: {rep.error}; no rank committed step "
                                      f"{step} (the last committed version is intact)")
        return out, [rep.payload for rep in reports]

    def _point(self, point: str, step: int) -> None:
        if self._hook is not None:
            self._hook(point, step)

    def _commit(self, flat: Flat, host: list[np.ndarray], slot: int, step: int, meta: dict,
                stage_seconds: float) -> SaveResult:
        t0 = time.perf_counter()
        try:
            self._vote(step, flat, None)
        except BaseException:
            self._pool.release(slot)
            if step not in self._committed:  # the refused save saved nothing: its step stays new
                self._main.steps.discard(step)
            raise
        sink = self._main
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                try:
                    if self._deltas is not None and plan is not None:  # before the staging copy is reused
                        self._deltas.written(flat, host, plan.digests)
                finally:  # a slot never given back would stop every later save in acquire()
                    self._pool.release(slot, plan.digests if plan is not None else None)

        plan, staged = None, self._pool.staged(slot)
        if self._deltas is not None:
            self._deltas.begin(flat)
            self._spots = {}

        mine: list[bytes] = []
        pack: list[str] = []  # the pack this rank wrote, if any
        try:
            spot = (lambda d, _v, name, j: self._spots.__setitem__(d, (name, j))) if self._deltas else None
            plan, news = self._together("hashing", step, lambda: self._plan(sink, flat, host, spot, staged.hashed),
                                        lambda p: sorted(p.new))
            mine = self._owned(news, set(plan.new))
            wrote, where = self._together("writing its chunks", step,
                                          lambda: self._write_owned(plan, mine, step, release, pack),
                                          lambda w: (w.locations, w.deltas))
            new_locs = {d: loc for locs, _d in where for d, loc in locs.items()}
            if self._deltas is not None:
                self._deltas.adopt({d: ref for _l, refs in where for d, ref in refs.items()}, set(plan.new))
            (m, part), parts = self._together("writing its part", step,
                                              lambda: self._write_part(flat, plan, wrote, new_locs, step, meta),
                                              lambda out: out[1])
        except BaseException:
            release()
            self._undo(step, mine, pack)
            raise
        release()
        self._commit_global(step, parts, mine, pack)
        self._committed.add(step)
        if self._deltas is not None:
            self._deltas.committed()
        committed = set().union(*(set(n) for n in news))
        sink.add_known(committed)
        sink.locations.update(new_locs)
        self._prev_trees, self._prev_step = plan.trees, step
        self._retain(step)
        return SaveResult(step=step, logical_bytes=m.logical_bytes, bytes_written=m.stats["bytes_written"],
                          chunks_total=m.nchunks, chunks_written=len(mine), chunks_unchanged=plan.unchanged,
                          manifest_bytes=part.nbytes, stage_seconds=stage_seconds,
                          persist_seconds=time.perf_counter() - t0, root=self.root,
                          chunks_rewritten=len(plan.rewritten), bytes_staged=staged.bytes_copied)

    def _owned(self, news: list[list[bytes]], here: set[bytes]) -> list[bytes]:
        """The new chunks this rank writes: of the ranks holding a chunk, one, spread by its digest."""
        holders: dict[bytes, list[int]] = {}
        for r, ds in enumerate(news):
            for d in ds:
                holders.setdefault(d, []).append(r)
        return sorted(d for d in here if holders[d][int.from_bytes(d[:8], "little") % len(holders[d])] == self.rank)

    def _write_owned(self, plan, mine: list[bytes], step: int, release: Callable[[], None], pack: list[str]) -> _Owned:
        """Write this rank's chunks: into rolling packs as ``pack=`` says (:mod:`.pack`), the rest as files."""
        store, owned = self._main.store, set(mine)
        futs = []
        packer = None
        try:
            as_deltas = write_deltas(self._deltas, self._main, plan.new, owned, self._spots, self._io.submit) \
                if self._deltas is not None else set()
            whole = [(d, v) for d, v in plan.new.items() if d in owned and d not in as_deltas]
            # packs written at once: as many as the I/O threads (chunk files are written that way too)
            packer = Packer(store, self._io.submit, stream_limit(self._packing, whole, self._streams), self._streams)
            for d, v in whole:  # the order they were found in: a pack holds neighbours
                if v.nbytes < self._packing.below:
                    packer.add(d, v)
                else:
                    futs.append(self._io.submit(store.put_chunk, d, v))
            wait_futures(futs)
            packed = packer.finish()  # deletes its packs and raises on a failure
        except BaseException:
            if packer is not None:
                packer.discard()  # waits for the packs in flight before the staging copy is released
            raise
        finally:
            release()  # the chunks' bytes were read from the staging copy
        pack.extend(packed.names)
        for f in futs:
            if f.exception() is not None:
                raise f.exception()
        self._point("after-chunks", step)
        mine_deltas = self._deltas.mine() if self._deltas is not None else {}
        return _Owned(sum(f.result() for f in futs) + packed.nbytes + sum(r.nbytes for r in mine_deltas.values()),
                      len(mine), packed.locations, mine_deltas)

    def _write_part(self, flat: Flat, plan, wrote: _Owned, new_locs: dict, step: int, meta: dict):
        m = self._manifest(flat, plan, step, meta, wrote.bytes, wrote.chunks,
                           locate(plan.digests, self._main.locations, new_locs))
        if self._deltas is not None:
            self._deltas.annotate(m, {**self._main.locations, **new_locs})
        data = encode(m)
        # a step saved again (overwrite) gets a new generation key: the committed part stays whole
        # until the new global manifest replaces the one pinning it
        old = self.jobs.part_gens(step).get(self.rank, [])
        self._part = _PartGen(step, max(old) + 1 if old else 0, old)
        self.jobs.put_part(m, self.rank, data, self._part.gen)
        self._point("after-part", step)
        return m, PartEntry(self.rank, len(data), part_digest(data), m.root, self._part.gen, bool(m.deltas))

    def _commit_global(self, step: int, parts: list[PartEntry], mine: list[bytes], pack: list[str]) -> None:
        """Rank 0 writes the global manifest; every rank learns whether it did."""
        err = ""
        if self.rank == 0:
            jm = JobManifest(step=step, world_size=self.world_size, hash=self.hash, chunk_size=self.chunk_size,
                             parts=parts, created=time.time(), parent=self._prev_step,
                             features=["deltas"] if any(p.deltas for p in parts) else [],
                             root=merkle.combine([bytes.fromhex(p.root) for p in parts], self._digest).hex())
            try:
                self._point("before-global", step)
                self.jobs.put_global(jm)
                self._point("after-global", step)
            except Exception as exc:  # every rank learns of it
                err = _failure(exc)
                try:  # a write that failed after its rename must not leave a version whose parts go next
                    now = self.jobs.find_global(step)
                    if now is not None and now.parts == parts:  # ours, not a replaced older one
                        self.jobs.delete_global(step)
                except (OSError, CheckpointError):
                    pass
        err = self._bg.bcast(err)
        if err:
            self._undo(step, mine, pack)
            raise CheckpointError(f"rank 0 failed to commit step {step}: {err}; no rank committed it (the last "
                                  "committed version is intact)")
        done, self._part = self._part, None
        for g in done.old if done is not None else []:  # parts of an older save of this step, now unpinned
            try:
                self.jobs.delete_part(step, self.rank, g)
            except OSError:  # a repack or gc removes what is left
                pass

    def _undo(self, step: int, mine: list[bytes], pack: list[str]) -> None:
        """Delete what this rank wrote for a save that did not commit (best effort: gc sweeps the rest)."""
        try:
            done, self._part = self._part, None
            if done is not None and done.step == step:  # only this save's part, never a committed one
                self.jobs.delete_part(step, self.rank, done.gen)
            for name in pack:
                delete_pack(self._main.store, name)
            if self._deltas is not None:
                self._deltas.abort(self._main.store)
        except OSError:
            pass
        self._drop_orphans(self._main, mine)

    def _retain(self, step: int) -> None:
        """``keep_last`` retention: rank 0 collects, every rank forgets the chunks it removed."""
        if self.keep_last is None:
            return
        removed: Any = None
        if self.rank == 0:
            try:
                live = collect_job(self.jobs, self.keep_last, full_sweep=False, protect=frozenset({step})).live
                # then the packs the kept versions use only partly; every rank learns the new places
                removed = (self._main.known - live, repack_store(self.jobs.store).moved)
            except Exception as exc:  # the version is committed; retention is retried after the next save
                removed = _failure(exc)
        removed = self._bg.bcast(removed)
        if isinstance(removed, str):
            raise CheckpointError(f"step {step} is committed, but rank 0's keep_last retention failed: {removed}")
        removed, moved = removed
        self._main.known -= removed
        for d in removed:
            self._main.locations.pop(d, None)
        self._main.locations.update(moved)
        if self._deltas is not None:
            self._deltas.retain(self._main.known | self._main.damaged)

    def _close_comms(self) -> None:
        for c in (self._sync, self._bg):
            c.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            super().close()
        finally:
            self._close_comms()


JOB_WRITER[:] = [JobWriter]
