"""The manifest: the one object whose presence means "this checkpoint version is complete".

Binary layout (``solar-ckpt/1``), little-endian::

    MAGIC (16 B) | header length (u64) | JSON header | chunk digests (n x 16 B)
        | xxh3-128 of all before (16 B) | END (8 B)

A manifest some of whose chunks are stored as deltas (:mod:`.delta`) has the format
``solar-ckpt/2`` and ``features: ["deltas"]``, and a ``deltas`` table (target digest -> base
digest, chain depth, delta bytes) covering every delta it reads, bases of bases included; a reader
of ``solar-ckpt/1`` only refuses it by its format instead of reading a delta as a missing chunk.
Every other manifest keeps the ``solar-ckpt/1`` bytes.

The JSON header holds the step, hash name, chunk size, the state dict's skeleton, the tensor table
(safetensors-style ``dtype``/``shape`` plus blob, byte offset and strides), the blob table (bytes,
first digest row, chunk count, Merkle root) and write statistics. Digests are a raw array, not JSON,
so a manifest indexing 10^5 chunks is ~1.6 MB, parses with one ``np.frombuffer`` and diffs in
milliseconds. The trailing checksum and end marker make a torn or partially written manifest
detectable: :func:`decode` raises :class:`~solar.errors.CorruptDataError` and readers skip it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
import xxhash

from solar.errors import CorruptDataError

from .chunking import DIGEST_SIZE, HASHES, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, chunk_count
from .flatten import DTYPES, TensorRef

__all__ = ["FORMAT", "FORMAT_DELTAS", "FEATURES", "Manifest", "BlobEntry", "Location", "DeltaRef", "encode", "decode",
           "seal", "unseal", "MAX_CHAIN"]

FORMAT = "solar-ckpt/1"
#: the format of a manifest that reads chunks through deltas
FORMAT_DELTAS = "solar-ckpt/2"
#: the extensions this SOLAR reads (a manifest naming another is refused, not misread)
FEATURES = frozenset({"deltas"})
#: the longest delta chain a manifest may declare (a writer's ``max_chain`` is at most this)
MAX_CHAIN = 64
MAGIC = b"SOLAR-CKPT\x00v1\x00\x00\x00"
END = b"SOLAREND"
assert len(MAGIC) == 16


class Location(NamedTuple):
    """Where a packed chunk lives (:mod:`.pack`): its pack's name and its byte range there."""

    pack: str
    offset: int
    length: int


class DeltaRef(NamedTuple):
    """How a chunk stored as a delta is rebuilt: apply the delta object (``nbytes`` long) to chunk
    ``base``, itself whole (``depth`` 1) or a delta of depth ``depth - 1``."""

    base: bytes
    depth: int
    nbytes: int


@dataclass
class BlobEntry:
    """One stored byte span: its size, its rows in the digest array and its Merkle root."""

    nbytes: int
    first: int  # first row in Manifest.digests
    nchunks: int
    root: str  # hex
    device: str = "cpu"

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Manifest:
    step: int
    hash: str
    chunk_size: int
    skeleton: Any
    tensors: list[TensorRef]
    blobs: list[BlobEntry]
    digests: np.ndarray  # (total chunks, 16) uint8
    root: str = ""  # hex digest over the skeleton and every blob root
    created: float = 0.0
    parent: int | None = None
    stats: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    # chunks that live in pack files (digest -> where); every other chunk is a file of its own
    locations: dict[bytes, Location] = field(default_factory=dict)
    # chunks stored as deltas (target digest -> how), bases of bases included
    deltas: dict[bytes, DeltaRef] = field(default_factory=dict)

    def blob_digests(self, i: int) -> np.ndarray:
        b = self.blobs[i]
        return self.digests[b.first:b.first + b.nchunks]

    @property
    def logical_bytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)

    @property
    def nchunks(self) -> int:
        return len(self.digests)

    def tensors_of_blob(self, i: int) -> list[str]:
        return [t.name for t in self.tensors if t.blob == i]


def encode(m: Manifest) -> bytes:
    header = {
        "format": FORMAT_DELTAS if m.deltas else FORMAT,
        "step": m.step,
        "hash": m.hash,
        "chunk_size": m.chunk_size,
        "root": m.root,
        "created": m.created,
        "parent": m.parent,
        "stats": m.stats,
        "meta": m.meta,
        "tensors": [t.to_json() for t in m.tensors],
        "blobs": [b.to_json() for b in m.blobs],
        "skeleton": m.skeleton,
    }
    if m.locations:  # only then: manifests of unpacked saves keep their exact bytes
        header["locations"] = {d.hex(): list(loc) for d, loc in sorted(m.locations.items())}
    if m.deltas:
        header["features"] = ["deltas"]
        header["deltas"] = {d.hex(): [r.base.hex(), r.depth, r.nbytes] for d, r in sorted(m.deltas.items())}
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    digests = np.ascontiguousarray(m.digests, dtype=np.uint8).reshape(-1, DIGEST_SIZE)
    return seal(b"".join([MAGIC, struct.pack("<Q", len(head)), head, digests.tobytes()]))


def seal(body: bytes) -> bytes:
    """``body`` followed by its xxh3-128 and the end marker: a torn or altered copy fails :func:`unseal`."""
    return body + xxhash.xxh3_128_digest(body) + END


def unseal(data: bytes, magic: bytes, where: str) -> memoryview:
    """The body of a sealed object starting with ``magic`` and a u64 header length, checked.

    Raises:
        CorruptDataError: another magic, truncated, torn or altered (names ``where``).
    """
    mv = memoryview(data)
    if len(mv) < len(magic) + 8 + 16 + len(END) or bytes(mv[:16]) != magic:
        raise CorruptDataError(f"{where} is not a SOLAR checkpoint manifest (bad magic or too short: {len(mv)} B)")
    if bytes(mv[-len(END):]) != END:
        # not "the save did not finish": a manifest is committed by one atomic write, so one under
        # its final name without its end can only be damage (or a durable=False save cut by a power loss)
        raise CorruptDataError(f"{where} is truncated or damaged (no end marker)")
    body = mv[:-len(END) - 16]
    if xxhash.xxh3_128_digest(body) != bytes(mv[-len(END) - 16:-len(END)]):
        raise CorruptDataError(f"{where} fails its checksum; it is torn or was altered")
    (hlen,) = struct.unpack_from("<Q", body, 16)
    if hlen > len(body) - 24:
        raise CorruptDataError(f"{where} declares a {hlen} B header in {len(body) - 24} B; "
                               "it is damaged or was crafted")
    return body


def decode(data: bytes, where: str = "manifest") -> Manifest:
    """Parse and check a manifest.

    Raises:
        CorruptDataError: torn, truncated or altered bytes (names ``where``).
    """
    body = unseal(data, MAGIC, where)
    (hlen,) = struct.unpack_from("<Q", body, 16)
    try:
        h = json.loads(bytes(body[24:24 + hlen]))
    except (ValueError, RecursionError) as exc:
        raise CorruptDataError(f"{where} has an unreadable header: {exc}") from exc
    if not isinstance(h, dict) or h.get("format") not in (FORMAT, FORMAT_DELTAS):
        got = h.get("format") if isinstance(h, dict) else None
        raise CorruptDataError(f"{where} has format {got!r:.80}; this SOLAR reads {FORMAT} and {FORMAT_DELTAS}")
    features = h.get("features", [])
    if not isinstance(features, list) or not set(map(str, features)) <= FEATURES:
        raise CorruptDataError(f"{where} uses features {features!r:.80}, which this SOLAR cannot read "
                               f"(it reads {sorted(FEATURES)}); upgrade SOLAR to load it")
    raw = body[24 + hlen:]
    if len(raw) % DIGEST_SIZE:
        raise CorruptDataError(f"{where} has a digest table of {len(raw)} B, not a multiple of {DIGEST_SIZE}")
    digests = np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_SIZE)
    _check_header(h, len(raw) // DIGEST_SIZE, where)
    return Manifest(
        step=h["step"], hash=h["hash"], chunk_size=h["chunk_size"], skeleton=h["skeleton"],
        tensors=[TensorRef(**t) for t in h["tensors"]], blobs=[BlobEntry(**b) for b in h["blobs"]],
        digests=digests, root=h["root"], created=h["created"], parent=h["parent"], stats=h["stats"],
        meta=h.get("meta", {}), locations=_locations(h.get("locations", {}), where),
        deltas=_deltas(h, where),
    )


def _deltas(h: dict, where: str) -> dict[bytes, DeltaRef]:
    """The header's delta table, checked: each base is whole (depth 1) or a delta one shorter, so
    a chain ends, at most :data:`MAX_CHAIN` long, and no delta is larger than the chunk size."""
    raw = h.get("deltas", {})
    if raw and (h["format"] != FORMAT_DELTAS or "deltas" not in h.get("features", [])):
        raise CorruptDataError(f"{where} is invalid: it has a delta table without format {FORMAT_DELTAS} and the "
                               "'deltas' feature. The root is damaged or was crafted; do not use this version")
    try:
        out = {}
        for k, (base, depth, nbytes) in raw.items():
            if not (_is_int(depth) and 1 <= depth <= MAX_CHAIN and _is_int(nbytes)
                    and 0 < nbytes <= h["chunk_size"]):
                raise ValueError(f"entry of chunk {k!r:.40} is {[base, depth, nbytes]!r:.120}")
            out[bytes.fromhex(k)] = DeltaRef(bytes.fromhex(base), depth, nbytes)
        for d, r in out.items():
            if len(d) != 16 or len(r.base) != 16:
                raise ValueError(f"entry of chunk {d.hex()} names digests that are not 16 B")
            below = out.get(r.base)
            if (below.depth if below is not None else 0) != r.depth - 1:
                raise ValueError(f"chunk {d.hex()} has depth {r.depth} over base {r.base.hex()} of depth "
                                 f"{below.depth if below is not None else 0}")
        return out
    except (AttributeError, TypeError, ValueError) as exc:
        raise CorruptDataError(f"{where} is invalid: 'deltas' {exc}. The root is damaged or was crafted; do not use "
                               "this version") from None


def _locations(raw: Any, where: str) -> dict[bytes, Location]:
    """The header's pack locations, checked (a pack name is 32 hex digits, ranges are ints >= 0)."""
    try:
        out = {}
        for k, (pack, offset, length) in raw.items():
            ok = (isinstance(pack, str) and len(pack) == 32 and _is_int(offset) and _is_int(length)
                  and offset >= 0 and 0 <= length <= MAX_CHUNK_SIZE)
            if not ok:
                raise ValueError(f"location of chunk {k!r:.40} is {[pack, offset, length]!r:.80}")
            int(pack, 16)
            out[bytes.fromhex(k)] = Location(pack, offset, length)
        return out
    except (AttributeError, TypeError, ValueError) as exc:
        raise CorruptDataError(f"{where} is invalid: 'locations' {exc}. The root is damaged or was crafted; do not "
                               "use this version") from None


#: the largest element count torch can index (``numel`` is an int64)
_MAX_NUMEL = (1 << 63) - 1
_TENSOR_REQUIRED = {f.name for f in fields(TensorRef) if f.default is MISSING}
_TENSOR_KEYS = {f.name for f in fields(TensorRef)}
_BLOB_REQUIRED = {f.name for f in fields(BlobEntry) if f.default is MISSING}
_BLOB_KEYS = {f.name for f in fields(BlobEntry)}
_HEADER_TYPES: dict[str, tuple] = {
    "step": (int,), "hash": (str,), "chunk_size": (int,), "root": (str,), "created": (int, float),
    "parent": (int, type(None)), "stats": (dict,), "tensors": (list,), "blobs": (list,),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_device(v: Any) -> bool:
    """Whether ``v`` is a device string torch parses (``"cpu"``, ``"cuda:1"``)."""
    if not isinstance(v, str):
        return False
    import torch

    try:
        torch.device(v)
    except (RuntimeError, ValueError):
        return False
    return True


def _check_header(h: Any, ndigests: int, where: str) -> None:
    """Check a decoded header as a schema before anything is built or allocated from it.

    A manifest that passes its checksum is intact, not trustworthy: whoever wrote the root chose
    every number in it (a downloaded checkpoint). Every size a reader allocates or indexes by is
    bounded here by something real, the digest table the manifest carries: each blob's chunk
    count is ``ceil(nbytes / chunk_size)`` and its rows lie inside the table, and each tensor's
    extent lies inside its blob. So a reader's allocations are bounded by the manifest's own size
    times ``chunk_size`` (at most :data:`~.chunking.MAX_CHUNK_SIZE`).

    Raises:
        CorruptDataError: names ``where`` (the version) and the entry that is wrong.
    """

    def bad(entry: str, why: str) -> CorruptDataError:
        return CorruptDataError(
            f"{where} is invalid: {entry} {why}. The root is damaged or was crafted; do not use this version "
            f"(load another step, or get the checkpoint again from a source you trust)")

    if not isinstance(h, dict):
        raise bad("the header", f"is a {type(h).__name__}, not an object")
    missing = sorted(k for k in (*_HEADER_TYPES, "skeleton") if k not in h)
    if missing:
        raise bad("the header", f"lacks {', '.join(missing)}")
    for key, types in _HEADER_TYPES.items():
        v = h[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise bad(f"{key!r}", f"is {v!r:.80}, not {' or '.join(t.__name__ for t in types)}")
    if not isinstance(h.get("meta", {}), dict):
        raise bad("'meta'", "is not an object")
    if h["step"] < 0:
        raise bad("'step'", f"is {h['step']}, not >= 0")
    if h["hash"] not in HASHES:  # a str (checked above), so hashable
        raise bad("'hash'", f"is {h['hash']!r:.80}; known hashes: {sorted(HASHES)}")
    chunk_size = h["chunk_size"]
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:  # the writer's range
        raise bad("'chunk_size'",
                  f"is {chunk_size}, outside the range {MIN_CHUNK_SIZE} .. {MAX_CHUNK_SIZE} a writer uses")
    blobs = h["blobs"]
    for i, b in enumerate(blobs):
        entry = f"blobs[{i}] (blob {i})"
        if not isinstance(b, dict):
            raise bad(entry, "is not an object")
        keys = set(b)
        if not _BLOB_REQUIRED <= keys <= _BLOB_KEYS:
            raise bad(entry, f"has keys {sorted(keys)}; expected {sorted(_BLOB_REQUIRED)} (and optionally "
                             f"{sorted(_BLOB_KEYS - _BLOB_REQUIRED)})")
        for k in ("nbytes", "first", "nchunks"):
            if not _is_int(b[k]) or b[k] < 0:
                raise bad(entry, f"has {k} {b[k]!r:.80}, not an int >= 0")
        if not isinstance(b["root"], str) or not _is_device(b.get("device", "cpu")):
            raise bad(entry, f"has root {b['root']!r:.80} and device {b.get('device')!r:.80}; they must be a hex "
                             "string and a torch device string")
        want = chunk_count(b["nbytes"], chunk_size)
        if b["nchunks"] != want:
            raise bad(entry, f"has nchunks {b['nchunks']}, but its {b['nbytes']} B in chunks of {chunk_size} B "
                             f"are {want}")
        if b["first"] + b["nchunks"] > ndigests:
            raise bad(entry, f"uses digest rows {b['first']} .. {b['first'] + b['nchunks'] - 1}, but the digest "
                             f"table has {ndigests} rows")
    for i, t in enumerate(h["tensors"]):
        _check_tensor(i, t, blobs, bad)


def _check_tensor(i: int, t: Any, blobs: list, bad) -> None:
    """One tensor-table entry: known keys, a known dtype, non-negative geometry, inside its blob."""
    if not isinstance(t, dict):
        raise bad(f"tensors[{i}] (tensor {i})", "is not an object")
    entry = (f"tensors[{i}] (tensor {t['name']!r:.120})" if isinstance(t.get("name"), str)
             else f"tensors[{i}] (tensor {i})")
    keys = set(t)
    if not _TENSOR_REQUIRED <= keys <= _TENSOR_KEYS:
        raise bad(entry, f"has keys {sorted(keys)}; expected {sorted(_TENSOR_REQUIRED)} (and optionally "
                         f"{sorted(_TENSOR_KEYS - _TENSOR_REQUIRED)})")
    if not isinstance(t["name"], str) or not _is_device(t["device"]):
        raise bad(entry, f"has device {t['device']!r:.80}, not a torch device string")
    if not all(isinstance(t.get(k, False), bool) for k in ("parameter", "requires_grad")):
        raise bad(entry, "has a parameter or requires_grad flag that is not a bool")
    if not isinstance(t["dtype"], str) or t["dtype"] not in DTYPES:
        raise bad(entry, f"has dtype {t['dtype']!r:.80}, which is not one SOLAR stores")
    if not _is_int(t["blob"]) or not 0 <= t["blob"] < len(blobs):
        raise bad(entry, f"is in blob {t['blob']!r:.80}, but the version has {len(blobs)} blobs")
    shape, stride = t["shape"], t["stride"]
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
            and all(_is_int(v) and v >= 0 for v in shape + stride)):
        raise bad(entry, f"has shape {shape!r:.80} and stride {stride!r:.80}; they must be lists of equal length "
                         "of ints >= 0")
    itemsize = DTYPES[t["dtype"]].itemsize
    offset = t["offset"]
    if not _is_int(offset) or offset < 0 or offset % itemsize:
        raise bad(entry, f"has offset {offset!r:.80}, not an int >= 0 that is a multiple of its {itemsize} B elements")
    numel = math.prod(shape)
    if numel > _MAX_NUMEL:
        raise bad(entry, f"has shape {shape}, more elements than torch can index")
    end = offset if numel == 0 else offset + (sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * itemsize
    nbytes = blobs[t["blob"]]["nbytes"]
    if end > nbytes:
        raise bad(entry, f"reaches byte {end} of blob {t['blob']}, which has {nbytes} B")
    gshape, goff = t.get("global_shape"), t.get("global_offset")
    if gshape is not None or goff is not None:
        fits = (isinstance(gshape, list) and isinstance(goff, list) and len(gshape) == len(goff) == len(shape)
                and all(_is_int(g) and _is_int(o) and 0 <= o and o + s <= g for s, g, o in zip(shape, gshape, goff)))
        if not fits:
            raise bad(entry, f"has global_shape {gshape!r:.80} and global_offset {goff!r:.80}, which do not place its "
                             f"shape {shape} inside the global tensor")
