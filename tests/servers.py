"""Real storage servers on 127.0.0.1 for the fsspec tests: Debian's nginx (HTTP with Range
requests), Python's http.server (no Range support, optional 403s) and moto's S3 server, each
started and stopped by the tests that use them.

The fixtures (``http_root``, ``s3_root``, ``s3_bucket``, ``place``) are imported once, by
tests/conftest.py, so every test module takes them as parameters without importing them.
``place`` is parametrized over every fsspec protocol SOLAR supports and gives a writable spot plus
the URL a reader uses for it, so one test body runs against file, memory, http and s3 alike.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

_NGINX_CONF = """daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/tmp_body;
    proxy_temp_path {d}/tmp_proxy;
    fastcgi_temp_path {d}/tmp_fastcgi;
    uwsgi_temp_path {d}/tmp_uwsgi;
    scgi_temp_path {d}/tmp_scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_timeout 65;
    server {{ listen 127.0.0.1:{port}; root {root}; autoindex on; }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen | None, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it served {url}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError as exc:  # connection refused while starting; 4xx means it is up
            if getattr(exc, "code", None):
                return
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer {url} within {timeout} s")


@contextlib.contextmanager
def nginx_server(root: str) -> Iterator[str]:
    """Serve directory ``root`` with nginx on 127.0.0.1:<free port>; yields the base URL."""
    if not os.path.exists(NGINX):
        msg = "nginx is not installed (apt-get install nginx; `make setup` does it)"
        if os.environ.get("SOLAR_STRICT") == "1":  # under `make test` a missing server is a failure
            pytest.fail(msg)
        pytest.skip(msg)
    conf_dir = tempfile.mkdtemp(prefix="solar-nginx-")
    port = free_port()
    conf = os.path.join(conf_dir, "nginx.conf")
    with open(conf, "w") as f:
        f.write(_NGINX_CONF.format(d=conf_dir, port=port, root=os.path.abspath(root)))
    proc = subprocess.Popen([NGINX, "-c", conf, "-p", conf_dir], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(base + "/", proc, "nginx")
        yield base
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not os.environ.get("SOLAR_KEEP_NGINX_LOGS"):
            shutil.rmtree(conf_dir, ignore_errors=True)


@contextlib.contextmanager
def python_http_server(root: str, forbidden: tuple[str, ...] = ()) -> Iterator[str]:
    """Serve directory ``root`` with Python's ``http.server`` (in a thread) on 127.0.0.1:<free port>;
    yields the base URL. Unlike nginx it ignores Range requests (it answers 200 with the whole
    file), as some servers do; paths in ``forbidden`` (relative to ``root``) answer 403."""
    import functools
    import http.server
    import threading

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def send_head(self):
            if self.path.split("?", 1)[0].lstrip("/") in forbidden:
                self.send_error(403)
                return None
            return super().send_head()

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            pass  # a client that stops reading a whole-file answer early: a broken pipe, expected

    srv = Server(("127.0.0.1", 0), functools.partial(Handler, directory=root))
    thread = threading.Thread(target=srv.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


@contextlib.contextmanager
def moto_s3_server() -> Iterator[dict[str, Any]]:
    """An S3-compatible server (moto) on 127.0.0.1:<free port>; yields s3fs storage options."""
    moto_server = pytest.importorskip("moto.server", reason="pip install moto flask flask-cors")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    try:
        host, port = srv.get_host_and_port()
        # No region in client_kwargs: s3fs would send a LocationConstraint that moto rejects.
        yield {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def http_root() -> Iterator[tuple[str, str]]:
    """``(directory, base_url)``: files written under the directory are served over HTTP."""
    # Not under pytest's tmp dir: that is mode 0700, and nginx's workers run as an unprivileged user.
    root = tempfile.mkdtemp(prefix="solar-www-")
    os.chmod(root, 0o755)
    try:
        with nginx_server(root) as base:
            yield root, base
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_root() -> Iterator[tuple[str, dict[str, Any]]]:
    """``(bucket_url, storage_options)`` of a fresh bucket on a local moto S3 server."""
    pytest.importorskip("s3fs")
    with moto_s3_server() as opts:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        # moto keeps its state per process, shared by every server it runs: a fresh bucket name
        # keeps this bucket apart from s3_bucket's
        bucket = f"solar-test-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        yield f"s3://{bucket}", opts


@pytest.fixture(scope="module")
def s3_bucket():
    """``(bucket_url, storage_options)``: a fresh bucket on a moto S3 server on 127.0.0.1, one per
    test module (the tier and checkpoint-store tests).

    (Own bucket name: moto keeps buckets process-wide, so fixtures of other modules may exist.)
    """
    pytest.importorskip("s3fs")
    with moto_s3_server() as opts:
        import s3fs

        name = f"solar-ckpt-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **opts).mkdir(name)
        yield f"s3://{name}", opts


@dataclass
class Place:
    """A spot to write test data and the URL to read it back from.

    ``write_url(name)`` is where a writer puts ``name`` (for http: the directory nginx serves),
    ``url(name)`` is what a reader opens, with ``storage_options``.
    """

    protocol: str
    write_base: str
    read_base: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    write_options: dict[str, Any] = field(default_factory=dict)

    def write_url(self, name: str) -> str:
        return f"{self.write_base}/{name}"

    def url(self, name: str) -> str:
        return f"{self.read_base}/{name}"

    def put_bytes(self, name: str, data: bytes) -> str:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(self.write_url(name), **self.write_options)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data)
        return self.url(name)


PROTOCOLS = ["file", "memory", "http", "s3"]


@pytest.fixture(params=PROTOCOLS)
def place(request, tmp_path) -> Place:
    """One :class:`Place` per protocol: local file, in-memory, nginx over HTTP, moto over S3."""
    unique = uuid.uuid4().hex[:10]
    if request.param == "file":
        return Place("file", f"file://{tmp_path}", f"file://{tmp_path}")
    if request.param == "memory":
        return Place("memory", f"memory://solar-{unique}", f"memory://solar-{unique}")
    if request.param == "http":
        root, base = request.getfixturevalue("http_root")
        os.makedirs(os.path.join(root, unique))
        return Place("http", f"file://{root}/{unique}", f"{base}/{unique}")
    bucket, opts = request.getfixturevalue("s3_root")
    return Place("s3", f"{bucket}/{unique}", f"{bucket}/{unique}", opts, opts)
