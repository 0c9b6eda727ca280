"""Atomic writes of small local files (reports, dumps, plots, restored checkpoints).

Readers never see half a file: the content goes to a temporary name beside the target and is
renamed over it; on failure the temporary file is removed and the old target stays.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["write_atomic", "write_text_atomic"]


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
