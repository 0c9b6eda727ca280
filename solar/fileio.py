"""Atomic writes of small local files (reports, dumps, plots, restored checkpoints), and the
advisory locks writers take.

Readers never see half a file: the content goes to a temporary name beside the target and is
renamed over it; on failure the temporary file is removed and the old target stays.
"""

from __future__ import annotations

import json
import os
from typing import Callable

__all__ = ["flock_or_holder", "write_atomic", "write_text_atomic"]


def write_atomic(path: str, write: Callable[[str], None], suffix: str = "") -> None:
    """Call ``write(tmp_path)`` and rename the result to ``path``.

    ``suffix`` ends the temporary name (e.g. ``".png"`` for writers that pick a format from it).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}{suffix}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_atomic(path, write)


def flock_or_holder(fd: int, owner: dict) -> str | None:
    """Take an exclusive ``flock`` on ``fd`` without waiting and write ``owner`` (JSON) into the
    file. If another process holds it, close ``fd`` and return what the holder wrote.

    Why ``flock``: the kernel drops the lock when its holder dies, so a crashed writer never
    leaves a stale lock to delete by hand. File systems without it (Lustre mounted without
    ``flock``) raise ``OSError``; the caller decides whether to go on unlocked.
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    return None
