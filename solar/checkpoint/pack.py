"""Pack files: all the chunks one save (one rank of a job) writes, in one object.

Git's pack files are the model. One file per chunk makes a save of a model with hundreds of
tensors (each small tensor is a chunk of its own) a metadata storm on a parallel file system;
with ``pack=True`` a save writes one pack plus its manifest, whatever the tensor count::

    packs/<2 hex>/<32 hex>    the new chunks' bytes back to back, named by the xxh3-128 of its bytes

A pack is immutable and published atomically, like a chunk. Which pack holds a chunk, and where,
is in the manifest of every version that uses the chunk (``Manifest.locations``: digest ->
``[pack, offset, length]``), so a reader needs no index and a de-duplicated chunk of an older
version is found through the new version's manifest too. A pack lives while a kept version
locates any chunk in it; ``gc`` deletes packs no kept version uses (a pack some of whose chunks
are dead stays whole).
"""

from __future__ import annotations

import os
from typing import Iterator

import xxhash

from solar.cache.disk import open_regular
from solar.errors import CheckpointError, CorruptDataError

from .manifest import Location, Manifest
from .store import CheckpointStore

__all__ = ["Location", "pack_key", "write_pack", "read_packed", "pack_names", "delete_pack", "located", "packs_of"]

_PACKS = "packs/"


def pack_key(name: str) -> str:
    return f"{_PACKS}{name[:2]}/{name}"


def write_pack(store: CheckpointStore, chunks: list[tuple[bytes, memoryview]]) -> tuple[dict[bytes, Location], int]:
    """Write ``chunks`` (digest, bytes) as one pack; return each chunk's location and the bytes written.

    Raises:
        CheckpointError: the tier refused the pack (byte budget) or the device is full.
    """
    if not chunks:
        return {}, 0
    buf = bytearray(sum(v.nbytes for _d, v in chunks))
    spans, at = [], 0
    for d, v in chunks:
        buf[at:at + v.nbytes] = v
        spans.append((d, at, v.nbytes))
        at += v.nbytes
    name = xxhash.xxh3_128_hexdigest(buf)
    try:
        ok = store.tier.put(pack_key(name), buf)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint pack {name} ({len(buf)} B, {len(chunks)} chunks) to "
                              f"{store.root}: {exc}") from exc
    if not ok:
        raise CheckpointError(f"checkpoint root {store.root} is over its byte budget writing pack {name} "
                              f"({len(buf)} B); run `solar-ckpt gc {store.root} --keep-last K` or raise the budget")
    return {d: Location(name, a, n) for d, a, n in spans}, len(buf)


def read_packed(store: CheckpointStore, digest: bytes, loc: Location, out: memoryview) -> int:
    """Read a packed chunk into ``out``; return the bytes read (fewer if the pack is short).

    Raises:
        CorruptDataError: the pack is missing.
    """
    key = pack_key(loc.pack)
    if store.local_dir is not None:
        try:
            fd = open_regular(store.tier.path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptDataError(f"pack {loc.pack} holding chunk {digest.hex()} is missing from {store.root}") \
                from None
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


def split_small(chunks: dict[bytes, memoryview], chunk_size: int) -> tuple[list, list]:
    """``(small, full)``: chunks shorter than ``chunk_size`` (small tensors, blob tails) go to a pack,
    full ones stay files of their own (a pack holds no full chunk, so writing it copies only small ones)."""
    small = sorted((d, v) for d, v in chunks.items() if v.nbytes < chunk_size)
    full = sorted((d, v) for d, v in chunks.items() if v.nbytes >= chunk_size)
    return small, full
