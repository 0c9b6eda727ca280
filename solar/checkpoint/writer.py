"""The incremental, asynchronous checkpoint writer.

``save`` blocks only while the state is copied into a reused host staging buffer (pinned when the
tensors live on a GPU); a background thread then hashes the copy chunk by chunk, writes only chunks
the store does not hold (a lookup by digest: content-addressed, so identical chunks across tensors
and versions are stored once), and commits the manifest last by an atomic write. One Merkle tree
per blob is built on the way and compared top-down with the previous version's tree; that diff
feeds the save's statistics and the manifest's roots, it does not decide what is written. Memory
stays bounded: there are ``max_in_flight`` staging buffers (one by default), and a save waits for
a free one.

With ``staging=`` the version is first committed to a fast (node-local) root and then drained to
the main root in the background: chunks first, the manifest last, so the main root only ever shows
complete versions too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from typing import Any, Callable, NamedTuple

import numpy as np

from solar.errors import CheckpointError, ConfigError

from . import merkle
from .chunking import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, chunk_spans, hash_chunks, hasher
from .collect import collect
from .deltasave import DEFAULT_MAX_CHAIN, DeltaSaver
from .flatten import Flat, flatten
from .host import host_pool
from .jobstore import is_job_root
from .loaderstate import LOADER_KEY, encode_loader, loader_state_of
from .manifest import BlobEntry, Location, Manifest
from .pack import Packer, locate, located, pack_policy
from .repack import repack_store
from .results import SaveResult, check_new_step, checked_meta, SaveFuture
from .store import CheckpointStore, chunk_key, referenced

__all__ = ["CheckpointWriter", "SaveResult", "JOB_WRITER"]


class _Sink:
    """A store plus the digests known to be in it (so the writer never probes the store per chunk)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.lock = store.lock()
        store.tier.cleanup_temp()  # temporaries of a killed writer; safe under the lock
        manifests = store.valid_manifests(warn=False)
        self.known: set[bytes] = referenced(manifests)
        self.steps = {m.step for m in manifests}  # committed, then every step saved (check_new_step)
        self.locations: dict[bytes, Location] = located(manifests)  # the known chunks that are packed
        # chunks `verify --repair` found damaged or missing: not trusted, rewritten when produced
        self.damaged = store.damaged_digests()
        self.known -= self.damaged

    def add_known(self, digests: set[bytes]) -> None:
        """Digests now in the store; damaged markers of rewritten chunks are cleared."""
        self.known |= digests
        for d in digests & self.damaged:
            self.store.clear_damaged(d)
            self.damaged.discard(d)

    def gc(self, keep_last: int | None, protect: "set[int] | frozenset[int]" = frozenset()) -> None:
        if keep_last is not None:
            # marked chunks stay untrusted until a save rewrites them (add_known clears them)
            rep = collect(self.store, keep_last, full_sweep=False, protect=protect)
            self.known, self.locations = rep.live - self.damaged, rep.locations
            # then the packs the kept versions use only partly (it writes once one is a quarter dead)
            self.locations.update(repack_store(self.store).moved)


class _Plan(NamedTuple):
    """What hashing one save's blobs found (:meth:`CheckpointWriter._plan`)."""

    entries: list[BlobEntry]
    digests: list[np.ndarray]  # each blob's chunk digests
    roots: list[bytes]  # each blob's Merkle root
    trees: dict[str, list[np.ndarray]]
    unchanged: int  # see SaveResult.chunks_unchanged
    rewritten: set[bytes]  # see SaveResult.chunks_rewritten
    new: dict[bytes, memoryview]  # chunks the store is not known to hold: digest -> bytes (one per digest)


class _Written(NamedTuple):
    """What :meth:`CheckpointWriter._write_chunks` did: the manifest to commit, and its counters."""

    manifest: Manifest
    bytes_written: int
    chunks_written: int  # distinct chunks written (SaveResult.chunks_written)
    chunks_unchanged: int  # see SaveResult.chunks_unchanged
    chunks_rewritten: int  # see SaveResult.chunks_rewritten
    trees: dict[str, list[np.ndarray]]  # each blob's Merkle levels by its first tensor's name: the next diff's base
    digests: set[bytes]  # the chunks written: the store holds them once the manifest is committed
    locations: dict[bytes, Location]  # where the packed ones of them are
    leaves: list[np.ndarray]  # each blob's chunk digests: what the staging buffer holds


#: the class ``CheckpointWriter(root, comm=...)`` builds: solar.checkpoint.job's JobWriter, which
#: subclasses this writer, puts itself here when imported (solar.checkpoint imports it)
JOB_WRITER: list[type] = []


class CheckpointWriter:
    """Writes incremental, content-addressed, Merkle-indexed checkpoints of state dicts.

    With ``comm=`` (an mpi4py communicator or a torch.distributed process group) every rank of the
    job constructs its writer on one shared ``root`` and the writer is a
    :class:`~solar.checkpoint.job.JobWriter`: one version for the whole job, committed by one
    global manifest (see ``docs/checkpoint-job.md``). Without it, one process owns the root.

    Args:
        root: local directory or fsspec URL of the checkpoint root (created if missing).
        chunk_size: bytes per chunk (default 1 MiB): smaller finds sparser changes, larger keeps the
            manifest and the number of objects small.
        keep_last: after each commit keep only the newest ``keep_last`` versions (``None``: keep all).
        hash: chunk hash, ``"xxh3_128"`` (default) or ``"blake3"`` (needs the blake3 package).
        max_in_flight: saves whose staging copy may exist at once (1: a save waits for the previous
            one to finish hashing and writing; memory is one copy of the state).
        staging: optional fast root (node-local disk) to commit to first; versions are then drained
            to ``root`` in the background.
        io_threads: parallel chunk writes (remote stores and parallel file systems like several).
        storage_options: fsspec options for a URL ``root`` (credentials, endpoint ...).
        pack: ``N`` (bytes): write each save's chunks into rolling pack files of at most ``N`` bytes
            instead of a file each (:mod:`.pack`), so a save makes a few files whatever the tensor
            count; ``True``: only its chunks smaller than ``chunk_size`` (small tensors, blob
            tails), into one pack, full chunks staying files of their own.
        durable: fsync every chunk and manifest of a local root before the next step of the commit
            (default). ``False`` keeps every write atomic against killed processes but not against
            power loss; it saves the fsync time.
        deltas: store a changed chunk as a delta against the previous save's chunk at the same
            place when that is smaller (:mod:`.deltasave`; keeps a host copy of the last save).
        max_chain: with ``deltas``, the most deltas a chunk is rebuilt through before it is
            written whole again.

    Raises:
        CheckpointLockedError: another writer holds ``root`` (or ``staging``).
        CheckpointError: ``root`` is a job root (written with ``comm=``).
    """

    def __new__(cls, *args: Any, comm: Any = None, **kwargs: Any) -> "CheckpointWriter":
        if comm is not None and cls is CheckpointWriter:
            return super().__new__(JOB_WRITER[0])
        return super().__new__(cls)

    def __init__(
        self,
        root: "str | os.PathLike",
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        keep_last: int | None = None,
        hash: str = "xxh3_128",
        max_in_flight: int = 1,
        staging: "str | os.PathLike | None" = None,
        io_threads: int = 4,
        storage_options: dict | None = None,
        durable: bool = True,
        comm: Any = None,
        pack: "bool | int" = False,
        deltas: bool = False,
        max_chain: int = DEFAULT_MAX_CHAIN,
    ) -> None:
        self._check_args(chunk_size, keep_last, max_in_flight)
        if pack and staging is not None:
            raise ConfigError("pack=True and staging= cannot be combined yet; leave one out")
        if deltas and staging is not None:
            raise ConfigError("deltas=True and staging= cannot be combined yet; leave one out")
        self.pack, self._packing = pack, pack_policy(pack, int(chunk_size))
        self.chunk_size = int(chunk_size)
        self.keep_last = keep_last
        self.hash = hash
        self._digest = hasher(hash)
        store = CheckpointStore(root, create=True, durable=durable, **(storage_options or {}))
        if is_job_root(store):
            raise CheckpointError(
                f"{store.root} is a job root, written by every rank of a job (CheckpointWriter(root, comm=...)); "
                "a single-process writer would commit versions the job's ranks do not see. Open it with "
                "CheckpointWriter(root, comm=MPI.COMM_WORLD) in every rank of the job, or use another root")
        self._main = _Sink(store)
        try:
            self._stage = _Sink(CheckpointStore(staging, create=True, durable=durable)) if staging is not None else None
        except BaseException:
            self._main.lock.release()
            raise
        self.root = self._main.store.root
        self._deltas = (DeltaSaver(self.chunk_size, max_chain, self._main.store.valid_manifests(warn=False),
                                   self._digest) if deltas else None)
        first = self._stage or self._main
        latest = first.store.latest()
        self._prev_step = latest.step if latest else None
        self._prev_trees: dict[str, list[np.ndarray]] = {}
        if latest is not None:
            for i, b in enumerate(latest.blobs):
                names = latest.tensors_of_blob(i)
                if names and latest.chunk_size == self.chunk_size:
                    self._prev_trees[names[0]] = merkle.build(latest.blob_digests(i), self._digest)
        self._pool = host_pool(max_in_flight, self.chunk_size, hash)
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="solar-ckpt-persist")
        self._drain = ThreadPoolExecutor(1, thread_name_prefix="solar-ckpt-drain") if self._stage else None
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="solar-ckpt-io")
        self._futures: list[Future] = []
        self._staged: list[Future] = []
        self._undrained: set[int] = set()  # staged versions whose drain to the main root is pending
        if self._stage is not None:
            # versions a killed writer committed to staging but never copied to the main root:
            # drain them first (kept from staging's gc until they are), oldest first
            behind = sorted(set(self._stage.store.versions()) - set(self._main.store.versions()))
            self._undrained.update(behind)
            for s in behind:
                self._futures.append(SaveFuture.following(self._drain.submit(self._redrain, s)))
        self._closed = False
        self._mutex = threading.Lock()

    @staticmethod
    def _check_args(chunk_size: int, keep_last: int | None, max_in_flight: int) -> None:
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(f"chunk_size must be between 1 KiB and 1 GiB, got {chunk_size}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {keep_last}")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")

    # -- public API --
    def save(self, state_dict: Any, step: int, *, blocking: bool = False, lazy: bool = False,
             meta: dict | None = None, loader: Any = None, overwrite: bool | None = None) -> Future:
        """Checkpoint ``state_dict`` as version ``step``; return a future of :class:`SaveResult`.

        Blocks while the state is copied to host memory (and while all staging buffers are busy
        with earlier saves); everything else runs in the background. ``blocking=True`` also waits
        for the commit. The state may be modified as soon as this returns.

        ``lazy=True`` returns before the copy, too (DataStates-LLM's "lazy" snapshot): the copy
        runs in the background while the forward and backward passes, which do not modify the
        weights, go on. The caller must then call :meth:`wait_staged` (or ``future.staged.result()``)
        before anything modifies the state, typically right before ``optimizer.step()``.

        ``loader``: a ``solar.DataLoader`` whose ``state_dict()`` is stored in the same version;
        ``load(root, loader=loader)`` restores it.

        ``overwrite``: a ``step`` the root holds (or a save in flight) is replaced with a warning
        (``None``), without one (``True``), or refused (``False``).

        Raises:
            InputError: a tensor cannot be saved (sparse, meta ...).
            ConfigError: bad ``step``, or a ``meta`` that is not JSON (it is copied here, so changing
                it after this returns does not change the version).
        """
        if self._closed:
            raise CheckpointError(f"CheckpointWriter for {self.root} is closed")
        t0 = time.perf_counter()
        try:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ConfigError(f"step must be a non-negative int, got {step!r}")
            meta = checked_meta(meta, step)
            if loader is not None:
                meta[LOADER_KEY] = encode_loader(loader_state_of(loader))
            flat = flatten(state_dict)
            check_new_step((self._stage or self._main).steps, step, overwrite, self.root)
        except Exception as exc:
            self._refuse(step, exc)  # a job's other ranks learn of it through their save's future
            raise
        staged: Future = Future()
        ticket = self._pool.ticket()
        try:
            if lazy:
                fut = self._persist.submit(self._stage_and_commit, flat, staged, ticket, step, meta)
            else:
                host, slot = self._stage_copy(flat, staged, ticket)
                fut = self._persist.submit(self._commit, flat, host, slot, step, meta, time.perf_counter() - t0)
        except BaseException:  # e.g. Ctrl-C while waiting for a buffer: later saves must not wait for this one
            self._pool.cancel(ticket)  # nothing if it already took its slot
            raise
        if self._drain is not None:
            fut = self._chain(fut)
        fut = SaveFuture.following(fut)
        fut.staged = staged  # type: ignore[attr-defined]
        with self._mutex:
            self._staged = [f for f in self._staged if not f.done()] + [staged]
        with self._mutex:  # finished saves are forgotten; a failed one once its failure was seen
            self._futures = [f for f in self._futures if not f.done() or f.unseen_failure()] + [fut]
        if blocking:
            fut.result()
        return fut

    def _refuse(self, step: Any, exc: BaseException) -> None:
        """``save`` raises ``exc`` before any work (a job writer tells its other ranks too)."""

    def _stage_copy(self, flat: Flat, staged: Future, ticket: int) -> tuple[list[np.ndarray], int]:
        try:
            slot = self._pool.acquire(ticket)  # gives the ticket up if it fails
        except BaseException as exc:
            staged.set_exception(exc)  # a lazy save's wait_staged() must not wait for it
            raise
        try:
            host = self._pool.stage(slot, flat.blobs)
        except BaseException as exc:
            self._pool.release(slot)
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        return host, slot

    def _stage_and_commit(self, flat: Flat, staged: Future, ticket: int, step: int, meta: dict) -> SaveResult:
        t0 = time.perf_counter()
        host, slot = self._stage_copy(flat, staged, ticket)
        return self._commit(flat, host, slot, step, meta, time.perf_counter() - t0)

    def reserve(self, state_dict: Any) -> Future:
        """Allocate the host staging buffers for saves of ``state_dict`` and touch their pages in the
        background, so the first save blocks for the copy alone, not for page faults (DataStates-LLM
        preallocates its host cache the same way). Returns a future done when they are ready; a save
        meanwhile waits for them. Memory: ``max_in_flight`` copies of the state, from now on.

        Call it once, when the state exists (after the model and optimizer are built, e.g. right
        after loading a checkpoint), ideally while the first steps train: without it the first
        save's copy faults in every page of fresh memory, several times the copy itself
        (``bench/checkpoint/job.json``: ``first`` against ``first_reserved``). A later state that
        no longer fits (it grew) gets a larger buffer at its save, or from another ``reserve``.
        A job writer's ranks may call it independently (it is not collective)."""
        return self._pool.reserve(flatten(state_dict).blobs)

    def wait_staged(self) -> None:
        """Wait until every lazy save has copied the state; after this it may be modified."""
        with self._mutex:
            staged = list(self._staged)
        for f in staged:
            f.result()

    def wait(self) -> list[SaveResult]:
        """Wait for every save in flight; return their results, or raise the first failure not
        yet seen (through its future, or an earlier ``wait``)."""
        with self._mutex:
            futures = list(self._futures)
        wait_futures(futures)
        results, errors = [], []
        for f in futures:
            exc = f.unseen_failure()
            if exc is not None:
                errors.append(exc)
            elif Future.exception(f) is None:
                results.append(f.result())
            f.seen = True
        with self._mutex:
            self._futures = [f for f in self._futures if f not in futures]
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        """Wait for pending saves, stop the threads and release the root lock; then raise the
        first failure of a save that :meth:`wait` has not already raised."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for ex in (self._persist, self._drain, self._io):
                if ex is not None:
                    ex.shutdown(wait=True)
            for sink in (self._main, self._stage):
                if sink is not None:
                    sink.lock.release()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:  # a failed save surfaces; it never hides the block's own error
                raise

    # -- background work --
    def _commit(self, flat: Flat, host: list[np.ndarray], slot: int, step: int, meta: dict,
                stage_seconds: float) -> SaveResult:
        t0 = time.perf_counter()
        sink = self._stage or self._main
        out, staged = None, self._pool.staged(slot)
        try:
            out = self._write_chunks(sink, flat, host, step, meta, staged.hashed)
        finally:
            self._pool.release(slot, out.leaves if out is not None else None)
        m = out.manifest
        try:
            manifest_bytes = sink.store.put_manifest(m)
        except BaseException:
            self._drop_orphans(sink, out.digests)
            if self._deltas is not None:
                self._deltas.abort(sink.store)
            raise
        if self._deltas is not None:
            self._deltas.committed()
        sink.add_known(out.digests)
        sink.locations.update(out.locations)
        self._prev_trees, self._prev_step = out.trees, step
        with self._mutex:
            if self._stage is not None:
                self._undrained.add(step)
            # the version just committed survives its own commit, even when its step is older
            # than the keep_last newest (a job relaunched into a root with later steps)
            protect = frozenset(self._undrained | {step})
        # gc runs here, in the one thread that writes this sink, so it never races a dedup decision
        sink.gc(self.keep_last, protect)
        if self._deltas is not None and self.keep_last is not None:
            self._deltas.retain(sink.known | sink.damaged)
        return SaveResult(step=step, logical_bytes=m.logical_bytes, bytes_written=out.bytes_written,
                          chunks_total=m.nchunks, chunks_written=out.chunks_written,
                          chunks_unchanged=out.chunks_unchanged, manifest_bytes=manifest_bytes,
                          stage_seconds=stage_seconds, persist_seconds=time.perf_counter() - t0,
                          root=sink.store.root, chunks_rewritten=out.chunks_rewritten,
                          bytes_staged=staged.bytes_copied)

    def _plan(self, sink: _Sink, flat: Flat, host: list[np.ndarray],
              on_new: Callable[[bytes, memoryview, str, int], None] | None = None,
              hashed: list[np.ndarray | None] | None = None) -> _Plan:
        """Hash every blob, diff its Merkle tree against the previous version's, and find the chunks
        the store is not known to hold (``on_new(digest, bytes, blob name, chunk index)`` is called
        once for each, as it is found). ``hashed``: blobs' digests the staging copy already found."""
        cs, digest = self.chunk_size, self._digest
        entries, all_digests, new_trees, roots = [], [], {}, []
        new: dict[bytes, memoryview] = {}
        unchanged = 0
        rewritten: set[bytes] = set()
        first = 0
        for i, (blob, arr) in enumerate(zip(flat.blobs, host)):
            known = hashed[i] if hashed else None
            leaves = known if known is not None else hash_chunks(arr, cs, digest)
            levels = merkle.build(leaves, digest)
            name = flat.tensors[blob.tensors[0]].name if blob.tensors else f"<blob {i}>"
            # The Merkle diff says what differs from the previous version (the save's statistics).
            # What is written is every chunk the store is not known to hold: a chunk the diff
            # calls unchanged may be gone (gc removed the previous version's chunks, e.g. when it
            # was older than the versions kept, or `verify --repair` deleted or marked it). Such a
            # chunk is counted as rewritten, not unchanged, so the counters never overlap.
            same_arr = np.ones(len(leaves), dtype=bool)
            same_arr[merkle.diff(self._prev_trees.get(name), levels)] = False
            same = same_arr.tolist()  # indexed per chunk below: Python bools, not numpy scalars
            view = memoryview(arr)
            spans = chunk_spans(blob.nbytes, cs)
            for j, row in enumerate(leaves):
                d = row.tobytes()
                if d in sink.known:
                    unchanged += int(same[j])
                    continue
                if same[j]:
                    rewritten.add(d)
                if d in new:
                    continue
                a, e = spans[j]
                new[d] = view[a:e]
                if on_new is not None:
                    on_new(d, new[d], name, j)
            root = merkle.root(levels)
            roots.append(root)
            entries.append(BlobEntry(blob.nbytes, first, len(leaves), root.hex(), blob.device))
            all_digests.append(leaves)
            new_trees[name] = levels
            first += len(leaves)
        return _Plan(entries, all_digests, roots, new_trees, unchanged, rewritten, new)

    def _manifest(self, flat: Flat, plan: _Plan, step: int, meta: dict, written: int, nwritten: int,
                  locations: dict[bytes, Location]) -> Manifest:
        """The manifest of one save (``nwritten`` chunks of ``written`` bytes written by this process)."""
        digest = self._digest
        skeleton_digest = digest(json.dumps(flat.skeleton, sort_keys=True).encode())
        m = Manifest(
            step=step, hash=self.hash, chunk_size=self.chunk_size, skeleton=flat.skeleton, tensors=flat.tensors,
            blobs=plan.entries,
            digests=np.concatenate(plan.digests) if plan.digests else np.zeros((0, 16), np.uint8),
            root=merkle.combine([skeleton_digest, *plan.roots], digest).hex(), created=time.time(),
            parent=self._prev_step, meta=meta, locations=locations,
        )
        m.stats = {"logical_bytes": m.logical_bytes, "bytes_written": written, "chunks_total": m.nchunks,
                   "chunks_written": nwritten, "chunks_unchanged": plan.unchanged}
        if plan.rewritten:
            # only when there are any: the manifests of ordinary saves keep their exact format
            m.stats["chunks_rewritten"] = len(plan.rewritten)
        return m

    def _write_chunks(self, sink: _Sink, flat: Flat, host: list[np.ndarray], step: int, meta: dict,
                      hashed: list[np.ndarray | None]) -> _Written:
        pending: dict[bytes, Future] = {}
        packer = Packer(sink.store, self._io.submit, self._packing.limit)

        def put(d: bytes, view: memoryview, name: str, j: int) -> None:  # written while the next blobs are hashed
            if view.nbytes < self._packing.below:
                packer.add(d, view)  # into a rolling pack (:mod:`.pack`)
            elif self._deltas is not None:
                pending[d] = self._io.submit(self._deltas.put, sink, d, view, name, j)
            else:
                pending[d] = self._io.submit(sink.store.put_chunk, d, view)

        if self._deltas is not None:
            self._deltas.begin(flat)
        plan = self._plan(sink, flat, host, put, hashed)
        wait_futures(pending.values())
        failed = [f.exception() for f in pending.values() if f.exception() is not None]
        try:
            packed = packer.finish()  # deletes its packs and raises on a failure
        except BaseException as exc:
            failed.insert(0, exc)
        else:
            if failed:
                packer.discard()
        if failed:
            self._drop_orphans(sink, [d for d, f in pending.items() if f.exception() is None])
            if self._deltas is not None:
                self._deltas.abort(sink.store)
            raise failed[0]
        locs = packed.locations
        written = sum(f.result() for f in pending.values()) + packed.nbytes
        nwritten = len(pending) + len(locs)
        m = self._manifest(flat, plan, step, meta, written, nwritten, locate(plan.digests, sink.locations, locs))
        if self._deltas is not None:
            self._deltas.written(flat, host, plan.digests)
            self._deltas.annotate(m, {**sink.locations, **locs})
        return _Written(m, written, nwritten, plan.unchanged, len(plan.rewritten), plan.trees,
                        set(pending) | set(locs), locs, plan.digests)

    @staticmethod
    def _drop_orphans(sink: _Sink, digests) -> None:
        """Delete the chunks a failed save wrote: no manifest references them, and left behind
        they would count against the root's byte budget until a full ``gc`` (which the running
        writer's lock prevents), failing every later save of an over-budget root."""
        for d in digests:
            if d not in sink.known:
                try:
                    sink.store.delete_chunk(d)
                except OSError:  # best effort: the next full gc removes what is left
                    pass

    def _chain(self, local: Future) -> Future:
        """A future for the drain to the main root that starts once the local commit is done."""
        out: Future = Future()

        def drain() -> None:
            try:
                res = local.result()
                res.bytes_written = self._drain_version(res.step)
                res.root = self.root
                out.set_result(res)
            except BaseException as exc:  # delivered through the future
                out.set_exception(exc)

        local.add_done_callback(lambda _f: self._drain.submit(drain))
        return out

    def _redrain(self, step: int) -> SaveResult:
        """Drain a version a dead writer left in staging; its result as for any save."""
        t0 = time.perf_counter()
        written = self._drain_version(step)
        m = self._main.store.read_manifest(step)
        st = m.stats or {}
        return SaveResult(step=step, logical_bytes=m.logical_bytes, bytes_written=written, chunks_total=m.nchunks,
                          chunks_written=st.get("chunks_written", 0), chunks_unchanged=st.get("chunks_unchanged", 0),
                          manifest_bytes=0, stage_seconds=0.0, persist_seconds=time.perf_counter() - t0,
                          root=self.root, chunks_rewritten=st.get("chunks_rewritten", 0))

    def _drain_version(self, step: int) -> int:
        src, dst = self._stage.store, self._main
        m = src.read_manifest(step)
        todo = {bytes(r) for r in m.digests} - dst.known

        def copy(d: bytes) -> int:
            data = src.tier.get(chunk_key(d))
            if data is None:
                raise CheckpointError(f"chunk {d.hex()} vanished from staging root {src.root} before it was drained")
            return dst.store.put_chunk(d, data)

        written = sum(self._io.map(copy, sorted(todo)))
        dst.store.put_manifest(m)
        dst.add_known(todo)
        dst.gc(self.keep_last, frozenset({step}))
        with self._mutex:
            self._undrained.discard(step)
        if self.keep_last is not None:
            self._persist.submit(self._gc_staging)  # in the thread that writes the staging root
        return written

    def _gc_staging(self) -> None:
        with self._mutex:
            protect = frozenset(self._undrained)
        self._stage.gc(self.keep_last, protect)
