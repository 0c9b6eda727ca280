"""Copy to host: the reused staging buffers a save copies the state into before hashing it.

This copy is the only part of a save the caller waits for. The buffers are reused from save to
save (pinned when the tensors live on a GPU), and there are ``slots`` of them, so the writer's
memory is bounded by that many copies of the state and a save waits while all are in use.

A fresh buffer costs a page fault per page on its first copy (about as long as the copy itself,
several times longer on a loaded node): :meth:`HostPool.reserve` allocates and touches the buffers
in a background thread ahead of the first save, as DataStates-LLM preallocates its host cache, so
that save blocks for the copy alone.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import torch

from .flatten import BlobSource

__all__ = ["HostPool"]

_ALIGN = 64  # each blob's copy starts on this byte boundary of the buffer


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

    def __init__(self, slots: int) -> None:
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

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

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
        buf = self._bufs[slot]
        if _too_small(buf, total, on_cuda):
            self._bufs[slot] = None  # free the old buffer before allocating its replacement
            buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_cuda)
            self._bufs[slot] = buf
        arr = buf.numpy()
        views = []
        for b, off in zip(blobs, offsets):
            src = b.byte_view()
            # torch's copy_ splits a large copy over the intra-op threads (np.copyto uses one).
            # On CUDA: async device-to-host into pinned memory.
            buf[off:off + b.nbytes].copy_(src, non_blocking=src.device.type == "cuda")
            views.append(arr[off:off + b.nbytes])
        if on_cuda:
            torch.cuda.synchronize()
        return views


def _layout(blobs: list[BlobSource]) -> tuple[int, list[int]]:
    """The staging buffer's size for ``blobs`` and where each blob's copy starts in it."""
    offsets, total = [], 0
    for b in blobs:
        offsets.append(total)
        total += -(-b.nbytes // _ALIGN) * _ALIGN
    return total, offsets


def _too_small(buf: torch.Tensor | None, total: int, on_cuda: bool) -> bool:
    return buf is None or buf.numel() < total or (on_cuda and not buf.is_pinned())
