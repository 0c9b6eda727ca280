"""The manifest: the one object whose presence means "this checkpoint version is complete".

Binary layout (``solar-ckpt/1``), little-endian::

    MAGIC (16 B) | header length (u64) | JSON header | chunk digests (n x 16 B) | xxh3-128 of all before (16 B) | END (8 B)

The JSON header holds the step, hash name, chunk size, the state dict's skeleton, the tensor table
(safetensors-style ``dtype``/``shape`` plus blob, byte offset and strides), the blob table (bytes,
first digest row, chunk count, Merkle root) and write statistics. Digests are a raw array, not JSON,
so a manifest indexing 10^5 chunks is ~1.6 MB, parses with one ``np.frombuffer`` and diffs in
milliseconds. The trailing checksum and end marker make a torn or partially written manifest
detectable: :func:`decode` raises :class:`~solar.errors.CorruptDataError` and readers skip it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from solar.errors import CorruptDataError

from .chunking import DIGEST_SIZE
from .flatten import TensorRef

__all__ = ["FORMAT", "Manifest", "BlobEntry", "encode", "decode"]

FORMAT = "solar-ckpt/1"
MAGIC = b"SOLAR-CKPT\x00v1\x00\x00\x00"
END = b"SOLAREND"
assert len(MAGIC) == 16


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
        "format": FORMAT,
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
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    digests = np.ascontiguousarray(m.digests, dtype=np.uint8).reshape(-1, DIGEST_SIZE)
    body = b"".join([MAGIC, struct.pack("<Q", len(head)), head, digests.tobytes()])
    return body + xxhash.xxh3_128_digest(body) + END


def decode(data: bytes, where: str = "manifest") -> Manifest:
    """Parse and check a manifest.

    Raises:
        CorruptDataError: torn, truncated or altered bytes (names ``where``).
    """
    mv = memoryview(data)
    if len(mv) < len(MAGIC) + 8 + 16 + len(END) or bytes(mv[:16]) != MAGIC:
        raise CorruptDataError(f"{where} is not a SOLAR checkpoint manifest (bad magic or too short: {len(mv)} B)")
    if bytes(mv[-len(END):]) != END:
        # not "the save did not finish": a manifest is committed by one atomic write, so one under
        # its final name without its end can only be damage (or a durable=False save cut by a power loss)
        raise CorruptDataError(f"{where} is truncated or damaged (no end marker)")
    body = mv[:-len(END) - 16]
    if xxhash.xxh3_128_digest(body) != bytes(mv[-len(END) - 16:-len(END)]):
        raise CorruptDataError(f"{where} fails its checksum; it is torn or was altered")
    (hlen,) = struct.unpack_from("<Q", body, 16)
    try:
        h = json.loads(bytes(body[24:24 + hlen]))
    except ValueError as exc:
        raise CorruptDataError(f"{where} has an unreadable header: {exc}") from exc
    if h.get("format") != FORMAT:
        raise CorruptDataError(f"{where} has format {h.get('format')!r}; this SOLAR reads {FORMAT}")
    raw = body[24 + hlen:]
    if len(raw) % DIGEST_SIZE:
        raise CorruptDataError(f"{where} has a digest table of {len(raw)} B, not a multiple of {DIGEST_SIZE}")
    digests = np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_SIZE)
    return Manifest(
        step=h["step"], hash=h["hash"], chunk_size=h["chunk_size"], skeleton=h["skeleton"],
        tensors=[TensorRef(**t) for t in h["tensors"]], blobs=[BlobEntry(**b) for b in h["blobs"]],
        digests=digests, root=h["root"], created=h["created"], parent=h["parent"], stats=h["stats"], meta=h.get("meta", {}),
    )
