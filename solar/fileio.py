"""Atomic writes of small local files (reports, dumps, plots, restored checkpoints), and the
advisory locks writers take.

Readers never see half a file: the content goes to a temporary name beside the target and is
renamed over it; on failure the temporary file is removed and the old target stays.

The temporary is made by ``tempfile.mkstemp`` in the target's directory: created exclusively
(``O_EXCL``, so a name someone planted there, a symlink included, is never opened) under a random
name, mode 0600 while it is written; the mode a plain ``open`` would give (0666 less the umask)
is set just before the rename. An output in a shared directory (``-o /shared/x.pt``) thus cannot
be redirected onto another file by a symlink planted at a predictable temporary name.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

__all__ = ["flock_or_holder", "write_atomic", "write_text_atomic"]


def write_atomic(path: str, write: Callable[[str], None], suffix: str = "") -> None:
    """Call ``write(tmp_path)`` and rename the result to ``path``.

    ``write`` gets the name of an empty file this call created (see the module docstring) and may
    reopen it by name (``torch.save``, ``safetensors``). ``suffix`` ends the temporary name (e.g.
    ``".png"`` for writers that pick a format from it).
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=f".tmp{suffix}", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """The process umask: from ``/proc`` where there is one, since reading it with ``os.umask``
    means setting it, and a file another thread creates meanwhile gets the temporary mask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # 0o077: the strictest, so a file made in the window is private, not open
    os.umask(mask)
    return mask


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
