"""A mapped file's rows copied into their batch when it is taken (NOTE [ Rows copied when the batch
is taken ] in solar/slots.py): the batches, hits and counters are those of rows read ahead; a file
cut shorter meanwhile raises from that batch; buffered values stay what they were."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import solar
from solar.io_backends.hdf5 import HDF5Backend
from solar.slots import DeferredStep, SlotPool
from test_loader_slots import N, _write

def _loader(path, mmap="auto", **kw):
    ds = solar.H5Dataset(path, ("x", "y"), backend_options={"mmap": mmap}, sieve_bytes=kw.pop("sieve_bytes", 64))
    return solar.DataLoader(ds, batch_size=6, shuffle=True, distributed=True, buffer=kw.pop("buffer", 20), **kw)


def _epochs(loader, epochs=3):
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out.append([(bx.clone(), by.clone()) for bx, by in loader])
    return out


@pytest.mark.parametrize("chunks", [False, True], ids=["contiguous", "chunked"])
def test_batches_hits_and_counters_are_those_of_rows_read_ahead(tmp_path, chunks):
    """Mapped (copied when taken) and not mapped (read ahead by preadv): the same batches in the
    same order, the same hits, the same bytes and requests, sieved gaps included."""
    path = str(tmp_path / "d.h5")
    x, y = _write(path, chunks, checksums=False)
    taken, ahead = _loader(path), _loader(path, mmap=False)
    got, want = _epochs(taken), _epochs(ahead)
    for a, b in zip(got, want):
        assert len(a) == len(b) == N // 6
        for (ax, ay), (bx, by) in zip(a, b):
            assert torch.equal(ax, bx) and torch.equal(ay, by)
            idx = [int(np.flatnonzero((y == r.numpy()).all(axis=1))[0]) for r in ay]
            assert torch.equal(ax, torch.from_numpy(x[idx]))
    s, t = taken.dataset.stats, ahead.dataset.stats
    assert (s.hits, s.misses, s.kept, s.bytes_in, s.read_calls) == (t.hits, t.misses, t.kept, t.bytes_in, t.read_calls)
    assert s.hits > 0
    assert taken.dataset.backend.stats.extra["mapped_reads"] > 0
    assert "mapped_reads" not in ahead.dataset.backend.stats.extra


def test_a_steps_rows_are_copied_when_its_field_is_read(tmp_path):
    """The read-ahead hands out steps whose raw fields are not made yet; reading a field makes
    a tensor of the stored rows, which the step does not keep (read again, it is made again,
    equal), and a pickled batch carries tensors."""
    path = str(tmp_path / "d.h5")
    x, y = _write(path, checksums=False)
    loader = _loader(path, buffer=0)
    steps = list(loader.batch_sampler)
    assert len(steps) == N // 6
    for step in steps:
        stored = step.stored
        assert isinstance(dict.__getitem__(stored.fields, "x"), DeferredStep)
        bx = stored.fields["x"]
        assert isinstance(bx, torch.Tensor) and torch.equal(bx, torch.from_numpy(x[list(step)]))
        assert isinstance(dict.__getitem__(stored.fields, "x"), DeferredStep)
        again = stored.fields["x"]
        assert again.data_ptr() != bx.data_ptr() and torch.equal(again, bx)
        again = pickle.loads(pickle.dumps(stored.fields))
        assert type(again) is dict and torch.equal(again["y"], torch.from_numpy(y[list(step)]))


def test_fields_with_checksums_are_read_and_verified_ahead(tmp_path):
    path = str(tmp_path / "d.h5")
    x, _ = _write(path)
    loader = _loader(path, buffer=0)
    step = next(iter(loader.batch_sampler))
    assert isinstance(dict.__getitem__(step.stored.fields, "x"), torch.Tensor)
    assert torch.equal(step.stored.fields["x"], torch.from_numpy(x[list(step)]))


def test_a_file_cut_shorter_before_the_batch_is_taken_raises_from_that_batch(tmp_path):
    """The rows were checked when the pass was made; the copy checks again, and a cut file
    gives StorageError naming it, not a SIGBUS."""
    path = str(tmp_path / "cut.h5")
    _write(path, checksums=False)
    loader = _loader(path, buffer=0)
    it = iter(loader.batch_sampler)
    steps = [next(it) for _ in range(3)]
    with open(path, "r+b") as fh:
        fh.truncate(1024)
    with pytest.raises(solar.StorageError, match=r"cut\.h5: .*(shrank|past the end)"):
        for step in steps:
            step.stored.fields["x"]


def test_buffered_values_evicted_before_the_batch_is_taken_keep_their_rows(tmp_path):
    """A hit is held by reference until its batch is taken: a buffer that drops or replaces the
    value meanwhile does not change the batch."""
    path = str(tmp_path / "d.h5")
    x, _ = _write(path, checksums=False)
    loader = _loader(path, buffer=N)  # every sample kept after the first epoch
    _epochs(loader, 1)
    loader.set_epoch(1)
    hits = loader.dataset.stats.hits
    steps = list(loader.batch_sampler)
    assert loader.dataset.stats.hits - hits == N
    buffer = loader.solar_sampler.buffer
    for key in list(buffer.keys()):
        buffer.delete(key)
    for step in steps:
        assert torch.equal(step.stored.fields["x"], torch.from_numpy(x[list(step)]))


def test_mapped_rows_are_views_of_the_stored_rows_and_none_when_not_mapped(tmp_path):
    path = str(tmp_path / "d.h5")
    x, _ = _write(path, True, checksums=False)
    b = HDF5Backend(path)
    got = b.mapped_rows("x", np.array([[2, 4], [7, 12]]))
    assert np.array_equal(np.stack(got.views), x[[2, 3, 7, 8, 9, 10, 11]])
    got.check()
    assert b.stats.rows_read == 7 and b.stats.read_calls == 2 and b.stats.extra["mapped_reads"] == 1
    with pytest.raises(IndexError, match="out of range"):
        b.mapped_rows("x", np.array([[55, 61]]))
    assert HDF5Backend(path, mmap=False).mapped_rows("x", np.array([[0, 3]])) is None
    assert HDF5Backend(path, direct_reads=False).mapped_rows("x", np.array([[0, 3]])) is None
    b.close()


def test_the_pool_hands_out_the_most_recently_used_free_tensor_first():
    pool = SlotPool()
    a, b, c = (pool.empty((4, 3), torch.float32) for _ in range(3))
    pa, pc = a.data_ptr(), c.data_ptr()
    del a, c
    first = pool.empty((4, 3), torch.float32)
    second = pool.empty((4, 3), torch.float32)
    assert first.data_ptr() == pc and second.data_ptr() == pa  # c was handed out last
    assert pool.empty((4, 3), torch.float32).data_ptr() not in (pa, b.data_ptr(), pc)


def test_the_read_ahead_advises_each_piece_of_a_mapped_file_once_until_its_pages_are_dropped(tmp_path):
    """MappedFile.populate: ``MADV_WILLNEED`` for pieces not advised yet, in whole grains; none
    again for pages advised before; all again after drop_pages."""
    import mmap
    import os

    from solar.io_backends.mapped import MappedFile

    path = str(tmp_path / "f.bin")
    with open(path, "wb") as fh:
        fh.write(b"\1" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        m = MappedFile.open(path, fd, 1 << 20)
    finally:
        os.close(fd)
    calls, real = [], m._map

    class Spy:
        def madvise(self, *args):
            calls.append(args)
            return real.madvise(*args)

        def __getattr__(self, name):
            return getattr(real, name)
    m._map = Spy()
    g = m._grain
    m.populate([(100, 10), (g + 5, 2 * g)])
    assert calls == [(mmap.MADV_WILLNEED, 0, g), (mmap.MADV_WILLNEED, g, 3 * g)]
    m.populate([(5, 50), (2 * g, 10), (3 * g - 1, 1)])
    assert len(calls) == 2
    m.populate([(3 * g - 1, 2), (4 * g, 1), ((1 << 20) - 3, 3)])
    assert calls[2:] == [(mmap.MADV_WILLNEED, 4 * g, g), (mmap.MADV_WILLNEED, (1 << 20) - g, g)]
    m.drop_pages()
    m.populate([(5, 50)])
    assert calls[-2:] == [(mmap.MADV_DONTNEED,), (mmap.MADV_WILLNEED, 0, g)]


def test_a_step_is_made_at_each_read_and_a_failed_row_or_check_fails_it():
    """DeferredStep: each make() fills a tensor from the pool with the step's rows, and the step
    keeps none of them, so a tensor the consumer dropped is the pool's again at the next step;
    a row that cannot be copied, or a failed size check, raises at every make()."""
    from solar.slots import DeferredRows

    rows = [np.full((2, 3), j, dtype=np.float32) for j in range(40)]
    pool = SlotPool()
    steps = [DeferredStep((10, 2, 3), torch.float32, pool, rows[a:a + 10], lambda: None) for a in range(0, 40, 10)]
    for k, step in enumerate(steps):
        t = step.make()
        assert torch.equal(t, torch.from_numpy(np.stack(rows[10 * k:10 * k + 10])))
        ptr = t.data_ptr()
        del t
        assert step.make().data_ptr() == ptr  # (the one just dropped, back from the pool)
    whole = DeferredRows(steps, [0, 10, 20, 30, 40], rows)
    assert torch.equal(whole[5:25], torch.from_numpy(np.stack(rows[5:25])))

    bad = DeferredStep((3, 2, 3), torch.float32, pool, [rows[0], np.zeros(5, np.float32), rows[2]], lambda: None)
    for _ in range(2):
        with pytest.raises(ValueError):
            bad.make()

    def cut():
        raise solar.StorageError("f.h5: cut")
    gone = DeferredStep((1, 2, 3), torch.float32, pool, [rows[0]], cut)
    for _ in range(2):
        with pytest.raises(solar.StorageError, match="f.h5: cut"):
            gone.make()


def test_a_pass_reuses_the_tensors_the_consumer_dropped(tmp_path):
    """The read-ahead holds a pass's batches until the consumer is past all of them; their
    made tensors are not, so a loop that drops each batch gets its next steps in the one or two
    tensors per field it dropped (NOTE [ Rows copied when the batch is taken ]), not in a new one
    per step of the pass."""
    path = str(tmp_path / "d.h5")
    _write(path, checksums=False)
    loader = _loader(path, buffer=0, prefetch=8)  # passes of up to 8 steps of 6
    for e in range(2):
        loader.set_epoch(e)
        seen = set()
        for bx, by in loader:
            seen.add(bx.data_ptr())
        assert len(seen) <= 2, e
