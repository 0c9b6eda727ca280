"""Serial HDF5 through h5py: one ``read_direct`` per contiguous row range, straight into ``out``."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np

from .base import ArrayInfo, Backend

__all__ = ["HDF5Backend", "h5_keys", "h5_attrs", "h5_read_errors", "read_rows"]


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


@contextlib.contextmanager
def h5_read_errors(url: str, key: str, ranges) -> Iterator[None]:
    """Re-raise h5py's own read failure (a plain ``OSError`` such as "data error detected by
    Fletcher32 checksum") as a :class:`~solar.StorageError` naming the file, dataset and rows;
    anything else passes (transport errors keep their types for the caller to classify)."""
    try:
        yield
    except OSError as exc:
        if type(exc) is not OSError:
            raise
        from solar.errors import StorageError

        msg = str(exc)
        rows = f"rows {int(ranges[0][0])}-{int(ranges[-1][1]) - 1}" if len(ranges) else "no rows"
        damaged = any(w in msg.lower() for w in ("checksum", "data error", "filter", "inflate", "decompress"))
        todo = ("its stored chunks are damaged (an HDF5 filter or checksum failed): copy the file again or "
                "regenerate it" if damaged else "check that the file is intact and readable with h5py")
        raise StorageError(f"{url}: reading {rows} of {key!r} failed ({msg}); {todo}") from exc


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
        return ("_file", "_dsets", "_keys", "_broken", "_fd")

    def _open_file(self):
        import h5py

        return h5py.File(self.url, "r", rdcc_nbytes=self.options.get("rdcc_nbytes", 4 << 20))

    def _open(self) -> None:
        try:
            self._file = self._open_file()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.url}: no such HDF5 file; check the path") from exc
        except OSError as exc:
            raise OSError(f"{self.url}: cannot open as HDF5 ({exc}); is it an HDF5 file?") from exc
        self._dsets: dict[str, Any] = {}
        self._keys: list[str] | None = None
        self._pin_size()

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
            from solar.errors import StorageError

            raise StorageError(
                f"{self.url}: the file shrank from {pinned} to {size} bytes while open (truncated, or being "
                "rewritten in place), so rows past the cut would read as zeros; recreate the dataset once the "
                "file is complete again (write a new file and rename it over the old one)")

    def _close(self) -> None:
        self.__dict__.pop("_fd", None)  # HDF5 closes the descriptor with the file
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
                raise KeyError(f"{self.url}: no dataset {key!r}") from None
            if not hasattr(d, "shape"):  # a group: rows are read from datasets only
                raise KeyError(f"{self.url}: {key!r} is a group, not a dataset; keys: {', '.join(self.keys())}")
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

    def _read_ranges(self, key: str, ranges: np.ndarray, out: np.ndarray) -> None:
        self.stats.read_calls += read_rows(self._dset(key), self.url, key, ranges, out)
        self._check_size()  # after the read: a cut during it is caught too
