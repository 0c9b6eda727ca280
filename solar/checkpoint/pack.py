"""Pack files: all the chunks one save (one rank of a job) writes, in one object.

Git's pack files are the model. One file per chunk makes a save of a model with hundreds of
tensors (each small tensor is a chunk of its own, each 1 MiB of a large one another) a metadata
storm on a parallel file system. ``pack=`` says what goes into packs (:func:`pack_policy`):

- ``pack=N`` (bytes; the job writer's default is :data:`PACK_BYTES`): every new chunk, into rolling
  packs of at most ``N`` bytes, so a save makes ``ceil(new bytes / N)`` packs plus its manifest,
  whatever the tensor count. Each pack is written by an I/O thread while the next fills: from the
  staging copy when its chunks lie back to back there, else assembled in one of ``in_flight``
  buffers the save's packs reuse, so the writer's extra memory is bounded by ``in_flight * N``;
- ``pack=True``: only the chunks smaller than ``chunk_size`` (small tensors, blob tails), into one
  pack per save; full chunks stay files of their own;
- ``pack=False``: a file per chunk (the default of a single-process writer: a root on a local disk).

::

    packs/<2 hex>/<32 hex>    the new chunks' bytes back to back, named by the xxh3-128 of its chunk
                              table (each chunk's digest and length, in order)

A pack is immutable and published atomically, like a chunk. Which pack holds a chunk, and where,
is in the manifest of every version that uses the chunk (``Manifest.locations``: digest ->
``[pack, offset, length]``), so a reader needs no index and a de-duplicated chunk of an older
version is found through the new version's manifest too. A pack lives while a kept version
locates any chunk in it; ``gc`` deletes packs no kept version uses, and ``solar-ckpt gc`` repacks
the ones that are partly dead (:mod:`.repack`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, wait as wait_futures
from typing import Callable, Iterator, NamedTuple

import numpy as np
import xxhash

from solar.cache.base import UnsafePathError
from solar.cache.disk import open_regular
from solar.errors import CheckpointError, ConfigError, CorruptDataError

from .manifest import Location, Manifest
from .store import CheckpointStore

__all__ = ["Location", "pack_key", "write_pack", "read_packed", "pack_names", "delete_pack", "located", "packs_of",
           "PACK_BYTES", "PackPolicy", "pack_policy", "Packer", "stream_limit"]

_PACKS = "packs/"
#: the most bytes of a rolling pack by default: a few packs per rank per save of a large model, and
#: a bounded buffer (two packs) in memory while they are written
PACK_BYTES = 256 << 20


class PackPolicy(NamedTuple):
    """What ``pack=`` asks for: chunks shorter than ``below`` bytes are packed, into packs of at most
    ``limit`` bytes (a chunk longer than ``limit`` makes a pack of its own)."""

    below: float
    limit: float


def pack_policy(pack: "bool | int", chunk_size: int) -> PackPolicy:
    """The :class:`PackPolicy` of a writer's ``pack=`` (see the module doc).

    Raises:
        ConfigError: ``pack`` is neither a bool nor a positive number of bytes.
    """
    if pack is True:
        return PackPolicy(chunk_size, float("inf"))
    if pack is False or pack is None:
        return PackPolicy(0, 0)
    if not isinstance(pack, int) or pack < 1:
        raise ConfigError(f"pack= takes True, False or the most bytes of a pack (an int >= 1), got {pack!r}")
    return PackPolicy(float("inf"), pack)


#: the least bytes of a pack that :func:`stream_limit` makes smaller than the policy's, to write a
#: save on several streams
MIN_STREAM_PACK = 32 << 20


def stream_limit(policy: PackPolicy, chunks: list[tuple[bytes, memoryview]], streams: int) -> float:
    """The bytes per pack that spread ``chunks`` (those of them ``policy`` packs) over ``streams``
    packs written at once: the policy's limit, or less when the save is smaller than ``streams``
    full packs (never under :data:`MIN_STREAM_PACK`), so a save of a few hundred MiB is not one
    pack written by one thread while the others wait."""
    if policy.limit == float("inf"):  # pack=True: one pack per save, as documented
        return policy.limit
    nbytes = sum(v.nbytes for _d, v in chunks if v.nbytes < policy.below)
    return min(policy.limit, max(MIN_STREAM_PACK, -(-nbytes // max(1, streams))))


class PackResult(NamedTuple):
    locations: dict  # digest -> Location of every chunk packed
    nbytes: int  # bytes written
    names: list  # the packs written


class Packer:
    """Rolling packs: chunks added in order fill a pack until the next would pass ``limit`` bytes;
    a full pack is assembled and written by ``submit`` (a thread pool's) while the next fills. At
    most ``in_flight`` packs are written at once (:meth:`add` waits), each assembled in a buffer
    the packs of this packer reuse, so memory stays bounded by that many packs. Chunks are views of
    the staging copy, which must live until :meth:`finish` returns."""

    def __init__(self, store: CheckpointStore, submit: Callable[..., Future], limit: float, in_flight: int = 2) -> None:
        self.store, self.submit, self.limit, self.in_flight = store, submit, limit, in_flight
        self._cur: list[tuple[bytes, memoryview]] = []
        self._cur_bytes = 0
        self._futs: list[Future] = []
        self._spare: list[np.ndarray] = []  # assembly buffers of finished writes
        self._spare_lock = threading.Lock()

    def add(self, digest: bytes, view: memoryview) -> None:
        if self._cur and self._cur_bytes + view.nbytes > self.limit:
            self._flush()
        self._cur.append((digest, view))
        self._cur_bytes += view.nbytes

    def _flush(self) -> None:
        if not self._cur:
            return
        running = [f for f in self._futs if not f.done()]
        if len(running) >= self.in_flight:
            running[0].exception()  # waits for the oldest (a failure is raised by finish)
        self._futs.append(self.submit(self._write, self._cur, self._cur_bytes))
        self._cur, self._cur_bytes = [], 0

    def _write(self, chunks: list[tuple[bytes, memoryview]], nbytes: int) -> tuple[dict[bytes, Location], int]:
        """Write one pack (in an I/O thread), assembled in a spare buffer when one is large enough.
        A fresh ``bytes`` per pack would fault in every page of it first: several times the copy."""
        if _one_span(chunks) is not None:  # written from where they are
            return write_pack(self.store, chunks)
        with self._spare_lock:  # the smallest spare that fits (sorted by size)
            i = next((i for i, b in enumerate(self._spare) if b.nbytes >= nbytes), None)
            buf = self._spare.pop(i) if i is not None else None
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        try:
            return write_pack(self.store, chunks, buf)
        finally:
            with self._spare_lock:
                self._spare.append(buf)
                self._spare.sort(key=lambda b: b.nbytes)
                del self._spare[:-self.in_flight]  # keep the largest

    def finish(self) -> PackResult:
        """Write the last pack, wait for every one; on a failure delete the packs written and raise it."""
        self._flush()
        wait_futures(self._futs)
        failed = [f.exception() for f in self._futs if f.exception() is not None]
        if failed:
            self.discard()
            raise failed[0]
        self._spare.clear()  # the writes are done: their buffers go
        out = PackResult({}, 0, [])
        for f in self._futs:
            locs, n = f.result()
            out.locations.update(locs)
            out = out._replace(nbytes=out.nbytes + n)
            out.names.extend({loc.pack for loc in locs.values()})
        return out

    def discard(self) -> None:
        """Delete the packs written so far (best effort: a full ``gc`` removes what is left)."""
        wait_futures(self._futs)
        self._spare.clear()
        for f in self._futs:
            if f.exception() is None:
                locs, _n = f.result()
                for name in {loc.pack for loc in locs.values()}:
                    try:
                        delete_pack(self.store, name)
                    except OSError:
                        pass


def pack_key(name: str) -> str:
    return f"{_PACKS}{name[:2]}/{name}"


def write_pack(store: CheckpointStore, chunks: list[tuple[bytes, memoryview]],
               into: np.ndarray | None = None) -> tuple[dict[bytes, Location], int]:
    """Write ``chunks`` (digest, bytes) as one pack; return each chunk's location and the bytes written.
    Chunks back to back in one buffer (consecutive chunks of a staging copy) are written from
    there; others are assembled in ``into`` (uint8, large enough) if given, else in new memory.

    Raises:
        CheckpointError: the tier refused the pack (byte budget) or the device is full.
    """
    if not chunks:
        return {}, 0
    spans, at = [], 0
    for d, v in chunks:
        spans.append((d, at, v.nbytes))
        at += v.nbytes
    span = _one_span(chunks)
    if span is not None:
        buf = span
    elif into is not None:
        for (_d, a, n), (_d2, v) in zip(spans, chunks):
            into[a:a + n] = np.frombuffer(v, np.uint8)
        buf = memoryview(into)[:at]
    else:
        buf = b"".join(v for _d, v in chunks)  # one copy, no zero-fill first
    # named by its chunk table: each digest names its chunk's bytes, so this names the pack's bytes
    # without hashing them again
    name = xxhash.xxh3_128_hexdigest(b"".join(d + n.to_bytes(8, "little") for d, _a, n in spans))
    try:
        ok = store.tier.put(pack_key(name), buf)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint pack {name} ({at} B, {len(chunks)} chunks) to "
                              f"{store.root}: {exc}") from exc
    if not ok:
        raise CheckpointError(f"checkpoint root {store.root} is over its byte budget writing pack {name} "
                              f"({at} B); run `solar-ckpt gc {store.root} --keep-last K` or raise the budget")
    return {d: Location(name, a, n) for d, a, n in spans}, at


def _one_span(chunks: list[tuple[bytes, memoryview]]) -> memoryview | None:
    """The chunks' bytes as one view of the buffer they lie in, back to back; else None."""
    base = chunks[0][1].obj
    try:
        whole = np.frombuffer(base, np.uint8)
    except (TypeError, ValueError):  # not one flat buffer
        return None
    origin = whole.ctypes.data
    start = at = np.frombuffer(chunks[0][1], np.uint8).ctypes.data - origin
    for _d, v in chunks:
        if v.obj is not base or np.frombuffer(v, np.uint8).ctypes.data - origin != at:
            return None
        at += v.nbytes
    if start < 0 or at > whole.nbytes:
        return None
    return memoryview(whole)[start:at]


def read_packed(store: CheckpointStore, digest: bytes, loc: Location, out: memoryview) -> int:
    """Read a packed chunk into ``out``; return the bytes read (fewer if the pack is short).

    Raises:
        CorruptDataError: the pack is missing.
    """
    key = pack_key(loc.pack)
    if store.local_dir is not None:
        try:
            fd = open_regular(store.tier.file_path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptDataError(f"pack {loc.pack} holding chunk {digest.hex()} is missing from {store.root}") \
                from None
        except UnsafePathError as exc:  # a planted symlink or special file: never read through
            raise CorruptDataError(f"pack {loc.pack} holding chunk {digest.hex()} in {store.root}: {exc.filename} "
                                   f"{exc.strerror}; nothing was read through it: get the checkpoint again from "
                                   "a source you trust") from None
        try:
            return os.preadv(fd, [out[:loc.length]], loc.offset)
        finally:
            os.close(fd)
    data = store.tier.get(key)
    if data is None:
        raise CorruptDataError(f"pack {loc.pack} holding chunk {digest.hex()} is missing from {store.root}")
    piece = memoryview(data)[loc.offset:loc.offset + loc.length]
    out[:piece.nbytes] = piece
    return piece.nbytes


def pack_names(store: CheckpointStore) -> Iterator[str]:
    for key in store.tier.keys_with_prefix(_PACKS):
        name = str(key).rpartition("/")[2]
        if len(name) == 32:
            yield name


def delete_pack(store: CheckpointStore, name: str) -> bool:
    return store.tier.delete(pack_key(name))


def located(manifests: list[Manifest]) -> dict[bytes, Location]:
    """Where the given versions' packed chunks are (the newest version's word wins)."""
    out: dict[bytes, Location] = {}
    for m in manifests:
        out.update(m.locations)
    return out


def packs_of(manifests: list[Manifest]) -> set[str]:
    """The packs the given versions use."""
    return {loc.pack for m in manifests for loc in m.locations.values()}


def locate(digests: list, *maps: dict[bytes, Location]) -> dict[bytes, Location]:
    """The locations a manifest records: of its digest rows (arrays of 16-byte rows), those packed
    according to ``maps`` (later maps win)."""
    maps = tuple(m for m in maps if m)
    if not maps or not digests:
        return {}
    out: dict[bytes, Location] = {}
    for arr in digests:
        raw = arr.tobytes()
        for i in range(0, len(raw), 16):
            d = raw[i:i + 16]
            for m in maps:
                if d in m:
                    out[d] = m[d]
    return out
