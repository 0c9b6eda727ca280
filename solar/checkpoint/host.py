"""Copy to host: the reused staging buffers a save copies the state into before hashing it.

This copy is the only part of a save the caller waits for. The buffers are reused from save to
save (pinned when the tensors live on a GPU), and there are ``slots`` of them, so the writer's
memory is bounded by that many copies of the state and a save waits while all are in use.

A fresh buffer costs a page fault per page on its first copy (about as long as the copy itself,
several times longer on a loaded node): :meth:`HostPool.reserve` allocates and touches the buffers
in a background thread ahead of the first save, as DataStates-LLM preallocates its host cache, so
that save blocks for the copy alone.

A slot's buffer also remembers the chunk digests of what it holds (:meth:`HostPool.release`
records them once the save has hashed its copy). The next save into that slot hashes a blob's
live chunks first and copies only the chunks whose digest differs from the one held, where the
blob's chunks mostly stayed the same last time: frozen layers, a replicated tensor, a sparse
update. Hashing reads each byte once where a copy reads and writes it, so an unchanged chunk
blocks the caller for well under its copy's time; a blob that mostly changed is copied outright
(hashing it first would add the hash to the copy), and a blob found changing throughout while it
is hashed is copied outright from there on. The digests hashed here are the save's own
chunk digests: the save does not hash those blobs again. Invariant: a slot's record holds the
digests of the bytes its buffer holds, or is absent; a staging copy that may have failed halfway
drops it first.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, NamedTuple

import numpy as np
import torch

from .chunking import DIGEST_SIZE, hasher
from .flatten import BlobSource

__all__ = ["HostPool", "SKIP_BELOW", "HASH_FIRST_MIN_CHUNK", "Staged", "host_pool"]

_ALIGN = 64  # each blob's copy starts on this byte boundary of the buffer
#: a blob is hashed before it is copied when at most this fraction of its chunks changed between
#: the slot's last two saves: hashing costs a good part of a copy (bench/checkpoint/job.py's
#: dense rows), and every changed chunk costs its copy on top, so a blob changing much more than
#: this blocks longer hashed first than copied outright
SKIP_BELOW = 0.25
_GROUP_BYTES = 4 << 20  # hash-first staging hashes, then copies, this many bytes of chunks at a time
#: hash-first staging needs chunks this large: it makes one hash call per chunk in the caller's
#: thread, whose fixed cost must stay small next to hashing the chunk's bytes
HASH_FIRST_MIN_CHUNK = 1 << 18


class Staged(NamedTuple):
    """What one save's staging copy did: each blob's chunk digests where it hashed the blob before
    copying it (``None``: copied outright), and the bytes it copied."""

    hashed: list[np.ndarray | None]
    bytes_copied: int


class _Held(NamedTuple):
    """What a slot's buffer holds: its layout, each blob's chunk digests (``None``: not known) and
    the fraction of each blob's chunks that differed from the slot's record before it."""

    layout: tuple[tuple[int, int], ...]  # (offset, nbytes) of each blob in the buffer
    digests: list[np.ndarray | None]
    changed: list[float]


class HostPool:
    """``slots`` reusable host buffers; acquiring one blocks while all are in use (back-pressure).

    Slots are granted in save order: each save takes a ticket when it is called and may take a
    slot only after every earlier save took one. Why: a lazy save takes its slot on the persist
    thread, where it queues behind earlier commits; a later normal save taking the free slot first
    would hold it while its own commit queues behind the lazy save, which waits for that slot.

    A save that leaves before its turn (Ctrl-C or any exception while it waits) must give up its
    ticket (:meth:`cancel`): the turn would otherwise never pass it, and every later save of the
    writer would wait forever.
    """

    def __init__(self, slots: int, chunk_size: int = 0, digest: Callable[[memoryview], bytes] | None = None) -> None:
        """``chunk_size`` and ``digest``: the writer's chunking and chunk hash, for the hash-first
        staging of blobs that mostly stay the same (off without a ``digest``)."""
        self._chunk_size, self._digest = chunk_size, digest
        self._held: list[_Held | None] = [None] * slots
        self._staged: list[Staged] = [Staged([], 0)] * slots  # what each slot's last stage() did
        self._cond = threading.Condition()
        self._free = list(range(slots))
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket whose turn it is to take a slot
        self._cancelled: set[int] = set()  # tickets given up before their turn; the turn skips them
        self._ready: list[Future | None] = [None] * slots  # a slot's buffer being reserved in the background

    def ticket(self) -> int:
        with self._cond:
            self._issued += 1
            return self._issued - 1

    def acquire(self, ticket: int) -> int:
        with self._cond:
            try:
                while not (self._free and self._serving == ticket):
                    self._cond.wait()
            except BaseException:  # KeyboardInterrupt while waiting: the turn must move on without us
                self.cancel(ticket)
                raise
            self._next_turn()
            return self._free.pop()

    def cancel(self, ticket: int) -> None:
        """Give up ``ticket`` unless it already took its slot (then this does nothing)."""
        with self._cond:
            if ticket >= self._serving:
                self._cancelled.add(ticket)
                if ticket == self._serving:
                    self._next_turn()

    def _next_turn(self) -> None:
        """Pass the turn to the next ticket still waiting (the caller holds ``_cond``)."""
        self._serving += 1
        while self._serving in self._cancelled:
            self._cancelled.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def release(self, slot: int, digests: list[np.ndarray] | None = None) -> None:
        """Give the slot back; ``digests``: each blob's chunk digests of what its buffer now holds
        (``None`` when the save did not hash all of it: the slot then remembers nothing)."""
        prev, self._staged[slot] = self._held[slot], Staged([], 0)
        self._held[slot] = None
        if digests is not None and prev is not None and self._digest is not None:
            changed = [_changed(old, new) for old, new in zip(prev.digests, digests)]
            self._held[slot] = _Held(prev.layout, [np.ascontiguousarray(d) for d in digests], changed)
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def staged(self, slot: int) -> Staged:
        """What :meth:`stage` did for the save holding ``slot``."""
        return self._staged[slot]

    def reserve(self, blobs: list[BlobSource]) -> Future:
        """Make every slot's buffer large enough for ``blobs`` and touch its pages, in a background
        thread; the returned future is done when they are. A save that takes a slot meanwhile waits
        for that slot's buffer (:meth:`stage`)."""
        total, _offsets = _layout(blobs)
        on_cuda = any(b.storage.device.type == "cuda" for b in blobs)
        done: Future = Future()
        with self._cond:
            # free slots only: a slot in use keeps its buffer until its save is done with it
            slots = [s for s in self._free if self._ready[s] is None and _too_small(self._bufs[s], total, on_cuda)]
            for s in slots:
                self._ready[s] = done

        def fill() -> None:
            try:
                for s in slots:
                    self._held[s] = None  # the new buffer holds none of the old one's chunks
                    self._bufs[s] = None  # the old buffer goes before its replacement is allocated
                    buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_cuda)
                    buf.zero_()  # touch every page here, not in a save's copy
                    self._bufs[s] = buf
                done.set_result(None)
            except BaseException as exc:  # a save then allocates its own buffer
                done.set_exception(exc)
            finally:
                with self._cond:
                    for s in slots:
                        self._ready[s] = None

        threading.Thread(target=fill, name="solar-ckpt-reserve", daemon=True).start()
        return done

    def stage(self, slot: int, blobs: list[BlobSource]) -> list[np.ndarray]:
        """Copy every blob into slot ``slot``'s buffer; return uint8 numpy views of the copies."""
        total, offsets = _layout(blobs)
        on_cuda = any(b.storage.device.type == "cuda" for b in blobs)
        ready = self._ready[slot]
        if ready is not None:
            ready.exception()  # waits; a failed reservation leaves the allocation to this save
        held, self._held[slot], self._staged[slot] = self._held[slot], None, Staged([], 0)
        buf = self._bufs[slot]
        if _too_small(buf, total, on_cuda):
            held = None  # a new buffer holds none of the old one's chunks
            self._bufs[slot] = None  # free the old buffer before allocating its replacement
            buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_cuda)
            self._bufs[slot] = buf
        layout = tuple((off, b.nbytes) for b, off in zip(blobs, offsets))
        on_cpu = all(b.storage.device.type == "cpu" for b in blobs)  # hashed where they live
        if held is None or held.layout != layout or not on_cpu or self._digest is None:
            held = None
        arr = buf.numpy()
        cuda = {b.storage.device for b in blobs if b.storage.device.type == "cuda"}
        try:
            hashed, copied = self._copy_blobs(blobs, offsets, buf, held)
        finally:  # every device's copies have landed before the buffer is read or staged again
            for dev in cuda:
                torch.cuda.synchronize(dev)
        # for release(): this save's layout and the digests the buffer held before it, which the
        # save's own digests are compared with
        before = held.digests if held is not None else [None] * len(blobs)
        self._held[slot] = _Held(layout, before, [0.0] * len(blobs))
        self._staged[slot] = Staged(hashed, copied)
        return [arr[off:off + b.nbytes] for b, off in zip(blobs, offsets)]

    def _copy_blobs(self, blobs: list[BlobSource], offsets: list[int], buf: torch.Tensor,
                    held: _Held | None) -> tuple[list[np.ndarray | None], int]:
        """Copy every blob into ``buf`` at its offset, hash-first where ``held`` says it mostly
        stays the same; each blob's digests (``None``: copied outright) and the bytes copied."""
        hashed, copied = [], 0
        for i, (b, off) in enumerate(zip(blobs, offsets)):
            src = b.byte_view()
            dst = buf[off:off + b.nbytes]
            old = held.digests[i] if held is not None and held.changed[i] <= SKIP_BELOW else None
            if old is not None and len(old) == -(-b.nbytes // self._chunk_size):
                digests, n = self._copy_changed(src, dst, old)  # digests None: it gave up hashing
                hashed.append(digests)
                copied += n
            else:
                # torch's copy_ splits a large copy over the intra-op threads (np.copyto uses one).
                # On CUDA: async device-to-host into pinned memory.
                dst.copy_(src, non_blocking=src.device.type == "cuda")
                hashed.append(None)
                copied += b.nbytes
        return hashed, copied

    def _copy_changed(self, src: torch.Tensor, dst: torch.Tensor, old: np.ndarray) -> tuple[np.ndarray | None, int]:
        """Hash ``src``'s chunks and copy into ``dst`` the chunks whose digest differs from ``old``
        (the digests of what ``dst`` holds); return the digests of what ``dst`` then holds and the
        bytes copied.

        A copied chunk's digest is taken from its copy, not from ``src``: a lazy save's source may
        change between the hash and the copy, and a digest that does not match the stored bytes
        would let later saves de-duplicate onto them. Group by group, so a changed chunk is copied
        and hashed again while it is in cache. Once the first group or a sixteenth of the blob,
        whichever is more, was seen with more than ``SKIP_BELOW`` of its chunks changed, the rest
        is copied outright and the digests are ``None`` (the save hashes its copy)."""
        cs, digest = self._chunk_size, self._digest
        live, held = memoryview(src.numpy()), memoryview(dst.numpy())
        n = len(old)
        group = max(1, _GROUP_BYTES // cs)
        probe = max(group, n // 16)
        out, copied, nchanged = bytearray(), 0, 0
        for g in range(0, n, group):
            if g >= probe and nchanged > SKIP_BELOW * g:
                a = g * cs
                dst[a:].copy_(src[a:])
                return None, copied + len(live) - a
            for j in range(g, min(g + group, n)):
                a, e = j * cs, min((j + 1) * cs, len(live))
                d = digest(live[a:e])
                if d != old[j].tobytes():
                    nchanged += 1
                    dst[a:e].copy_(src[a:e])
                    copied += e - a
                    d = digest(held[a:e])
                out += d
        return np.frombuffer(bytes(out), dtype=np.uint8).reshape(-1, DIGEST_SIZE), copied


def host_pool(slots: int, chunk_size: int, hash: str) -> HostPool:
    """The writer's pool; hash-first staging only with a hash that reads faster than a copy (XXH3)
    and chunks of at least ``HASH_FIRST_MIN_CHUNK`` bytes."""
    fast = hash == "xxh3_128" and chunk_size >= HASH_FIRST_MIN_CHUNK
    return HostPool(slots, chunk_size, hasher(hash) if fast else None)


def _layout(blobs: list[BlobSource]) -> tuple[int, list[int]]:
    """The staging buffer's size for ``blobs`` and where each blob's copy starts in it."""
    offsets, total = [], 0
    for b in blobs:
        offsets.append(total)
        total += -(-b.nbytes // _ALIGN) * _ALIGN
    return total, offsets


def _changed(old: np.ndarray | None, new: np.ndarray) -> float:
    """The fraction of chunks whose digest changed; 0.0 when nothing is known to compare with: a
    blob is taken to stay the same until a save sees it change (one save of a blob that changes
    throughout then hashes before its copy, and the saves after it copy outright)."""
    if old is None:
        return 0.0
    if old.shape != new.shape:
        return 1.0
    return float((old != new).any(axis=1).mean()) if len(new) else 0.0


def _too_small(buf: torch.Tensor | None, total: int, on_cuda: bool) -> bool:
    return buf is None or buf.numel() < total or (on_cuda and not buf.is_pinned())
