"""HDF5 files on any fsspec filesystem, read by h5py through block-cached fsspec file objects.

h5py reads the file through an fsspec file object opened with ``block_size``/``cache_type``, so
its many small metadata reads and the data reads hit a block cache instead of making one HTTP/S3
request each. The ``fsspec`` backend (:mod:`solar.io_backends.fsspec`) opens a URL this way when
it is a file that does not end in ``.npy``; every h5py call it makes then goes through
:func:`h5_errors`.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Iterator

from solar.errors import DatasetFormatError, StorageError

from .fsspec_common import is_http, url_errors, url_to_fs

__all__ = ["h5_errors", "open_file_object", "open_h5", "pinned_fs"]

# NOTE [ No garbage collection while h5py reads through fsspec ]
#     h5py holds its global lock ("phil") for the whole of a call, and an HDF5 file on an fsspec
#     file object calls back into Python for every read, which waits on fsspec's event-loop thread.
#     If a garbage collection runs in that thread meanwhile and finalizes an h5py object left in a
#     reference cycle (any earlier unclosed h5py handle), the finalizer waits for phil: the loop
#     waits for the reader, the reader for the loop, forever (the loop thread stuck in
#     gc_collect_main -> h5py ObjectID.__dealloc__ -> phil). So automatic collection is paused
#     while any h5py call over fsspec runs (process-wide, counted across threads) and resumed
#     after the last one; garbage is collected then, outside phil.
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


@contextlib.contextmanager
def h5_errors(url: str, doing: str) -> Iterator[None]:
    """Around an h5py call over an fsspec file: transport errors become :class:`StorageError`
    (NOTE [ Storage errors name the URL ] in ``fsspec_common.py``), h5py's own ``OSError``s pass
    through, and no garbage collection runs meanwhile, see
    NOTE [ No garbage collection while h5py reads through fsspec ]."""
    with url_errors(url, doing, hdf5=True), _gc_paused():
        yield


def open_file_object(fs, path: str, url: str, info: dict, options: dict[str, Any]) -> "_WholeReads":
    """The block-cached file object h5py reads ``path`` through; over HTTP every request is pinned
    to the version ``info`` describes (the server refuses, 412, a file that changed since)."""
    kw = {} if "::" in url else {"cache_type": options.get("cache_type", "blockcache")}
    fs = pinned_fs(fs, url, info, options)
    fobj = fs.open(path, "rb", block_size=options.get("block_size", 1 << 20),
                   cache_options=options.get("cache_options"), **kw)
    return _WholeReads(fobj, url, info.get("size"))


def pinned_fs(fs, url: str, info: dict, options: dict[str, Any]):
    """``fs``, or over HTTP a filesystem whose every request is pinned to the version ``info``
    describes (``If-Match`` its ETag, else ``If-Unmodified-Since``: the server refuses, 412, a
    file that changed since)."""
    if not is_http(fs):
        return fs
    pin = {"If-Match": info["ETag"]} if info.get("ETag") else (
        {"If-Unmodified-Since": info["Last-Modified"]} if info.get("Last-Modified") else {})
    if not pin:
        return fs
    so = options["storage_options"]  # through the filesystem's own headers: open(headers=) clashes with them
    return url_to_fs(url, **{**so, "headers": {**so.get("headers", {}), **pin}})[0]


def open_h5(fobj: "_WholeReads", url: str, options: dict[str, Any]):
    """``h5py.File`` over ``fobj``; ``fobj`` is closed when that fails."""
    import h5py

    try:
        with h5_errors(url, "opening it as HDF5"):
            return h5py.File(fobj, "r", rdcc_nbytes=options.get("rdcc_nbytes", 4 << 20))
    except StorageError:
        fobj.close()
        raise
    except OSError as exc:
        fobj.close()
        raise DatasetFormatError(f"{url}: cannot open as HDF5 ({exc}); is it an HDF5 file "
                                 "or a directory of .npy files?") from exc


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
