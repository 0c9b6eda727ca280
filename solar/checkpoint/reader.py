"""Restore any version straight from its manifest and the chunk store.

A chunk stored as a delta (``deltas=True`` writers) is rebuilt from its base through a chain of at
most ``max_chain`` deltas (:mod:`.deltastore`); every other chunk is read as it is stored.
Every chunk is re-hashed as it is read, so :func:`load` never returns corrupt data: a flipped byte
raises :class:`~solar.errors.CorruptDataError` naming the chunk and the tensors it touches.

A writer's ``keep_last`` retention may delete the version being read (its manifest first, then the
chunks no kept version uses). That can only make chunks *missing*, never wrong: chunk files are
named by the digest of their bytes and published atomically (temporary + rename), so a file under
a digest's name holds exactly those bytes, even one deleted and rewritten meanwhile. A missing chunk
of a version whose manifest is gone is reported as removed (or the newest version is read again),
not as damage, and nothing read from the removed version is kept.
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, TypeVar

import torch
from tqdm import tqdm

from solar.errors import CheckpointError, CorruptDataError

from .chunking import chunk_spans, hasher
from .comm import plain_comm
from .delta import want_kernel
from .deltastore import ChunkReadError, rebuild
from .errors import CheckpointVersionRemovedError
from .flatten import materialize, unflatten
from .jobstore import JobManifest, JobStore, is_job_root
from .loaderstate import LOADER_KEY, decode_loader
from .manifest import Manifest
from .store import CheckpointStore

__all__ = ["load", "list_versions", "Reader", "LATEST_RETRIES", "agreed_step"]

T = TypeVar("T")

#: threads one blob's chunks are read by
READ_THREADS = max(1, min(4, os.cpu_count() or 1))


class _Got(NamedTuple):
    """One chunk read: its bytes, or (``what`` not ``None``) why it could not be."""

    n: int
    digest: bytes = b""
    what: str | None = None


def _target_device(saved: str, map_location: Any) -> torch.device:
    if map_location is None:
        dev = torch.device(saved)
    elif isinstance(map_location, dict):
        dev = torch.device(map_location.get(saved, saved))
    elif callable(map_location):
        dev = _call_map_location(map_location, saved)
    else:
        dev = torch.device(map_location)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"tensors were saved on {saved} but CUDA is not available here; pass map_location='cpu'")
    return dev


def _call_map_location(fn: Callable, saved: str) -> torch.device:
    """The device a ``map_location`` callable maps ``saved`` to, in either form.

    SOLAR's own form maps the saved device string to a device (``lambda loc: "cpu"``).
    ``torch.load``'s form is ``fn(storage, location)`` returning a storage (or ``None`` to keep
    the default), so code ported from ``torch.load`` works unchanged. A callable that
    takes two positional arguments gets ``torch.load``'s arguments (an empty CPU storage, as
    ``torch.load`` passes a CPU-deserialised one) and the device of the storage it returns is used.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the one-argument form
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return torch.device(fn(saved))
    out = fn(torch.UntypedStorage(0), saved)
    if out is None:
        return torch.device(saved)
    if isinstance(out, (str, torch.device)):
        return torch.device(out)
    return out.device


#: how many more times a load of the newest version starts over after the writer's ``keep_last``
#: retention removed the version mid-read (each time a newer one had been committed)
LATEST_RETRIES = 5


class Reader:
    """Reads blobs and tensors of one version, checking every chunk against its digest.

    A writer's ``keep_last`` retention can remove the version while it is being read (manifest
    first, then its chunks). A chunk that goes missing is then not reported as damage: a reader of
    the newest version (``step=None``) starts over on the now-newest one (see :meth:`retry_if_removed`),
    and a reader of an explicit step raises :class:`CheckpointVersionRemovedError`.

    Args:
        root: checkpoint root (path, URL or tier).
        step: version; ``None`` for the newest complete one.
        verify: re-hash chunks as they are read (on by default; the cost is a few percent of a read).
        rank: on a job root (``CheckpointWriter(root, comm=...)``), the rank whose state to read
            (may be left out when one rank saved the version); ignored on a single-process root,
            whose one state every rank loads (the DDP pattern).
    """

    def __init__(self, root: Any, step: int | None = None, *, verify: bool = True, store: CheckpointStore | None = None,
                 storage_options: dict | None = None, rank: int | None = None) -> None:
        self.store = store or CheckpointStore(root, **(storage_options or {}))
        self.requested = step
        self.verify = verify
        self.rank = rank
        self.bytes_read = 0  # chunk bytes read so far
        self.jobs = JobStore(self.store) if is_job_root(self.store) else None
        self.job_manifest: JobManifest | None = None
        self._open(self._resolve(step))

    def _resolve(self, step: int | None) -> Manifest:
        """The manifest of ``step`` (newest: ``None``); on a job root, this rank's part of it."""
        if self.jobs is None:
            return self.store.resolve(step)
        jm = self.jobs.resolve(step)
        rank = self.rank
        if rank is None:
            if jm.world_size != 1:
                raise CheckpointError(
                    f"{self.store.root} is a job root; step {jm.step} was saved by {jm.world_size} ranks: pass "
                    f"rank= (0 .. {jm.world_size - 1}), or comm= in every rank, to load a rank's state")
            rank = 0
        self.job_manifest = jm
        return self.jobs.part(jm, rank)

    def _still_stored(self) -> bool:
        if self.jobs is None:
            return self.store.holds(self.manifest)
        try:
            jm = self.jobs.find_global(self.manifest.step)
        except CorruptDataError:
            return True  # still there, damaged: reported as damage
        return jm is not None and self.job_manifest is not None and jm.root == self.job_manifest.root

    def versions(self) -> list[int]:
        return self.store.versions() if self.jobs is None else self.jobs.versions()

    def loader_state(self) -> dict | None:
        """The data loader's state saved with this version (``save(..., loader=)``), or ``None``."""
        skeleton = self.manifest.meta.get(LOADER_KEY)
        if skeleton is None:
            return None
        return decode_loader(skeleton, f"step {self.manifest.step} of {self.store.root}")

    def _open(self, manifest: Manifest) -> None:
        """Switch to ``manifest``, dropping every blob read for the previous one.

        The blob cache is keyed by blob index, which means nothing across versions: keeping it
        would splice the old version's bytes into the new one.
        """
        self.manifest: Manifest = manifest
        self._digest = hasher(manifest.hash)
        self._kernel_asked = False  # want_kernel told of this version's deltas (on its first read)
        self._blobs: dict[int, torch.Tensor] = {}

    def retry_if_removed(self, read: Callable[[], T]) -> T:
        """``read()``, started over on the now-newest version when retention removed the one read.

        Only for a reader of the newest version (``step=None``), and at most
        :data:`LATEST_RETRIES` times; ``read`` must take everything from ``self.manifest`` and
        :meth:`read_blob` afresh on each call. Nothing from the removed version is kept, so the
        result is always one complete version.
        """
        for attempt in range(LATEST_RETRIES + 1):
            try:
                return read()
            except CheckpointVersionRemovedError as exc:
                if self.requested is not None:
                    raise
                if attempt == LATEST_RETRIES:
                    raise CheckpointVersionRemovedError(
                        f"the newest version of {self.store.root} was removed while it was being read, "
                        f"{LATEST_RETRIES + 1} times in a row (last: step {self.manifest.step}): a CheckpointWriter's "
                        "keep_last retention deletes versions faster than a load reads them. Nothing is corrupt; "
                        "give the writer a larger keep_last, or load while it is not saving") from exc
                self._open(self._resolve(None))
        raise AssertionError("unreachable")  # pragma: no cover

    def corrupt(self, blob: int, digest: bytes, what: str) -> CorruptDataError:
        m = self.manifest
        names = ", ".join(m.tensors_of_blob(blob)) or "(no tensor)"
        return CorruptDataError(
            f"chunk {digest.hex()} of step {m.step} in {self.store.root} {what}; it holds bytes of tensor(s) "
            f"{names}. Run `solar-ckpt verify {self.store.root}` and restore from an older version"
        )

    def removed(self) -> CheckpointVersionRemovedError:
        m = self.manifest
        now = self.versions()
        return CheckpointVersionRemovedError(
            f"step {m.step} of {self.store.root} was removed while it was being read: a CheckpointWriter's keep_last "
            f"retention (or a gc) deleted it after committing newer versions. Nothing is corrupt; load a newer "
            f"version (there now: {now or 'none'}) or give the writer a larger keep_last")

    def _chunk_error(self, blob: int, digest: bytes, what: str) -> CheckpointError:
        """The error for a chunk that cannot be read right: damage only if the version is still stored.

        ``gc`` deletes manifests before chunks, so if the manifest is gone (or replaced), the
        chunk went with the version, deleted by the writer's retention during this read.
        """
        if not self._still_stored():
            return self.removed()
        return self.corrupt(blob, digest, what)

    def read_blob(self, i: int) -> torch.Tensor:
        """Blob ``i`` as a CPU uint8 tensor (verified).

        Raises:
            CorruptDataError: a chunk of this (still stored) version is missing or damaged.
            CheckpointVersionRemovedError: the version was removed while being read.
        """
        if i in self._blobs:
            return self._blobs[i]
        m = self.manifest
        entry = m.blobs[i]
        try:
            # bounded by the manifest (decode checks nbytes against its digest rows and chunk_size),
            # and pages are touched only as chunks arrive: a size the chunks do not back fails on
            # the first short chunk
            buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        except RuntimeError as exc:  # torch reports a refused allocation as RuntimeError
            raise CheckpointError(
                f"cannot allocate blob {i} of step {m.step} in {self.store.root} ({entry.nbytes} B, tensors "
                f"{', '.join(m.tensors_of_blob(i)) or '(none)'}): {str(exc).splitlines()[0]}; load it on a machine "
                "with more memory, or read single tensors with Reader.tensor") from exc
        view = memoryview(buf.numpy()) if entry.nbytes else memoryview(bytearray())
        self._fill(i, view, 0, entry.nbytes)
        self._blobs[i] = buf
        return buf

    def read_span(self, i: int, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of blob ``i`` (verified), reading only the chunks that hold them."""
        cs = self.manifest.chunk_size
        a, e = start // cs * cs, min(-(-end // cs) * cs, self.manifest.blobs[i].nbytes)
        buf = torch.empty(max(e - a, 0), dtype=torch.uint8)
        if e > a:
            self._fill(i, memoryview(buf.numpy()), a, e)
        return buf[start - a:end - a]

    def _fill(self, i: int, view: memoryview, start: int, end: int) -> None:
        """Read the chunks covering bytes ``[start, end)`` of blob ``i`` (chunk-aligned) into ``view``.

        The first chunk is read alone (a version removed since its manifest was read fails there,
        before any other read starts), the others by up to :data:`READ_THREADS` threads (reads,
        hashing, zstd and numpy's loops release the GIL); the first chunk in blob order that cannot
        be read is reported.
        """
        m = self.manifest
        digests = m.blob_digests(i)
        spans = chunk_spans(m.blobs[i].nbytes, m.chunk_size)
        if m.deltas and not self._kernel_asked:
            self._kernel_asked = True
            want_kernel(sum(ref.nbytes for ref in m.deltas.values()))

        def one(j: int) -> _Got:
            d = digests[j].tobytes()
            a, e = spans[j]
            try:  # a delta chunk is rebuilt through its chain, every piece checked
                return _Got(rebuild(self.store, m, d, view[a - start:e - start], self._digest, verify=self.verify))
            except ChunkReadError as exc:
                return _Got(0, d, exc.what)

        def take(got: _Got) -> None:
            if got.what is not None:
                raise self._chunk_error(i, got.digest, got.what)
            self.bytes_read += got.n

        js = range(start // m.chunk_size, -(-end // m.chunk_size))
        if not js:
            return
        take(one(js[0]))
        threads = min(READ_THREADS, len(js) - 1)
        if threads <= 1:
            for j in js[1:]:
                take(one(j))
            return
        pool = ThreadPoolExecutor(threads, thread_name_prefix="solar-ckpt-read")
        try:
            for got in pool.map(one, js[1:]):
                take(got)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def tensor(self, name: str, map_location: Any = "cpu") -> torch.Tensor:
        """One tensor by its flattened name, reading only the chunks of its blob."""
        return self.retry_if_removed(lambda: self._tensor(name, map_location))

    def _tensor(self, name: str, map_location: Any) -> torch.Tensor:
        refs = [t for t in self.manifest.tensors if t.name == name]
        if not refs:
            raise CheckpointError(f"no tensor {name!r} in step {self.manifest.step} of {self.store.root}")
        ref = refs[0]
        buf = self.read_blob(ref.blob)
        dev = _target_device(ref.device, map_location)
        return materialize([ref], {ref.blob: buf if dev.type == "cpu" else buf.to(dev)})[0]

    def state_dict(self, map_location: Any = None, *, progress: bool = False, weights_only: bool = True) -> Any:
        """The whole version as the state dict it was saved from.

        ``weights_only``: see :func:`load`.
        """
        return self.retry_if_removed(lambda: self._state_dict(map_location, progress, weights_only))

    def _state_dict(self, map_location: Any, progress: bool, weights_only: bool) -> Any:
        m = self.manifest
        where = f"step {m.step} of {self.store.root}"
        if weights_only:
            # the skeleton first, with placeholders for the tensors: a pickle off the allow-list (or
            # a malformed value) is refused before any chunk is read. Not with the full unpickler:
            # its pickles' code must run once, as torch.load's would
            unflatten(m.skeleton, [None] * len(m.tensors), where=where)  # type: ignore[list-item]
        buffers = []
        bar = None
        if progress:
            bar = tqdm(total=m.logical_bytes, unit="B", unit_scale=True, desc=f"load step {m.step}", leave=False,
                       disable=None)
        try:
            for i, entry in enumerate(m.blobs):
                buf = self.read_blob(i)
                dev = _target_device(entry.device, map_location)
                buffers.append(buf if dev.type == "cpu" else buf.to(dev))
                if bar is not None:
                    bar.update(entry.nbytes)
        finally:  # a retry after a removed version opens its own bar
            if bar is not None:
                bar.close()
        self._blobs.clear()
        return unflatten(m.skeleton, materialize(m.tensors, buffers), weights_only=weights_only, where=where)


def load(root: "str | os.PathLike", step: int | None = None, map_location: Any = None, *, verify: bool = True,
         storage_options: dict | None = None, weights_only: bool = True, rank: int | None = None,
         comm: Any = None, loader: Any = None) -> Any:
    """Load the state dict of version ``step`` (default: the newest complete one).

    Args:
        root: checkpoint root: local path or fsspec URL.
        step: version to load; ``None`` for the newest whose manifest is complete.
        map_location: like ``torch.load``: a device, a ``{saved: target}`` dict or a callable, either
            ``torch.load``'s ``fn(storage, location)`` or ``fn(location) -> device``.
        verify: re-hash every chunk (default); corrupt data raises instead of being returned.
        storage_options: fsspec options for a URL ``root``.
        weights_only: unpickle the skeleton's pickled values (objects other than tensors and plain
            values) only through an allow-list of safe globals (containers, numbers, numpy arrays
            and RNG states, enums of imported modules), as ``torch.load(weights_only=True)`` does.
            ``False`` unpickles anything, which runs whatever code the pickle names: only for a
            root you trust (one you wrote).
        rank: on a job root, the rank whose state to load (see :class:`Reader`).
        comm: on a job root, called by every rank of the job (an mpi4py communicator or a
            torch.distributed group): each rank loads its own state, and with ``step=None`` all
            load the same version (rank 0 picks the newest and tells the others).
        loader: a ``solar.DataLoader``: the loader state saved in the version (``save(...,
            loader=)``) is given to ``loader.load_state_dict``.

    Raises:
        CheckpointError: no such version, or nothing complete to load.
        CheckpointVersionRemovedError: an explicit ``step`` was removed by a writer's ``keep_last``
            retention while it was being read (with ``step=None`` the load starts over on the
            now-newest version instead, a few times).
        CorruptDataError: a chunk is missing or does not match its digest (names it and its tensors),
            or the manifest is malformed (names the entry).
        UntrustedPickleError: with ``weights_only=True``, a pickled value names a global off the
            allow-list (names the key, the global and the opt-in); nothing was unpickled.
    """
    if comm is not None:
        rank, step = agreed_step(root, step, comm, storage_options, same_world=True)
    reader = Reader(root, step, verify=verify, storage_options=storage_options, rank=rank)
    state = reader.state_dict(map_location, weights_only=weights_only)
    if loader is not None:
        saved = reader.loader_state()
        if saved is None:
            raise CheckpointError(f"step {reader.manifest.step} of {reader.store.root} holds no loader state (it was "
                                  "saved without save(..., loader=)); load it without loader=")
        loader.load_state_dict(saved)
    return state


def agreed_step(root: Any, step: int | None, comm: Any, storage_options: dict | None, *,
                same_world: bool = False) -> tuple[int, int | None]:
    """This rank and the step every rank of ``comm`` loads (rank 0 resolves the newest).

    ``same_world``: refuse, on every rank, a job version saved by another number of ranks (each
    rank loads its own part, and some would have none).
    """
    c = plain_comm(comm)
    found: Any = None
    if c.rank == 0:
        try:
            r = Reader(root, step, storage_options=storage_options, rank=0)
            found = (r.manifest.step, r.job_manifest.world_size if r.job_manifest is not None else None)
        except Exception as exc:  # every rank raises it
            found = f"{type(exc).__name__}: {exc}"
    found = c.bcast(found)
    if isinstance(found, str):
        raise CheckpointError(f"rank 0 found no version to load in {root}: {found}")
    got, world = found
    if same_world and world is not None and world != c.size:
        raise CheckpointError(
            f"step {got} of {root} was saved by {world} ranks and this job has {c.size}: each rank would load its "
            f"own part and some have none. Fill a template with load_into(root, state, comm=...) (sharded state is "
            f"resliced), or load one rank's replicated state with load(root, rank=0, loader=...) (a loader's "
            f"position is global)")
    return c.rank, got


def list_versions(root: "str | os.PathLike", *, storage_options: dict | None = None) -> list[int]:
    """Steps of the complete versions in ``root``, oldest first (torn manifests are ignored); on a job
    root, the versions whose global manifest verifies."""
    store = CheckpointStore(root, **(storage_options or {}))
    return JobStore(store).versions() if is_job_root(store) else store.versions()
