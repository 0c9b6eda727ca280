"""Any fsspec URL (``file://``, ``http(s)://``, ``s3://``, ``memory://`` ...): HDF5 files through
block-cached file objects, and directories of plain ``.npy`` shards read by byte ranges.

Two container kinds, chosen from the URL when the backend opens:

* **An HDF5 file** (any URL that is a file and does not end in ``.npy``): h5py reads it through an
  fsspec file object opened with ``block_size``/``cache_type``, so its many small metadata reads
  and the data reads hit a block cache instead of making one HTTP/S3 request each.
* **A ``.npy`` store**: a directory (or URL prefix) of ``.npy`` files, or one ``.npy`` file.
  See NOTE [ npy store layout ]. Rows are read with ``fs.cat_ranges``: one byte range per
  contiguous run of rows (adjacent ranges coalesced), fetched concurrently by async
  filesystems (http, s3). No block cache: the bytes asked for are the bytes moved.

NOTE [ npy store layout ]
    Keys are file paths relative to the directory with ``.npy`` removed, ``/``-separated:
    ``x.npy`` is key ``x``, ``x/data.npy`` is key ``x/data``, ``_solar/checksum/x.npy`` is key
    ``_solar/checksum/x`` -- so a SOLAR file's datasets map one to one onto a directory.
    A key may be split into **shards** along the sample axis: ``x.00000.npy``, ``x.00001.npy``
    ... (a dot and digits before ``.npy``) are concatenated in numeric order into key ``x``;
    shards must agree in dtype and row shape. Attributes come from an optional ``attrs.json`` at
    the top: ``{"/": {root attrs}, "x": {attrs of key x}}``. Arrays must be C-ordered.
    A single ``.npy`` URL is a store with one key, the file's stem.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import urlsplit

import numpy as np

from solar.errors import ConfigError, DatasetFormatError, MissingDependencyError, SolarError, StorageError
from solar.io_backends.npy_format import npy_header

from .base import ArrayInfo, Backend
from .hdf5 import HDF5Backend

__all__ = ["FsspecBackend", "NpyStore", "write_npy_store", "npy_header", "url_to_fs", "missing_protocol_error"]

# NOTE [ fsspec after fork ]
#     A forked child inherits the parent's asyncio event loop *and its epoll instance*, which the
#     kernel shares between both processes. If the child lets the parent's async filesystem (http,
#     s3) or its sessions be garbage-collected, their finalizers close the pooled connections, and
#     each close deregisters its socket from the shared epoll set -- the parent then never hears
#     the answer to its next request on that socket and hangs (found by the conformance suite's
#     fork test: an S3 session left as cyclic garbage by an earlier test was collected in the
#     child and froze the parent's next HTTP request). So (1) a child that reopens keeps the
#     filesystem objects it inherited alive and opens fresh ones of its own, and (2) every forked
#     child freezes the garbage collector's view of what it inherited (``gc.freeze``), so
#     inherited garbage is never finalized there; the parent collects it. Children exit with
#     ``os._exit``, which runs no finalizers.
_INHERITED: list[Any] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=gc.freeze)

# NOTE [ No garbage collection while h5py reads through fsspec ]
#     h5py holds its global lock ("phil") for the whole of a call, and an HDF5 file on an fsspec
#     file object calls back into Python for every read, which waits on fsspec's event-loop thread.
#     If a garbage collection runs in that thread meanwhile and finalizes an h5py object left in a
#     reference cycle (any earlier unclosed h5py handle), the finalizer waits for phil: the loop
#     waits for the reader, the reader for the loop, forever (seen in CI: an ingest of an HTTP
#     input hung, its loop thread in gc_collect_main -> h5py ObjectID.__dealloc__ -> phil). So
#     automatic collection is paused while any h5py call over fsspec runs (process-wide, counted
#     across threads) and resumed after the last one; garbage is collected then, outside phil.
_GC_LOCK = threading.Lock()
_GC_PAUSED = [0, False]  # active h5py-over-fsspec calls; whether collection was enabled before


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    with _GC_LOCK:
        if _GC_PAUSED[0] == 0:
            _GC_PAUSED[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSED[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSED[0] -= 1
            if _GC_PAUSED[0] == 0 and _GC_PAUSED[1]:
                gc.enable()

# NOTE [ Storage errors name the URL ]
#     fsspec passes its transports' exceptions through: aiohttp's ClientResponseError (an HTTP
#     403, 500 ...; not an OSError), botocore's EndpointConnectionError (an S3 endpoint nobody
#     answers), a plain ValueError when an HTTP server ignores Range requests. None of them says
#     which dataset URL failed or what to do, and callers catching OSError miss most of them.
#     Every storage call of this backend goes through ``_storage_errors``, which re-raises them as
#     :class:`solar.StorageError` (an ``OSError``) naming the URL and what to check, the original
#     exception chained; FileNotFoundError and SOLAR's own errors pass through unchanged.
_NO_RANGES = "support range requests"  # fsspec's HTTPFile message for a 200 to a Range request


_CHANGED = ("the file changed since it was opened (its ETag or modification time no longer matches); "
            "reopen the dataset to read the new version")


def _range_not_satisfiable(exc: BaseException) -> bool:
    """Whether ``exc`` says that a byte range starts past the end of the file: HTTP 416, or S3's
    ``InvalidRange`` (which s3fs turns into an ``OSError(EINVAL)``, the ClientError chained)."""
    if isinstance(getattr(exc, "status", None), int) and type(exc).__module__.startswith("aiohttp"):
        return exc.status == 416
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)  # botocore's ClientError
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "InvalidRange":
            return True
    return isinstance(exc, OSError) and exc.errno == errno.EINVAL and "range is not satisfiable" in str(exc)


def _shorter_than_header(shard: str, key: str, start: int, end: int, got: int | None = None) -> str:
    """What a read past the end of a ``.npy`` shard means: its size was checked against its
    header at open (:meth:`NpyStore._check_size`), so the file changed since."""
    short = f"got {got} of bytes {start}-{end}" if got is not None else f"bytes {start}-{end} are past its end"
    return (f"{shard}: this shard of {key!r} is shorter than its .npy header says ({short}): it was truncated "
            "or replaced since it was opened; reopen the dataset to read the new version, or restore the file")


def _range_hint(url: str) -> str:
    return (f"{url}: the server ignores HTTP Range requests (it sends the whole file instead of the bytes "
            "asked for), so rows cannot be read by byte ranges; serve the file from a server that supports "
            "them (nginx, Apache, S3 ...) or copy it to a local path")


def _storage_error(url: str, exc: BaseException, doing: str, hdf5: bool = False) -> StorageError | None:
    """The :class:`StorageError` for a transport exception, or None to let ``exc`` through.

    ``hdf5``: ``exc`` came through h5py, whose own errors (a file that is not HDF5 ...) are
    plain ``OSError``s; those pass through for the caller to report as format errors."""
    if isinstance(exc, (SolarError, FileNotFoundError)):
        return None
    if isinstance(exc, ValueError) and _NO_RANGES in str(exc):
        return StorageError(_range_hint(url))
    name, mod = type(exc).__name__, type(exc).__module__ or ""
    status = getattr(exc, "status", None)
    if mod.startswith("aiohttp") and isinstance(status, int):  # ClientResponseError: an HTTP status
        if status == 412:
            todo = _CHANGED
        elif status in (401, 403):
            todo = "check that you may read it (file permissions; credentials or tokens in storage_options)"
        elif status >= 500:
            todo = "the server failed; retry later or check the server's logs"
        else:
            todo = "check the URL"
        return StorageError(f"{url}: the server answered HTTP {status} {getattr(exc, 'message', '')} while {doing}; "
                            f"{todo}")
    if name == "FileExpired":  # s3fs: the object's ETag changed since the open
        return StorageError(f"{url}: {doing} failed: {_CHANGED}")
    if mod.startswith(("botocore", "aiobotocore")) and ("Endpoint" in name or "Connect" in name):
        return StorageError(f"{url}: cannot connect to the S3 endpoint while {doing} ({exc}); check "
                            "storage_options['client_kwargs']['endpoint_url'] and that the service is up")
    if mod.startswith("aiohttp") and "Connect" in name:
        return StorageError(f"{url}: cannot connect to the server while {doing} ({exc}); check the host and "
                            "port in the URL and that the server is up")
    if isinstance(exc, PermissionError):
        return StorageError(f"{url}: access denied while {doing} ({exc}); check the credentials in "
                            "storage_options and the file's permissions")
    if (isinstance(exc, OSError) and not (hdf5 and type(exc) is OSError)) or \
            mod.startswith(("aiohttp", "botocore", "aiobotocore")):
        return StorageError(f"{url}: {doing} failed ({name}: {exc}); check the URL, storage_options and that "
                            "the service is up")
    return None


@contextlib.contextmanager
def _storage_errors(url: str, doing: str, hdf5: bool = False) -> Iterator[None]:
    """Re-raise transport exceptions as :class:`StorageError` (NOTE [ Storage errors name the URL ])."""
    try:
        if hdf5:  # an h5py call over an fsspec file: NOTE [ No garbage collection while h5py ... ]
            with _gc_paused():
                yield
        else:
            yield
    except TypeError as exc:
        if "keyword argument" not in str(exc):
            raise
        raise ConfigError(f"{url}: a storage option is not accepted by this URL's filesystem ({exc}) while "
                          f"{doing}; check the keys of storage_options (and of its client_kwargs / "
                          "config_kwargs) against the fsspec implementation for this protocol") from exc
    except Exception as exc:  # noqa: BLE001 - classified by _storage_error, else re-raised as is
        err = _storage_error(url, exc, doing, hdf5)
        if err is None:
            raise
        raise err from exc


def missing_protocol_error(url: str, exc: ImportError | None = None) -> MissingDependencyError | None:
    """The :class:`MissingDependencyError` for ``url`` when a protocol of it (each part of a
    ``a::b://`` chain) lacks its package (NOTE [ What an fsspec protocol needs ] in
    ``solar/capabilities.py``), naming the protocol, the package, fsspec's own hint and the pip
    command; None when every protocol's packages are found and ``exc`` (an ImportError fsspec
    raised for ``url``) names no module either."""
    from fsspec.core import split_protocol
    from fsspec.registry import known_implementations

    from solar.capabilities import fsspec_protocol_missing, pip_name

    protocols = [split_protocol(part)[0] or "file" for part in url.split("::")]
    proto, missing = protocols[-1], []
    for p in protocols:
        missing = fsspec_protocol_missing(p) or []
        if missing:
            proto = p
            break
    if not missing and exc is not None:
        # fsspec's ImportError for a class that does not import chains the ModuleNotFoundError
        name = next((e.name for e in (exc, exc.__cause__, exc.__context__) if getattr(e, "name", None)), None)
        missing = [name.partition(".")[0]] if name else []
    if not missing:
        return None
    pkgs = list(dict.fromkeys(map(pip_name, missing)))
    what = f"package {pkgs[0]}, which is" if len(pkgs) == 1 else f"packages {', '.join(pkgs)}, which are"
    hint = known_implementations.get(proto, {}).get("err")
    return MissingDependencyError(
        f"{url}: the {proto}:// protocol needs the {what} not installed{f' (fsspec: {hint})' if hint else ''}; "
        f"install it with `pip install {' '.join(pkgs)}`")


def url_to_fs(url: str, **storage_options: Any):
    """``fsspec.core.url_to_fs``, except that a protocol whose package is missing raises
    :func:`missing_protocol_error` instead of fsspec's bare ImportError (or the
    ModuleNotFoundError of a filesystem that imports its package when made: ``hdfs``)."""
    from fsspec.core import url_to_fs as fsspec_url_to_fs

    try:
        return fsspec_url_to_fs(url, **storage_options)
    except ImportError as exc:
        err = None if isinstance(exc, MissingDependencyError) else missing_protocol_error(url, exc)
        if err is None:
            raise
        raise err from exc


def _protocols(fs) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _is_http(fs) -> bool:
    return "http" in _protocols(fs)


def _full_url(fs, path: str) -> str:
    """``path`` of ``fs`` as the user can open it: with its protocol (s3fs's paths have none:
    ``bucket/x.npy``), a local path as it is."""
    return path if {"file", "local"} & set(_protocols(fs)) else fs.unstrip_protocol(path)


class _WholeReads:
    """An fsspec file for h5py that raises on a short read inside the size seen at open.

    Why: a file replaced by a shorter one, or truncated, after the open answers fsspec's range
    requests with fewer bytes (or a 416 that fsspec turns into none); h5py's file-object driver
    then leaves the rest of its buffer as it was, and rows came back as garbage or as other
    rows' bytes, silently. (A file replaced by one of the same size is refused by the server:
    ``If-Match`` with the ETag seen at open, for HTTP; s3fs checks the ETag itself.)"""

    def __init__(self, fobj, url: str, size: int | None) -> None:
        self._f, self._url = fobj, url
        self.raw = fobj  # the fsspec file (its block cache's counters)
        self._size = size if size is not None else getattr(fobj, "size", None)

    def _short(self, at: int, want: int, got: int) -> None:
        end = min(at + want, self._size) if self._size is not None else at + want
        if at + got < end:
            raise StorageError(f"{self._url}: got {got} of {end - at} bytes at offset {at} of a {self._size}-byte "
                               "file; it changed (shrank or was replaced) since it was opened. Reopen the "
                               "dataset to read the new version")

    def read(self, n: int = -1) -> bytes:
        at = self._f.tell()
        data = self._f.read(n)
        if n is not None and n >= 0:
            self._short(at, n, len(data))
        return data

    def readinto(self, buf) -> int:
        at = self._f.tell()
        got = self._f.readinto(buf)
        self._short(at, memoryview(buf).nbytes, got or 0)
        return got

    def seek(self, *args):
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __getattr__(self, name):
        return getattr(self._f, name)


_SHARD = re.compile(r"^(?P<key>.+)\.(?P<idx>\d+)$")
_STORE_OPTIONS = ("block_size", "cache_type", "rdcc_nbytes", "storage_options", "cache_options")


@dataclass(frozen=True)
class _Shard:
    path: str
    rows: int
    offset: int  # byte offset of row 0 in the file


@dataclass
class _NpyArray:
    info: ArrayInfo
    shards: list[_Shard]
    starts: np.ndarray  # first row of each shard, plus the total at the end


class NpyStore:
    """The ``.npy`` shard index of one directory (or one file) on an fsspec filesystem."""

    def __init__(self, fs, root: str, url: str, is_dir: bool | None = None, info: dict | None = None) -> None:
        """``info``: the filesystem's info of ``root`` when the caller has it (one request less)."""
        self.fs, self.root, self.url = fs, root.rstrip("/"), url
        self.arrays: dict[str, _NpyArray] = {}
        self.attrs: dict[str, dict[str, Any]] = {}
        if fs.isdir(self.root) if is_dir is None else is_dir:
            found = fs.find(self.root, detail=True)
            files = sorted(p for p in found if p.endswith(".npy"))
            sizes = {p: found[p].get("size") for p in files}
            names = {p: p[len(self.root) + 1:-len(".npy")] for p in files}
            if fs.exists(f"{self.root}/attrs.json"):
                self.attrs = json.loads(fs.cat_file(f"{self.root}/attrs.json"))
        else:  # one file; its URL may carry a query (a presigned URL's signature)
            files = [self.root]
            sizes = {self.root: (info if info is not None else fs.info(self.root)).get("size")}
            names = {self.root: urlsplit(self.root).path.rsplit("/", 1)[-1][:-len(".npy")]}
            self.root = self.root.rsplit("/", 1)[0]
        if not files:
            raise DatasetFormatError(f"{url}: no .npy files found; expected NAME.npy or NAME.00000.npy shards")
        groups: dict[str, list[tuple[int, str]]] = {}
        for path in files:
            rel = names[path]
            m = _SHARD.match(rel)
            key, idx = (m["key"], int(m["idx"])) if m else (rel, -1)
            groups.setdefault(key, []).append((idx, path))
        # One request for the headers of every file (async filesystems fetch them concurrently).
        paths = [p for key in groups for _, p in sorted(groups[key])]
        heads = dict(zip(paths, fs.cat_ranges(paths, [0] * len(paths), [4096] * len(paths))))
        for key, members in groups.items():
            idx = sorted(i for i, _ in members)
            if len(members) > 1 and idx != list(range(len(idx))):  # NAME.00000.npy, NAME.00001.npy ...
                gap = next(i for i, j in enumerate(idx) if i != j)
                raise DatasetFormatError(
                    f"{url}: shard {gap:05d} of {key!r} ({key}.{gap:05d}.npy) is missing: its shards are "
                    f"numbered {', '.join(f'{i:05d}' for i in idx[:8])}{' ...' if len(idx) > 8 else ''}; "
                    "without it the rows after it would shift, so restore the shard (or rewrite the store)")
            shards, dtype, row_shape = [], None, None
            for _, path in sorted(members):
                head = heads[path]
                if isinstance(head, Exception):
                    err = _storage_error(path, head, "reading the .npy header")
                    raise (err or OSError(f"{path}: cannot read the .npy header ({head})")) from head
                try:
                    shape, dt, off = npy_header(head, path)
                except DatasetFormatError:
                    if len(head) < 4096:
                        raise
                    # a header longer than the first 4 KiB (many fields or a huge shape)
                    shape, dt, off = npy_header(fs.cat_file(path, start=0, end=1 << 20), path)
                if dtype is None:
                    dtype, row_shape = dt, shape[1:]
                elif dt != dtype or shape[1:] != row_shape:
                    raise DatasetFormatError(
                        f"{path}: shard has dtype {dt} rows {shape[1:]}, but earlier shards of {key!r} have "
                        f"{dtype} rows {row_shape}; every shard of a key must match")
                self._check_size(path, shape, dt, off, sizes[path])
                shards.append(_Shard(path, shape[0], off))
            starts = np.concatenate([[0], np.cumsum([s.rows for s in shards])]).astype(np.int64)
            self.arrays[key] = _NpyArray(ArrayInfo((int(starts[-1]), *row_shape), dtype), shards, starts)

    def _check_size(self, path: str, shape: tuple[int, ...], dtype: np.dtype, offset: int, size: Any) -> None:
        """Refuse a shard shorter than its header says (``size`` as the filesystem reports it;
        unknown, e.g. an HTTP listing or a server without Content-Length: not checked).

        Why: a truncated ``.npy`` (an interrupted copy or download) opened fine and failed only
        when a read reached its missing rows, in the middle of a training epoch or an ingest."""
        rows = shape[0]
        need = offset + rows * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if isinstance(size, (int, np.integer)) and size < need:
            raise DatasetFormatError(
                f"{_full_url(self.fs, path)}: its .npy header promises {rows} rows of shape {shape[1:]} {dtype} "
                f"({need} bytes with the header), but the file has {size} bytes: it is truncated (an interrupted "
                "copy or write?); write or copy it again")

    def byte_ranges(self, key: str, ranges: np.ndarray) -> tuple[list[str], list[int], list[int]]:
        """The (paths, starts, ends) byte ranges holding ``ranges`` of ``key``, adjacent ones merged."""
        arr = self.arrays[key]
        rb = arr.info.row_nbytes
        paths: list[str] = []
        starts: list[int] = []
        ends: list[int] = []
        for lo, hi in ranges.tolist():
            first = int(np.searchsorted(arr.starts, lo, side="right")) - 1
            while lo < hi:
                shard, s0 = arr.shards[first], int(arr.starts[first])
                stop = min(hi, s0 + shard.rows)
                b0, b1 = shard.offset + (lo - s0) * rb, shard.offset + (stop - s0) * rb
                if paths and paths[-1] == shard.path and ends[-1] == b0:
                    ends[-1] = b1  # coalesce with the previous range
                else:
                    paths.append(shard.path)
                    starts.append(b0)
                    ends.append(b1)
                lo, first = stop, first + 1
        return paths, starts, ends


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
    """

    name = "fsspec"

    def __init__(self, url, **options: Any) -> None:
        storage = dict(options.pop("storage_options", None) or {})
        storage.update({k: options.pop(k) for k in list(options) if k not in _STORE_OPTIONS})
        super().__init__(url, storage_options=storage, **options)

    def _handle_attrs(self):
        return (*super()._handle_attrs(), "_fs", "_fobj", "_npy")

    def _open(self) -> None:
        self._keep_parent_handles()
        with _storage_errors(self.url, "opening it"):
            self._fs, path = url_to_fs(self.url, **self.options["storage_options"])
        self._owner_pid = os.getpid()
        self._fobj = self._npy = None
        self._file = None
        self._dsets, self._keys = {}, None
        with _storage_errors(self.url, "opening it"):
            is_dir, info = self._probe(path)
            if is_dir or urlsplit(path).path.endswith(".npy"):
                self._npy = NpyStore(self._fs, path, self.url, is_dir, info)
                return
            self._check_same_version(info)
            kw = {} if "::" in self.url else {"cache_type": self.options.get("cache_type", "blockcache")}
            fs = self._fs
            if _is_http(fs):  # the server refuses (412) a file that changed since this open
                pin = {"If-Match": info["ETag"]} if info.get("ETag") else (
                    {"If-Unmodified-Since": info["Last-Modified"]} if info.get("Last-Modified") else {})
                if pin:  # through the filesystem's own headers: open(headers=) clashes with them
                    so = self.options["storage_options"]
                    fs = url_to_fs(self.url, **{**so, "headers": {**so.get("headers", {}), **pin}})[0]
            fobj = fs.open(path, "rb", block_size=self.options.get("block_size", 1 << 20),
                           cache_options=self.options.get("cache_options"), **kw)
            self._fobj = _WholeReads(fobj, self.url, info.get("size"))
        import h5py

        try:
            with _storage_errors(self.url, "opening it as HDF5", hdf5=True):
                self._file = h5py.File(self._fobj, "r", rdcc_nbytes=self.options.get("rdcc_nbytes", 4 << 20))
        except StorageError:
            self._fobj.close()
            raise
        except OSError as exc:
            self._fobj.close()
            raise DatasetFormatError(f"{self.url}: cannot open as HDF5 ({exc}); is it an HDF5 file "
                                     "or a directory of .npy files?") from exc

    def _check_same_version(self, info: dict) -> None:
        """Pin the file's version on the first open; a later open of this backend or of a copy of
        it (the dataset's request threads and workers get pickled copies, which open the URL
        anew) must find the same version.

        Why: the If-Match pin (HTTP) and s3fs's ETag check hold for one open file object only. A
        copy opened after the file was replaced read the new version while the dataset still used
        the old one's offsets and checksums: mixed versions, or a misleading "checksum fails,
        the file is damaged". The version is the ETag, modification time and size that the
        filesystem reports, whichever it has."""
        mine = {k: str(info[k]) for k in ("ETag", "LastModified", "Last-Modified", "mtime", "size")
                if info.get(k) is not None}
        pinned = self.__dict__.get("_version")
        if pinned is None:
            self._version = mine
        elif any(mine.get(k, v) != v for k, v in pinned.items()):
            raise StorageError(f"{self.url}: {_CHANGED}")

    def _probe(self, path: str) -> tuple[bool, dict]:
        """``(is it a directory, its info)`` in one metadata request.

        Why not ``isdir`` and ``exists``: over HTTP each of them GETs the whole body (to look for
        links in it), two whole-file downloads per open of an HDF5 file. ``info`` is one HEAD
        there; an HTTP "directory" is an index page: a URL ending in ``/`` or served as HTML."""
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            if _is_http(self._fs):  # fsspec reports any failed HEAD so; one byte's GET says why (403 ...)
                with contextlib.suppress(FileNotFoundError):  # a 404: fsspec's message is the bare URL
                    self._fs.cat_file(path, start=0, end=1)
            raise FileNotFoundError(f"{self.url}: no such file or directory; check the URL") from None
        if _is_http(self._fs):
            return path.endswith("/") or info.get("mimetype") == "text/html", info
        return info.get("type") == "directory", info

    def _keep_parent_handles(self) -> None:
        """In a forked child, keep the parent's filesystem objects alive and never close them.

        See NOTE [ fsspec after fork ]."""
        stale = self.__dict__.get("_fs")
        if stale is None or self.__dict__.get("_owner_pid") == os.getpid():
            return
        _INHERITED.append((stale, self.__dict__.pop("_fobj", None), self.__dict__.pop("_file", None)))
        _INHERITED.extend(getattr(type(stale), "_cache", {}).values())
        self.__dict__.pop("_dsets", None)

    def _close(self) -> None:
        if self.__dict__.get("_owner_pid") not in (None, os.getpid()):
            self._keep_parent_handles()
            return
        super()._close()
        fobj = self.__dict__.pop("_fobj", None)
        if fobj is not None:
            fobj.close()
        self.__dict__.pop("_npy", None)

    @property
    def kind(self) -> str:
        """``"hdf5"`` or ``"npy"``: what the URL turned out to hold."""
        self.ensure_open()
        return "npy" if self._npy is not None else "hdf5"

    def _array(self, key: str) -> _NpyArray:
        try:
            return self._npy.arrays[key]
        except KeyError:
            raise KeyError(f"{self.url}: no array {key!r}; keys: {', '.join(self._npy.arrays)}") from None

    def keys(self) -> list[str]:
        self.ensure_open()
        if self._npy is None:
            with _storage_errors(self.url, "listing its datasets", hdf5=True):
                return super().keys()
        order = self._npy.attrs.get("/", {}).get("fields")
        keys = list(self._npy.arrays)
        if order:  # stored field order first, the rest in name order
            order = json.loads(order) if isinstance(order, str) else order
            keys = [k for k in order if k in self._npy.arrays] + [k for k in keys if k not in order]
        return keys

    def broken_links(self) -> dict[str, str]:
        self.ensure_open()
        return {} if self._npy is not None else super().broken_links()

    def info(self, key: str) -> ArrayInfo:
        self.ensure_open()
        if self._npy is None:
            with _storage_errors(self.url, f"reading the metadata of {key!r}", hdf5=True):
                return super().info(key)
        return self._array(key).info

    def attrs(self, key: str = "/") -> dict[str, Any]:
        self.ensure_open()
        if self._npy is None:
            with _storage_errors(self.url, "reading attributes", hdf5=True):
                return super().attrs(key)
        key = "/" if key in ("", "/") else key
        if key != "/" and key not in self._npy.arrays and not any(k.startswith(key + "/") for k in self._npy.arrays):
            raise KeyError(f"{self.url}: no array or group {key!r}")
        return dict(self._npy.attrs.get(key, {}))

    def serializes_reads(self, key: str) -> bool:
        """HDF5 through a file object: every read is an h5py call (its lock held while the file
        object fetches); ``.npy`` byte ranges: no lock."""
        self.ensure_open()
        return self._npy is None

    def _read_ranges(self, key: str, ranges: np.ndarray, out: np.ndarray) -> None:
        if self._npy is None:
            # Local files are plain OS files (no fsspec cache): nothing to count but the reads.
            cache = getattr(getattr(self._fobj, "raw", None), "__dict__", {}).get("cache")
            before = getattr(cache, "miss_count", 0)
            with _storage_errors(self.url, f"reading rows of {key!r}", hdf5=True):
                if self._dset(key).is_virtual:  # h5py crashes (SIGSEGV) reading one from a file object
                    raise DatasetFormatError(
                        f"{self.url}: {key!r} is a virtual dataset (h5py.VirtualLayout), which HDF5 cannot "
                        "read through an fsspec file; open its local path instead (backend='hdf5'), or "
                        "`solar ingest` it into a regular file from a local path")
                super()._read_ranges(key, ranges, out)
            if cache is not None:
                self.stats.extra["block_misses"] = (self.stats.extra.get("block_misses", 0)
                                                    + getattr(cache, "miss_count", 0) - before)
            return
        self._array(key)
        paths, starts, ends = self._npy.byte_ranges(key, ranges)
        if not paths:
            return
        with _storage_errors(self.url, f"reading rows of {key!r}"):
            blobs = self._fs.cat_ranges(paths, starts, ends)
        flat = out.reshape(-1).view(np.uint8) if out.flags.c_contiguous else None
        dst = flat if flat is not None else np.empty(out.nbytes, np.uint8)
        pos = 0
        for path, blob, s, e in zip(paths, blobs, starts, ends):
            shard = _full_url(self._fs, path)
            if isinstance(blob, FileNotFoundError):  # listed at open, gone now
                raise FileNotFoundError(
                    errno.ENOENT, f"{shard}: this shard of {key!r} was in the store when {self.url} was opened "
                    "and is gone now (deleted or renamed while in use); restore it, or reopen the dataset "
                    "if the store was rewritten") from blob
            if isinstance(blob, Exception) and _range_not_satisfiable(blob):
                raise StorageError(_shorter_than_header(shard, key, s, e)) from blob
            if isinstance(blob, Exception):
                err = _storage_error(shard, blob, f"reading bytes {s}-{e} of {key!r}")
                raise (err or OSError(f"{self.url}: reading bytes {s}-{e} of {key!r} failed: {blob}")) from blob
            if len(blob) > e - s:  # more than asked: the server answered a Range request with the whole file
                raise StorageError(_range_hint(shard))
            if len(blob) != e - s:  # as a 416 over http
                raise StorageError(_shorter_than_header(shard, key, s, e, len(blob)))
            dst[pos:pos + len(blob)] = np.frombuffer(blob, np.uint8)
            pos += len(blob)
        if flat is None:
            out[...] = dst.view(out.dtype).reshape(out.shape)
        self.stats.read_calls += len(paths)


def write_npy_store(url: str, arrays: dict[str, np.ndarray], attrs: dict[str, dict[str, Any]] | None = None,
                    shard_rows: int | None = None, **storage_options: Any) -> None:
    """Write ``arrays`` as a ``.npy`` store at ``url`` (see NOTE [ npy store layout ]).

    Args:
        url: directory URL.
        arrays: key -> array with a leading sample axis.
        attrs: optional ``{"/": {...}, key: {...}}`` written to ``attrs.json``.
        shard_rows: split each array into shards of this many rows (``None``: one file per key).
    """
    import io

    fs, root = url_to_fs(url, **storage_options)
    root = root.rstrip("/")
    for key, a in arrays.items():
        a = np.ascontiguousarray(a)
        parts = [a] if not shard_rows else [a[i:i + shard_rows] for i in range(0, max(len(a), 1), shard_rows)]
        for i, part in enumerate(parts):
            name = f"{root}/{key}.npy" if not shard_rows else f"{root}/{key}.{i:05d}.npy"
            parent = name.rsplit("/", 1)[0]
            fs.makedirs(parent, exist_ok=True)
            buf = io.BytesIO()
            np.save(buf, part, allow_pickle=False)
            fs.pipe_file(name, buf.getvalue())
    if attrs:
        fs.pipe_file(f"{root}/attrs.json", json.dumps(attrs, default=_json_default).encode())


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"attribute value {v!r} is not JSON-serializable")
