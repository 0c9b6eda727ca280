"""The ``fsspec`` backend: any fsspec URL (``file://``, ``http(s)://``, ``s3://``, ``memory://`` ...).

Two container kinds, chosen from what the URL holds when the backend opens (so a backend made in
one process and pickled to another decides where it reads):

* **An HDF5 file** (any URL that is a file and does not end in ``.npy``): read by h5py through a
  block-cached fsspec file object (:mod:`solar.io_backends.fsspec_hdf5`), its plain rows by
  byte ranges, or from a node-local copy with ``stage=`` (:mod:`solar.io_backends.fsspec_stage`).
* **A ``.npy`` store**: a directory (or URL prefix) of ``.npy`` files, or one ``.npy`` file, read
  by byte ranges (:mod:`solar.io_backends.npy_store`, NOTE [ npy store layout ] there).

What both share (URL -> filesystem, storage errors, fork) is in
:mod:`solar.io_backends.fsspec_common`; this module re-exports the public names of all three.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from solar.errors import DatasetFormatError, StorageError

from .base import ArrayInfo
from .fsspec_common import (CHANGED, INHERITED, _protocols, http_chunks, is_http, missing_protocol_error, s3_ranges,
                            url_errors, url_to_fs)
from .fsspec_hdf5 import h5_errors, open_file_object, open_h5, pinned_fs
from .fsspec_stage import StagedFile
from .hdf5 import HDF5Backend, RowPlaces, RowViews, _Span
from .npy_format import npy_header
from .npy_store import NpyStore, write_npy_store

__all__ = ["FsspecBackend", "NpyStore", "write_npy_store", "npy_header", "url_to_fs", "missing_protocol_error"]

#: options of the backend itself; every other keyword option is a storage option
_STORE_OPTIONS = ("block_size", "cache_type", "rdcc_nbytes", "storage_options", "cache_options", "direct_reads",
                  "stage")

#: Largest byte range one request asks for: a long run is cut into pieces requested concurrently.
RANGE_BYTES = 8 << 20


class FsspecBackend(HDF5Backend):
    """Reads HDF5 files or ``.npy`` stores from any fsspec URL.

    Args:
        url: an fsspec URL or local path.
        storage_options: passed to the filesystem (e.g. ``{"key": ..., "secret": ...,
            "client_kwargs": {"endpoint_url": ...}}`` for S3). Other unknown keyword options are
            treated as storage options too.
        block_size: bytes per fetched block for HDF5 files (default 1 MiB).
        cache_type: fsspec cache for HDF5 files (default ``"blockcache"``, an LRU of blocks).
        cache_options: extra cache arguments, e.g. ``{"maxblocks": 64}``.
        stage: a directory on node-local disk: an HDF5 file whose rows are read by byte range is
            copied there in large pieces while it is read, and its rows are read from the copy
            (NOTE [ Staging a remote file ] in fsspec_stage.py). Unset: rows are read by byte
            range from the URL every time.
    """

    name = "fsspec"

    def __init__(self, url, **options: Any) -> None:
        storage = dict(options.pop("storage_options", None) or {})
        storage.update({k: options.pop(k) for k in list(options) if k not in _STORE_OPTIONS})
        super().__init__(url, storage_options=storage, **options)

    def _handle_attrs(self):
        return (*super()._handle_attrs(), "_fs", "_fobj", "_npy", "_range_fs", "_range_spans", "_stage")

    def _open(self) -> None:
        self._keep_parent_handles()
        with url_errors(self.url, "opening it"):
            self._fs, path = url_to_fs(self.url, **self.options["storage_options"])
        self._owner_pid = os.getpid()
        self._fobj = self._npy = self._stage = None
        self._file = None
        self._dsets, self._keys = {}, None
        with url_errors(self.url, "opening it"):
            is_dir, info = self._probe(path)
            if is_dir or urlsplit(path).path.endswith(".npy"):
                self._npy = NpyStore(self._fs, path, self.url, is_dir, info)
                return
            self._check_same_version(info)
            self._fobj = open_file_object(self._fs, path, self.url, info, self.options)
            self._range_fs, self._path = pinned_fs(self._fs, self.url, info, self.options), path
            self._etag = info.get("ETag") if "s3" in _protocols(self._fs) else None
        self._file = open_h5(self._fobj, self.url, self.options)
        self._range_spans = {}
        if self.options.get("stage") and self.options.get("direct_reads", True) and "::" not in self.url:
            self._stage = StagedFile(self.url, int(info["size"]), self._fetch_ranges, os.fspath(self.options["stage"]),
                                     fetch_piece=self._fetch_piece)
            self._stage_counted = 0

    def _check_same_version(self, info: dict) -> None:
        """Pin the file's version on the first open; a later open of this backend or of a copy of
        it (the dataset's request threads and workers get pickled copies, which open the URL
        anew) must find the same version.

        Why: the If-Match pin (HTTP) and s3fs's ETag check hold for one open file object only. A
        copy opened after the file was replaced would read the new version while the dataset
        still uses the old one's offsets and checksums: mixed versions, or a misleading "checksum
        fails, the file is damaged". The version is the ETag, modification time and size that the
        filesystem reports, whichever it has."""
        mine = {k: str(info[k]) for k in ("ETag", "LastModified", "Last-Modified", "mtime", "size")
                if info.get(k) is not None}
        pinned = self.__dict__.get("_version")
        if pinned is None:
            self._version = mine
        elif any(mine.get(k, v) != v for k, v in pinned.items()):
            raise StorageError(f"{self.url}: {CHANGED}")

    def _probe(self, path: str) -> tuple[bool, dict]:
        """``(is it a directory, its info)`` in one metadata request.

        Why not ``isdir`` and ``exists``: over HTTP each of them GETs the whole body (to look for
        links in it), two whole-file downloads per open of an HDF5 file. ``info`` is one HEAD
        there; an HTTP "directory" is an index page: a URL ending in ``/`` or served as HTML."""
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            if is_http(self._fs):  # fsspec reports any failed HEAD so; one byte's GET says why (403 ...)
                with contextlib.suppress(FileNotFoundError):  # a 404: fsspec's message is the bare URL
                    self._fs.cat_file(path, start=0, end=1)
            raise FileNotFoundError(f"{self.url}: no such file or directory; check the URL") from None
        if is_http(self._fs):
            return path.endswith("/") or info.get("mimetype") == "text/html", info
        return info.get("type") == "directory", info

    def _keep_parent_handles(self) -> None:
        """In a forked child, keep the parent's filesystem objects alive and never close them.

        See NOTE [ fsspec after fork ] in ``fsspec_common.py``."""
        stale = self.__dict__.get("_fs")
        if stale is None or self.__dict__.get("_owner_pid") == os.getpid():
            return
        INHERITED.append((stale, self.__dict__.pop("_fobj", None), self.__dict__.pop("_file", None),
                          self.__dict__.pop("_stage", None)))  # (its thread is the parent's: left as it is)
        INHERITED.extend(getattr(type(stale), "_cache", {}).values())
        self.__dict__.pop("_dsets", None)

    def _close(self) -> None:
        if self.__dict__.get("_owner_pid") not in (None, os.getpid()):
            self._keep_parent_handles()
            return
        super()._close()
        stage = self.__dict__.pop("_stage", None)
        if stage is not None:
            stage.close()
        self.__dict__.pop("_range_fs", None)
        self.__dict__.pop("_range_spans", None)
        fobj = self.__dict__.pop("_fobj", None)
        if fobj is not None:
            fobj.close()
        self.__dict__.pop("_npy", None)

    @property
    def kind(self) -> str:
        """``"hdf5"`` or ``"npy"``: what the URL turned out to hold."""
        self.ensure_open()
        return "npy" if self._npy is not None else "hdf5"

    def keys(self) -> list[str]:
        self.ensure_open()
        if self._npy is None:
            with h5_errors(self.url, "listing its datasets"):
                return super().keys()
        return self._npy.keys()

    def broken_links(self) -> dict[str, str]:
        self.ensure_open()
        return {} if self._npy is not None else super().broken_links()

    def info(self, key: str) -> ArrayInfo:
        self.ensure_open()
        if self._npy is None:
            with h5_errors(self.url, f"reading the metadata of {key!r}"):
                return super().info(key)
        return self._npy.array(key).info

    def attrs(self, key: str = "/") -> dict[str, Any]:
        self.ensure_open()
        if self._npy is None:
            with h5_errors(self.url, "reading attributes"):
                return super().attrs(key)
        return self._npy.attrs_of(key)

    def serializes_reads(self, key: str) -> bool:
        """HDF5 through a file object: every read is an h5py call (its lock held while the file
        object fetches), or else one call whose byte ranges are requested concurrently already
        (NOTE [ Remote rows by byte ranges ]): request threads would add nothing; ``.npy`` byte
        ranges: no lock."""
        self.ensure_open()
        return self._npy is None

    def _range_span(self, key: str):
        """NOTE [ Remote rows by byte ranges ]: an HDF5 dataset whose rows are plain bytes in the
        file (contiguous, or unfiltered chunks of whole rows: ``_Span.of``, as for local direct
        reads) is read by its byte ranges, every range of a call requested at once (fsspec's
        ``cat_ranges``: concurrent requests on http and s3), instead of through h5py, which
        fetches one ``block_size`` block at a time under its lock. The offsets come from the
        file's metadata, read once through h5py. A call for less than one ``block_size`` of rows
        still goes through h5py and its block cache (one request at most, and its neighbours
        cached); ``backend_options={"direct_reads": False}`` reads every call through h5py.

        A remote URL neither spills nor stages to node-local disk unless told where: what is
        node-local (and how large, and whether it is memory in disguise, as a tmpfs ``/tmp``
        is) differs between machines, and a library that fills a disk it was not given fails
        someone else's job. By default the buffer keeps what the plan keeps, read once, and the
        misses are read again each epoch by these ranges: one request per row of a shuffled
        pass, far below the link's throughput for rows of a few hundred KiB (a pass wants a few
        rows in every region of the file: no coalescing makes large requests of them). Two ways
        to put disk to use, both opt-in: ``backend_options={"stage": dir}`` copies the whole
        file there in large concurrent pieces while it is read (NOTE [ Staging a remote file ]
        in fsspec_stage.py: the first epoch at about the link's throughput, later ones read
        local disk; what LitData and Streaming do with their chunks by default), and
        ``spill=(dir, size)`` lets the buffer keep more samples on that disk, raising the
        hit-rate bound."""
        spans = self.__dict__.get("_range_spans")
        if spans is None or self._file is None:
            return None
        if key not in spans:
            with h5_errors(self.url, f"reading the layout of {key!r}"):
                ok = self.options.get("direct_reads", True) and "::" not in self.url
                spans[key] = _Span.of(self._dset(key), self._file) if ok else None
        return spans[key]

    def scatter_ready(self, key: str) -> bool:
        """Whether :meth:`read_rows_to` reads ``key``'s rows straight into their places, or
        :meth:`mapped_rows` gives views of them: from a staged copy (NOTE [ Staging a remote
        file ]; ``read_rows_to`` reads a pass's rows in one buffer until the copy is complete)."""
        self.ensure_open()
        stage = self.__dict__.get("_stage")
        return stage is not None and self._range_span(key) is not None

    def _read_ranges(self, key: str, ranges: np.ndarray, out: "np.ndarray | RowPlaces | RowViews") -> None:
        if isinstance(out, RowViews):  # (mapped_rows) views of rows of a staged copy, or nothing
            self._view_staged(key, ranges, out)
            return
        if isinstance(out, RowPlaces):
            span = self._range_span(key)
            if self._stage is not None and self._stage.complete and span is not None and span.row:
                runs = [piece for start, stop in ranges.tolist() for piece in span.pieces(start, stop)]
                self._stage.rows_into(runs, out, span.row)
                self.stats.read_calls += int((ranges[:, 1] > ranges[:, 0]).sum())
                return
            info = self.info(key)  # (read into one buffer, then to the places)
            buf = np.empty((len(out), *info.row_shape), info.dtype)
            self._read_ranges(key, ranges, buf)
            for place, row in zip(out, buf):
                place[...] = row
            return
        if self._npy is not None:
            self.stats.read_calls += self._npy.read_into(key, ranges, out)
            return
        big = out.nbytes >= self.options.get("block_size", 1 << 20) or self._stage is not None
        span = self._range_span(key) if big else None
        if span is not None and out.flags.c_contiguous and out.flags.writeable:
            with h5_errors(self.url, f"reading the layout of {key!r}"):
                allocated = span.allocated(ranges)
            if allocated and self._stage is not None:
                self._read_staged(span, ranges, out)
                return
            if allocated:
                self._read_bytes(key, span, ranges, out)
                return
        # Local files are plain OS files (no fsspec cache): nothing to count but the reads.
        cache = getattr(getattr(self._fobj, "raw", None), "__dict__", {}).get("cache")
        before = getattr(cache, "miss_count", 0)
        with h5_errors(self.url, f"reading rows of {key!r}"):
            if self._dset(key).is_virtual:  # h5py crashes (SIGSEGV) reading one from a file object
                raise DatasetFormatError(
                    f"{self.url}: {key!r} is a virtual dataset (h5py.VirtualLayout), which HDF5 cannot "
                    "read through an fsspec file; open its local path instead (backend='hdf5'), or "
                    "`solar ingest` it into a regular file from a local path")
            super()._read_ranges(key, ranges, out)
        if cache is not None:
            self.stats.extra["block_misses"] = (self.stats.extra.get("block_misses", 0)
                                                + getattr(cache, "miss_count", 0) - before)

    def _fetch_ranges(self, starts: list[int], ends: list[int]) -> list:
        """Bytes ``[starts[i], ends[i])`` of the file, requested concurrently, each pinned to the
        version opened."""
        if self._etag is not None:  # s3: every range pinned to the version opened (412 otherwise)
            return s3_ranges(self._range_fs, self._path, starts, ends, self._etag)
        # (http: the filesystem's If-Match header pins them)
        return self._range_fs.cat_ranges([self._path] * len(starts), starts, ends, on_error="raise")

    def _view_staged(self, key: str, ranges: np.ndarray, out: RowViews) -> None:
        """``out`` gets a view per row, its rows copied when the batch is taken (NOTE [ Rows
        copied when the batch is taken ] in solar/slots.py), as a local mapped file's: of the
        staged copy's map once their pieces are there, or of the bytes requested directly for
        rows of pieces not on their way yet (:meth:`StagedFile.row_views`); nothing (read now
        instead) without a staged copy or where the rows are not plain bytes."""
        stage = self.__dict__.get("_stage")
        if stage is None:
            return
        span = self._range_span(key)
        if span is None or not span.row:
            return
        with h5_errors(self.url, f"reading the layout of {key!r}"):
            if not span.allocated(ranges):
                return
        info = self.info(key)
        pieces = [p for start, stop in ranges.tolist() for p in span.pieces(start, stop)]
        out.extend(stage.row_views(pieces, span.row, info.dtype, info.row_shape))
        out.check = stage.check
        self.stats.read_calls += int((ranges[:, 1] > ranges[:, 0]).sum())
        self._count_stage()

    def _fetch_piece(self, start: int, end: int) -> list:
        """Bytes ``[start, end)`` of the file, pinned to the version opened, as the byte strings
        received (s3 and http: not joined into one) or one."""
        if self._etag is not None:
            return s3_ranges(self._range_fs, self._path, [start], [end], self._etag, chunks=True)[0]
        if is_http(self._range_fs):
            return http_chunks(self._range_fs, self._path, start, end)
        return self._fetch_ranges([start], [end])

    def _read_staged(self, span, ranges: np.ndarray, out: np.ndarray) -> None:
        """Rows of ``ranges`` from the staged copy (NOTE [ Staging a remote file ])."""
        runs = [piece for start, stop in ranges.tolist() for piece in span.pieces(start, stop)]
        self._stage.read_into(runs, memoryview(out.reshape(-1).view(np.uint8)))
        self.stats.read_calls += int((ranges[:, 1] > ranges[:, 0]).sum())
        self._count_stage()

    def _count_stage(self) -> None:
        """``stats.extra["stage_requests"]``: the staged copy's requests since the last count."""
        made = self._stage.requests + self._stage.direct_requests
        self.stats.extra["stage_requests"] = self.stats.extra.get("stage_requests", 0) + made - self._stage_counted
        self._stage_counted = made

    def _read_bytes(self, key: str, span, ranges: np.ndarray, out: np.ndarray) -> None:
        """Rows of ``ranges`` by byte ranges (NOTE [ Remote rows by byte ranges ]), pieces of at
        most ``RANGE_BYTES`` requested together, each copied once into its place in ``out``."""
        starts, ends, at = [], [], []
        pos = 0
        for start, stop in ranges.tolist():
            for off, n in span.pieces(start, stop):
                for a in range(0, n, RANGE_BYTES):
                    k = min(RANGE_BYTES, n - a)
                    starts.append(off + a)
                    ends.append(off + a + k)
                    at.append(pos + a)
                pos += n
        if not starts:
            return
        with url_errors(self.url, f"reading rows of {key!r}"):
            got = self._fetch_ranges(starts, ends)
        flat = out.reshape(-1).view(np.uint8)
        for b, a, s_, e in zip(got, at, starts, ends):
            if isinstance(b, BaseException):
                raise b
            if len(b) != e - s_:
                raise StorageError(f"{self.url}: got {len(b)} of {e - s_} bytes at offset {s_} reading {key!r}; "
                                   f"{CHANGED}")
            flat[a:a + len(b)] = np.frombuffer(b, np.uint8)
        self.stats.read_calls += int((ranges[:, 1] > ranges[:, 0]).sum())
        self.stats.extra["range_requests"] = self.stats.extra.get("range_requests", 0) + len(starts)
