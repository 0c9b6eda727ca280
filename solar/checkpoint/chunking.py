"""Fixed-size chunking and chunk hashing straight from host memory (no ``tobytes`` copies).

A blob is cut into ``chunk_size`` pieces (the last one shorter); each piece is hashed through a
``memoryview`` slice, so hashing runs at the hash function's speed (XXH3-128 does several GB/s per
core) instead of at ``memcpy`` speed plus allocation. Digests are 16 bytes whatever the hash, so
manifests and trees stay fixed-width numpy arrays.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from solar.errors import ConfigError, MissingDependencyError

__all__ = ["DIGEST_SIZE", "HASHES", "hasher", "hash_chunks", "chunk_spans", "chunk_count", "Span", "ChunkSpans",
           "DEFAULT_CHUNK_SIZE", "MIN_CHUNK_SIZE", "MAX_CHUNK_SIZE"]

DIGEST_SIZE = 16
DEFAULT_CHUNK_SIZE = 1 << 20  # 1 MiB: 1% of a 1 GiB state is ~10 chunks; 1e5 chunks index 100 GiB
#: the largest chunk a manifest may declare: one chunk is read into one buffer, so this bounds
#: what a single chunk read allocates (a manifest is checked against it before anything is read)
MAX_CHUNK_SIZE = 1 << 30
#: the smallest: below it the 16 B digest per chunk stops being small next to the chunk
MIN_CHUNK_SIZE = 1 << 10


def _xxh3_128() -> Callable[[memoryview], bytes]:
    import xxhash

    return xxhash.xxh3_128_digest


def _blake3() -> Callable[[memoryview], bytes]:
    try:
        from blake3 import blake3
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("hash 'blake3' needs the blake3 package: pip install blake3") from exc
    return lambda data: blake3(data).digest(length=DIGEST_SIZE)


#: hash name (recorded in every manifest) -> factory of ``digest(bytes-like) -> 16 bytes``.
HASHES: dict[str, Callable[[], Callable[[memoryview], bytes]]] = {"xxh3_128": _xxh3_128, "blake3": _blake3}


def hasher(name: str) -> Callable[[memoryview], bytes]:
    """The 16-byte digest function called ``name``.

    Raises:
        ConfigError: unknown hash name.
    """
    try:
        factory = HASHES[name]
    except KeyError:
        raise ConfigError(f"unknown checkpoint hash {name!r}; choose one of {sorted(HASHES)}") from None
    return factory()


class Span(NamedTuple):
    """Bytes ``[start, end)`` of one chunk in its blob."""

    start: int
    end: int


def chunk_count(nbytes: int, chunk_size: int) -> int:
    """How many fixed chunks an ``nbytes`` buffer has (0 for an empty one)."""
    return -(-nbytes // chunk_size)


class ChunkSpans(Sequence[Span]):
    """The fixed chunks of an ``nbytes`` buffer, computed on demand.

    Lazy so that its memory does not grow with the chunk count: a manifest's sizes come from
    whoever wrote it, and a materialized list of 2^30 spans was an out-of-memory kill.
    """

    __slots__ = ("nbytes", "chunk_size")

    def __init__(self, nbytes: int, chunk_size: int) -> None:
        if chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
        self.nbytes, self.chunk_size = nbytes, chunk_size

    def __len__(self) -> int:
        return chunk_count(self.nbytes, self.chunk_size)

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        n = len(self)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"chunk {j} of {n}")
        a = j * self.chunk_size
        return Span(a, min(a + self.chunk_size, self.nbytes))

    def __iter__(self) -> Iterator[Span]:
        for a in range(0, self.nbytes, self.chunk_size):
            yield Span(a, min(a + self.chunk_size, self.nbytes))


def chunk_spans(nbytes: int, chunk_size: int) -> ChunkSpans:
    """The ``Span(start, end)`` of each fixed chunk of an ``nbytes`` buffer (none for an empty one), lazily."""
    return ChunkSpans(nbytes, chunk_size)


def hash_chunks(buf, chunk_size: int, digest: Callable[[memoryview], bytes]) -> np.ndarray:
    """Digests of the fixed chunks of ``buf`` (any C-contiguous bytes-like), as an ``(n, 16)`` uint8 array."""
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    view = memoryview(buf).cast("B")
    out = bytearray()
    for a in range(0, view.nbytes, chunk_size):
        out += digest(view[a:a + chunk_size])
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(-1, DIGEST_SIZE)
