"""NOTE [ Spilled rows in slab files ] (cache/slab.py): a spill tier keeps arrays of 16 KiB or
more in one file per size, read back as views of its map; a slot is written again only once its
value was deleted and no view of it lives; a loader spilling such rows gives torch's batches."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.cache import slab as slab_module
from solar.cache.slab import MADV_POPULATE_READ, MIN_BYTES, Slab
from solar.cache.spill import MAX_SLABS, SpillTier

ROW = (64, 64)  # float32: 16 KiB, spilled to a slab


def _rows(n: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(ROW).astype(np.float32) for _ in range(n)]


def test_a_slot_is_written_again_only_once_nothing_reads_it(tmp_path):
    slab = Slab(str(tmp_path), 16384, block_bytes=3 * 16384)
    rows = _rows(4)
    views = [slab.put(r.view(np.uint8).reshape(-1), np.float32, ROW) for r in rows]
    assert slab.slots == 6 and slab.in_use == 4  # two blocks of three
    for v, r in zip(views, rows):
        np.testing.assert_array_equal(v, r)
        assert v.dtype == np.float32 and v.shape == ROW and not v.flags.writeable
    held, exported = views[0][5:], memoryview(views[1])  # a view of a row; a buffer export of one
    del views, v
    assert slab.in_use == 2
    new = [slab.put(r.view(np.uint8).reshape(-1), np.float32, ROW) for r in _rows(4, seed=9)]
    assert slab.slots == 6 and slab.in_use == 6
    assert not any(np.shares_memory(n, old) for n in new for old in (held, np.asarray(exported)))
    np.testing.assert_array_equal(held, rows[0][5:])
    np.testing.assert_array_equal(np.asarray(exported), rows[1])
    del held, exported
    assert slab.in_use == 4
    assert slab.put(rows[0].view(np.uint8).reshape(-1), np.float32, ROW) is not None and slab.slots == 6
    assert os.listdir(tmp_path) == [".slab-16384"]
    slab.close()


def test_spilled_arrays_are_views_of_one_file_per_size(tmp_path):
    tier = SpillTier.on_disk(str(tmp_path), 0, None)
    rows = _rows(5)
    small = np.arange(MIN_BYTES // 8 - 1, dtype=np.int64)
    for i, r in enumerate(rows):
        assert tier.put(("x", i), r)
    assert tier.put(("s", 0), small)
    a, b = tier.get(("x", 2)), tier.get(("x", 2))
    np.testing.assert_array_equal(a, rows[2])
    assert a.dtype == np.float32 and a.shape == ROW and not a.flags.writeable
    assert np.shares_memory(a, b)  # the same page-cache bytes, not a fresh read each
    got = tier.get(("s", 0))
    np.testing.assert_array_equal(got, small)
    root = tier._slab_dir
    names = sorted(os.listdir(root))
    assert ".slab-16384" in names and len([n for n in names if not n.startswith(".")]) == 1  # the small one
    assert len(list(tier.second.keys())) == 1  # the small one's file: no slab among the disk tier's files
    # a value replaced or deleted while a view of it lives: that view keeps its bytes
    assert tier.put(("x", 2), rows[0]) and tier.delete(("x", 3))
    for i in range(5, 12):
        assert tier.put(("x", i), rows[i % 5] + 100)
    np.testing.assert_array_equal(a, rows[2])
    np.testing.assert_array_equal(tier.get(("x", 2)), rows[0])
    assert ("x", 3) not in tier
    tier.close()
    np.testing.assert_array_equal(a, rows[2])  # (the map outlives its file)
    assert not os.path.exists(root)


def test_a_slab_that_cannot_grow_spills_to_files(tmp_path, monkeypatch):
    tier = SpillTier.on_disk(str(tmp_path), 0, None)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    r = _rows(1)[0]
    assert tier.put(("x", 0), r)  # (the disk tier's own file: a cache keeps what it can)
    np.testing.assert_array_equal(tier.get(("x", 0)), r)
    assert len(list(tier.second.keys())) == 1 and not any(sl.slots for sl in tier._slabs.values())
    monkeypatch.undo()  # room again: the next array goes to a slab
    assert tier.put(("x", 1), r) and sum(sl.slots for sl in tier._slabs.values()) > 0
    np.testing.assert_array_equal(tier.get(("x", 1)), r)
    tier.close()


def test_a_loader_spilling_large_rows_gives_torchs_batches(tmp_path):
    path = str(tmp_path / "big.h5")
    x = np.stack(_rows(40, seed=11))
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=np.arange(40))
    (tmp_path / "nvme").mkdir()
    ds, ref_ds = solar.H5Dataset(path), solar.H5Dataset(path)
    s, ref_s = (tud.DistributedSampler(d, num_replicas=1, rank=0, seed=2) for d in (ds, ref_ds))
    ref = tud.DataLoader(ref_ds, batch_size=5, sampler=ref_s)
    loader = solar.DataLoader(ds, batch_size=5, sampler=s, buffer="64KiB", spill=(str(tmp_path / "nvme"), "1MiB"))
    try:
        for e in range(3):
            s.set_epoch(e)
            ref_s.set_epoch(e)
            for (bx, by), (rx, ry) in zip(loader, ref):
                assert torch.equal(bx, rx) and torch.equal(by, ry)
        buf = loader.solar_sampler.buffer
        assert any(k[0] == "x" for k in buf._spilled) and buf._slabs
        assert ds.stats.hits >= 2 * 40 - 4  # every sample a hit after the first epoch (4 in memory)
    finally:
        ds.close()
        ref_ds.close()


def test_written_values_are_mapped_in_at_once(tmp_path):
    """Each put maps its pages into the block's map (MADV_POPULATE_READ): reading the values
    afterwards takes no page faults, where each would have faulted in a first read."""
    import resource

    _skip_without_populate_read(tmp_path)
    slab = Slab(str(tmp_path), 16384)
    views = [slab.put(np.full(4096, i, np.float32).view(np.uint8), np.float32, (4096,)) for i in range(256)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = sum(float(v[0]) + float(v[-1]) for v in views)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert total == 2 * sum(range(256)) and faults < 16  # (without: a fault every few values, 65 here)
    slab.close()


def _skip_without_populate_read(tmp_path) -> None:
    """Skip where the kernel refuses MADV_POPULATE_READ (before Linux 5.14, e.g. RHEL 8)."""
    if MADV_POPULATE_READ is None or not hasattr(mmap.mmap, "madvise"):
        pytest.skip("no MADV_POPULATE_READ on this platform")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * mmap.PAGESIZE)
    with open(probe, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            m.madvise(MADV_POPULATE_READ)
        except OSError:
            pytest.skip("this kernel refuses MADV_POPULATE_READ (Linux < 5.14)")


_METADATA = 64 << 10  # what a file system may allocate besides the data (extent blocks)


def _disk_bytes(root: str) -> int:
    return sum(os.stat(os.path.join(root, n)).st_blocks * 512 for n in os.listdir(root))


def test_slab_blocks_count_against_the_spill_budget(tmp_path):
    """Arrays of distinct sizes (compressed blobs) reserve no block per size: the disk under
    the tier stays within its budget, slabs are few, and a size that repeats gets one."""
    budget = 8 << 20
    tier = SpillTier.on_disk(str(tmp_path), 0, budget)
    rng = np.random.default_rng(1)
    blobs = [rng.integers(0, 255, 16384 + 16 * i, dtype=np.uint8) for i in range(200)]
    for i, b in enumerate(blobs):
        assert tier.put(("b", i), b)
    for i, b in enumerate(blobs):
        np.testing.assert_array_equal(tier.get(("b", i)), b)
    assert len(tier._slabs) <= MAX_SLABS and tier.nbytes <= budget
    assert _disk_bytes(tier._slab_dir) <= budget + _METADATA
    repeated = 40000  # a size none of the blobs has: its second value on goes to a slab
    for i in range(3):
        assert tier.put(("r", i), np.full(repeated, i, np.uint8))
    assert repeated in tier._slabs and tier._slabs[repeated].in_use == 2
    tier.close()
    # one size filling the budget: its blocks never grow past it, and the budget is used
    tier = SpillTier.on_disk(str(tmp_path), 0, 1 << 20)
    kept = sum(tier.put(("x", i), r) for i, r in enumerate(_rows(80)))
    assert 56 <= kept <= 64 and tier.nbytes <= 1 << 20 and _disk_bytes(tier._slab_dir) <= (1 << 20) + _METADATA
    tier.close()


def _open_fds() -> list[str]:
    return [os.path.realpath(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_spill_tier_dropped_without_close_closes_its_slab_files(tmp_path):
    """A tier the sampler replaces goes with the garbage collector: its slabs' descriptors (and
    the disk space of their deleted files) go too."""
    gc.collect()
    before = len(_open_fds())
    for i in range(5):
        tier = SpillTier.on_disk(str(tmp_path), 0, None)
        assert tier.put(("x", 0), _rows(1)[0]) and tier._slabs
        del tier
        gc.collect()
    assert len(_open_fds()) <= before and not any(".slab-" in f for f in _open_fds())


def test_slab_blocks_grow_geometrically(tmp_path):
    """A slab's blocks double (up to a cap), so it holds few maps (each holds a descriptor)."""
    slab = Slab(str(tmp_path), 16384, block_bytes=4 * 16384, max_block_bytes=64 * 16384)
    views = [slab.put(r.view(np.uint8).reshape(-1), np.float32, ROW) for r in _rows(600)]
    sizes = [len(m) // 16384 for m in slab._maps]
    assert sizes == [4, 8, 16, 32] + [64] * 9 and slab.slots >= 600  # (150 maps of 4)
    np.testing.assert_array_equal(views[599], _rows(600)[599])
    slab.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_spill_without_descriptors_says_so(tmp_path):
    """A process out of file descriptors is told so, not that its disk is full."""
    script = textwrap.dedent(f"""
        import os, resource, warnings, numpy as np
        from solar.cache.spill import SpillTier
        tier = SpillTier.on_disk({str(tmp_path)!r}, 0, None)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = max(int(n) for n in os.listdir("/proc/self/fd")) + 64
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            os.close(held.pop())  # one descriptor left: the slab's file takes it, its map finds none
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            kept = [tier.put(("x", i), np.ones(1 << 15, np.uint8)) for i in range(3)]
        print(kept)
        for x in w:
            print("WARNING", x.message)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert warned and all("file descriptor" in line and "free space" not in line for line in warned), out.stdout


def test_spill_without_posix_fallocate_keeps_a_file_each(tmp_path, monkeypatch):
    """Where the platform has no posix_fallocate (macOS) large arrays are a file each."""
    monkeypatch.delattr(os, "posix_fallocate")
    tier = SpillTier.on_disk(str(tmp_path), 0, None)
    rows = _rows(3)
    for i, r in enumerate(rows):
        assert tier.put(("x", i), r)
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(tier.get(("x", i)), r)
    assert not tier._slabs and len(list(tier.second.keys())) == 3
    tier.close()


def _counting_fallocate(monkeypatch, fail: int | None = None) -> list:
    calls, real = [], os.posix_fallocate

    def fallocate(fd, offset, length):
        calls.append(length)
        if fail is not None:
            raise OSError(fail, os.strerror(fail))
        return real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    return calls


def test_a_slab_that_cannot_map_is_turned_off_and_a_full_disk_is_not_retried(tmp_path, monkeypatch):
    """A file system that cannot map the slab: one reservation, a warning, then a file each. A
    full disk: no reservation tried again until the file system has room."""
    calls = _counting_fallocate(monkeypatch)

    def no_map(fd, size, at):
        raise OSError(errno.ENODEV, "No such device")
    monkeypatch.setattr(slab_module, "_map", no_map)
    tier = SpillTier.on_disk(str(tmp_path), 0, None)
    rows = _rows(20)
    with pytest.warns(RuntimeWarning, match="cannot map it"):
        assert all(tier.put(("x", i), r) for i, r in enumerate(rows))
    assert len(calls) == 1 and len(list(tier.second.keys())) == 20
    np.testing.assert_array_equal(tier.get(("x", 19)), rows[19])
    tier.close()
    monkeypatch.undo()

    calls = _counting_fallocate(monkeypatch, fail=errno.ENOSPC)
    real_statvfs = os.fstatvfs
    free = {"bytes": 0}

    def statvfs(fd):
        st = real_statvfs(fd)
        return os.statvfs_result((st.f_bsize, 1, st.f_blocks, free["bytes"], free["bytes"], *st[5:]))
    monkeypatch.setattr(os, "fstatvfs", statvfs)
    tier = SpillTier.on_disk(str(tmp_path), 0, None)
    assert all(tier.put(("x", i), r) for i, r in enumerate(rows))
    assert len(calls) == 1  # (then the disk had no room: not tried again)
    free["bytes"] = 1 << 40
    assert tier.put(("x", 20), rows[0]) and len(calls) == 2
    tier.close()
