"""A node-local copy of a remote file, made at link speed while its rows are read.

NOTE [ Staging a remote file ]
    Rows of a shuffled epoch lie all over the file: read one by one as byte ranges, each row is
    a request of its own (64-128 KiB for PtychoNN-shaped data), and a request costs far more
    than its bytes (a few thousand per epoch against the 48 large ones of a plain parallel
    download). No grouping of one pass's rows helps: a pass wants a few rows in every region of
    the file. What reaches the link's throughput is what LitData and Streaming do with their
    chunks: copy the bytes to node-local disk once, in large pieces, and read rows from there.

    With ``backend_options={"stage": DIR}`` the fsspec backend does that for an HDF5 file whose
    rows it reads by byte range (NOTE [ Remote rows by byte ranges ] in fsspec.py). When the
    file is opened (before the first iteration: while the loader is made and plans), threads
    start downloading the whole file in ``PIECE``-byte pieces, ``INFLIGHT`` at a time (below
    botocore's pool of 10 connections, so a request of anybody else never queues behind the
    copy), into an unnamed file under ``DIR`` (created and unlinked at once: nothing is left
    behind, even when the job is killed). One write at a time, by whichever fetching thread
    finds a piece queued and nobody writing: concurrent writes to one file serialize on its
    inode's lock in the kernel, whose waiters spin on the cores the server and the downloads
    need, and a thread that only queues its piece goes on fetching. Over s3 and http a piece is
    written as the transport received it (``pwritev`` of its chunks: ``s3_ranges(chunks=True)``,
    ``http_chunks``), not joined into one byte string first: one copy of every byte fewer than a
    plain download makes. The writer then maps the piece's pages into the copy's map, so that
    the copies of its rows into batches take no page faults.

    A read waits only for the pieces holding its rows, which jump the file order when they are
    not on their way yet. Its rows are then views of a read-only map of the copy (NOTE [ Mapped
    reads ] in mapped.py), copied once, when their batch is taken (``FsspecBackend.mapped_rows``
    through ``_view_staged``; NOTE [ Rows copied when the batch is taken ] in solar/slots.py);
    the rows a pass keeps in the buffer are kept as those views, not copied (their bytes never
    change: NOTE [ Kept rows in an arena ] in cache/arena.py), so the first epoch's puts cost
    no memory and no copy at the end of the copy, when the pass's rows have all arrived.
    Rows that are a small part of a piece not on its way yet, far past the copy's front
    (``DIRECT_AHEAD``), are requested directly instead: a shuffled pass over a large file wants
    a few rows in every piece, and waiting for them would hold the first batches for the whole
    file. Nearer, the read waits: direct requests cost the server and the client per request,
    on the cores that move the copy's bytes, and the first epoch ends when the copy does either
    way (each pass wants rows of nearly every piece). So the first epoch takes about the copy's
    time, the copy about a plain parallel download's, and later epochs read the local copy at
    memory speed. Every piece is requested pinned to the version opened (``If-Match`` /
    ``IfMatch=ETag``), so a file replaced meanwhile is refused, as for range reads; the
    dataset's checksums are still verified once per row the backend returns (such fields are
    read into their slots, not as views). Costs: disk space for the whole file per process that
    opens it (checked up front; freed when the dataset is closed and the loader's buffer, which
    keeps views of it, is gone), and the whole file crosses the link even when a rank reads only
    part of it.
"""

from __future__ import annotations

import collections
import mmap
import os
import shutil
import tempfile
import threading
from typing import Callable

import numpy as np

from solar.errors import ConfigError, StorageError

from .fsspec_common import CHANGED, url_errors
from .mapped import fs_type

__all__ = ["StagedFile", "PIECE", "INFLIGHT", "DIRECT_BELOW", "DIRECT_MIN", "DIRECT_AHEAD"]

#: File systems whose ``fallocate`` reserves blocks without writing them.
FALLOCATE_FS = frozenset({"ext4", "xfs", "btrfs", "tmpfs", "f2fs", "bcachefs"})
#: Bytes per request of the copy.
PIECE = 8 << 20
#: Requests of the background copy in flight at once.
INFLIGHT = 8
#: A read that wants less than this fraction of a piece nobody fetches yet requests its bytes
#: directly instead of waiting for the piece (see :meth:`StagedFile.read_into`) ...
DIRECT_BELOW = 0.25
#: ... when the piece is at least this large (a smaller one costs one request either way) ...
DIRECT_MIN = 1 << 20
#: ... and lies at least this far past the copy's front (the next piece in file order nobody
#: fetches yet). Nearer, the read waits for the copy: what a direct request saves in waiting,
#: its requests cost the copy (each is work for the server and the client, on the cores that
#: move the copy's bytes), and the epoch ends with the copy either way. Farther, the wait would
#: hold the first batches for seconds (at ~1 GB/s: one per GiB).
DIRECT_AHEAD = 1 << 30

#: ``fetch(starts, ends) -> [bytes]``: the file's bytes ``[starts[i], ends[i])``, requested together.
Fetch = Callable[[list, list], list]
#: ``fetch_piece(start, end) -> [bytes, ...]``: the file's bytes ``[start, end)`` in consecutive
#: byte strings (as received, none joined), or one exception.
FetchPiece = Callable[[int, int], list]
#: Most buffers one ``pwritev`` takes (Linux's ``IOV_MAX``).
IOV_MAX = 1024
#: madvise advice mapping pages of the page cache into the map (Linux 5.14; Python's mmap
#: module names it from 3.12 only).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class StagedFile:
    """The file at ``url`` (``size`` bytes), copied under ``directory`` by ``inflight`` threads,
    each fetching one piece at a time: the pieces reads wait for first, then the rest in file
    order.

    :meth:`read_into` is safe from several threads; :meth:`close` stops the copy and frees the
    disk space once no read uses it."""

    def __init__(self, url: str, size: int, fetch: Fetch, directory: str, piece: int = PIECE,
                 inflight: int = INFLIGHT, direct_ahead: int = DIRECT_AHEAD,
                 fetch_piece: FetchPiece | None = None) -> None:
        if not os.path.isdir(directory):
            raise ConfigError(f"{url}: stage={directory!r} is not a directory; pass an existing directory on "
                              "node-local disk to copy the file into, or leave stage unset to read byte ranges")
        free = shutil.disk_usage(directory).free
        if free < size:
            raise ConfigError(f"{url}: stage={directory!r} has {free} bytes free and the file takes {size}; "
                              "pass a directory with room for it, or leave stage unset to read byte ranges")
        self.url, self.size, self.piece, self.inflight = url, int(size), int(piece), int(inflight)
        self.direct_ahead = int(direct_ahead)
        self._fetch = fetch
        self._fetch_piece = fetch_piece or (lambda a, b: fetch([a], [b]))
        fd, name = tempfile.mkstemp(prefix="solar-stage-", dir=directory)
        os.unlink(name)  # nameless: the space returns when the last descriptor closes
        if fs_type(directory) in FALLOCATE_FS and self.size:
            # its blocks allocated at once: writing pieces into a sparse file allocated blocks
            # write by write (ext4's delayed allocation), 3-10x the CPU of the writes themselves
            os.posix_fallocate(fd, 0, self.size)
        else:  # (glibc would emulate fallocate by writing zeros: twice the writes)
            os.ftruncate(fd, self.size)
        self._fd: int | None = fd
        # the copy's bytes, read as memory (NOTE [ Mapped reads ] in mapped.py): no system call
        # per row; only pieces already written are read, and nobody else can cut this file
        self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        self._flat = np.frombuffer(self._map, np.uint8) if self.size else np.zeros(0, np.uint8)
        n = -(-self.size // self.piece)
        self._done = np.zeros(n, bool)
        self._claimed = np.zeros(n, bool)  # done, or being fetched
        self._urgent: collections.deque = collections.deque()  # pieces a read waits for
        self._next = 0  # the next piece in file order not claimed yet
        self._cond = threading.Condition()
        self._queued: collections.deque = collections.deque()  # (piece, [bytes]) fetched, not written yet
        self._writer = False  # a thread writes the queued pieces
        self._error: BaseException | None = None
        self._closed = False
        self._running = 0  # copying threads alive
        self.requests = 0  # pieces fetched so far
        self.direct_requests = 0  # ranges read directly, past the copy
        self._start()

    def _start(self) -> None:
        """Start the copying threads (again, after a failure)."""
        with self._cond:
            need, self._running = self.inflight - self._running, self.inflight
        for _ in range(need):
            threading.Thread(target=self._copy, name="solar-stage", daemon=True).start()

    @property
    def complete(self) -> bool:
        return bool(self._done.all())

    def _claim(self) -> int | None:
        """The next piece to fetch (under the lock): one a read waits for, else the next in file
        order; None when there is none."""
        while self._urgent:
            k = self._urgent.popleft()
            if not self._claimed[k]:
                self._claimed[k] = True
                return k
        while self._next < len(self._claimed) and self._claimed[self._next]:
            self._next += 1
        if self._next == len(self._claimed):
            return None
        self._claimed[self._next] = True
        return self._next

    def _copy(self) -> None:
        """One copying thread: fetch and write pieces until none is left, the copy is closed or
        a fetch fails (the failure goes to the reads that wait; the next read starts over)."""
        k = None
        try:
            while True:
                with self._cond:
                    k = None if self._closed or self._error is not None else self._claim()
                    # nothing left to fetch, pieces left to write (a write failed meanwhile)
                    write = k is None and self._error is None and bool(self._queued) and not self._writer
                    self._writer = self._writer or write
                if k is None:
                    if write:
                        self._write_queued()
                    return
                self._get(k)
        except BaseException as exc:
            with self._cond:
                if k is not None and not self._done[k]:
                    self._claimed[k] = False
                    self._next = min(self._next, k)
                self._error = self._error or exc
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _get(self, k: int) -> None:
        """Fetch piece ``k`` and queue it to be written; the first thread to queue a piece while
        nobody writes writes every queued one (:meth:`_write_queued`). One write at a time:
        concurrent writes to one file queue on its inode's lock in the kernel, whose waiters spin
        on a core the server and the downloads need; and a thread that queues goes on fetching
        instead of waiting for that lock."""
        a, b = k * self.piece, min(self.size, (k + 1) * self.piece)
        with url_errors(self.url, "copying it to the stage directory"):
            data = self._fetch_piece(a, b)
        for got in data:
            if isinstance(got, BaseException):
                raise got
        if sum(map(len, data)) != b - a:
            raise StorageError(f"{self.url}: got {sum(map(len, data))} of {b - a} bytes at offset {a}; {CHANGED}")
        with self._cond:
            if self._closed:
                return
            self._queued.append((k, data))
            if self._writer:  # (bounded: a slow disk holds the fetches back)
                while len(self._queued) > self.inflight and not self._closed and self._writer:
                    self._cond.wait()
                return
            self._writer = True
        self._write_queued()

    def _write_queued(self) -> None:
        """Write queued pieces to the copy until none is left (this thread is the writer)."""
        while True:
            with self._cond:
                if not self._queued or self._closed:
                    self._writer = False
                    self._cond.notify_all()
                    return
                k, data = self._queued.popleft()
                fd = os.dup(self._fd)
            try:
                _write_all(fd, data, k * self.piece)
                self._map_in(k)
            except BaseException as exc:
                with self._cond:
                    self._claimed[k], self._next, self._writer = False, min(self._next, k), False
                    self._cond.notify_all()
                if isinstance(exc, OSError):
                    raise StorageError(f"{self.url}: writing its copy to the stage directory failed ({exc}); "
                                       "free space there, or pass another stage directory") from exc
                raise
            finally:
                os.close(fd)
            with self._cond:
                self._done[k] = True
                self.requests += 1
                self._cond.notify_all()

    def _map_in(self, k: int) -> None:
        """Map piece ``k``'s pages (just written: in the page cache) into the copy's map now, on
        the copying thread, so that the rows' copies into their batches take no page faults.
        Advice only: an older kernel leaves them to be faulted in."""
        try:
            self._map.madvise(MADV_POPULATE_READ, k * self.piece, min(self.piece, self.size - k * self.piece))
        except (OSError, ValueError):  # (EINVAL before Linux 5.14; ValueError: closed meanwhile)
            pass

    def _ensure(self, ks: np.ndarray) -> None:
        """Wait until pieces ``ks`` are in the copy, asking for them ahead of the file order."""
        with self._cond:
            self._urgent.extend(ks[~self._claimed[ks]].tolist())
            self._cond.notify_all()
            while not self._done[ks].all():
                if self._closed:
                    raise StorageError(f"{self.url}: closed by another thread while reading; close a "
                                       "dataset only when no loader or thread reads it any more")
                if self._error is not None:
                    error, self._error = self._error, None
                    break
                self._cond.wait()
            else:
                return
        self._start()  # (the next read tries again)
        raise error

    def _parts(self, runs: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """``runs`` cut at piece boundaries: ``(file offset, length, offset in out, piece)``."""
        parts, pos = [], 0
        for at, n in runs:
            end = at + n
            while at < end:
                k = at // self.piece
                m = min(end, (k + 1) * self.piece) - at
                parts.append((at, m, pos, k))
                at, pos = at + m, pos + m
        return parts

    def _far(self, parts: list[tuple[int, int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pieces, far, inv)``: the pieces ``parts`` touch, whether each is one to request
        directly (nobody fetches it yet, the read wants less than ``DIRECT_BELOW`` of it, and it
        lies ``direct_ahead`` bytes or more past the copy's front), and each part's index in
        ``pieces``."""
        ks, inv = np.unique(np.array([p[3] for p in parts]), return_inverse=True)
        wanted = np.bincount(inv, weights=[p[1] for p in parts])
        lens = np.minimum(self.size, (ks + 1) * self.piece) - ks * self.piece
        with self._cond:
            ahead = (ks - self._next) * self.piece >= self.direct_ahead
            far = ~self._claimed[ks] & (wanted < DIRECT_BELOW * lens) & (lens >= DIRECT_MIN) & ahead
        return ks, far, inv

    def read_into(self, runs: list[tuple[int, int]], out: memoryview) -> None:
        """Bytes of ``runs`` (``(file offset, length)``, in order) into consecutive bytes of ``out``.

        A piece that nobody fetches yet, of which this read wants less than ``DIRECT_BELOW`` and
        which lies ``direct_ahead`` bytes or more past the copy's front is not waited for: its
        bytes are requested directly (one range each), and the copy gets to the piece in its
        turn. So the first passes over a large file do not wait for the whole file around the
        few rows they want (in a shuffled pass, a few in every piece); pieces nearer, they wait
        for (``DIRECT_AHEAD``)."""
        parts = self._parts(runs)
        if not parts:
            return
        ks, far, inv = self._far(parts)
        if far.any():
            self._read_direct([p for p, d in zip(parts, far[inv]) if d], out)
        staged = [p for p, d in zip(parts, far[inv]) if not d]
        if staged:
            self._ensure(ks[~far])
            self._pread(staged, out)

    def row_views(self, runs: list[tuple[int, int]], row: int, dtype: np.dtype, row_shape: tuple) -> list:
        """Rows of ``runs`` (``(file offset, length)`` of whole rows of ``row`` bytes, in order),
        one read-only array each, for a caller that copies them later: views of the copy's map
        (each keeps it alive, even past :meth:`close`) once their pieces are there, waited for
        as :meth:`read_into` waits; rows touching a piece that read would request directly are
        requested so (consecutive ones as one range) and are views of the bytes received."""
        if self.complete:
            with self._cond:
                flat = self._mapped()
            return [r for at, n in runs for r in flat[at:at + n].view(dtype).reshape(-1, *row_shape)]
        at = np.array([a for s, n in runs for a in range(s, s + n, row)], np.int64)
        parts = self._parts(runs)
        if not parts:
            return []
        ks, far, _ = self._far(parts)
        first, last = at // self.piece, (at + row - 1) // self.piece
        direct = np.isin(first, ks[far]) | np.isin(last, ks[far])
        views: list = [None] * len(at)
        if direct.any():
            for i, r in zip(np.flatnonzero(direct).tolist(), self._request_rows(at[direct], row)):
                views[i] = r.view(dtype).reshape(row_shape)
        near = ~direct
        if near.any():
            self._ensure(np.unique(np.r_[first[near], last[near]]))
            with self._cond:
                flat = self._mapped()
            for i, a in zip(np.flatnonzero(near).tolist(), at[near].tolist()):
                views[i] = flat[a:a + row].view(dtype).reshape(row_shape)
        return views

    def _request_rows(self, at: np.ndarray, row: int) -> list[np.ndarray]:
        """Rows of ``row`` bytes at the sorted offsets ``at``, requested from the URL, each run of
        adjacent ones as one range: one read-only byte array per row."""
        cut = np.flatnonzero(np.diff(at) != row) + 1
        groups = np.split(at, cut)
        starts = [int(g[0]) for g in groups]
        ends = [int(g[-1]) + row for g in groups]
        with url_errors(self.url, "reading rows"):
            got = self._fetch(starts, ends)
        rows = []
        for a, b, data in zip(starts, ends, got):
            if isinstance(data, BaseException):
                raise data
            if len(data) != b - a:
                raise StorageError(f"{self.url}: got {len(data)} of {b - a} bytes at offset {a}; {CHANGED}")
            rows.extend(np.frombuffer(data, np.uint8).reshape(-1, row))
        with self._cond:
            self.direct_requests += len(starts)
        return rows

    def _read_direct(self, parts: list[tuple[int, int, int, int]], out: memoryview) -> None:
        """``parts`` requested from the URL, each copied into its place in ``out``."""
        with url_errors(self.url, "reading rows"):
            got = self._fetch([at for at, _, _, _ in parts], [at + n for at, n, _, _ in parts])
        for (at, n, pos, _), data in zip(parts, got):
            if isinstance(data, BaseException):
                raise data
            if len(data) != n:
                raise StorageError(f"{self.url}: got {len(data)} of {n} bytes at offset {at}; {CHANGED}")
            out[pos:pos + n] = data
        with self._cond:
            self.direct_requests += len(parts)

    def _pread(self, parts: list[tuple[int, int, int, int]], out: memoryview) -> None:
        """``parts`` from the copy (their pieces are there) into their places in ``out``."""
        with self._cond:
            flat = self._mapped()
        dest = np.frombuffer(out, np.uint8)
        for at, n, pos, _ in parts:
            dest[pos:pos + n] = flat[at:at + n]

    def _mapped(self) -> np.ndarray:
        """The copy's map (under the lock), which a close() meanwhile leaves to this read: it is
        unmapped with its last reference."""
        if self._closed:
            raise StorageError(f"{self.url}: closed by another thread while reading; close a dataset only when "
                               "no loader or thread reads it any more")
        return self._flat

    def rows_into(self, runs: list[tuple[int, int]], places: list, row: int) -> None:
        """Rows of ``runs`` (``(file offset, length)`` of whole rows of ``row`` bytes, in order)
        into ``places`` (one array per row): one copy each, from a complete copy only."""
        if not self.complete:
            raise RuntimeError(f"{self.url}: rows_into before the copy is complete")
        with self._cond:
            flat = self._mapped()
        pos = 0
        for at, n in runs:
            for a in range(at, at + n, row):
                dest = places[pos]
                dest.reshape(-1).view(np.uint8)[...] = flat[a:a + row]
                pos += 1

    def check(self) -> None:
        """Nothing to check before copying from :meth:`row_views`: the copy is this process's
        own nameless file, which nobody else can cut."""

    # the rows of row_views never change (views of this process's own file, written once, or
    # of bytes received): the buffer keeps them as they are, no copy (NOTE [ Kept rows in an
    # arena ] in cache/arena.py)
    check.stable = True  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the copy and close the local file (its space is freed when the last read ends)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            fd, self._fd = self._fd, None
            self._cond.notify_all()
        os.close(fd)


def _write_all(fd: int, data: list, at: int) -> None:
    """The byte strings ``data``, one after another, to ``fd`` at offset ``at``: ``pwritev`` of
    up to ``IOV_MAX`` at a time, again from where a short write stopped."""
    views = [memoryview(d) for d in data if len(d)]
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], at)
        at += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
