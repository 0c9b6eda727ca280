"""npm's ``s3rver`` on 127.0.0.1 for the S3 runs of bench/compete: it answers ranged GETs by
streaming the asked bytes (moto copies the whole object for each one, which no real store does).

``bench/compete/venvs.sh`` installs it (``npm install s3rver@3`` under ``.s3rver/``, git-ignored).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from servers import _wait_http, free_port  # noqa: E402

ROOT = os.path.join(HERE, "..", "..", ".s3rver")
BIN = os.path.join(ROOT, "node_modules", ".bin", "s3rver")
KEY = SECRET = "S3RVER"  # s3rver's fixed credentials


@contextlib.contextmanager
def s3rver(bucket: str) -> Iterator[dict]:
    """s3rver on a free port with ``bucket``; yields s3fs storage options."""
    if not os.path.exists(BIN):
        raise SystemExit(f"{BIN} is missing: run `bash bench/compete/venvs.sh s3rver` first")
    data = tempfile.mkdtemp(prefix="solar-s3rver-")
    port = free_port()
    proc = subprocess.Popen([BIN, "-d", data, "-a", "127.0.0.1", "-p", str(port), "--configure-bucket", bucket,
                             "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f"http://127.0.0.1:{port}/", proc, "s3rver", timeout=30)
        yield {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)
