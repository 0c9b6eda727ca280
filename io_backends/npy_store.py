"""``.npy`` stores on any fsspec filesystem: directories (or URL prefixes) of plain ``.npy``
shards, or one ``.npy`` file, read by byte ranges.

Rows are read with ``fs.cat_ranges``: one byte range per contiguous run of rows (adjacent ranges
coalesced), fetched concurrently by async filesystems (http, s3). No block cache: the bytes asked
for are the bytes moved. The ``fsspec`` backend (:mod:`solar.io_backends.fsspec`) reads a URL
through :class:`NpyStore` when it holds one.

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

import errno
import io
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from solar.errors import DatasetFormatError, MissingKeyError, StorageError

from .base import ArrayInfo
from .fsspec_common import full_url, range_hint, transport_error, url_errors, url_to_fs
from .npy_format import npy_header

__all__ = ["NpyStore", "write_npy_store"]

_SHARD = re.compile(r"^(?P<key>.+)\.(?P<idx>\d+)$")


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
                    err = transport_error(path, head, "reading the .npy header")
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
                f"{full_url(self.fs, path)}: its .npy header promises {rows} rows of shape {shape[1:]} {dtype} "
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

    def array(self, key: str) -> _NpyArray:
        try:
            return self.arrays[key]
        except KeyError:
            raise MissingKeyError(f"{self.url}: no array {key!r}; keys: {', '.join(self.arrays)}") from None

    def keys(self) -> list[str]:
        """Every key: the stored field order (root attribute ``fields``) first, the rest in name order."""
        order = self.attrs.get("/", {}).get("fields")
        keys = list(self.arrays)
        if order:
            order = json.loads(order) if isinstance(order, str) else order
            keys = [k for k in order if k in self.arrays] + [k for k in keys if k not in order]
        return keys

    def attrs_of(self, key: str = "/") -> dict[str, Any]:
        """The attributes of array or group ``key`` (``attrs.json``; none: empty)."""
        key = "/" if key in ("", "/") else key
        if key != "/" and key not in self.arrays and not any(k.startswith(key + "/") for k in self.arrays):
            raise MissingKeyError(f"{self.url}: no array or group {key!r}")
        return dict(self.attrs.get(key, {}))

    def read_into(self, key: str, ranges: np.ndarray, out: np.ndarray) -> int:
        """Read rows ``ranges`` of ``key`` into ``out`` with one ``cat_ranges`` call (one byte
        range per run of rows, adjacent ones merged); the number of byte ranges read."""
        self.array(key)
        paths, starts, ends = self.byte_ranges(key, ranges)
        if not paths:
            return 0
        with url_errors(self.url, f"reading rows of {key!r}"):
            blobs = self.fs.cat_ranges(paths, starts, ends)
        flat = out.reshape(-1).view(np.uint8) if out.flags.c_contiguous else None
        dst = flat if flat is not None else np.empty(out.nbytes, np.uint8)
        pos = 0
        for path, blob, s, e in zip(paths, blobs, starts, ends):
            self._check_blob(full_url(self.fs, path), key, blob, s, e)
            dst[pos:pos + len(blob)] = np.frombuffer(blob, np.uint8)
            pos += len(blob)
        if flat is None:
            out[...] = dst.view(out.dtype).reshape(out.shape)
        return len(paths)

    def _check_blob(self, shard: str, key: str, blob, s: int, e: int) -> None:
        """Raise unless ``blob`` (what ``cat_ranges`` gave for bytes ``s..e`` of ``shard``) is those bytes."""
        if isinstance(blob, FileNotFoundError):  # listed at open, gone now
            raise FileNotFoundError(
                errno.ENOENT, f"{shard}: this shard of {key!r} was in the store when {self.url} was opened "
                "and is gone now (deleted or renamed while in use); restore it, or reopen the dataset "
                "if the store was rewritten") from blob
        if isinstance(blob, Exception) and _range_not_satisfiable(blob):
            raise StorageError(_shorter_than_header(shard, key, s, e)) from blob
        if isinstance(blob, Exception):
            err = transport_error(shard, blob, f"reading bytes {s}-{e} of {key!r}")
            raise (err or OSError(f"{self.url}: reading bytes {s}-{e} of {key!r} failed: {blob}")) from blob
        if len(blob) > e - s:  # more than asked: the server answered a Range request with the whole file
            raise StorageError(range_hint(shard))
        if len(blob) != e - s:  # as a 416 over http
            raise StorageError(_shorter_than_header(shard, key, s, e, len(blob)))


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


def write_npy_store(url: str, arrays: dict[str, np.ndarray], attrs: dict[str, dict[str, Any]] | None = None,
                    shard_rows: int | None = None, **storage_options: Any) -> None:
    """Write ``arrays`` as a ``.npy`` store at ``url`` (see NOTE [ npy store layout ]).

    Args:
        url: directory URL.
        arrays: key -> array with a leading sample axis.
        attrs: optional ``{"/": {...}, key: {...}}`` written to ``attrs.json``.
        shard_rows: split each array into shards of this many rows (``None``: one file per key).
    """
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
