"""The writer's side of fine-grained increments (``CheckpointWriter(..., deltas=True)``).

Chunks stay the unit of storage and de-duplication, and the Merkle tree still locates the changed
ones. Inside a changed chunk, the writer compares the new bytes with the previous save's bytes at the
same place and stores a delta (:mod:`.delta`) when that is clearly smaller; otherwise the chunk
whole. For that it keeps a host copy of what it last saved (the *mirror*: one copy of the state,
tagged per chunk with the digest it holds), refreshed only where chunks changed.

A delta is written against a base only if the base is a chunk the store is known to hold (so a
mirror holding bytes of a save that failed is never a base), and only while the chain stays
bounded: at most ``max_chain`` deltas deep and at most one chunk's worth of delta bytes on top of
the whole chunk the chain starts from (its *anchor*), so a restore reads at most about twice a
version's size. Otherwise the chunk is re-based: stored as a delta against the anchor itself
(read back from the store; depth 1, all the changes since the anchor: skip-deltas, as Subversion
stores revisions), or, once that is no longer clearly smaller, written whole: the new anchor.

A writer opened on an existing root starts without a mirror: its first save writes changed chunks
whole (reading the old bytes back would cost a full read of the previous version).

The mirror is refreshed chunk by chunk in the I/O threads, as each new chunk is stored (there its
copy overlaps the other threads' writes and fsyncs), and after the save for the chunks no I/O
thread stored (packed, repeated or already known ones). A chunk that changed clearly densely
(:func:`.delta.clearly_dense`) keeps only a sample of its words there: it would be written whole
again next time, so copying its bytes would cost a dense save a copy of the state for nothing.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch

from solar.errors import ConfigError, CorruptDataError

from .chunking import chunk_count, chunk_spans
from .delta import clearly_dense, element_size, encode, sample_words
from .deltastore import delete_delta, put_delta
from .manifest import MAX_CHAIN, DeltaRef, Manifest
from .pack import read_packed

__all__ = ["DeltaSaver", "DEFAULT_MAX_CHAIN", "check_max_chain"]

#: the default longest delta chain: a restore applies at most this many deltas per chunk
DEFAULT_MAX_CHAIN = 4


def check_max_chain(max_chain: int) -> int:
    if not isinstance(max_chain, int) or isinstance(max_chain, bool) or not 1 <= max_chain <= MAX_CHAIN:
        raise ConfigError(f"max_chain must be an int between 1 and {MAX_CHAIN}, got {max_chain!r}")
    return max_chain


class _Blob(NamedTuple):
    elem: int  # the word changes are found in
    nbytes: int


class _Mirror(NamedTuple):
    data: np.ndarray  # uint8, the blob's bytes as last saved
    digests: np.ndarray  # (n, 16) uint8: the digest of what ``data`` holds at each chunk (zero: nothing)
    samples: dict  # chunk index -> sample_words of a chunk left out of ``data`` (clearly dense)


class _Tried(NamedTuple):
    """What :meth:`DeltaSaver._try_delta` did with a chunk."""

    written: int | None  # bytes written as a delta; None: to be written whole
    dense: bool  # it changed clearly densely
    words: np.ndarray | None  # its sample_words, when taken


class DeltaSaver:
    """Per-writer state of delta saves; ``put`` runs in the writer's I/O threads, the rest in its
    save thread (one save at a time)."""

    def __init__(self, chunk_size: int, max_chain: int, manifests: Iterable[Manifest],
                 digest: Callable[[memoryview], bytes]) -> None:
        self.chunk_size = chunk_size
        self._digest = digest
        self.max_chain = check_max_chain(max_chain)
        self.chains: dict[bytes, DeltaRef] = {}  # committed chunks stored as deltas
        for m in manifests:
            self.chains.update(m.deltas)
        self._mirror: dict[str, _Mirror] = {}
        self._blobs: dict[str, _Blob] = {}
        self._fresh: dict[bytes, DeltaRef] = {}  # this save's deltas (a job's: every rank's)
        self._mine: set[bytes] = set()  # those this process wrote
        self._whole: set[bytes] = set()  # this save's chunks written whole
        self._changed = 0
        self._lock = threading.Lock()

    def load_chains(self, chains: dict) -> None:
        """Chains read elsewhere (a job's rank 0): digest -> (base, depth, nbytes)."""
        self.chains.update({d: DeltaRef(*ref) for d, ref in chains.items()})

    # -- one save --
    def begin(self, flat) -> None:
        """Start a save of ``flat``: its blobs' element sizes, by the name the writer keys blobs by."""
        self._fresh, self._whole, self._changed, self._mine = {}, set(), 0, set()
        self._blobs = {}
        self._left: dict[str, set[int]] = {}  # chunks this save left out of the mirror
        for i, blob in enumerate(flat.blobs):
            name = flat.tensors[blob.tensors[0]].name if blob.tensors else f"<blob {i}>"
            itemsize = flat.tensors[blob.tensors[0]].itemsize if blob.tensors else 1
            self._blobs[name] = _Blob(element_size(self.chunk_size, itemsize), blob.nbytes)
            mirror = self._mirror.get(name)
            if mirror is None or mirror.data.nbytes != blob.nbytes:
                # filled as the chunks are stored; a zero row holds no chunk (never a known digest).
                # torch's allocator, as the staging buffer's: numpy asks for transparent huge pages,
                # whose first touch stalls in memory compaction on a host whose memory is fragmented
                self._mirror[name] = _Mirror(torch.empty(blob.nbytes, dtype=torch.uint8).numpy(),
                                             np.zeros((chunk_count(blob.nbytes, self.chunk_size), 16), np.uint8), {})

    def _chain(self, d: bytes) -> tuple[int, bytes]:
        """The delta bytes read on top of the whole chunk to rebuild ``d``, and that chunk (the anchor)."""
        total = 0
        ref = self.chains.get(d)
        while ref is not None:
            total += ref.nbytes
            d = ref.base
            ref = self.chains.get(d)
        return total, d

    def _against(self, sink, d: bytes, view: memoryview, old: memoryview, base: bytes, depth: int,
                 elem: int) -> tuple[int | None, int]:
        """Store ``d`` as a delta against ``base`` (bytes ``old``) if it is clearly smaller: ``(bytes
        written or None, elements changed or -1)``."""
        enc = encode(view, old, base, elem)
        if enc.data is None:
            return None, enc.changed
        written = put_delta(sink.store, d, base, enc.data)
        with self._lock:
            self._fresh[d] = DeltaRef(base, depth, written)
            self._mine.add(d)
        return written, enc.changed

    def _anchor_bytes(self, sink, anchor: bytes, n: int) -> memoryview | None:
        """The anchor chunk read back (checked), or ``None`` if it cannot be."""
        buf = memoryview(bytearray(n))
        loc = sink.locations.get(anchor)
        try:
            got = read_packed(sink.store, anchor, loc, buf) if loc else sink.store.read_chunk_into(anchor, buf)
        except (CorruptDataError, ValueError, OSError):
            return None
        return buf if got == n and self._digest(buf) == anchor else None

    def _base(self, known: set[bytes], name: str, j: int) -> bytes | None:
        mirror, blob = self._mirror.get(name), self._blobs.get(name)
        if mirror is None or blob is None or mirror.data.nbytes != blob.nbytes:
            return None
        base = mirror.digests[j].tobytes()
        return base if base in known else None

    def _keep(self, name: str, j: int, d: bytes, view: memoryview) -> None:
        """The mirror of blob ``name`` holds new chunk ``d`` (bytes ``view``) at position ``j`` from now on."""
        mirror = self._mirror.get(name)
        a = j * self.chunk_size
        if mirror is None or a + view.nbytes > mirror.data.nbytes:
            return  # not a blob of this save: written() leaves it out
        mirror.data[a:a + view.nbytes] = np.frombuffer(view, np.uint8)
        mirror.digests[j] = np.frombuffer(d, np.uint8)
        mirror.samples.pop(j, None)

    def _leave_out(self, name: str, j: int, view: memoryview, elem: int, words: np.ndarray | None) -> bool:
        """Keep only a sample of clearly dense chunk ``j`` of blob ``name`` (``words``, if already
        taken): the next save writes it whole (no base), without the copy of its bytes now, unless
        its sample shows the changes have become sparse (then its bytes are kept again). False: it
        is too short to sample."""
        mirror = self._mirror.get(name)
        if words is None:
            words = sample_words(view, elem)
        if mirror is None or words is None or (j + 1) * 16 > mirror.digests.size:
            return False
        mirror.digests[j] = 0
        mirror.samples[j] = words
        self._left.setdefault(name, set()).add(j)
        return True

    def put(self, sink, d: bytes, view: memoryview, name: str, j: int) -> int:
        """Store new chunk ``d`` (position ``j`` of blob ``name``): as a delta if that pays, else whole."""
        written = self.try_delta(sink, d, view, name, j)
        return written if written is not None else sink.store.put_chunk(d, view)

    def try_delta(self, sink, d: bytes, view: memoryview, name: str, j: int) -> int | None:
        """Store new chunk ``d`` (position ``j`` of blob ``name``) as a delta if that pays and return
        the bytes written; ``None``: the caller writes it whole. The mirror keeps its bytes, or a
        sample of them when it changed densely (a chunk written whole does not pay for the copy)."""
        blob = self._blobs.get(name)
        elem = element_size(view.nbytes, blob.elem if blob else 1)
        tried = self._try_delta(sink, d, view, name, j, elem)
        if not (tried.dense and tried.written is None and self._leave_out(name, j, view, elem, tried.words)):
            self._keep(name, j, d, view)
        return tried.written

    def _try_delta(self, sink, d: bytes, view: memoryview, name: str, j: int, elem: int) -> _Tried:
        n = view.nbytes
        base = self._base(sink.known, name, j)
        changed = n // elem
        dense, words = False, None
        if base is None:  # left out of the mirror last time: its sample says whether it is still dense
            mirror = self._mirror.get(name)
            old = mirror.samples.get(j) if mirror is not None else None
            words = sample_words(view, elem) if old is not None else None
            dense = words is not None and clearly_dense(words, old)
        else:
            a = j * self.chunk_size
            prev = self.chains.get(base)
            depth = (prev.depth if prev is not None else 0) + 1
            chain_bytes, anchor = self._chain(base)
            written, got = None, -1
            if depth <= self.max_chain:
                written, got = self._against(sink, d, view, memoryview(self._mirror[name].data[a:a + n]), base,
                                             depth, elem)
                dense = got < 0
                if written is not None and chain_bytes + written > n:  # too long a read: re-base instead
                    with self._lock:
                        del self._fresh[d]
                        self._mine.discard(d)
                    delete_delta(sink.store, d, base)
                    written = None
            if written is None and not dense and anchor != base and anchor in sink.known:  # dense: no read back
                old = self._anchor_bytes(sink, anchor, n)
                if old is not None:
                    written, _ = self._against(sink, d, view, old, anchor, 1, elem)
            changed = got if got >= 0 else changed
            if written is not None:
                with self._lock:
                    self._changed += changed
                return _Tried(written, dense, words)
        with self._lock:
            self._whole.add(d)
            self._changed += changed
        return _Tried(None, dense, words)

    def mine(self) -> dict[bytes, DeltaRef]:
        """The deltas this process wrote in the current save."""
        return {d: self._fresh[d] for d in self._mine}

    def adopt(self, fresh: dict[bytes, DeltaRef], new: set[bytes]) -> None:
        """A job's save: the deltas every rank wrote, and every chunk the save wrote (the rest of
        them written whole, ending their chains)."""
        self._fresh.update(fresh)
        self._whole = set(new) - set(self._fresh)

    def written(self, flat, host: list[np.ndarray], digests: list[np.ndarray]) -> None:
        """After every chunk of the save is written (and before its staging copy is reused): keep the
        saved bytes where they differ from the mirror's."""
        live = set()
        for i, (blob, arr, rows) in enumerate(zip(flat.blobs, host, digests)):
            name = flat.tensors[blob.tensors[0]].name if blob.tensors else f"<blob {i}>"
            live.add(name)
            src = np.frombuffer(memoryview(arr).cast("B"), np.uint8) if arr.nbytes else np.zeros(0, np.uint8)
            mirror = self._mirror.get(name)
            if mirror is None or mirror.data.nbytes != src.nbytes:
                self._mirror[name] = _Mirror(src.copy(), rows.copy(), {})
                continue
            # only the chunks no I/O thread kept (_keep) or left out: packed, repeated or known ones
            left = self._left.get(name, set())
            differ = [j for j in np.flatnonzero((mirror.digests != rows).any(axis=1)).tolist() if j not in left]
            for j in differ:
                a, e = chunk_spans(src.nbytes, self.chunk_size)[j]
                mirror.data[a:e] = src[a:e]
                mirror.samples.pop(j, None)
            mirror.digests[differ] = rows[differ]
        for name in set(self._mirror) - live:  # tensors no longer saved
            del self._mirror[name]

    def annotate(self, m: Manifest, locations: dict) -> None:
        """Give manifest ``m`` its delta table (bases of bases included), the locations of packed
        bases, and the save's delta statistics."""
        table: dict[bytes, DeltaRef] = {}
        todo = [d for d in _rows(m.digests) if d not in self._whole and (d in self._fresh or d in self.chains)]
        while todo:
            d = todo.pop()
            if d in table:
                continue
            ref = self._fresh.get(d) or self.chains[d]
            table[d] = ref
            if ref.base in self._fresh or ref.base in self.chains:
                todo.append(ref.base)
            elif ref.base in locations:
                m.locations[ref.base] = locations[ref.base]
        m.deltas = table
        m.stats["delta_chunks"] = len(self._mine)
        m.stats["delta_bytes"] = sum(self._fresh[d].nbytes for d in self._mine)
        m.stats["elements_changed"] = self._changed

    def committed(self) -> None:
        """The save's manifest is committed: its deltas are known, its whole chunks end their chains."""
        for d in self._whole:
            self.chains.pop(d, None)
        self.chains.update(self._fresh)
        self._fresh, self._whole = {}, set()

    def abort(self, store) -> None:
        """The save failed: delete the delta objects it wrote (best effort; a full gc sweeps the rest)."""
        for d, ref in self._fresh.items():
            try:
                delete_delta(store, d, ref.base)
            except OSError:
                pass
        self._fresh, self._whole = {}, set()

    def retain(self, live: set[bytes]) -> None:
        """Forget the chains of chunks retention removed."""
        self.chains = {d: r for d, r in self.chains.items() if d in live}


def _rows(digests: np.ndarray) -> Iterable[bytes]:
    raw = np.ascontiguousarray(digests).tobytes()
    return (raw[i:i + 16] for i in range(0, len(raw), 16))
