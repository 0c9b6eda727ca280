"""Inputs of ``solar ingest``: ``.npy``/``.npz`` files and HDF5 datasets, local or fsspec URLs.

Each input becomes a :class:`Source`: a number of samples and, per field, the sample shape and
dtype, plus a way to read rows ``[lo, hi)`` of a field. Sources are small picklable descriptions
(rank 0 validates them all and broadcasts the plan); handles open lazily in the reading process.

How inputs map to fields
    * ``X.npy``: one field, named ``x`` (or the one name given with ``--fields``).
    * ``X.npz``: one field per array in the archive, named as in the archive.
    * ``X.h5`` (any other name): every dataset with a leading sample axis, as in
      :func:`solar.layout.describe_fields`; ``X.h5:/path/to/dset`` picks one dataset, named by
      its last path component.
    * ``NAME=FILE``: fields from separate files, one array each (``x=X.npy y=Y.npy``): the
      ``i``-th file of each name give the same samples, so every name needs as many files, with
      equally many samples, and ``--fields`` is not used. A path that exists as written (a file
      named ``a=b.npy``) is a plain input.
    * ``--fields a b`` keeps only those fields, in that order; ``--fields new=old`` renames. For
      HDF5 a key is a dataset's path or, if unambiguous, its last component, and only the named
      datasets are described: the file's others may have another length (or be scalars).

One sample per file or many
    ``samples="axis0"``: each array's leading axis indexes samples. ``samples="file"``: each file
    is one sample (the whole array). ``samples="auto"`` (default): ``file`` when there are two or
    more ``.npy``/``.npz`` inputs and all of them have identical array shapes, else ``axis0``
    (``solar ingest`` says on stderr when ``auto`` chose ``file``: equal-length runs look alike).
    HDF5 inputs always have a leading sample axis.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from solar.errors import DatasetFormatError, InputError, MissingDependencyError
from solar.io_backends import open_backend
from solar.io_backends.fsspec import missing_protocol_error, url_to_fs
from solar.io_backends.npy_format import npy_array
from solar.layout import describe_fields, name_matches, tensor_dtype_ok

__all__ = ["Source", "ZippedSource", "FieldInfo", "open_sources", "parse_field_args", "input_kind", "digest_ranges"]


@dataclass(frozen=True)
class FieldInfo:
    shape: tuple[int, ...]  # one sample's shape
    dtype: np.dtype


def input_kind(url: str) -> str:
    base = url.split("::")[0].rstrip("/")
    path = base.rsplit(":", 1)[0] if _h5_dataset_suffix(base) else base
    if "://" in path:  # by the URL's path: a presigned URL carries a query after it
        path = urlsplit(path).path
    if path.endswith(".npy"):
        return "npy"
    if path.endswith(".npz"):
        return "npz"
    return "hdf5"


def _h5_dataset_suffix(url: str) -> str | None:
    """``"/path/dset"`` for ``file.h5:/path/dset`` (the part after the last ``:`` when it starts with /)."""
    head, sep, tail = url.rpartition(":")
    if sep and tail.startswith("/") and not tail.startswith("//") and head and not head.endswith(":"):
        return tail
    return None


def parse_field_args(fields: list[str] | None) -> list[tuple[str, str]] | None:
    """``["a", "b=c"]`` -> ``[("a", "a"), ("b", "c")]`` (output name, input key)."""
    if not fields:
        return None
    out = []
    for f in fields:
        name, _, key = f.partition("=")
        if not name or (_ and not key):
            raise InputError(f"--fields entry {f!r} is not NAME or NAME=KEY")
        out.append((name, key or name))
    return out


#: What :meth:`Source.content_digest` reads of an input: its first and last ``DIGEST_EDGE`` bytes
#: and ``DIGEST_BLOCKS`` blocks of ``DIGEST_BLOCK`` bytes evenly spaced between them.
DIGEST_EDGE, DIGEST_BLOCK, DIGEST_BLOCKS = 64 << 10, 16 << 10, 8


def digest_ranges(size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` byte ranges of a ``size``-byte input that its content digest covers.

    Why these: the ends hold headers (``.npy``, HDF5 superblock and metadata) and the data's
    first and last rows, the evenly spaced blocks sample the rest, so a regenerated input
    (new values throughout) changes the digest. At most 256 KiB per input whatever its size
    (the whole file below that): a resume fingerprints thousands of inputs in seconds, and an
    object store serves each input's ranges in one concurrent request batch."""
    if size <= 2 * DIGEST_EDGE + DIGEST_BLOCKS * DIGEST_BLOCK:
        return [(0, size)]
    lo, hi = DIGEST_EDGE, size - DIGEST_EDGE
    mids = [lo + (i + 1) * (hi - lo) // (DIGEST_BLOCKS + 1) - DIGEST_BLOCK // 2 for i in range(DIGEST_BLOCKS)]
    return [(0, lo), *((m, m + DIGEST_BLOCK) for m in mids), (hi, size)]


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


@dataclass
class Source:
    """One input: ``n`` samples of ``fields`` (name -> FieldInfo), read by rows."""

    url: str
    kind: str  # "npy" | "npz" | "hdf5"
    per_file: bool  # True: the whole file is one sample
    keys: dict[str, str]  # output field name -> key inside the input
    n: int = 0
    fields: dict[str, FieldInfo] = field(default_factory=dict)
    storage_options: dict[str, Any] = field(default_factory=dict)
    _handle: Any = field(default=None, repr=False, compare=False)
    _pid: int | None = field(default=None, repr=False, compare=False)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handle"], state["_pid"] = None, None
        return state

    # -- handles -----------------------------------------------------------------------------------
    def _open(self):
        if self._handle is not None and self._pid == os.getpid():
            return self._handle
        if self.kind == "npz":
            import fsspec  # imported when an .npz input is opened, the only kind read through it here

            # the members are read without np.load (its header parser races other threads' ast
            # use on CPython 3.11; see io_backends/npy_format.py); keys as in np.load(...).files
            try:
                with fsspec.open(self.url, "rb", **self.storage_options) as f, zipfile.ZipFile(f) as z:
                    self._handle = {name.removesuffix(".npy"): npy_array(z.read(name), f"{self.url}:{name}")
                                    for name in z.namelist()}
            except ImportError as exc:  # the URL's protocol lacks its package: say which, and how to install it
                err = None if isinstance(exc, MissingDependencyError) else missing_protocol_error(self.url, exc)
                if err is None:
                    raise
                raise err from exc
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                raise DatasetFormatError(f"{self.url}: not a readable .npz archive ({type(exc).__name__}: {exc}); "
                                         "check the file (np.savez writes one)") from exc
        else:
            url = self.url
            if self.kind == "hdf5" and _h5_dataset_suffix(url):
                url = url.rpartition(":")[0]
            name = "fsspec" if self.kind == "npy" or "://" in url and not url.startswith("file://") else "hdf5"
            self._handle = open_backend(url, name, **({"storage_options": self.storage_options}
                                                      if name == "fsspec" else {}))
        self._pid = os.getpid()
        return self._handle

    def _file_url(self) -> str:
        """The input's file (``FILE.h5`` of ``FILE.h5:/dset``)."""
        return self.url.rpartition(":")[0] if self.kind == "hdf5" and _h5_dataset_suffix(self.url) else self.url

    def stamp(self) -> list:
        """``[size, modification stamp]`` of the input file, for the job fingerprint.

        Why: ``--resume`` must not append batches of a changed input to a file started from the
        old one; shapes and dtypes alone do not see new values. Size and mtime (or an object
        store's ETag / Last-Modified) are the cheap signals ``make`` and ``rsync`` use. Missing
        metadata gives ``None`` entries (that part of the check is then skipped). They miss a
        file rewritten with the same size and mtime (``cp -p``, ``rsync -a``), hence
        :meth:`identity`."""
        path = self._file_url()
        if _is_local(path):
            st = os.stat(_local_path(path))
            return [st.st_size, st.st_mtime_ns]
        fs, p = url_to_fs(path, **self.storage_options)
        try:
            info = fs.info(p)
        except (OSError, NotImplementedError):
            return [None, None]
        norm = {str(k).lower().replace("-", "").replace("_", ""): v for k, v in info.items() if v is not None}
        mark = next((norm[k] for k in ("etag", "mtime", "lastmodified", "updated", "created") if k in norm), None)
        return [info.get("size"), None if mark is None else str(mark)]

    def identity(self) -> list:
        """``[size, modification stamp, content digest]``: :meth:`stamp` plus
        :meth:`content_digest`, what the job fingerprint records of this input.

        Why: an input regenerated between a crash and ``--resume`` and copied back with ``cp -p``
        or ``rsync -a`` (or written twice within a coarse mtime granularity) keeps its size and
        mtime; only its bytes tell. A sample of them catches a regenerated input at a bounded
        cost (see :func:`digest_ranges`); a change confined to bytes outside the sample is still
        missed, which only ``--verify`` (every sample against the inputs) rules out."""
        size, mark = self.stamp()
        return [size, mark, self.content_digest(size)]

    def content_digest(self, size: int | None) -> str | None:
        """BLAKE2b of the byte ranges :func:`digest_ranges` picks for a ``size``-byte file, read
        through the same path as the data (``open`` for local files, the fsspec filesystem of the
        URL with ``storage_options`` otherwise; the ranges fetched in one ``cat_ranges`` call,
        concurrently for http/s3). ``None`` (that part of the check skipped, as for missing
        metadata in :meth:`stamp`) when the size is unknown or the bytes cannot be read: the
        ingest's own reads report an unreadable input, naming it."""
        if size is None:
            return None
        ranges = digest_ranges(int(size))
        try:
            blobs = self._read_byte_ranges(ranges)
        except Exception:  # noqa: BLE001 -- any transport error (aiohttp's are not OSErrors): no digest
            return None
        h = hashlib.blake2b(digest_size=16)
        for blob in blobs:
            h.update(bytes(blob))
        return h.hexdigest()

    def _read_byte_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        path = self._file_url()
        if _is_local(path):
            out = []
            with open(_local_path(path), "rb") as fh:
                for lo, hi in ranges:
                    fh.seek(lo)
                    out.append(fh.read(hi - lo))
            return out
        fs, p = url_to_fs(path, **self.storage_options)
        return fs.cat_ranges([p] * len(ranges), [lo for lo, _ in ranges], [hi for _, hi in ranges], on_error="raise")

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid() and hasattr(self._handle, "close"):
            self._handle.close()
        self._handle = None

    def available_keys(self, wanted: list[str] | None = None) -> dict[str, FieldInfo]:
        """Every key this input offers, with its *stored array* shape and dtype.

        ``wanted``: the input keys ``--fields`` asks for. An HDF5 input then describes only the
        datasets they name (see :meth:`_h5_resolve`): the file may hold other datasets of another
        length (or scalars, string tables) that the user did not ask for, and those must not stop
        the job. The lengths of the chosen fields are compared by :func:`open_sources`."""
        h = self._open()
        if self.kind == "npz":
            return {k: FieldInfo(tuple(a.shape), a.dtype) for k, a in h.items()}
        if self.kind == "npy":
            (key,) = h.keys()
            info = h.info(key)
            return {key: FieldInfo(info.shape, info.dtype)}
        sel = _h5_dataset_suffix(self.url)
        if sel or not wanted:
            _, specs = describe_fields(h, [sel.strip("/")] if sel else None)
        else:  # one at a time: describe_fields would compare their lengths with a message meant for the API
            specs = [describe_fields(h, [path])[1][0] for path in self._h5_resolve(h, wanted)]
        out = {}
        for s in specs:
            if s.kind != "raw":
                raise InputError(f"{self.url}: field {s.name!r} is already compressed ({s.codec}); "
                                 "ingest reads raw arrays only; decode it first")
            out[s.name] = FieldInfo((h.info(s.data_key).shape[0], *s.sample_shape), s.dtype)
        return out

    def _h5_resolve(self, h, wanted: list[str]) -> list[str]:
        """The dataset paths ``wanted`` names in this HDF5 file: each key is a full path
        (``group/dset``, a leading ``/`` optional) or, if unambiguous, a dataset's last component.
        A compressed field's group counts as one entry (its ``data``/``offsets`` do not)."""
        keys = h.keys()
        groups = {k[:-len("/data")] for k in keys if k.endswith("/data") and k[:-len("data")] + "offsets" in keys}
        parts = {f"{g}/data" for g in groups} | {f"{g}/offsets" for g in groups}
        entries = [k for k in keys if k not in parts and not k.startswith("_solar")] + sorted(groups)
        out: list[str] = []
        for key in wanted:
            k = key.strip("/")
            hits = name_matches(k, entries)
            if not hits:
                raise InputError(f"{self.url}: no array {key!r}; it has: {', '.join(entries) or 'none'}")
            if len(hits) > 1:
                raise InputError(f"{self.url}: {key!r} names several datasets ({', '.join(hits)}); pick one "
                                 f"by its full path, e.g. --fields {k}={hits[0]}")
            if hits[0] not in out:
                out.append(hits[0])
        return out

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of field ``name``, shape ``(hi - lo, *sample_shape)``."""
        info = self.fields[name]
        if hi <= lo:
            return np.empty((0, *info.shape), info.dtype)
        h, key = self._open(), self.keys[name]
        if self.kind == "npz":
            a = h[key]
            return a[None] if self.per_file else a[lo:hi]
        if self.per_file:
            return h.read_all(key).reshape(1, *info.shape)
        return h.read_ranges(key, [(lo, hi)])


class ZippedSource:
    """Fields that come from separate files (``x=X.npy y=Y.npy``): one :class:`Source` per field,
    read side by side. It offers what the ingest uses of a :class:`Source` (``url``, ``n``,
    ``fields``, ``keys``, ``per_file``, :meth:`identity`, :meth:`read`, :meth:`close`), so the
    plan concatenates zipped and plain inputs alike. Invariant: ``parts[name].fields`` and
    ``parts[name].per_file`` always equal this source's, so each part reads its rows as a
    plain input would."""

    kind = "zipped"

    def __init__(self, parts: dict[str, Source]):
        self.parts = parts
        self.url = " ".join(f"{name}={p.url}" for name, p in parts.items())
        self.keys = {name: p.url for name, p in parts.items()}
        self.n = 0
        self._fields = {name: p.fields[name] for name, p in parts.items()}
        self._per_file = False

    @property
    def plain_files(self) -> bool:
        """Whether every part is a ``.npy``/``.npz`` file (whose whole array may be one sample)."""
        return all(p.kind in ("npy", "npz") for p in self.parts.values())

    @property
    def fields(self) -> dict[str, FieldInfo]:
        return self._fields

    @fields.setter
    def fields(self, value: dict[str, FieldInfo]) -> None:
        self._fields = dict(value)
        for name, p in self.parts.items():
            p.fields = {name: value[name]}

    @property
    def per_file(self) -> bool:
        return self._per_file

    @per_file.setter
    def per_file(self, value: bool) -> None:
        self._per_file = bool(value)
        for p in self.parts.values():
            p.per_file = self._per_file and p.kind in ("npy", "npz")

    def identity(self) -> list:
        """``[sizes, modification stamps, content digest]`` of the parts, the three entries of a
        :meth:`Source.identity`, so the job fingerprint covers every file."""
        ids = [p.identity() for p in self.parts.values()]
        digests = [i[2] for i in ids]
        digest = None if None in digests else hashlib.blake2b("".join(digests).encode(), digest_size=16).hexdigest()
        return [[i[0] for i in ids], [i[1] for i in ids], digest]

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        return self.parts[name].read(name, lo, hi)

    def close(self) -> None:
        for p in self.parts.values():
            p.close()


_NAMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$")


def split_named(urls: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``(plain inputs, {field name: [files]})`` of ``urls``: ``NAME=FILE`` entries name the field
    their one array becomes; a path that exists as written stays a plain input."""
    plain, named = [], {}
    for u in urls:
        m = _NAMED.match(u)
        if m is None or os.path.exists(u):
            plain.append(u)
        else:
            named.setdefault(m.group(1), []).append(m.group(2))
    return plain, named


def _zip_sources(named: dict[str, list[str]], storage_options) -> list[ZippedSource]:
    counts = {name: len(files) for name, files in named.items()}
    if len(set(counts.values())) > 1:
        raise InputError(f"NAME=FILE inputs give each field a different number of files ({counts}); the i-th "
                         "files of every name hold the same samples, so give each name as many files")
    out = []
    for group in zip(*named.values()):
        parts = {}
        for name, url in zip(named, group):
            part = _describe(url, None, storage_options)
            if len(part.fields) != 1:
                pick = (f"pick one with {name}={url}:/DATASET" if part.kind == "hdf5"
                        else "save the array you want as its own .npy")
                raise InputError(f"{name}={url}: a NAME=FILE input gives one field, but {url} holds "
                                 f"{len(part.fields)} arrays ({', '.join(part.keys.values())}); {pick}")
            (key,) = part.keys.values()
            part.keys, part.fields = {name: key}, {name: next(iter(part.fields.values()))}
            parts[name] = part
        out.append(ZippedSource(parts))
    return out


def _describe(url: str, wanted, storage_options) -> Source:
    kind = input_kind(url)
    src = Source(url, kind, False, {}, storage_options=dict(storage_options))
    try:
        avail = src.available_keys([k for _, k in wanted] if wanted and kind == "hdf5" else None)
    except FileNotFoundError as exc:
        raise InputError(f"{url}: input not found ({exc}); check the path") from None
    except InputError:
        raise
    except DatasetFormatError as exc:  # names the input (or its shard) and what is wrong with it
        raise InputError(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{url}: cannot read this input ({exc})") from None
    if kind == "npy":
        (key,) = avail
        if wanted and len(wanted) != 1:
            raise InputError(f"{url}: a .npy input holds one array; give one --fields name, got {len(wanted)}")
        names = {(wanted[0][0] if wanted else "x"): key}
    elif wanted:
        names = {}
        for name, k in wanted:
            # an HDF5 dataset may be named by its full path or, if unambiguous, its last component
            hits = name_matches(k, avail)
            if len(hits) != 1:
                raise InputError(f"{url}: no array {k!r}; it has: {', '.join(avail) or 'none'}")
            names[name] = hits[0]
    else:
        names = {k.rsplit("/", 1)[-1] if kind == "hdf5" else k: k for k in avail}
        if len(names) != len(avail):
            raise InputError(f"{url}: datasets {sorted(avail)} share a name in different groups; pick them "
                             "with --fields NAME=group/path")
    src.keys = names
    src.fields = {n: avail[k] for n, k in names.items()}  # stored shapes; split below
    if kind in ("npy", "npz"):  # HDF5 fields are checked by describe_fields
        _check_dtypes(src)
    return src


def _check_dtypes(src: Source) -> None:
    """Refuse a ``.npy``/``.npz`` field that a torch tensor cannot hold (strings, bytes,
    datetimes, structured records), as :func:`solar.layout.describe_fields` refuses such an HDF5
    dataset. Why: h5py cannot store a unicode array (its TypeError would come after ``OUT.tmp``
    is made), and a bytes array would make an output that SOLAR cannot read back (no usable
    field)."""
    for name, fi in src.fields.items():
        if tensor_dtype_ok(fi.dtype):
            continue
        drop = ("leave it out with --fields (naming the other fields)" if src.kind == "npz"
                else "leave this input out")
        raise InputError(f"{src.url}: field {name!r} has dtype {fi.dtype}, which a tensor cannot hold (strings, "
                         f"bytes, dates and records are not numeric); convert it to a numeric array, or {drop}")


def open_sources(urls: list[str], *, fields: list[str] | None = None, samples: str = "auto",
                 storage_options: dict[str, Any] | None = None
                 ) -> tuple[list[Source | ZippedSource], dict[str, FieldInfo]]:
    """Describe and validate every input; returns ``(sources, fields)``.

    Raises:
        InputError: naming the input, for a missing file, an unreadable input, a missing field,
            or shapes/dtypes of a field that differ between inputs.
    """
    if samples not in ("auto", "file", "axis0"):
        raise InputError(f"samples must be auto, file or axis0, got {samples!r}")
    if not urls:
        raise InputError("no inputs given")
    wanted = parse_field_args(fields)
    plain_urls, named = split_named(urls)
    if named and (plain_urls or wanted):
        what = f"plain inputs ({', '.join(plain_urls)})" if plain_urls else "--fields"
        raise InputError(f"NAME=FILE inputs ({', '.join(f'{n}=...' for n in named)}) name every field; they "
                         f"cannot be mixed with {what}: write every input as NAME=FILE, or none")
    sources = (_zip_sources(named, storage_options or {}) if named
               else [_describe(u, wanted, storage_options or {}) for u in urls])
    plain = [s for s in sources if s.kind in ("npy", "npz") or isinstance(s, ZippedSource) and s.plain_files]
    per_file = samples == "file" or (
        samples == "auto" and len(plain) >= 2 and len({tuple(sorted((n, f.shape) for n, f in s.fields.items()))
                                                       for s in plain}) == 1)
    ref: dict[str, FieldInfo] | None = None
    ref_url = ""
    for s in sources:
        s.per_file = per_file and any(s is p for p in plain)
        lengths = set()
        shaped: dict[str, FieldInfo] = {}
        for name, fi in s.fields.items():
            if s.per_file:
                shaped[name] = fi
                lengths.add(1)
            else:
                if not fi.shape:
                    raise InputError(f"{s.url}: field {name!r} is a scalar, so it has no sample axis; "
                                     "pass --samples file to take each file as one sample")
                shaped[name] = FieldInfo(fi.shape[1:], fi.dtype)
                lengths.add(fi.shape[0])
        if len(lengths) > 1:
            fix = ("the files given together must hold equally many samples" if isinstance(s, ZippedSource)
                   else "pick fields of one length with --fields")
            raise InputError(f"{s.url}: its fields have different numbers of samples "
                             f"({ {n: f.shape[0] for n, f in s.fields.items()} }); {fix}")
        s.fields, s.n = shaped, lengths.pop() if lengths else 0
        if ref is None:
            ref, ref_url = shaped, s.url
            continue
        if list(shaped) != list(ref):
            raise InputError(f"{s.url}: has fields {list(shaped)}, but {ref_url} has {list(ref)}; "
                             "every input must give the same fields (use --fields)")
        for name, fi in shaped.items():
            if fi != ref[name]:
                raise InputError(
                    f"{s.url}: field {name!r} has samples of shape {fi.shape} dtype {fi.dtype}, but {ref_url} has "
                    f"{ref[name].shape} {ref[name].dtype}; every sample of a field must match")
    for s in sources:
        s.close()
    return sources, dict(ref or {})
