"""Every registered storage tier runs the shipped conformance suite, plus tier-specific checks."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

import solar
from solar.cache import get_tier, registry
from solar.cache.disk import DiskTier
from solar.cache.fsspec_tier import FsspecTier
from solar.cache.spill import SpillTier, spill_level
from solar.errors import ConfigError
from solar.testing.tiers import TierTests, race_put_new


class _MemoryURLTier(FsspecTier):
    """The fsspec tier on ``memory://`` (an object store: direct writes, no rename)."""

    @classmethod
    def example(cls, scratch_dir, capacity_bytes=None):
        return cls(f"memory://tiers/{abs(hash(scratch_dir))}", capacity_bytes)


def _s3_tier(bucket: str, opts: dict) -> type:
    class _S3Tier(FsspecTier):
        """The fsspec tier on a real S3 API (moto on 127.0.0.1)."""

        @classmethod
        def example(cls, scratch_dir, capacity_bytes=None):
            return cls(f"{bucket}/tiers-{uuid.uuid5(uuid.NAMESPACE_URL, scratch_dir).hex[:12]}", capacity_bytes,
                       storage_options=opts)

    return _S3Tier


@pytest.fixture(params=registry.names() + ["fsspec-memory", "fsspec-s3"])
def tier_cls(request):
    if request.param == "fsspec-memory":
        return _MemoryURLTier
    if request.param == "fsspec-s3":
        return _s3_tier(*request.getfixturevalue("s3_bucket"))
    return get_tier(request.param)


class TestRegisteredTiers(TierTests):
    pass


@pytest.mark.parametrize("tier_cls", [_MemoryURLTier, DiskTier, get_tier("memory")],
                         ids=["memory-url", "disk", "memory"])
def test_exclusive_create_holds_under_fast_thread_switching(tier_cls, tmp_path):
    """memory://'s own "create" is a check then a write: with threads switching every
    microsecond two racers both won (29 of 200 trials) until creates took a process-wide lock."""
    race_put_new(tier_cls.example(str(tmp_path), None), rounds=30, switch_interval=1e-6)


def test_registry_lists_the_storage_tiers():
    assert {"memory", "disk", "fsspec"} <= set(registry.names())


def test_disk_tier_leaves_no_temporaries_and_cleans_killed_ones(tmp_path):
    tier = DiskTier(tmp_path / "t")
    for i in range(20):
        tier.put(f"k/{i}", os.urandom(100))
    names = [n for _d, _s, files in os.walk(tier.root) for n in files]
    assert not [n for n in names if n.startswith(".")]
    # a temporary a SIGKILLed writer left behind: invisible, then removed
    leftover = os.path.join(tier.root, "k", f".5.tmp-999-{uuid.uuid4().hex[:8]}")
    with open(leftover, "wb") as f:
        f.write(b"torn")
    assert sorted(tier.keys()) == sorted(f"k/{i}" for i in range(20))
    assert tier.cleanup_temp() == 1 and not os.path.exists(leftover)


def test_file_tiers_keep_int_keys_and_hash_named_files_apart(tmp_path):
    """A string key "#5" was stored in the file of the int key 5 (one overwrote the other), and
    a file "#007" was listed as the key 7, which get(7) did not find."""
    tier = DiskTier(tmp_path / "t")
    with pytest.raises(ValueError, match="starting with '#' is how int keys are stored"):
        tier.put("#5", b"s")
    assert tier.put(5, b"i") and tier.get(5) == b"i" and list(tier.keys()) == [5]
    with open(os.path.join(tier.root, "#007"), "wb") as f:
        f.write(b"by hand")
    assert sorted(map(str, tier.keys())) == ["#007", "5"]


@pytest.mark.parametrize("bad", ["", "../x", "a//b", ".hidden", "a/./b", 3.5])
def test_file_tiers_reject_bad_keys(tmp_path, bad):
    tier = DiskTier(tmp_path / "t")
    with pytest.raises((ValueError, TypeError)):
        tier.put(bad, b"v")


def test_fsspec_tier_local_rename_is_atomic(tmp_path):
    tier = FsspecTier(str(tmp_path / "f"))
    assert tier.rename_atomic
    tier.put("a/b", b"x" * 10)
    assert os.listdir(tmp_path / "f" / "a") == ["b"]


def test_write_atomic_fsyncs_the_file_its_directory_and_every_directory_it_creates(tmp_path, monkeypatch):
    from solar.cache import disk

    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(disk.os, "fsync", spy)
    target = tmp_path / "chunks" / "ab" / "abcd"
    disk.write_atomic(str(target), b"x" * 10)
    assert str(tmp_path) in synced and str(tmp_path / "chunks") in synced  # new dirs' entries
    assert str(tmp_path / "chunks" / "ab") in synced  # the renamed file's entry
    synced.clear()
    disk.write_atomic(str(tmp_path / "chunks" / "ab" / "abce"), b"y")
    assert str(tmp_path / "chunks") not in synced  # nothing new created: only the file and its dir


def test_a_checkpoint_roots_files_leave_the_page_cache_after_their_fsync_and_a_spill_tiers_stay(tmp_path, monkeypatch):
    """``drop_written``: a durable checkpoint root advises the kernel to drop each file's pages
    after its fsync (never before, and never for a spill tier, whose files are read again); the
    bytes are whole either way, and a file system refusing the advice changes nothing."""
    from solar.cache import disk
    from solar.checkpoint.store import open_tier

    events = []
    real_fsync = os.fsync
    monkeypatch.setattr(disk.os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(disk.os, "posix_fadvise", lambda fd, off, n, advice: events.append(("advise", advice)))
    root = open_tier(str(tmp_path / "ckpt"))
    assert isinstance(root, DiskTier) and root.drop_written
    root.put("chunks/ab/abcd", b"x" * 4096)
    at = events.index(("advise", os.POSIX_FADV_DONTNEED))  # right after the file's own fsync
    assert events[at - 1] == "fsync" and events.count(("advise", os.POSIX_FADV_DONTNEED)) == 1
    assert root.get("chunks/ab/abcd") == b"x" * 4096
    assert not open_tier(str(tmp_path / "fast"), durable=False).drop_written  # (no fsync: dirty pages)
    events.clear()
    spill = DiskTier.in_directory(str(tmp_path / "spill"))
    spill.put("s", b"y" * 10)
    assert not any(isinstance(e, tuple) for e in events)

    def refuse(*_):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(disk.os, "posix_fadvise", refuse)
    root.put("chunks/ab/abce", b"z" * 10)
    assert root.get("chunks/ab/abce") == b"z" * 10


def test_spill_tier_keeps_arrays_and_cleans_up_only_in_its_own_process(tmp_path):
    """Arrays spilled to disk come back with their dtype and shape; the tier's directory is
    removed when it is collected, but not by a forked child that exits (a DataLoader worker)."""
    import gc

    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 100, 10_000, block=1)
    small, big = np.arange(3, dtype=">i2"), np.linspace(0, 1, 60).reshape(3, 4, 5).astype(np.float32)
    assert tier.put(("x", 1), small) and tier.put(("x", 2), big)
    assert ("x", 1) in tier.first and ("x", 2) not in tier.first  # 480 B: spilled
    got = tier.get(("x", 2))
    assert got.dtype == big.dtype and got.shape == big.shape and np.array_equal(got, big)
    assert tier.put(("x", 2), small) and ("x", 2) in tier.first and tier.second.nbytes == 0  # moved back
    assert tier.put(("x", 3), big) and tier.nbytes == 2 * small.nbytes + big.nbytes
    root = tier.second.root
    pid = os.fork()
    if pid == 0:  # a child that runs its exit hooks (weakref finalizers among them), then ends
        import atexit

        try:
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.isdir(root) and tier.get(("x", 3)) is not None
    del tier, got
    gc.collect()
    assert not os.path.exists(root)


def test_spill_tier_that_cannot_write_keeps_less_and_says_so(tmp_path):
    """A full (here: removed) spill directory is a smaller cache, not a failed read pass."""
    import shutil

    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 10, 10_000)
    shutil.rmtree(tier.second.root)
    with open(tier.second.root, "w"):  # a file where its directory was: every write fails (as root too)
        pass
    with pytest.warns(RuntimeWarning, match="spill directory .* refused a write"):
        assert tier.put("a", b"x" * 100) is False
    assert tier.put("b", b"y" * 100) is False and "a" not in tier and tier.nbytes == 0
    assert tier.put("c", b"z" * 5) is True  # memory still works


def test_spill_tier_charges_whole_blocks_under_one_budget_and_sweeps_killed_jobs(tmp_path):
    """Each spilled value is a file: it is charged whole blocks, so a small-row dataset cannot
    fill the drive past its budget; memory and disk share one budget (a value fits where the
    total allows, not only where one part has room); a directory left by a killed process of
    this host is removed by the next tier, one of a live process is not."""
    import socket
    import subprocess
    import sys

    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 1000, 3 * 4096, block=4096)
    assert tier.capacity_bytes == 1000 + 3 * 4096
    for i in range(10):
        tier.put(i, np.zeros(300, np.uint8))  # 3 fit in memory, then 3 blocks on disk; the rest refused
    assert len(tier.first) == 3 and len(tier._spilled) == 3 and tier.nbytes == 900 + 3 * 4096
    assert tier.put("big", np.zeros(2000, np.uint8)) is False  # no part has room for it
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"solar-spill-{host}-{dead}-0123abcd"
    live = tmp_path / f"solar-spill-{host}-{os.getpid()}-89abcdef"
    other = tmp_path / f"solar-spill-otherhost-{dead}-0123abcd"
    for d in (stale, live, other):
        (d / "x").mkdir(parents=True)
    SpillTier.on_disk(str(tmp_path), 10, 10)
    assert not stale.exists() and live.exists() and other.exists()


def test_spill_tier_on_a_full_disk_keeps_less(tmp_path, monkeypatch):
    """ENOSPC comes out of the disk tier as TierFullError (not an OSError): a smaller cache too."""
    from solar.cache.base import TierFullError
    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 10, 10_000, block=1)

    def full(key, value):
        raise TierFullError("no space left on device")

    monkeypatch.setattr(tier.second, "put", full)
    with pytest.warns(RuntimeWarning, match="refused a write"):
        assert tier.put("a", b"x" * 100) is False
    assert "a" not in tier and tier.nbytes == 0


def test_spill_tier_forgets_files_removed_behind_its_back(tmp_path):
    """A spilled file deleted by someone else is a miss, and its bytes leave the budget."""
    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 10, 1000, block=1)
    assert tier.put("a", b"x" * 900)
    for _dir, _sub, files in os.walk(tier.second.root):
        for f in files:
            os.unlink(os.path.join(_dir, f))
    assert tier.get("a") is None and "a" not in tier and tier.nbytes == 0
    assert tier.put("b", b"y" * 900)  # the room is back


def test_a_closed_spill_tier_keeps_values_in_memory_only_and_its_directory_stays_gone(tmp_path):
    """A put that spilled after close() made the directory again, which nothing removed."""
    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path), 100, 10_000, block=1)
    big = np.zeros(200, np.uint8)
    assert tier.put(1, big) and 1 not in tier.first  # spilled
    root = tier.second.root
    tier.close()
    assert not os.path.exists(root) and 1 not in tier
    assert tier.put(2, big) is False  # no room in memory, and no disk any more
    assert tier.put(3, b"xyz") and tier.get(3) == b"xyz"
    assert not os.path.exists(root)


# -- tiers as the loader's spill level (spill={"tier": name, ...}) ------------------------------
FILE_TIERS = [n for n in registry.names() if get_tier(n).keeps_files]


def test_the_tiers_that_keep_files_are_disk_and_fsspec():
    assert set(FILE_TIERS) == {"disk", "fsspec"}
    for name in set(registry.names()) - set(FILE_TIERS):
        with pytest.raises(ConfigError, match=f"the '{name}' cache tier keeps no files in a directory"):
            get_tier(name).in_directory("/nonexistent")


@pytest.mark.parametrize("name", FILE_TIERS)
def test_a_spill_to_any_file_tier_is_built_through_the_registry_and_removed_with_it(name, tmp_path):
    """SpillTier.on_disk(tier=name) spills to a fresh, private instance of the registered tier:
    arrays come back with their dtype and shape from its files, and the directory goes on close."""
    tier = SpillTier.on_disk(str(tmp_path), 100, 10_000, block=1, tier=name)
    assert type(tier.second) is get_tier(name) and tier.second.capacity_bytes is None
    big = np.linspace(0, 1, 60).reshape(3, 4, 5).astype(np.float32)
    assert tier.put(("x", 2), big) and ("x", 2) not in tier.first  # 240 B: spilled, under a tuple key
    got = tier.get(("x", 2))
    assert got.dtype == big.dtype and got.shape == big.shape and np.array_equal(got, big)
    (root,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    assert tier.second.root == root and os.stat(root).st_mode & 0o777 == 0o700
    assert list(tier.second.keys()) == [0] and len(os.listdir(root)) == 1  # the tier's own key: a file number
    tier.close()
    assert not os.path.exists(root)


def test_spill_level_names_the_tiers_a_buffer_can_spill_to():
    assert spill_level("fsspec") is get_tier("fsspec")
    with pytest.raises(ConfigError, match="no cache tier named 'nvme'; known: .*spills to one that keeps files: "
                                          "disk, fsspec"):
        spill_level("nvme")
    with pytest.raises(ConfigError, match="the 'spill' cache tier keeps no files .*name one that does: disk, fsspec"):
        spill_level("spill")


def test_loader_options_naming_a_tier_say_what_to_pass(h5path, tmp_path):
    """Wrong buffer=/spill= values that mean a cache tier: the error names the value and the form to use."""
    ds, d = solar.H5Dataset(h5path), str(tmp_path)
    disk = DiskTier(tmp_path / "mine")

    def refused(**options):
        with pytest.raises(ConfigError) as err:
            solar.DataLoader(ds, batch_size=4, **options)
        return str(err.value)

    msg = refused(buffer="disk")
    assert msg.startswith("buffer='disk': buffer= is the memory part of the rank buffer") and \
        "pass spill={'tier': 'disk', 'dir': <local directory>, 'size': '100GiB'}" in msg and "buffer='0B'" in msg
    assert "buffer=DiskTier(" in refused(buffer=disk) and "spill={'tier': 'disk'" in refused(buffer=disk)
    assert "the loader builds the buffer itself: a memory tier of buffer= bytes" in refused(buffer="memory")
    msg = refused(buffer="1MB", spill=disk)
    assert msg.startswith("spill=DiskTier(") and "not a DiskTier instance" in msg and \
        "pass {'tier': 'disk', 'dir': ..., 'size': ...}" in msg
    msg = refused(buffer="1MB", spill={"tier": "memory", "dir": d, "size": "1MB"})
    assert msg.startswith("spill={'tier': 'memory'") and "name one that does: disk, fsspec" in msg
    assert "no cache tier named 'nvme'" in refused(buffer="1MB", spill={"tier": "nvme", "dir": d, "size": "1MB"})
    msg = refused(buffer="1MB", spill={"tier": "disk", "path": d, "size": "1MB"})
    assert "a dict takes the keys 'dir' and 'size', and 'tier'" in msg
    msg = refused(buffer="1MB", spill={"tier": "fsspec", "dir": "s3://bucket/spill", "size": "1MB"})
    assert "spill directory s3://bucket/spill is a URL" in msg and "pass a local directory" in msg
    assert "pass (directory, size)" in refused(buffer="1MB", spill=(d, "1MB", "disk"))
    loader = solar.DataLoader(ds, batch_size=4, buffer="1MB", spill={"tier": "fsspec", "dir": d, "size": "1MB"})
    assert loader.solar_sampler.spill_spec.tier == "fsspec"
