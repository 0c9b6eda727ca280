"""Serial HDF5: contiguous datasets by ``preadv`` of their bytes, others through h5py; one read
per contiguous row range, straight into ``out``.

NOTE [ Reads outside h5py's lock ]
    h5py serializes every call into HDF5 with one process-wide lock ("phil"), held for the whole
    of an ``H5Dread``, storage wait included (it releases the GIL, not the lock). Threads that read
    through h5py therefore never overlap their requests: ``io_threads=4`` on a parallel file
    system buys one request at a time (h5py/h5py#591, #1287). A dataset with no filters, no
    external storage and a plain numeric type holds its rows as plain bytes in the dtype h5py
    reports (byte order included): one run at one offset (contiguous layout), or one run per
    chunk when each chunk holds whole rows (chunks stored at full size, C order; SOLAR's
    compressed-blob fields are such a 1-D uint8 dataset). The stored type must be exactly the
    one h5py reads into, the dataset must live in this file (not behind an external link) and
    the file must be open read-only in this process (no writer's unflushed caches); see
    ``_Span.of`` for each case. Its rows are read here with
    ``os.preadv`` on the file's own descriptor (the ``sec2`` driver's), straight into ``out``:
    no HDF5 call but one address lookup per chunk (once), no lock, the GIL released during the
    syscall, so concurrent requests overlap as they do on any file. Other chunkings, filtered,
    virtual, external or string datasets, chunks never written (the fill value), other drivers
    (``core``, ``mpio``, fsspec file objects) and platforms without ``preadv`` read through h5py
    as before; ``backend_options={"direct_reads": False}`` forces that everywhere. A read past the
    end of the file (truncated while open) raises instead of returning zeros. Reads use a
    duplicate of the descriptor taken per call, so a ``close()`` from another thread cannot
    send a read in flight to whatever file reuses the number next. On a local file system the
    same rows are copied from a read-only map of the file instead (NOTE [ Mapped reads ] in
    mapped.py): no system call per row once its pages are mapped.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from solar.errors import MissingKeyError, NotHDF5Error, StorageError, storage_errors

from .base import ArrayInfo, Backend
from .mapped import MappedFile, mappable

__all__ = ["HDF5Backend", "MappedRows", "h5_keys", "h5_attrs", "h5_read_errors", "read_rows"]

#: iovecs per ``preadv`` call (the system's limit, POSIX's minimum where it says none)
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024)


def h5_keys(f, broken: dict[str, str] | None = None) -> list[str]:
    """Every dataset path in ``f`` (an h5py File), groups walked in creation/storage order.

    ``broken``: filled with the links that resolve to nothing (an external link whose file is
    missing or unreachable, e.g. a relative one opened through a URL; a dangling soft link), path
    -> target, so callers can name them instead of losing the field without a word."""
    import h5py

    out: list[str] = []

    def walk(group, prefix: str) -> None:
        for name, obj in group.items():
            path = f"{prefix}{name}"
            if isinstance(obj, h5py.Dataset):
                out.append(path)
            elif isinstance(obj, h5py.Group):
                walk(obj, path + "/")
            elif obj is None and broken is not None:
                link = group.get(name, getlink=True)
                where = getattr(link, "filename", None)
                broken[path] = f"{where}:{link.path}" if where else str(getattr(link, "path", link))

    walk(f, "")
    return out


def h5_read_errors(url: str, key: str, ranges):
    """Re-raise h5py's own read failure (a plain ``OSError`` such as "data error detected by
    Fletcher32 checksum") as a :class:`~solar.StorageError` naming the file, dataset and rows;
    anything else passes (transport errors keep their types for the caller to classify)."""
    return storage_errors(lambda exc: _read_failure(url, key, ranges, exc))


def _read_failure(url: str, key: str, ranges, exc: Exception) -> StorageError | None:
    if type(exc) is not OSError:
        return None
    msg = str(exc)
    rows = f"rows {int(ranges[0][0])}-{int(ranges[-1][1]) - 1}" if len(ranges) else "no rows"
    damaged = any(w in msg.lower() for w in ("checksum", "data error", "filter", "inflate", "decompress"))
    todo = ("its stored chunks are damaged (an HDF5 filter or checksum failed): copy the file again or "
            "regenerate it" if damaged else "check that the file is intact and readable with h5py")
    return StorageError(f"{url}: reading {rows} of {key!r} failed ({msg}); {todo}")


def read_rows(d, url: str, key: str, ranges: np.ndarray, out: np.ndarray) -> int:
    """One ``read_direct`` of h5py dataset ``d`` per non-empty range into consecutive rows of
    ``out``; returns the number of reads. h5py's own failures name the file, dataset and rows."""
    pos = calls = 0
    for start, stop in ranges.tolist():
        n = stop - start
        if n == 0:
            continue
        with h5_read_errors(url, key, [(start, stop)]):
            d.read_direct(out, np.s_[start:stop], np.s_[pos:pos + n])
        pos += n
        calls += 1
    return calls


def h5_attrs(f, key: str) -> dict[str, Any]:
    obj = f if key in ("/", "") else f[key]
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in obj.attrs.items()}


class HDF5Backend(Backend):
    """Reads an HDF5 file with serial h5py (any process, no MPI).

    Args:
        url: local path.
        rdcc_nbytes: h5py chunk-cache size per dataset (default 4 MiB).
    """

    name = "hdf5"

    def _handle_attrs(self):
        return ("_file", "_dsets", "_keys", "_broken", "_fd", "_spans", "_dfd", "_dfd_lock", "_map")

    def _open_file(self):
        import h5py

        return h5py.File(self.url, "r", rdcc_nbytes=self.options.get("rdcc_nbytes", 4 << 20))

    def _open(self) -> None:
        try:
            self._file = self._open_file()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.url}: no such HDF5 file; check the path") from exc
        except OSError as exc:
            raise NotHDF5Error(f"{self.url}: cannot open as HDF5 ({exc}); is it an HDF5 file?") from exc
        self._dsets: dict[str, Any] = {}
        self._spans: dict[str, _Span | None] = {}
        self._keys: list[str] | None = None
        self._pin_size()
        # Direct reads go through private duplicates of the file's descriptor: a close() while
        # another thread reads (a loop left early, its dataset closed while the read-ahead still
        # reads) must not let that read go on through a number the next open file reuses.
        # (a FileIO: closed with the backend's last reference too, like h5py's handle; a bare
        # number leaked, and its share of HDF5's file lock kept the file from being reopened)
        self._dfd = io.FileIO(os.dup(self._fd), "r", closefd=True) if self._fd is not None else None
        self._dfd_lock = threading.Lock()

    def _pin_size(self) -> None:
        """Remember the file's size at the first open (pickled copies keep it).

        HDF5 reads rows past the end of a file as zeros, without an error: a plain HDF5 file
        truncated while a loader reads it (rewritten in place, a copy still in progress) gave
        zeros for every row past the cut. Files with stored checksums catch that; plain files
        have only this size check (:meth:`_check_size`, one ``fstat`` per read call).
        """
        fd = size = None
        if self._file.driver == "sec2":  # a POSIX descriptor (mpio's handle is not one)
            try:
                fd = self._file.id.get_vfd_handle()
                size = os.fstat(fd).st_size
            except Exception:  # noqa: BLE001 - no descriptor after all: no check
                fd = size = None
        self._fd = fd if size is not None else None
        if getattr(self, "_pinned_size", None) is None:
            self._pinned_size = size

    def _check_size(self) -> None:
        fd, pinned = self.__dict__.get("_fd"), getattr(self, "_pinned_size", None)
        if fd is None or pinned is None:
            return
        size = os.fstat(fd).st_size
        if size < pinned:
            raise StorageError(
                f"{self.url}: the file shrank from {pinned} to {size} bytes while open (truncated, or being "
                "rewritten in place), so rows past the cut would read as zeros; recreate the dataset once the "
                "file is complete again (write a new file and rename it over the old one)")

    def _close(self) -> None:
        self.__dict__.pop("_fd", None)  # HDF5 closes the descriptor with the file
        self.__dict__.pop("_spans", None)
        self.__dict__.pop("_map", None)  # (unmapped with its last reference: a read in flight keeps it)
        lock = self.__dict__.pop("_dfd_lock", None)
        if lock is not None:
            with lock:  # no read is between taking its duplicate and using it
                dfd = self.__dict__.pop("_dfd", None)
                if dfd is not None:
                    dfd.close()
        f = self.__dict__.pop("_file", None)
        if f is not None:
            f.close()
        self._dsets = {}

    def _dset(self, key: str):
        self.ensure_open()
        d = self._dsets.get(key)
        if d is None:
            try:
                d = self._file[key]
            except KeyError:
                raise MissingKeyError(f"{self.url}: no dataset {key!r}; keys: {', '.join(self.keys())}") from None
            if not hasattr(d, "shape"):  # a group: rows are read from datasets only
                raise MissingKeyError(f"{self.url}: {key!r} is a group, not a dataset; keys: {', '.join(self.keys())}")
            self._dsets[key] = d
        return d

    def keys(self) -> list[str]:
        self.ensure_open()
        if self._keys is None:
            self._broken: dict[str, str] = {}
            self._keys = h5_keys(self._file, self._broken)
        return list(self._keys)

    def broken_links(self) -> dict[str, str]:
        self.keys()
        return dict(self._broken)

    def info(self, key: str) -> ArrayInfo:
        d = self._dset(key)
        return ArrayInfo(tuple(d.shape), d.dtype)

    def attrs(self, key: str = "/") -> dict[str, Any]:
        self.ensure_open()
        return h5_attrs(self._file, key)

    def _span(self, key: str) -> "_Span | None":
        """Where ``key``'s rows lie in the file when they may be read as plain bytes (NOTE
        [ Reads outside h5py's lock ]), else None. Looked up once per key and open."""
        spans = self.__dict__.get("_spans")
        if spans is None:
            return None
        if key not in spans:
            ok = (self.__dict__.get("_fd") is not None and hasattr(os, "preadv")
                  and self.options.get("direct_reads", True))
            spans[key] = _Span.of(self._dset(key), self._file) if ok else None
        return spans[key]

    def serializes_reads(self, key: str) -> bool:
        self.ensure_open()
        return self._span(key) is None

    def _mapping(self) -> MappedFile | None:
        """The map of the file its direct reads copy from (NOTE [ Mapped reads ] in mapped.py),
        or None: they ``preadv``. Made at the first direct read of an open."""
        m = self.__dict__.get("_map", _UNSET)
        if m is _UNSET:
            fd, m = self.__dict__.get("_fd"), None
            if fd is not None and mappable(self.url, self.options.get("mmap", "auto")):
                m = MappedFile.open(self.url, fd, os.fstat(fd).st_size)
            self._map = m
        return m

    def mapped(self, key: str) -> bool:
        self.ensure_open()
        return self._span(key) is not None and self._mapping() is not None

    def _read_ranges(self, key: str, ranges: np.ndarray, out: "np.ndarray | RowPlaces | RowViews") -> None:
        span = self._span(key)
        if isinstance(out, RowViews):  # views of the map, or nothing (mapped_rows)
            m = self._mapping() if span is not None and span.row and span.allocated(ranges) else None
            calls = self._view_rows(m, key, span, ranges, out) if m is not None else 0
            self.stats.read_calls += calls
            if out.check is not None and calls:
                extra = self.stats.extra
                extra["direct_reads"] = extra.get("direct_reads", 0) + 1
                extra["mapped_reads"] = extra.get("mapped_reads", 0) + 1
            self._check_size()
            return
        if isinstance(out, RowPlaces) and (span is None or not span.row or not span.allocated(ranges)):
            info = self.info(key)  # read through h5py: into one buffer, then to the places
            buf = np.empty((len(out), *info.row_shape), info.dtype)
            self._read_ranges(key, ranges, buf)
            for place, row in zip(out, buf):
                place[...] = row
            return
        if isinstance(out, RowPlaces) or (span is not None and out.flags.c_contiguous and out.flags.writeable
                                          and span.allocated(ranges)):
            m = self._mapping()
            if m is None:
                calls = self._pread_rows(key, span, ranges, out)
            else:
                calls = self._copy_rows(m, key, span, ranges, out)
            self.stats.read_calls += calls
            if calls:
                self.stats.extra["direct_reads"] = self.stats.extra.get("direct_reads", 0) + 1
                if m is not None:
                    self.stats.extra["mapped_reads"] = self.stats.extra.get("mapped_reads", 0) + 1
        else:  # (rows of a chunk never written read as the fill value, through h5py)
            self.stats.read_calls += read_rows(self._dset(key), self.url, key, ranges, out)
        self._check_size()  # after the read: a cut during it is caught too

    def scatter_ready(self, key: str) -> bool:
        """Whether :meth:`read_rows_to` reads ``key`` with no copy of its own (rows of plain
        bytes, read by ``preadv``: NOTE [ Reads outside h5py's lock ])."""
        self.ensure_open()
        return self._span(key) is not None

    def read_rows_to(self, key: str, ranges: np.ndarray, dests: list) -> None:
        """Rows of the sorted ``[start, stop)`` ``ranges`` into ``dests``, one writable
        C-contiguous array of the row's shape and dtype per row, in order (a row nobody wants,
        read through a sieved gap, may share one scratch row with others): one ``preadv`` per
        run of the file, each row straight into its place. Without a plain-bytes span (h5py
        reads), the rows are read into one buffer and copied to their places."""
        self.ensure_open()
        info = self.info(key)
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        total = int((ranges[:, 1] - ranges[:, 0]).sum()) if len(ranges) else 0
        if len(dests) != total:
            raise ValueError(f"{self.url}:{key}: {len(dests)} destinations for {total} rows")
        if len(ranges) and (ranges[0, 0] < 0 or ranges[-1, 1] > info.shape[0]):
            raise IndexError(f"{self.url}:{key}: rows {int(ranges[0, 0])}..{int(ranges[-1, 1]) - 1} out of range "
                             f"for {info.shape[0]} rows")
        self._read_ranges(key, ranges, RowPlaces(dests))
        self.stats.rows_read += total
        self.stats.bytes_read += total * info.row_nbytes

    def mapped_rows(self, key: str, ranges: np.ndarray) -> "MappedRows | None":
        """The rows of the sorted ``[start, stop)`` ``ranges`` as views of the file's map, for a
        caller that copies them later (NOTE [ Rows copied when the batch is taken ] in
        solar/slots.py), or None where :meth:`read_rows_to` would not copy them from a map.
        A read as any other (counted, and checked to lie inside the file: ``StorageError``);
        ``check()`` checks the file again, before the caller's copy (NOTE [ Mapped reads ])."""
        self.ensure_open()
        info = self.info(key)
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        if len(ranges) and (ranges[0, 0] < 0 or ranges[-1, 1] > info.shape[0]):
            raise IndexError(f"{self.url}:{key}: rows {int(ranges[0, 0])}..{int(ranges[-1, 1]) - 1} out of range "
                             f"for {info.shape[0]} rows")
        out = RowViews()
        self._read_ranges(key, ranges, out)
        if out.check is None:
            return None
        self.stats.rows_read += len(out)
        self.stats.bytes_read += len(out) * info.row_nbytes
        return MappedRows(list(out), out.check)

    def _view_rows(self, m: MappedFile, key: str, span: "_Span", ranges: np.ndarray, out: "RowViews") -> int:
        """:meth:`mapped_rows`' read: ``out`` gets a view of the map per row and its ``check``;
        nothing where the map no longer covers the rows (the file grew). Returns the calls made."""
        spans = [(a, b) for a, b in ranges.tolist() if b > a]
        pieces = [p for a, b in spans for p in span.pieces(a, b)]
        end = max((at + n for at, n in pieces), default=0)
        if end > m.size:
            return 0

        def check() -> None:
            size = m.file_size()
            if end > size:
                self._past_end(None, key, spans[0][0], spans[-1][1], size)
        check()
        m.populate(pieces)
        info = self.info(key)
        dtype, shape = info.dtype, info.row_shape
        if span.offset is not None:  # contiguous: rows of one view of the whole dataset
            rows = m.rows(span.offset, info.shape[0] * span.row, dtype, shape)
            for a, b in spans:
                if b - a == 1:
                    out.append(rows[a])
                else:
                    out.extend(rows[a:b])  # (numpy iterates the rows' views)
        else:
            for at, n in pieces:
                out.extend(m.rows(at, n, dtype, shape))
        out.check = check
        return len(spans)

    def _pread_places(self, fd: int, key: str, span: "_Span", ranges: np.ndarray, out: "RowPlaces") -> int:
        """:meth:`_pread_into` for rows that each have a place of their own."""
        views = [memoryview(d).cast("B") for d in out]
        pos = calls = 0
        for start, stop in ranges.tolist():
            if stop == start:
                continue
            for at, n in span.pieces(start, stop):
                k = n // span.row
                with h5_read_errors(self.url, key, [(start, stop)]):
                    self._preadv_all(fd, key, views[pos:pos + k], at, (start, stop))
                pos += k
            calls += 1
        return calls

    def _preadv_all(self, fd: int, key: str, views: list, at: int, rows: tuple) -> None:
        """``views`` filled from file offset ``at`` on, by as few ``preadv`` calls as the
        system's iovec limit and short reads allow."""
        i, skip = 0, 0  # the first view not yet full, and how much of it is
        while i < len(views):
            iov = [views[i][skip:]] + views[i + 1:i + _IOV_MAX]
            got = os.preadv(fd, iov, at)
            if got == 0:
                self._past_end(fd, key, *rows)
            at += got
            got += skip
            while i < len(views) and got >= len(views[i]):
                got -= len(views[i])
                i += 1
            skip = got

    def _past_end(self, fd: int | None, key: str, start: int, stop: int, size: int | None = None) -> None:
        """A read that met the end of the file inside the dataset's bytes: say what happened."""
        self._check_size()  # it shrank since the open: say so
        raise StorageError(
            f"{self.url}: {key!r} rows {start}-{stop - 1} lie past the end of the file "
            f"({os.fstat(fd).st_size if size is None else size} bytes), which is incomplete (a copy still in "
            "progress?); recreate the dataset once the file is complete")

    def _copy_rows(self, m: MappedFile, key: str, span: "_Span", ranges: np.ndarray, out) -> int:
        """:meth:`_pread_rows` from the file's map: one copy per row place, or per run into
        ``out`` (NOTE [ Mapped reads ] in mapped.py). Every byte is checked to lie inside the file
        as it is now first: a mapped page past its end would kill the process (SIGBUS)."""
        spans = ranges.tolist()
        if span.offset is not None:  # contiguous: the rows as one array of the map
            pieces = None
            end = span.offset + max((b for a, b in spans), default=0) * span.row
        else:
            pieces = [p for a, b in spans if b > a for p in span.pieces(a, b)]
            end = max((at + n for at, n in pieces), default=0)
        calls = sum(1 for a, b in spans if b > a)
        if not calls:
            return 0
        size = m.file_size()
        if end > size:
            self._past_end(None, key, spans[0][0], spans[-1][1], size)
        if end > m.size:  # (grown since it was mapped)
            return self._pread_rows(key, span, ranges, out)
        info = self.info(key)
        if pieces is not None:
            m.copy_pieces(pieces, out, info.dtype, info.row_shape, span.row)
            return calls
        rows = m.rows(span.offset, info.shape[0] * span.row, info.dtype, info.row_shape)
        if not isinstance(out, RowPlaces):
            pos = 0
            for a, b in spans:
                out[pos:pos + b - a] = rows[a:b]
                pos += b - a
            return calls
        places = iter(out)
        for a, b in spans:
            for r in range(a, b):
                next(places)[...] = rows[r]
        return calls

    def _dup_fd(self, key: str) -> int:
        """A private duplicate of the file's descriptor, taken under the lock close() takes."""
        lock = self.__dict__.get("_dfd_lock")
        fd = None
        if lock is not None:
            with lock:
                dfd = self.__dict__.get("_dfd")
                fd = os.dup(dfd.fileno()) if dfd is not None else None
        if fd is None:
            raise StorageError(f"{self.url}: closed by another thread while reading {key!r}; close a dataset "
                               "only when no loader or thread reads it any more")
        return fd

    def _pread_rows(self, key: str, span: "_Span", ranges: np.ndarray, out: np.ndarray) -> int:
        """Rows of each range by ``os.preadv`` into consecutive rows of ``out``; returns the
        number of non-empty ranges (``read_calls`` counts one per range, as for h5py reads; a
        range over chunks that are not back to back in the file takes one ``preadv`` per run).

        Reads through a duplicate of the file's descriptor, taken under the lock that close()
        takes: the file stays open for this read even if another thread closes the backend."""
        fd = self._dup_fd(key)
        try:
            if isinstance(out, RowPlaces):
                return self._pread_places(fd, key, span, ranges, out)
            return self._pread_into(fd, key, span, ranges, out)
        finally:
            os.close(fd)

    def _pread_into(self, fd: int, key: str, span: "_Span", ranges: np.ndarray, out: np.ndarray) -> int:
        flat = memoryview(out.reshape(-1).view(np.uint8))
        pos = calls = 0
        for start, stop in ranges.tolist():
            if stop == start:
                continue
            for at, n in span.pieces(start, stop):
                got = 0
                while got < n:
                    with h5_read_errors(self.url, key, [(start, stop)]):  # EIO and the like name the rows
                        k = os.preadv(fd, [flat[pos + got:pos + n]], at + got)
                    if k == 0:  # end of file inside the dataset's bytes
                        self._past_end(fd, key, start, stop)
                    got += k
                pos += n
            calls += 1
        return calls


_UNSET = object()


class MappedRows(NamedTuple):
    """:meth:`HDF5Backend.mapped_rows`: one view of the map per row, and the check to make
    before copying from them."""

    views: list
    check: Callable[[], None]


class RowPlaces(list):
    """Where a read's rows go, one array per row (:meth:`HDF5Backend.read_rows_to`), in place of
    one ``out`` buffer."""


class RowViews(list):
    """What :meth:`HDF5Backend.mapped_rows` asks ``_read_ranges`` for: a view of the map per row,
    in place of a copy, and the ``check`` to make before copying from them (None: not mapped)."""

    check: Callable[[], None] | None = None


class _Span:
    """Where a dataset's rows lie in its file, when they are plain bytes there: one run
    (contiguous layout), or one run per chunk of whole rows (chunked, no filters), each chunk
    stored at full size in C order. Chunk addresses are asked of HDF5 once each, when first read.
    """

    __slots__ = ("row", "offset", "chunk_rows", "chunk_at", "_d")

    def __init__(self, d, row: int, offset: int | None, chunk_rows: int = 0) -> None:
        self._d, self.row, self.offset, self.chunk_rows = d, row, offset, chunk_rows
        self.chunk_at: dict[int, int | None] = {}

    @classmethod
    def of(cls, d, f) -> "_Span | None":
        """The span of dataset ``d`` of the open file ``f``, or None when its rows must be read
        through h5py. Each condition below is a case where the file's bytes are not h5py's:

        * another file: an external link's target is not behind ``f``'s descriptor;
        * ``f`` not read-only: the same process has the file open for writing, and HDF5's
          caches may hold writes not on disk yet (a writer opened later is refused by HDF5);
        * filters or external storage;
        * a stored type other than the one h5py reads into (``H5Tequal`` with h5py's type for the
          dtype): integers of fewer bits than their size, bit offsets or pad bits, complex parts
          in another order, strings, compounds;
        * chunks in a file with a user block: ``H5Dget_chunk_info`` counts addresses from the
          end of the user block before HDF5 1.14.4 and from the start of the file since.
        """
        import h5py

        if h5py.h5f.get_name(d.id) != h5py.h5f.get_name(f.id) or f.id.get_intent() != h5py.h5f.ACC_RDONLY:
            return None
        dcpl = d.id.get_create_plist()
        dt = d.dtype
        if not (dcpl.get_nfilters() == 0 and dcpl.get_external_count() == 0 and dt.kind in "iufc"
                and dt.fields is None and len(d.shape) >= 1 and d.id.get_type().equal(h5py.h5t.py_create(dt))):
            return None
        row = int(np.prod(d.shape[1:], dtype=np.int64)) * dt.itemsize
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            offset = d.id.get_offset()  # None: storage never allocated (rows read as the fill value)
            if offset is None or d.id.get_storage_size() != d.shape[0] * row:
                return None
            return cls(d, row, int(offset))
        if (layout == h5py.h5d.CHUNKED and tuple(d.chunks[1:]) == tuple(d.shape[1:])
                and hasattr(d.id, "get_chunk_info_by_coord") and f.id.get_create_plist().get_userblock() == 0):
            return cls(d, row, None, int(d.chunks[0]))
        return None

    def _chunk(self, k: int) -> int | None:
        at = self.chunk_at.get(k, -1)
        if at == -1:
            info = self._d.id.get_chunk_info_by_coord((k * self.chunk_rows,) + (0,) * (len(self._d.shape) - 1))
            at = self.chunk_at[k] = None if info.byte_offset is None else int(info.byte_offset)
        return at

    def allocated(self, ranges: np.ndarray) -> bool:
        """Whether every chunk the ranges touch has storage (contiguous: always)."""
        if self.offset is not None or not len(ranges):
            return True
        C = self.chunk_rows
        ks = set()
        for start, stop in ranges.tolist():
            ks.update(range(start // C, (stop - 1) // C + 1))
        return all(self._chunk(k) is not None for k in ks)

    def pieces(self, start: int, stop: int):
        """``(file offset, bytes)`` runs holding rows ``[start, stop)`` in order; runs of chunks
        that lie back to back in the file are one run."""
        row = self.row
        if self.offset is not None:
            yield self.offset + start * row, (stop - start) * row
            return
        C = self.chunk_rows
        run_at = run_n = None
        r = start
        while r < stop:
            k = r // C
            end = min(stop, (k + 1) * C)
            at, n = self._chunk(k) + (r - k * C) * row, (end - r) * row
            if run_at is not None and run_at + run_n == at:
                run_n += n
            else:
                if run_at is not None:
                    yield run_at, run_n
                run_at, run_n = at, n
            r = end
        if run_at is not None:
            yield run_at, run_n
