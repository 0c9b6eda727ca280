"""NOTE [ Spilled rows in slab files ] (cache/slab.py): a spill tier keeps arrays of 16 KiB or
more in one file per size, read back as views of its map; a slot is written again only once its
value was deleted and no view of it lives; a loader spilling such rows gives torch's batches."""

from __future__ import annotations

import os

import h5py
import numpy as np
import torch
import torch.utils.data as tud

import solar
from solar.cache.slab import MIN_BYTES, Slab
from solar.cache.spill import SpillTier

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

    slab = Slab(str(tmp_path), 16384)
    views = [slab.put(np.full(4096, i, np.float32).view(np.uint8), np.float32, (4096,)) for i in range(256)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = sum(float(v[0]) + float(v[-1]) for v in views)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert total == 2 * sum(range(256)) and faults < 16  # (without: a fault every few values, 65 here)
    slab.close()
