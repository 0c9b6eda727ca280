"""solar.fileio: atomic writes keep the old file on failure and leave no temporary behind."""

from __future__ import annotations

import pytest

from solar.fileio import write_atomic, write_text_atomic


def test_write_text_atomic_replaces(tmp_path):
    p = tmp_path / "r.json"
    write_text_atomic(str(p), "old")
    write_text_atomic(str(p), "new")
    assert p.read_text() == "new"
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "r.txt"
    p.write_text("old")

    def half(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(p), half, suffix=".txt")
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["r.txt"]
