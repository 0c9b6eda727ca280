"""Misses read straight into their batch slots (NOTE [ One copy into the batch ] in solar/fetch.py:
FetchPass._to_slots, RowReads._read_rows_to, HDF5Backend.read_rows_to): the batches stay the
stored rows, with checksums, chunked files, repeats, Subsets and short reads."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.fetch import FetchPass
from solar.io_backends.hdf5 import HDF5Backend
from solar.layout import checksum_key, sample_checksum

N = 60


def _write(path, chunks=None, checksums=True):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 3, 5)).astype("f4")
    y = rng.integers(0, 1 << 30, (N, 7)).astype("i8")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(4, 3, 5) if chunks else None)
        f.create_dataset("y", data=y, chunks=(6, 7) if chunks else None)
        if checksums:
            f[checksum_key("x")] = np.array([sample_checksum(r) for r in x], dtype=np.uint64)
            f[checksum_key("y")] = np.array([sample_checksum(r) for r in y], dtype=np.uint64)
    return x, y


@pytest.fixture
def slots(monkeypatch):
    """Counts the passes whose raw fields were read into their slots."""
    count = {"n": 0}
    real = FetchPass._to_slots

    def counted(self, spec, disjoint, split):
        count["n"] += 1
        return real(self, spec, disjoint, split)
    monkeypatch.setattr(FetchPass, "_to_slots", counted)
    return count


def _check_epochs(loader, x, y, epochs=3):
    for e in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(e)
        for bx, by in loader:
            assert bx.dtype == torch.float32 and by.dtype == torch.int64
            # every row is a stored row, and the two fields are of the same sample
            idx = [int(np.flatnonzero((y == r.numpy()).all(axis=1))[0]) for r in by]
            assert torch.equal(bx, torch.from_numpy(x[idx]))


@pytest.mark.parametrize("chunks", [False, True], ids=["contiguous", "chunked"])
@pytest.mark.parametrize("sieve", [0, 1 << 20])
def test_batches_are_the_stored_rows(tmp_path, slots, chunks, sieve):
    path = str(tmp_path / "d.h5")
    x, y = _write(path, chunks)
    ds = solar.H5Dataset(path, ("x", "y"), sieve_bytes=sieve, io_threads=3)
    loader = solar.DataLoader(ds, batch_size=7, shuffle=True, distributed=True, buffer=20)
    _check_epochs(loader, x, y)
    assert slots["n"] > 0 and ds.stats.hits > 0
    assert ds.reads_to_places(ds.specs[0])


def test_a_damaged_row_read_into_its_slot_names_the_sample(tmp_path, slots):
    path = str(tmp_path / "bad.h5")
    _write(path)
    with h5py.File(path, "r+") as f:
        f["x"][13] = np.zeros((3, 5), "f4")
    loader = solar.DataLoader(solar.H5Dataset(path, ("x", "y")), batch_size=N, buffer=0)
    with pytest.raises(solar.CorruptDataError, match=r"bad.h5: field 'x' sample 13 fails its xxh3"):
        next(iter(loader))
    assert slots["n"] > 0


def test_repeats_in_a_batch_and_in_a_subset(tmp_path, slots):
    path = str(tmp_path / "d.h5")
    x, y = _write(path)
    ds = solar.H5Dataset(path, ("x", "y"))
    batches = [[0, 0, 5, 59], [5, 3, 3, 3], [59, 1, 0, 2]]
    loader = solar.DataLoader(ds, batch_sampler=batches, buffer=2)
    for _ in range(2):
        for want, (bx, by) in zip(batches, loader):
            assert torch.equal(bx, torch.from_numpy(x[want])) and torch.equal(by, torch.from_numpy(y[want]))
    sub = tud.Subset(solar.H5Dataset(path, ("x", "y")), [4, 4, 9, 4, 11, 9, 30, 31])
    loader = solar.DataLoader(sub, batch_size=3, buffer=3)
    got = [torch.cat([b[0] for b in loader]) for _ in range(3)]
    for g in got:
        assert torch.equal(g, torch.from_numpy(x[[4, 4, 9, 4, 11, 9, 30, 31]]))
    assert slots["n"] > 0


def test_short_reads_and_the_iovec_limit(tmp_path, monkeypatch):
    """read_rows_to continues a row a short read left half full, and cuts a run into calls of at
    most the system's iovec limit."""
    path = str(tmp_path / "d.h5")
    x, _ = _write(path, checksums=False)
    real = os.preadv
    calls = []

    def short(fd, views, at):  # at most 37 bytes per call, at most 3 iovecs
        calls.append(len(views))
        assert len(views) <= 3
        first = memoryview(views[0])[:37]
        return real(fd, [first], at)
    monkeypatch.setattr("io_backends.hdf5._IOV_MAX", 3)
    monkeypatch.setattr(os, "preadv", short)
    b = HDF5Backend(path, mmap=False)  # (the preadv path: the mapped one makes no such calls)
    scratch = np.empty((3, 5), "f4")
    out = np.full((4, 3, 5), -1, "f4")
    dests = [out[0], scratch, out[1], out[2], scratch, out[3]]
    b.read_rows_to("x", np.array([[2, 5], [7, 10]]), dests)
    assert np.array_equal(out, x[[2, 4, 7, 9]]) and len(calls) > 6
    assert b.stats.rows_read == 6 and b.stats.read_calls == 2
    with pytest.raises(IndexError, match="out of range"):
        b.read_rows_to("x", np.array([[58, 61]]), [scratch] * 3)
    b.close()


def test_without_plain_bytes_rows_are_read_and_copied(tmp_path, slots):
    """A filtered field (h5py reads it) still gives the stored rows, through read and copy."""
    path = str(tmp_path / "gz.h5")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 4)).astype("f4")
    y = np.arange(N * 7, dtype="i8").reshape(N, 7)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(8, 4), compression="gzip")
        f["y"] = y
    ds = solar.H5Dataset(path, ("x", "y"))
    assert not ds.reads_to_places(ds.specs[0]) and ds.reads_to_places(ds.specs[1])
    b = HDF5Backend(path)
    out = np.empty((2, 4), "f4")
    b.read_rows_to("x", np.array([[3, 5]]), [out[0], out[1]])
    assert np.array_equal(out, x[3:5])
    loader = solar.DataLoader(ds, batch_size=9, shuffle=True, distributed=True, buffer=10)
    for e in range(2):
        loader.set_epoch(e)
        for bx, by in loader:
            assert torch.equal(bx, torch.from_numpy(x[(by[:, 0] // 7).numpy()]))
    assert slots["n"] > 0


# -- NOTE [ Reused batch memory ] ---------------------------------------------------------------
def test_step_tensors_are_reused_only_when_nothing_references_their_memory():
    """A pool's tensor comes back for a later pass once the consumer dropped it; a kept batch, a
    slice of it, a numpy view of it or a smaller step of the same size never get it back."""
    from solar.fetch import SlotPool

    pool = SlotPool()
    kept = pool.empty((4, 3), torch.float32)
    first = pool.empty((4, 3), torch.float32)
    address = first.data_ptr()
    del first
    again = pool.empty((4, 3), torch.float32)
    assert again.data_ptr() == address and again.data_ptr() != kept.data_ptr()
    box = [again]  # (the only reference to the tensor under test, so that it can be dropped)
    del again
    for hold in (lambda t: t, lambda t: t[1:], lambda t: t.numpy(), lambda t: t.view(12)):
        held = hold(box[0])
        ptr = box[0].data_ptr()
        box.clear()
        got = pool.empty((4, 3), torch.float32)
        assert got.data_ptr() != ptr and got.data_ptr() != kept.data_ptr()
        del held
        box.append(got)
        del got
    assert pool.empty((2, 3), torch.float32).shape == (2, 3)
    assert len(pool._out) <= SlotPool.LIMIT
    big = [pool.empty((SlotPool.LIMIT_BYTES // 8,), torch.uint8) for _ in range(10)]  # (pages never touched)
    assert pool._bytes == sum(t.nbytes for t in pool._out) <= SlotPool.LIMIT_BYTES
    assert [t is b for t, b in zip(pool._out, big[2:])] == [True] * 8  # the newest remembered, the oldest gone


def test_batches_kept_by_the_consumer_keep_their_rows_while_later_epochs_run(tmp_path):
    """Batches (and slices of them) a loop keeps, as a validation loop collecting outputs does,
    still hold their stored rows after later epochs reused the memory of the batches it dropped."""
    path = str(tmp_path / "d.h5")
    x, y = _write(path, checksums=False)
    ds = solar.H5Dataset(path, ("x", "y"))
    loader = solar.DataLoader(ds, batch_size=8, shuffle=True, buffer="2KiB", distributed=True)
    kept = []
    for e in range(4):
        loader.set_epoch(e)
        for k, (bx, by) in enumerate(loader):
            if e == 0:  # the whole batch of one field, a slice of the other
                kept.append((bx, by[1:], 1) if k % 2 else (bx[2:], by, -2))
    assert kept
    for bx, by, cut in kept:
        idx = [int(np.flatnonzero((y == r.numpy()).all(axis=1))[0]) for r in by]
        if cut == 1:  # bx: the whole batch, by: its rows from the second on
            assert torch.equal(bx[1:], torch.from_numpy(x[idx]))
        else:  # bx: its rows from the third on, by: the whole batch
            assert torch.equal(bx, torch.from_numpy(x[idx[2:]]))
    assert ds.__dict__["_slot_pool"]._out  # (the pass layout that reuses memory ran)
    ds.close()
