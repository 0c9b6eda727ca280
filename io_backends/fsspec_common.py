"""What every fsspec-based reader shares: URL -> filesystem with install hints, storage errors
that name the URL, and the rule for filesystem objects inherited through ``fork``.

Used by :mod:`solar.io_backends.fsspec` (the ``fsspec`` backend), its two container kinds
(:mod:`~solar.io_backends.fsspec_hdf5`, :mod:`~solar.io_backends.npy_store`) and ``solar ingest``.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from solar.capabilities import fsspec_protocol_missing, pip_name
from solar.errors import ConfigError, MissingDependencyError, SolarError, StorageError, storage_errors

__all__ = ["INHERITED", "CHANGED", "transport_error", "url_errors", "range_hint", "missing_protocol_error",
           "url_to_fs", "is_http", "full_url", "s3_ranges", "http_chunks"]

# NOTE [ fsspec after fork ]
#     A forked child inherits the parent's asyncio event loop *and its epoll instance*, which the
#     kernel shares between both processes. If the child lets the parent's async filesystem (http,
#     s3) or its sessions be garbage-collected, their finalizers close the pooled connections, and
#     each close deregisters its socket from the shared epoll set -- the parent then never hears
#     the answer to its next request on that socket and hangs (an S3 session left as cyclic
#     garbage, collected in the child, freezes the parent's next HTTP request). So (1) a child
#     that reopens keeps the filesystem objects it inherited alive (:data:`INHERITED`) and opens
#     fresh ones of its own, and (2) every forked child freezes the garbage collector's view of
#     what it inherited (``gc.freeze``), so inherited garbage is never finalized there; the parent
#     collects it. Children exit with ``os._exit``, which runs no finalizers.
INHERITED: list[Any] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=gc.freeze)

# NOTE [ Storage errors name the URL ]
#     fsspec passes its transports' exceptions through: aiohttp's ClientResponseError (an HTTP
#     403, 500 ...; not an OSError), botocore's EndpointConnectionError (an S3 endpoint nobody
#     answers), a plain ValueError when an HTTP server ignores Range requests. None of them says
#     which dataset URL failed or what to do, and callers catching OSError miss most of them.
#     Every storage call of the fsspec backend goes through :func:`url_errors`, which
#     re-raises them as :class:`solar.StorageError` (an ``OSError``) naming the URL and what to
#     check, the original exception chained; FileNotFoundError and SOLAR's own errors pass
#     through unchanged.
_NO_RANGES = "support range requests"  # fsspec's HTTPFile message for a 200 to a Range request
#: s3fs's OSError for S3's PreconditionFailed (a GET with IfMatch=ETag of an object replaced since)
_S3_PRECONDITION = "pre-conditions you specified did not hold"


CHANGED = ("the file changed since it was opened (its ETag or modification time no longer matches); "
           "reopen the dataset to read the new version")


def range_hint(url: str) -> str:
    return (f"{url}: the server ignores HTTP Range requests (it sends the whole file instead of the bytes "
            "asked for), so rows cannot be read by byte ranges; serve the file from a server that supports "
            "them (nginx, Apache, S3 ...) or copy it to a local path")


def transport_error(url: str, exc: BaseException, doing: str, hdf5: bool = False) -> Exception | None:
    """The :class:`StorageError` for a transport exception, or None to let ``exc`` through.

    ``hdf5``: ``exc`` came through h5py, whose own errors (a file that is not HDF5 ...) are
    plain ``OSError``s; those pass through for the caller to report as format errors. A
    ``TypeError`` about a keyword is a storage option the filesystem does not take: a
    :class:`ConfigError`."""
    if isinstance(exc, TypeError) and "keyword argument" in str(exc):
        return ConfigError(f"{url}: a storage option is not accepted by this URL's filesystem ({exc}) while "
                           f"{doing}; check the keys of storage_options (and of its client_kwargs / "
                           "config_kwargs) against the fsspec implementation for this protocol")
    if isinstance(exc, (SolarError, FileNotFoundError)):
        return None
    if isinstance(exc, ValueError) and _NO_RANGES in str(exc):
        return StorageError(range_hint(url))
    name, mod = type(exc).__name__, type(exc).__module__ or ""
    status = getattr(exc, "status", None)
    if mod.startswith("aiohttp") and isinstance(status, int):  # ClientResponseError: an HTTP status
        if status == 412:
            todo = CHANGED
        elif status in (401, 403):
            todo = "check that you may read it (file permissions; credentials or tokens in storage_options)"
        elif status >= 500:
            todo = "the server failed; retry later or check the server's logs"
        else:
            todo = "check the URL"
        return StorageError(f"{url}: the server answered HTTP {status} {getattr(exc, 'message', '')} while {doing}; "
                            f"{todo}")
    if name == "FileExpired" or _S3_PRECONDITION in str(exc):  # s3fs: the ETag changed since the open
        return StorageError(f"{url}: {doing} failed: {CHANGED}")
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


def url_errors(url: str, doing: str, hdf5: bool = False):
    """Re-raise transport exceptions as :class:`StorageError` (NOTE [ Storage errors name the URL ]),
    through :func:`solar.errors.storage_errors`; ``hdf5`` as for :func:`transport_error`."""
    return storage_errors(lambda exc: transport_error(url, exc, doing, hdf5))


def missing_protocol_error(url: str, exc: ImportError | None = None) -> MissingDependencyError | None:
    """The :class:`MissingDependencyError` for ``url`` when a protocol of it (each part of a
    ``a::b://`` chain) lacks its package (NOTE [ What an fsspec protocol needs ] in
    ``solar/capabilities.py``), naming the protocol, the package, fsspec's own hint and the pip
    command; None when every protocol's packages are found and ``exc`` (an ImportError fsspec
    raised for ``url``) names no module either."""
    from fsspec.core import split_protocol  # fsspec: imported by the fsspec backends only
    from fsspec.registry import known_implementations

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


def s3_ranges(fs, path: str, starts: list[int], ends: list[int], etag: str, chunks: bool = False) -> list:
    """Bytes ``[starts[i], ends[i])`` of the S3 object ``path``, requested concurrently on the
    filesystem's event loop, each with ``IfMatch=etag``: an object replaced since it was opened
    is refused (s3fs's own ``cat_ranges`` does not pin the version; its file objects do).

    ``chunks``: each range as the list of byte strings the transport received, not joined into
    one (a copy of every byte saved, for a caller that writes them with ``pwritev``)."""
    import asyncio

    from fsspec.asyn import sync  # fsspec: imported by the fsspec backends only

    bucket, key, _ = fs.split_path(path)

    async def one(start: int, end: int):
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        body = resp["Body"]
        try:
            content = getattr(getattr(body, "raw_stream", None), "content", None)  # aiohttp's StreamReader
            if not chunks or content is None or not hasattr(content, "readchunk"):
                data = await body.read()
                return [data] if chunks else data
            return await _chunks(content)
        finally:
            body.close()

    async def every() -> list:
        return await asyncio.gather(*(one(a, b) for a, b in zip(starts, ends)))

    return sync(fs.loop, every)


async def _chunks(content) -> list[bytes]:
    """What is left of an aiohttp response's body, as the chunks received (none joined)."""
    got = []
    while True:
        data, boundary = await content.readchunk()
        if not data and not boundary:
            return got
        if data:
            got.append(data)


def http_chunks(fs, path: str, start: int, end: int) -> list[bytes]:
    """Bytes ``[start, end)`` of ``path`` on the HTTP filesystem ``fs`` (its headers, the version
    pin among them, sent as fsspec's ``cat_file`` sends them), as the chunks received: not joined
    into one byte string (see :func:`s3_ranges`' ``chunks``)."""
    from fsspec.asyn import sync  # fsspec: imported by the fsspec backends only

    async def get() -> list[bytes]:
        kw = dict(fs.kwargs)
        headers = {**(kw.pop("headers", None) or {}), "Range": f"bytes={start}-{end - 1}"}
        session = await fs.set_session()
        async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
            fs._raise_not_found_for_status(r, path)
            return await _chunks(r.content)

    return sync(fs.loop, get)


def _protocols(fs) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_http(fs) -> bool:
    return "http" in _protocols(fs)


def full_url(fs, path: str) -> str:
    """``path`` of ``fs`` as the user can open it: with its protocol (s3fs's paths have none:
    ``bucket/x.npy``), a local path as it is."""
    return path if {"file", "local"} & set(_protocols(fs)) else fs.unstrip_protocol(path)
