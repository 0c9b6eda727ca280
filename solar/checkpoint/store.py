"""The chunk store: content-addressed chunks and step-named manifests on one storage tier.

Layout under a root (the same on a local disk, a parallel file system or an object store)::

    chunks/<2 hex>/<32 hex>     one object per distinct chunk, named by its digest (immutable)
    manifests/<step, 20 digits> one manifest per committed version, written last
    .lock                       the writer lock (local roots: flock; remote roots: an exclusive object)

The store reads and writes through a :class:`solar.cache.Tier` built from the cache registry
(:func:`solar.cache.get_tier`: ``"disk"`` for local paths, ``"fsspec"`` for URLs), so the checkpoint
writer and the loader share one implementation of atomic writes and byte budgets.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from fsspec.core import url_to_fs

from solar.cache import get_tier
from solar.cache.base import Tier, TierFullError, UnsafePathError
from solar.errors import CheckpointError, CheckpointLockedError, CorruptDataError
from solar.fileio import UnsafeLockFileError, flock_or_holder, open_lock_file

from .errors import CheckpointReadOnlyError, CheckpointVersionRemovedError, NotACheckpointRootError
from .manifest import Manifest, decode, encode

__all__ = ["CheckpointStore", "ListedManifests", "open_tier", "chunk_key", "manifest_key", "parse_ref", "referenced"]

_MANIFESTS = "manifests/"
_CHUNKS = "chunks/"
#: Empty markers ``damaged/<hex digest>``: chunks ``verify --repair`` found damaged or missing.
#: A writer starting on the root treats them as absent and rewrites them when it produces
#: their bytes (then the marker goes).
_DAMAGED = "damaged/"
#: listings :meth:`CheckpointStore.latest` makes when listed manifests vanish before they are read
_RELISTS = 5


def _local_dir(root: str) -> str | None:
    if root.startswith("file://"):
        return root[len("file://"):]
    return None if "://" in root else root


#: errnos that mean "this process may not write here" (read-only mount, permissions, immutable files)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _is_not_writable(exc: OSError) -> bool:
    return isinstance(exc, PermissionError) or exc.errno in _NOT_WRITABLE


def not_writable(root: str, path: str, exc: OSError) -> CheckpointReadOnlyError:
    """The error for a root this process cannot write.

    It names the root and the path refused, what needs write access, and that reading still works
    without it: a bare ``OSError: [Errno 30] ... /.lock`` would not say whether the checkpoint is
    broken.
    """
    return CheckpointReadOnlyError(
        f"checkpoint root {root} is not writable here ({exc.strerror or exc}: {path}); saving, gc and "
        "`verify --repair` need write access to it: remount it read-write, fix its permissions or use "
        "another root. Reading works as it is (load, log, show, verify, diff, restore, export)")


@contextlib.contextmanager
def _writes_to(root: str, path: str) -> Iterator[None]:
    """Re-raise a refused write inside the block as :func:`not_writable` (other errors pass)."""
    try:
        yield
    except OSError as exc:
        if _is_not_writable(exc):
            raise not_writable(root, exc.filename or path, exc) from exc
        raise


@contextlib.contextmanager
def _no_links_out(root: str, kind: type = CheckpointError) -> Iterator[None]:
    """Re-raise a tier's refusal of a planted symlink or special file as ``kind`` naming the root."""
    try:
        yield
    except UnsafePathError as exc:
        raise kind(f"checkpoint root {root}: {exc.filename} {exc.strerror}. The root holds a symlink or special "
                   "file where SOLAR keeps its own files (it may come from someone else); nothing was read or written "
                   "through it: remove it, or get the checkpoint again from a source you trust") from None


def open_tier(root: "str | os.PathLike | Tier", *, durable: bool = True, **storage_options) -> Tier:
    """The tier a checkpoint root lives on: the registered ``"disk"`` tier for local paths, ``"fsspec"`` for URLs.

    ``durable=False`` skips the fsyncs of a local root: writes stay atomic against crashed
    processes, but a power loss may lose recent versions.

    Raises:
        CheckpointReadOnlyError: a local root that does not exist cannot be created here.
    """
    if isinstance(root, Tier):
        return root
    root = os.fspath(root)
    local = _local_dir(root)
    if local is not None:
        with _writes_to(root, local):
            # (creates the directory if missing); a durable root's chunks leave the page cache
            # once on disk: cached, they made every later save slower (bench/checkpoint/delta.py)
            return get_tier("disk")(local, fsync=durable, drop_written=durable)
    return get_tier("fsspec")(root, storage_options=storage_options or None)


def chunk_key(digest: bytes) -> str:
    h = digest.hex()
    return f"{_CHUNKS}{h[:2]}/{h}"


def manifest_key(step: int) -> str:
    return f"{_MANIFESTS}{int(step):020d}"


def parse_ref(ref: str) -> tuple[str, int | None]:
    """Split ``ROOT@STEP`` into ``(root, step)``; ``ROOT`` alone gives ``(root, None)``."""
    root, sep, step = ref.rpartition("@")
    if sep and step.isdigit():
        return root, int(step)
    return ref, None


def _must_exist(root: str, storage_options: dict) -> None:
    """Readers never create a root: a mistyped path is an error, not a new empty checkpoint."""
    local = _local_dir(root)
    if local is not None:
        exists = os.path.isdir(local)
    else:
        fs, path = url_to_fs(root, **storage_options)
        exists = fs.exists(path) or fs.isdir(path)
    if not exists:
        raise CheckpointError(f"no checkpoint root at {root}; "
                              "check the path (a CheckpointWriter creates it on first use)")


class _Lock:
    """Exclusive writer lock on a root: ``flock`` locally (released by the kernel if the holder
    dies), an exclusive lock object elsewhere (must be removed by hand after a crash)."""

    def __init__(self, store: "CheckpointStore") -> None:
        self.store = store
        self.fd: int | None = None
        self.token: bytes | None = None

    def acquire(self) -> None:
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        local = self.store.local_dir
        if local is not None:
            fd = self._open_local(local)
            holder = flock_or_holder(fd, owner)
            if holder is not None:
                raise CheckpointLockedError(
                    f"checkpoint root {self.store.root} is locked by another writer ({holder}); close that "
                    f"CheckpointWriter (or wait for it) before writing or running gc here")
            self.fd = fd
            return
        tier = self.store.tier
        owner["token"] = uuid.uuid4().hex
        token = json.dumps(owner).encode()
        # an exclusive create where the storage has one (S3's conditional PUT, link(2)): of two
        # writers racing here exactly one gets the lock; elsewhere the read-back below catches
        # most races (a check-then-put cannot catch all of them)
        for _attempt in range(3):
            try:
                created = tier.put_new("LOCK", token)
            except NotImplementedError:  # http:// and other read-only file systems
                raise CheckpointReadOnlyError(f"checkpoint root {self.store.root} is read-only here (its file system "
                                              "cannot write); writing, gc and repair need a writable root") from None
            if created:
                break
            holder = tier.get("LOCK")
            if holder is not None:
                raise CheckpointLockedError(
                    f"checkpoint root {self.store.root} is locked by another writer "
                    f"({holder.decode(errors='replace')}); if that writer crashed, delete {self.store.root}/LOCK, "
                    "then retry")
            # the holder released it between our create and our read: try again
        else:
            raise CheckpointError(f"could not create the lock object {self.store.root}/LOCK: the storage refused it "
                                  "(full?); free space there, then retry")
        if tier.get("LOCK") != token:  # lost a race with another writer (tiers without exclusive create)
            raise CheckpointLockedError(f"checkpoint root {self.store.root} was locked concurrently by another writer")
        self.token = token

    def _open_local(self, local: str) -> int:
        """Open (creating it if needed) the lock file of a local root.

        This is the first write anything does to a root, so a read-only mount or missing
        permissions surface here: as :class:`CheckpointReadOnlyError` naming the root, not as a
        bare ``OSError`` on ``.lock`` (which ``solar-ckpt`` reported as a traceback with exit 1,
        the code for "a check failed").
        """
        path = os.path.join(local, ".lock")
        with _writes_to(self.store.root, path):
            os.makedirs(local, exist_ok=True)
            try:
                return open_lock_file(path)
            except UnsafeLockFileError as exc:
                raise CheckpointError(
                    f"checkpoint root {self.store.root}: its lock file {path} {exc.strerror}; SOLAR does not write "
                    f"through it (the root may come from someone else). A lock file is a regular file a writer "
                    f"creates: check what {path} is, remove it, then retry") from None

    def release(self) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
        elif self.token is not None:
            if self.store.tier.get("LOCK") == self.token:
                self.store.tier.delete("LOCK")
            self.token = None


class CheckpointStore:
    """Chunks and manifests of one checkpoint root.

    Args:
        root: local directory, fsspec URL, or a :class:`~solar.cache.Tier` instance.
    """

    def __init__(self, root: "str | os.PathLike | Tier", *, create: bool = False, durable: bool = True,
                 **storage_options) -> None:
        if not create and not isinstance(root, Tier):
            _must_exist(os.fspath(root), storage_options)
        self.tier = open_tier(root, durable=durable, **storage_options)
        # what messages and results name: the URL as given (an fsspec tier's ``root`` has lost its
        # scheme, so `solar-ckpt ... ROOT` commands built from it would point elsewhere)
        self.root = str(getattr(self.tier, "url", None) or getattr(self.tier, "root", None) or root)
        self.local_dir = self.tier.root if isinstance(self.tier, get_tier("disk")) else None
        self._manifest_cache: dict[int, tuple[int, Manifest]] = {}

    # -- is this a root? --
    def _holds_any(self, prefix: str) -> bool:
        return next(iter(self.tier.keys_with_prefix(prefix)), None) is not None

    def _has_lock(self) -> bool:
        """Whether a writer was started here (its lock file or object exists, held or not)."""
        if self.local_dir is not None:
            return os.path.exists(os.path.join(self.local_dir, ".lock"))
        return self.tier.exists("LOCK")

    def require_root(self) -> None:
        """Refuse a directory no writer ever used (no manifests, chunks or lock), before anything
        writes there.

        Why: ``gc`` and ``verify --repair`` take the writer lock, which creates ``.lock``, so
        pointing them at the parent of a root (``/scratch/run42`` for ``/scratch/run42/ckpt``)
        would leave a lock file there and report success having done nothing. A root whose writer has
        not committed yet passes (its lock says so), and ``gc`` then meets that writer's lock;
        a lock beside roots of its own (the parent of a root, where such a ``gc`` left one) does
        not make a root.

        Raises:
            NotACheckpointRootError: see :meth:`not_a_root`.
        """
        if not (self._holds_any(_MANIFESTS) or self._holds_any(_CHUNKS) or self._fresh_root()):
            raise self.not_a_root()

    def _fresh_root(self) -> bool:
        """A writer's root before its first save: a lock, and no roots below it."""
        return self._has_lock() and not self._roots_below()

    def not_a_root(self) -> NotACheckpointRootError:
        """The error for a directory without a committed version, naming roots found below it."""
        if self._holds_any(_CHUNKS) or self._fresh_root():
            why = "it holds no committed version yet (a writer's first save may still be running)"
        elif self._has_lock():
            why = ("it holds neither manifests/ nor chunks/, only a .lock file (left there by an older "
                   "`solar-ckpt gc` or `verify --repair` pointed at it; it can be removed)")
        else:
            why = "it holds neither manifests/ nor chunks/"
        below = self._roots_below()
        if below:
            hint = f"; roots below it: {', '.join(below)}"
        elif self.local_dir is not None:
            hint = f"; `find {self.root} -maxdepth 3 -type d -name manifests` lists the roots below it"
        else:
            hint = ""
        return NotACheckpointRootError(
            f"{self.root} is not a checkpoint root: {why}. A root is the directory a CheckpointWriter was given, "
            f"holding manifests/ and chunks/{hint}; check the path")

    def _roots_below(self, most: int = 5) -> list[str]:
        """Direct subdirectories of a local root that are roots (hold ``manifests/``), sorted."""
        if self.local_dir is None:
            return []
        try:
            with os.scandir(self.local_dir) as entries:
                found = sorted(e.path for e in entries
                               if e.is_dir() and os.path.isdir(os.path.join(e.path, _MANIFESTS)))
        except OSError:
            return []
        return found[:most] + (["..."] if len(found) > most else [])

    # -- locking --
    def lock(self) -> _Lock:
        lk = _Lock(self)
        lk.acquire()
        return lk

    # -- chunks --
    def has_chunk(self, digest: bytes) -> bool:
        with _no_links_out(self.root):
            return self.tier.exists(chunk_key(digest))

    def put_chunk(self, digest: bytes, data) -> int:
        """Store one chunk; return the bytes written.

        Raises:
            CheckpointError: the tier refused it (byte budget) or the device is full.
        """
        view = memoryview(data).cast("B")
        if not self.tier.persistent:
            view = memoryview(bytes(view))  # a memory tier keeps the object: never the reused staging buffer
        try:
            with _no_links_out(self.root):
                ok = self.tier.put(chunk_key(digest), view)
        except TierFullError as exc:
            raise CheckpointError(f"cannot write checkpoint chunk {digest.hex()} to {self.root}: {exc}") from exc
        if not ok:
            raise CheckpointError(
                f"checkpoint root {self.root} is over its byte budget ({self.tier.capacity_bytes} B) writing chunk "
                f"{digest.hex()} ({view.nbytes} B); run `solar-ckpt gc {self.root} --keep-last K` or raise the budget"
            )
        return view.nbytes

    def chunk_digests(self) -> Iterator[bytes]:
        for key in self.tier.keys_with_prefix(_CHUNKS):
            name = str(key).rpartition("/")[2]
            try:
                yield bytes.fromhex(name)
            except ValueError:
                continue

    def delete_chunk(self, digest: bytes) -> bool:
        with _no_links_out(self.root):
            return self.tier.delete(chunk_key(digest))

    def mark_damaged(self, digest: bytes) -> None:
        with _no_links_out(self.root):
            self.tier.put(f"{_DAMAGED}{digest.hex()}", b"")

    def damaged_digests(self) -> set[bytes]:
        out = set()
        for key in self.tier.keys_with_prefix(_DAMAGED):
            try:
                out.add(bytes.fromhex(str(key)[len(_DAMAGED):]))
            except ValueError:
                continue
        return out

    def clear_damaged(self, digest: bytes) -> None:
        with _no_links_out(self.root):
            self.tier.delete(f"{_DAMAGED}{digest.hex()}")

    def read_chunk_into(self, digest: bytes, out: memoryview) -> int:
        with _no_links_out(self.root, CorruptDataError):
            n = self.tier.read_into(chunk_key(digest), out)
        if n is None:
            raise CorruptDataError(f"chunk {digest.hex()} is missing from {self.root}")
        return n

    # -- manifests --
    def steps(self) -> list[int]:
        """Steps that have a manifest object (complete or not; see :meth:`versions`)."""
        out = []
        for key in self.tier.keys_with_prefix(_MANIFESTS):
            name = str(key).rpartition("/")[2]
            if name.isdigit():
                out.append(int(name))
        return sorted(out)

    def put_manifest(self, m: Manifest) -> int:
        """Commit ``m``: one atomic write, after every chunk it references is stored."""
        data = encode(m)
        try:
            with _no_links_out(self.root):
                ok = self.tier.put(manifest_key(m.step), data)
        except TierFullError as exc:
            raise CheckpointError(f"cannot commit step {m.step} to {self.root}: {exc}; "
                                  "earlier versions are intact") from exc
        if not ok:
            raise CheckpointError(f"checkpoint root {self.root} is over its byte budget committing step {m.step}; "
                                  "earlier versions are intact")
        self._manifest_cache.pop(m.step, None)
        return len(data)

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``.

        Raises:
            CheckpointError: no such version (lists the ones there are).
            CorruptDataError: the manifest is torn or altered.
        """
        m = self.find_manifest(step)
        if m is None:
            raise CheckpointError(f"no checkpoint step {step} in {self.root}; versions: {self.versions() or 'none'}")
        return m

    def find_manifest(self, step: int) -> Manifest | None:
        """The manifest of ``step``, or ``None`` if there is none.

        For steps taken from a listing: one that is gone when read was removed in between by a
        writer's ``keep_last`` retention (or a ``gc``), which is not an error for a reader that
        walks the listing; :meth:`read_manifest` is for a step the caller asked for.

        Raises:
            CorruptDataError: the manifest is torn or altered.
        """
        with _no_links_out(self.root, CorruptDataError):
            data = self.tier.get(manifest_key(step))
        return None if data is None else decode(data, f"manifest of step {step} in {self.root}")

    def delete_manifest(self, step: int) -> bool:
        with _no_links_out(self.root):
            return self.tier.delete(manifest_key(step))

    def listed_manifests(self) -> "ListedManifests":
        """Every manifest the store lists, read: the good ones, the damaged ones, the vanished ones.

        A listed manifest that is gone when read was removed by a writer's ``keep_last`` retention
        (or a ``gc``) after the listing: it is skipped, not reported as "no checkpoint step N". Its
        removal means a newer version was committed, so the store is listed again for steps not
        yet seen (at most ``_RELISTS`` listings); otherwise a root whose only version was replaced
        while being listed would look empty.
        """
        out = ListedManifests()
        seen: set[int] = set()
        for _listing in range(_RELISTS):
            vanished = False
            for step in self.steps():
                if step in seen:
                    continue
                seen.add(step)
                try:
                    m = self.find_manifest(step)
                except CorruptDataError as exc:
                    out.damaged.append((step, exc))
                    continue
                if m is None:
                    out.removed.append(step)
                    vanished = True
                else:
                    out.good.append(m)
            if not vanished:
                break
        out.good.sort(key=lambda m: m.step)
        out.damaged.sort(key=lambda e: e[0])
        return out

    def valid_manifests(self, *, warn: bool = True) -> list[Manifest]:
        """Manifests that decode and pass their checksum, oldest first; torn ones are skipped, and
        so are listed ones removed by retention before they could be read (see :meth:`listed_manifests`)."""
        listed = self.listed_manifests()
        if warn:
            for _step, exc in listed.damaged:
                warnings.warn(f"ignoring incomplete checkpoint: {exc}", stacklevel=2)
        return listed.good

    def versions(self) -> list[int]:
        return [m.step for m in self.valid_manifests(warn=False)]

    def latest(self) -> Manifest | None:
        """The newest complete version; newer manifests failing their checksum are skipped, with
        a warning naming them (``solar-ckpt verify`` reports them as problems).

        A listed manifest that is gone when read was removed by a writer's ``keep_last`` retention
        in between, which means a newer version was committed: the store is listed again (falling
        back to an older listed step would pick a version that retention is removing too).

        Raises:
            CheckpointVersionRemovedError: versions vanished on every one of ``_RELISTS`` listings.
        """
        for _listing in range(_RELISTS):
            for step in reversed(self.steps()):
                try:
                    m = self.find_manifest(step)
                except CorruptDataError as exc:
                    warnings.warn(f"skipping checkpoint step {step}: {exc}", stacklevel=2)
                    continue
                if m is None:
                    break  # removed since listed: list again
                return m
            else:
                return None
        raise CheckpointVersionRemovedError(
            f"the newest version of {self.root} was removed while it was being opened, {_RELISTS} times in a row: a "
            "CheckpointWriter with keep_last is committing there faster than versions can be read; load again, "
            "or give the writer a larger keep_last")

    def holds(self, m: Manifest) -> bool:
        """Whether the manifest ``m`` was read from is still stored (not removed or replaced).

        ``gc`` deletes a version's manifest before its chunks, so a chunk missing while its manifest
        is still here is damage, and one whose manifest is gone was collected while being read.
        """
        try:
            with _no_links_out(self.root, CorruptDataError):
                data = self.tier.get(manifest_key(m.step))
        except CorruptDataError:
            return True  # still there, replaced by a link: damage, reported as such
        if data is None:
            return False
        try:
            return decode(data).root == m.root
        except CorruptDataError:
            return True  # still there, damaged: what went wrong is damage, reported as such

    def resolve(self, step: int | None) -> Manifest:
        if step is None:
            m = self.latest()
            if m is None:
                raise CheckpointError(f"no complete checkpoint in {self.root}; nothing to load")
            return m
        return self.read_manifest(step)


@dataclass
class ListedManifests:
    """What :meth:`CheckpointStore.listed_manifests` found, each list oldest first."""

    good: list[Manifest] = field(default_factory=list)
    damaged: list[tuple[int, CorruptDataError]] = field(default_factory=list)  # (step, why) failing their checksum
    removed: list[int] = field(default_factory=list)  # listed, then removed before they could be read


def referenced(manifests: list[Manifest]) -> set[bytes]:
    """Every chunk digest the given manifests reference."""
    out: set[bytes] = set()
    for m in manifests:
        raw = np.ascontiguousarray(m.digests).tobytes()
        out.update(raw[i:i + 16] for i in range(0, len(raw), 16))
    return out
