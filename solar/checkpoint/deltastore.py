"""Delta objects in a root, and rebuilding any chunk of a version (whole, packed, or through its deltas).

Layout beside ``chunks/`` and ``packs/``::

    deltas/<2 hex>/<target hex><base hex>   one delta object (:mod:`.delta`): chunk target as a delta of base

Named by both digests, so a delta is immutable like a chunk: the same target rewritten against
another base (after ``verify --repair`` marked it, or after ``gc`` removed it) is another object,
and the versions that read the first one keep reading it. Published atomically (the tier's
temporary + rename), so a killed writer leaves either nothing or the whole object under its name.

:func:`rebuild` reads one chunk of a manifest and checks every piece on the way: a whole chunk
against its digest; a delta chunk once rebuilt, against its own digest (taken from the verified
manifest, that one check covers the base and every delta applied to it). Only when it fails is the
chain replayed with the base and every step hashed, to name what is wrong: a delta whose base is
missing or damaged is reported naming the chunk and the base.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, NamedTuple

from solar.cache.base import TierFullError, UnsafePathError
from solar.cache.disk import open_regular
from solar.errors import CheckpointError, CorruptDataError

from .chunking import MAX_CHUNK_SIZE
from .delta import DeltaFormatError, apply
from .manifest import DeltaRef, Manifest
from .pack import read_packed
from .store import CheckpointStore

__all__ = ["delta_key", "put_delta", "get_delta", "delete_delta", "delta_keys", "rebuild", "ChunkReadError"]

_DELTAS = "deltas/"
#: no delta object is larger than the largest chunk (a bigger file is not one: reported as missing)
_MAX_DELTA = MAX_CHUNK_SIZE


class ChunkReadError(Exception):
    """Why a chunk could not be rebuilt; ``what`` completes "chunk X of step S ...", the reader names the tensors."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def delta_key(target: bytes, base: bytes) -> str:
    t = target.hex()
    return f"{_DELTAS}{t[:2]}/{t}{base.hex()}"


def put_delta(store: CheckpointStore, target: bytes, base: bytes, data: bytes) -> int:
    """Store one delta object; return the bytes written.

    Raises:
        CheckpointError: the tier refused it (byte budget) or the device is full.
    """
    try:
        ok = store.tier.put(delta_key(target, base), data)
    except (TierFullError, OSError) as exc:
        raise CheckpointError(f"cannot write checkpoint delta of chunk {target.hex()} to {store.root}: {exc}") from exc
    if not ok:
        raise CheckpointError(f"checkpoint root {store.root} is over its byte budget writing the delta of chunk "
                              f"{target.hex()} ({len(data)} B); run `solar-ckpt gc {store.root} --keep-last K` or "
                              "raise the budget")
    return len(data)


def get_delta(store: CheckpointStore, target: bytes, base: bytes) -> bytes | None:
    """The delta object, or ``None`` if it is missing (a local root's file is read directly, as packs are)."""
    key = delta_key(target, base)
    if store.local_dir is None:
        return store.tier.get(key)
    try:
        fd = open_regular(store.tier.file_path(key))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnsafePathError as exc:  # a planted symlink or special file: never read through
        raise CorruptDataError(f"delta {target.hex()} (against {base.hex()}) in {store.root}: {exc.filename} "
                               f"{exc.strerror}; nothing was read through it: get the checkpoint again from a "
                               "source you trust") from None
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0) if size <= _MAX_DELTA else None
    finally:
        os.close(fd)


def delete_delta(store: CheckpointStore, target: bytes, base: bytes) -> bool:
    return store.tier.delete(delta_key(target, base))


def delta_keys(store: CheckpointStore) -> Iterator[tuple[bytes, bytes]]:
    """Every stored delta object as ``(target, base)``."""
    for key in store.tier.keys_with_prefix(_DELTAS):
        name = str(key).rpartition("/")[2]
        if len(name) == 64:
            try:
                yield bytes.fromhex(name[:32]), bytes.fromhex(name[32:])
            except ValueError:
                continue


def _whole(store: CheckpointStore, m: Manifest, d: bytes, out: memoryview,
           digest: Callable[[memoryview], bytes] | None) -> int:
    """Read whole chunk ``d`` into ``out``, checked against its digest unless ``digest`` is ``None``."""
    loc = m.locations.get(d) if m.locations else None
    try:
        n = read_packed(store, d, loc, out) if loc else store.read_chunk_into(d, out)
    except CorruptDataError as exc:  # missing, or its file refused (a planted symlink: its message says)
        raise ChunkReadError(f"is missing or has the wrong size ({exc})") from None
    except ValueError:  # longer than expected
        raise ChunkReadError("is missing or has the wrong size") from None
    if n != out.nbytes:
        raise ChunkReadError(f"has {n} B instead of {out.nbytes} B")
    if digest is not None and digest(out) != d:
        raise ChunkReadError("fails its hash (the stored bytes changed)")
    return n


class _Link(NamedTuple):
    target: bytes
    ref: DeltaRef


def rebuild(store: CheckpointStore, m: Manifest, d: bytes, out: memoryview,
            digest: Callable[[memoryview], bytes], *, verify: bool = True) -> int:
    """Read chunk ``d`` of version ``m`` into ``out`` (exactly its size), checked; return the bytes read.

    A whole chunk is checked against its digest (its size only, with ``verify=False``).

    A delta chunk: the whole chunk its chain ends in is read (its size checked), every delta of the
    chain is applied (each checks it is a delta against the base the manifest names), and the result
    is checked against ``d``: one hash per chunk, as for a whole chunk. The base and the chunks
    between are not hashed (a wrong byte in any of them makes the last check fail); only if that
    check fails is the chain replayed, hashing the base and each step, to name what is wrong.

    Raises:
        ChunkReadError: the chunk, its delta or a base of it is missing or damaged (says which).
    """
    chain: list[_Link] = []
    x = d
    while m.deltas and x in m.deltas:  # ends: decode checked the depths step down to a whole chunk
        chain.append(_Link(x, m.deltas[x]))
        x = m.deltas[x].base
    if not chain:
        return _whole(store, m, d, out, digest if verify else None)
    n = _base(store, m, x, chain, out, None)
    for link in reversed(chain):
        n += _apply(store, link, out, d)
    if digest(out) != d:
        _name_bad_delta(store, m, x, chain, out, digest, d)
    return n


def _base(store: CheckpointStore, m: Manifest, x: bytes, chain: list[_Link], out: memoryview,
          digest: Callable[[memoryview], bytes] | None) -> int:
    """Read whole chunk ``x`` a chain starts from into ``out`` (hashed if ``digest``), naming it as the base."""
    try:
        return _whole(store, m, x, out, digest)
    except ChunkReadError as exc:
        via = "" if x == chain[0].ref.base else f" (its chain of {len(chain)} deltas starts at whole chunk {x.hex()})"
        raise ChunkReadError(f"is a delta against base chunk {chain[0].ref.base.hex()}{via}, and base chunk "
                             f"{x.hex()} {exc.what}") from None


def _apply(store: CheckpointStore, link: _Link, out: memoryview, d: bytes) -> int:
    target, ref = link
    what = "" if target == d else f"; on its chain, the delta of chunk {target.hex()}"
    data = get_delta(store, target, ref.base)
    if data is None:
        raise ChunkReadError(f"is a delta against base chunk {ref.base.hex()}{what} whose delta object is missing")
    if len(data) != ref.nbytes:
        raise ChunkReadError(f"is a delta against base chunk {ref.base.hex()}{what} whose delta object has "
                             f"{len(data)} B instead of {ref.nbytes} B")
    try:
        apply(data, out, ref.base)
    except DeltaFormatError as exc:
        raise ChunkReadError(f"is a delta against base chunk {ref.base.hex()}{what} whose delta object is damaged: "
                             f"{exc}") from None
    return len(data)


def _name_bad_delta(store, m, x: bytes, chain: list[_Link], out: memoryview, digest, d: bytes) -> None:
    """The rebuilt chunk failed its hash: replay the chain hashing the base and each step, and raise
    naming the first wrong one."""
    _base(store, m, x, chain, out, digest)
    for link in reversed(chain):
        _apply(store, link, out, d)
        if digest(out) != link.target:
            what = "" if link.target == d else f" (on its chain, the delta of chunk {link.target.hex()})"
            raise ChunkReadError(f"rebuilt from its delta against base chunk {chain[0].ref.base.hex()} fails its "
                                 f"hash{what}: the delta object against {link.ref.base.hex()} changed")
    raise ChunkReadError("fails its hash after its chain was rebuilt twice (the stored bytes changed while read)")
