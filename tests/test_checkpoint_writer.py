"""The writer's background commit: staging roots and their drain, byte budgets and full disks,
relaunches, lazy and interrupted saves, and failures raised exactly once."""

from __future__ import annotations

import concurrent.futures
import errno
import subprocess
import threading

import pytest
import torch

from solar.cache.disk import DiskTier
from solar.checkpoint import CheckpointWriter, list_versions, load, verify
from solar.checkpoint import writer as W
from solar.errors import CheckpointError
from test_checkpoint import KB, assert_same, bits, seeded_state


def test_staging_root_drains_to_main_root(tmp_path):
    x = torch.randn(32 * KB)
    with CheckpointWriter(tmp_path / "shared", staging=tmp_path / "local", chunk_size=4 * KB, keep_last=2) as w:
        r1 = w.save({"x": x}, 1).result()
        x[0] += 1
        r2 = w.save({"x": x}, 2).result()
        w.save({"x": x}, 3)
    assert r1.root == r2.root == str(tmp_path / "shared")
    assert r2.bytes_written == 4 * KB
    assert list_versions(tmp_path / "shared") == [2, 3] == list_versions(tmp_path / "local")
    assert bits(load(tmp_path / "shared", 3)["x"]) == bits(x)
    assert verify(tmp_path / "shared").ok


def test_staging_never_drops_a_version_before_it_is_drained(tmp_path):
    """The staging root runs ahead of a slow drain; keep_last=1 there must not lose versions."""
    x = torch.randn(16 * KB)
    with CheckpointWriter(tmp_path / "shared", staging=tmp_path / "local", chunk_size=4 * KB, keep_last=1) as w:
        release = __import__("threading").Event()
        w._drain.submit(release.wait)  # hold the drain thread while five versions are staged
        futures = []
        for step in range(5):
            x[step] = 100.0 + step
            futures.append(w.save({"x": x}, step))
            futures[-1].staged.result()
        release.set()
        results = [f.result() for f in futures]
    assert [r.step for r in results] == list(range(5))
    assert list_versions(tmp_path / "shared") == [4] and list_versions(tmp_path / "local") == [4]
    assert bits(load(tmp_path / "shared")["x"]) == bits(x)
    assert verify(tmp_path / "shared").ok and verify(tmp_path / "local").ok


def test_budget_exceeded_is_a_clear_error_and_keeps_earlier_versions(tmp_path):
    tier = DiskTier(tmp_path / "small", capacity_bytes=300 * KB)
    x = torch.randn(32 * KB)  # 128 KiB
    with CheckpointWriter(tier, chunk_size=16 * KB) as w:
        w.save({"x": x}, 1).result()
        with pytest.raises(CheckpointError, match="byte budget"):
            w.save({"x": torch.randn(64 * KB)}, 2).result()
    assert list_versions(tier) == [1]
    assert bits(load(tier)["x"]) == bits(x)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()}); the byte-budget test covers ENOSPC")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_a_clear_error_and_keeps_earlier_versions(tiny_tmpfs):
    x = torch.randn(64 * KB)  # 256 KiB
    with CheckpointWriter(tiny_tmpfs / "ck", chunk_size=64 * KB) as w:
        w.save({"x": x}, 1).result()
        with pytest.raises(CheckpointError, match="no space left"):
            w.save({"x": torch.randn(512 * KB)}, 2).result()
    assert list_versions(tiny_tmpfs / "ck") == [1]
    assert bits(load(tiny_tmpfs / "ck")["x"]) == bits(x)
    assert verify(tiny_tmpfs / "ck").ok


def test_relaunch_below_the_newest_step_with_keep_last_loses_nothing(tmp_path):
    """A job relaunched into a root holding a later step: its save survives its own commit, and
    the next save rewrites chunks gc removed instead of trusting the Merkle diff."""
    def state(step, seed):
        g = torch.Generator().manual_seed(seed)
        return {"backbone": torch.randn(8192, generator=g), "head": torch.full((1024,), float(step))}

    with CheckpointWriter(tmp_path, keep_last=1, chunk_size=4096) as w:
        w.save(state(1000, 1), 1000).result()
    with CheckpointWriter(tmp_path, keep_last=1, chunk_size=4096) as w:
        w.save(state(500, 2), 500).result()
        assert 500 in list_versions(tmp_path)
        w.save(state(1500, 2), 1500).result()
    assert list_versions(tmp_path) == [1500]
    assert verify(tmp_path).ok
    assert_same(load(tmp_path), state(1500, 2))


def test_lazy_then_normal_saves_behind_a_running_commit_do_not_deadlock(tmp_path):
    state = {"w": torch.randn(1 << 20)}
    w = CheckpointWriter(tmp_path, chunk_size=1 << 16)

    def run():
        w.save(state, 1)
        w.save(state, 2, lazy=True)  # takes its staging slot on the persist thread, behind save 1
        w.save(state, 3)  # must not take the slot before the lazy save did
        w.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "saves deadlocked"
    w.close()
    assert list_versions(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("later", ["normal", "lazy"])
def test_a_save_interrupted_while_waiting_for_the_buffer_does_not_hang_later_saves(tmp_path, monkeypatch, later):
    """Ctrl-C in a save waiting for the staging buffer (max_in_flight=1) gives up its turn, so
    later saves of the writer do not wait forever for it."""
    gate = threading.Event()
    original = W.CheckpointWriter._write_chunks

    def write_chunks(self, *args):
        gate.wait()  # save 1's commit holds the only staging buffer until the test lets it go
        return original(self, *args)

    monkeypatch.setattr(W.CheckpointWriter, "_write_chunks", write_chunks)
    w = CheckpointWriter(tmp_path, chunk_size=4 * KB)
    try:
        f1 = w.save(seeded_state(1), 1)
        cond = w._pool._cond
        real_wait = cond.wait

        def interrupted_wait(*args, **kwargs):  # the user presses Ctrl-C while save 2 waits
            cond.wait = real_wait
            raise KeyboardInterrupt

        cond.wait = interrupted_wait
        with pytest.raises(KeyboardInterrupt):
            w.save(seeded_state(2), 2)
        assert cond.wait is real_wait  # save 2 did wait for the buffer
    finally:
        gate.set()
    results = []

    def run():
        results.append(w.save(seeded_state(3), 3, lazy=later == "lazy").result())
        results.append(w.save(seeded_state(4), 4).result())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)  # a hang guard, not a timing: these saves take well under a second
    assert not t.is_alive(), "saves after the interrupted one never got the staging buffer"
    assert f1.result().step == 1 and [r.step for r in results] == [3, 4]
    w.close()
    assert list_versions(tmp_path) == [1, 3, 4]
    assert_same(load(tmp_path, 4), seeded_state(4))


def test_a_failed_background_save_is_raised_by_wait_and_by_close(tmp_path):
    class Flaky(DiskTier):
        fail = True

        def put(self, key, value):
            if self.fail and str(key).startswith("chunks/"):
                raise OSError(errno.EIO, "simulated I/O error")
            return super().put(key, value)

    tier = Flaky(str(tmp_path / "a"))
    w = CheckpointWriter(tier, chunk_size=4096)
    f1 = w.save({"w": torch.randn(1000)}, 1)
    concurrent.futures.wait([f1])  # done, its failure not looked at
    tier.fail = False
    w.save({"w": torch.randn(1000)}, 2)  # a later save must not drop the failed one
    with pytest.raises(OSError, match="simulated"):
        w.wait()
    assert w.wait() == []  # raised once
    w.close()
    with pytest.raises(OSError, match="simulated"):
        with CheckpointWriter(Flaky(str(tmp_path / "b")), chunk_size=4096) as w2:
            w2.save({"w": torch.randn(1000)}, 1)
    with CheckpointWriter(Flaky(str(tmp_path / "d")), chunk_size=4096) as w4:
        with pytest.raises(OSError, match="simulated"):
            w4.save({"w": torch.randn(1000)}, 1).result()  # seen here: close() does not raise it again
    with pytest.raises(KeyError):  # the block's own error wins over a failed save's
        with CheckpointWriter(Flaky(str(tmp_path / "c")), chunk_size=4096) as w3:
            w3.save({"w": torch.randn(1000)}, 1)
            raise KeyError("mine")


def test_a_restarted_writer_drains_what_a_dead_one_left_in_staging(tmp_path, monkeypatch):
    main, stage = tmp_path / "main", tmp_path / "stage"
    w = CheckpointWriter(main, staging=stage)
    w.save({"w": torch.full((10,), 1.0)}, 1, blocking=True)
    monkeypatch.setattr(W.CheckpointWriter, "_drain_version", lambda self, step: (_ for _ in ()).throw(
        OSError("killed before the drain")))
    f2 = w.save({"w": torch.full((10,), 2.0)}, 2)
    with pytest.raises(OSError, match="killed"):
        f2.result()
    w.close()
    monkeypatch.undo()
    assert list_versions(main) == [1] and list_versions(stage) == [1, 2]
    with CheckpointWriter(main, staging=stage) as w:
        w.save({"w": torch.full((10,), 3.0)}, 3, blocking=True)
        assert [(type(r).__name__, r.step) for r in w.wait()] == [("SaveResult", 2), ("SaveResult", 3)]  # 2: drained
    assert list_versions(main) == [1, 2, 3]
    assert torch.equal(load(main, 2)["w"], torch.full((10,), 2.0))


def test_an_over_budget_save_leaves_no_chunks_behind(tmp_path):
    w = CheckpointWriter(DiskTier(str(tmp_path), capacity_bytes=300_000), chunk_size=4096, keep_last=1)
    w.save({"w": torch.randn(25_000)}, 1).result()
    with pytest.raises(CheckpointError, match="budget"):
        w.save({"w": torch.randn(100_000)}, 2).result()
    w.save({"w": torch.randn(10)}, 3).result()  # fits once the failed save's chunks are gone
    w.close()
    assert list_versions(tmp_path) == [3] and verify(tmp_path).ok
