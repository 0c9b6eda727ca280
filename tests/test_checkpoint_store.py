"""The chunk store under the writer: locks (local, fsspec, S3, a read-only HTTP root), gc, and
read-only roots (one clear error naming the root, not a bare ``OSError`` on ``.lock``)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.cache import MemoryTier
from solar.cache.fsspec_tier import FsspecTier
from solar.checkpoint import CheckpointReadOnlyError, CheckpointWriter, gc, list_versions, load, verify
from solar.checkpoint.store import CheckpointStore
from solar.errors import CheckpointError, CheckpointLockedError, ConfigError
from test_checkpoint import KB, assert_same, bits, seeded_state


def test_writers_on_one_root_are_locked_out(tmp_path):
    with CheckpointWriter(tmp_path):
        with pytest.raises(CheckpointLockedError, match="locked by another writer"):
            CheckpointWriter(tmp_path)
        with pytest.raises(CheckpointLockedError):
            gc(tmp_path, keep_last=1)
        # also from another process (flock is per open file description)
        code = (f"from solar.checkpoint import CheckpointWriter\ntry:\n CheckpointWriter({str(tmp_path)!r})\n"
                "except Exception as e:\n print(type(e).__name__)")
        out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "CheckpointLockedError", out.stderr
    CheckpointWriter(tmp_path).close()  # released on close


def test_fsspec_root_lock_and_roundtrip():
    root = "memory://solar-ckpt-test/root"
    state = {"a": torch.randn(10 * KB), "b": [1, 2]}
    with CheckpointWriter(root, chunk_size=4 * KB) as w:
        # messages name the URL as given, so the recovery they suggest points at the right object
        with pytest.raises(CheckpointLockedError, match=f"delete {root}/LOCK"):
            CheckpointWriter(root)
        assert w.save(state, 1).result().root == root
        state["a"][0] = 1.0
        assert w.save(state, 2).result().chunks_written == 1
    assert list_versions(root) == [1, 2]
    assert_same(load(root, 2), state)
    assert verify(root).ok


def test_memory_tier_root_does_not_alias_the_staging_buffer():
    tier = MemoryTier()
    with CheckpointWriter(tier, chunk_size=4 * KB) as w:
        w.save({"x": torch.ones(4 * KB)}, 1)
        w.save({"x": torch.full((4 * KB,), 2.0)}, 2)  # reuses the staging buffer
    assert list_versions(tier) == [1, 2]
    assert load(tier, 1)["x"].eq(1).all() and load(tier, 2)["x"].eq(2).all()


def test_gc_keeps_every_referenced_chunk(tmp_path):
    x = torch.randn(16 * KB)
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        for step in range(5):
            x[step * 4000] += 1
            w.save({"x": x, "const": torch.ones(4 * KB)}, step)
    before = len(list(CheckpointStore(tmp_path).chunk_digests()))
    rep = gc(tmp_path, keep_last=2)
    assert rep.kept == [3, 4] and rep.removed_versions == [0, 1, 2]
    assert rep.removed_chunks == before - rep.kept_chunks > 0
    assert verify(tmp_path).ok and list_versions(tmp_path) == [3, 4]
    assert load(tmp_path, 3)["x"][3 * 4000] == x[3 * 4000]
    with pytest.raises(ConfigError):
        gc(tmp_path, keep_last=0)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=6), st.integers(1, 3))
def test_gc_never_removes_a_referenced_chunk(tmp_path_factory, edits, keep):
    root = tmp_path_factory.mktemp("gc")
    x = torch.zeros(8 * KB // 4 * 4)
    expected = {}
    with CheckpointWriter(root, chunk_size=1 * KB) as w:
        for step, (pos, val) in enumerate(edits):
            x[pos * 256] = val
            expected[step] = x.clone()
            w.save({"x": x}, step)
    gc(root, keep_last=keep)
    kept = list_versions(root)
    assert kept == sorted(expected)[-keep:]
    for step in kept:
        assert bits(load(root, step)["x"]) == bits(expected[step])


def test_s3_root_on_a_real_moto_server(s3_bucket):
    """An object-store root: direct PUTs (atomic), a LOCK object, increments, verify and gc."""
    bucket, opts = s3_bucket
    root = f"{bucket}/ckpt-{os.getpid()}"
    x = torch.randn(16 * KB)
    with CheckpointWriter(root, chunk_size=4 * KB, keep_last=2, storage_options=opts) as w:
        with pytest.raises(CheckpointLockedError, match="LOCK"):
            CheckpointWriter(root, storage_options=opts)
        assert w.save({"x": x}, 1).result().chunks_written == 16
        x[0] = 7.0
        assert w.save({"x": x}, 2).result().chunks_written == 1
        w.save({"x": x, "y": torch.ones(3)}, 3)
    assert list_versions(root, storage_options=opts) == [2, 3]
    assert bits(load(root, storage_options=opts)["x"]) == bits(x)
    assert verify(root, storage_options=opts).ok
    assert gc(root, keep_last=1, storage_options=opts).removed_versions == [2]


def test_lock_released_between_create_and_read_is_taken_not_reported_as_full(tmp_path):
    """put_new fails because another writer holds LOCK, which it releases before we read the
    holder: the lock is free, so acquiring retries instead of blaming a full storage."""
    class ReleasedMeanwhile(MemoryTier):
        first = True

        def get(self, key):
            if key == "LOCK" and self.first:  # the other writer's close lands right here
                self.first = False
                self.delete("LOCK")
            return super().get(key)

    tier = ReleasedMeanwhile()
    tier.put("LOCK", b'{"pid": 1}')
    lock = CheckpointStore(tier, create=True).lock()
    assert tier.get("LOCK") == lock.token
    lock.release()


def test_read_only_http_root_cannot_be_locked(http_root):
    root, base = http_root
    local = os.path.join(root, f"ro-{os.getpid()}")
    with CheckpointWriter(local) as w:
        w.save({"x": torch.ones(3)}, 1).result()
    url = f"{base}/ro-{os.getpid()}"
    assert verify(url).ok
    with pytest.raises(CheckpointError, match="read-only"):
        verify(url, repair=True)


def test_s3_lock_is_an_exclusive_create(s3_bucket, monkeypatch):
    """Two writers that both saw no LOCK (forced here: every existence check says "absent"):
    S3's conditional PUT lets only the first create it; the second is refused and the first
    keeps its lock (a check-then-put would let the second overwrite it and both write)."""
    bucket, opts = s3_bucket
    root = f"{bucket}/lockrace-{os.getpid()}"
    with CheckpointWriter(root, storage_options=opts) as w:
        tier = FsspecTier(root, storage_options=opts)
        mine = tier.get("LOCK")
        assert mine is not None
        monkeypatch.setattr(FsspecTier, "_exists_path", lambda self, path: False)
        with pytest.raises(CheckpointLockedError, match="locked by another writer"):
            CheckpointWriter(root, storage_options=opts)
        monkeypatch.undo()
        assert tier.get("LOCK") == mine
        w.save({"x": torch.ones(4)}, 1).result()
    assert not FsspecTier(root, storage_options=opts).exists("LOCK")  # released on close


def _read_only_lock(monkeypatch, err: int) -> None:
    """Make opening any ``.lock`` for writing fail as on a read-only mount (EROFS) or without
    permission (EACCES): tests run as root, which chmod cannot stop."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == ".lock" and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_a_read_only_root_is_a_clear_error_for_writers_and_gc_and_still_loads(tmp_path, monkeypatch, err):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        w.save(seeded_state(1), 1, blocking=True)
    _read_only_lock(monkeypatch, err)
    for attempt in (lambda: CheckpointWriter(tmp_path), lambda: gc(tmp_path, keep_last=1),
                    lambda: verify(tmp_path, repair=True)):
        with pytest.raises(CheckpointReadOnlyError) as info:
            attempt()
        e = info.value
        assert isinstance(e, CheckpointError) and isinstance(e, PermissionError)
        msg = str(e)
        assert f"checkpoint root {tmp_path} is not writable here" in msg and os.strerror(err) in msg
        assert "need write access" in msg and "load" in msg and "\n" not in msg
    assert_same(load(tmp_path), seeded_state(1))  # reading needs no lock
    assert verify(tmp_path).ok


def test_a_new_root_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch):
    real_mkdir = os.mkdir
    ro = str(tmp_path / "ro")

    def fake_mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(ro):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    with pytest.raises(CheckpointReadOnlyError, match=f"checkpoint root {ro}/ck is not writable here"):
        CheckpointWriter(f"{ro}/ck")
