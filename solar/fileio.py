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

import errno
import json
import os
import stat
import tempfile
from typing import Callable

from solar.errors import UnsafeLockFileError

__all__ = ["flock_or_holder", "open_lock_file", "UnsafeLockFileError", "write_atomic", "write_text_atomic"]

#: the most a lock owner record (JSON of host, pid, time) takes; a bigger file is not a lock
_LOCK_RECORD_MAX = 4096


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


def open_lock_file(path: str, mode: int = 0o644) -> int:
    """A read-write descriptor of the lock file ``path``, created if missing, for :func:`flock_or_holder`.

    The directory holding it may come from someone else (a downloaded checkpoint root), and the
    owner record is written into the file, so the file is opened only if it is safe to write:
    never through a symlink (``O_NOFOLLOW``; a ``.lock -> ~/.bashrc`` would have been truncated),
    only a regular file (a FIFO is not opened for blocking I/O) with no other hard link, and, if
    this call did not create it, only one that holds a lock owner record (a JSON object) or
    nothing. A lock the caller did not create is thus never truncated unless it is a lock.

    Raises:
        UnsafeLockFileError: any of the above fails (nothing was written).
        OSError: the open itself failed (e.g. ``PermissionError``).
    """
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)  # ours: made now, nothing to check
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeLockFileError(errno.ELOOP, "is a symlink, not a lock file", path) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafeLockFileError(exc.errno, "is not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeLockFileError(errno.EINVAL, "is not a regular file", path)
        if st.st_nlink != 1:
            raise UnsafeLockFileError(errno.EMLINK, f"has {st.st_nlink} hard links (a lock file has one)", path)
        head = os.pread(fd, _LOCK_RECORD_MAX + 1, 0)
        if len(head) > _LOCK_RECORD_MAX or not (head.strip() == b"" or head.lstrip().startswith(b"{")):
            raise UnsafeLockFileError(errno.EINVAL, "holds something other than a lock owner record", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def flock_or_holder(fd: int, owner: dict) -> str | None:
    """Take an exclusive ``flock`` on ``fd`` without waiting and write ``owner`` (JSON) into the
    file. If another process holds it, close ``fd`` and return what the holder wrote.

    Why ``flock``: the kernel drops the lock when its holder dies, so a crashed writer never
    leaves a stale lock to delete by hand. File systems without it (Lustre mounted without
    ``flock``) raise ``OSError``; the caller decides whether to go on unlocked.
    """
    import fcntl  # POSIX only: the rest of this module stays importable without it

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    return None
