"""Copy to host: the reused staging buffers a save copies the state into before hashing it.

This copy is the only part of a save the caller waits for. The buffers are reused from save to
save (pinned when the tensors live on a GPU), and there are ``slots`` of them, so the writer's
memory is bounded by that many copies of the state and a save waits while all are in use.
"""

from __future__ import annotations

import threading

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

    def stage(self, slot: int, blobs: list[BlobSource]) -> list[np.ndarray]:
        """Copy every blob into slot ``slot``'s buffer; return uint8 numpy views of the copies."""
        offsets, total = [], 0
        for b in blobs:
            offsets.append(total)
            total += -(-b.nbytes // _ALIGN) * _ALIGN
        on_cuda = any(b.storage.device.type == "cuda" for b in blobs)
        buf = self._bufs[slot]
        if buf is None or buf.numel() < total or (on_cuda and not buf.is_pinned()):
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
