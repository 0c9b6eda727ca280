"""NOTE [ Kept rows in an arena ] (cache/arena.py): the rows a pass keeps in the buffer are copied
into slots of large blocks, a slot handed out again only once nothing reads it; the rows of a
staged copy (real nginx and s3 servers on 127.0.0.1) are kept as the copy's own views, no copy."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import solar
from solar.cache.arena import MIN_ROW_BYTES, RowArena, arena_for
from solar.cache import MemoryTier
from test_remote_ranges import putter

N = 48
SHAPE = (64, 64)  # float32 rows of 16 KiB: kept in an arena


def _write(path: str) -> np.ndarray:
    x = np.random.default_rng(5).standard_normal((N, *SHAPE)).astype("f4")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x)
        f.create_dataset("i", data=np.arange(N))
    return x


def _epochs(loader, x: np.ndarray, epochs: int = 3) -> None:
    for e in range(epochs):
        loader.set_epoch(e)
        seen = []
        for bx, bi in loader:
            np.testing.assert_array_equal(bx.numpy(), x[bi.numpy()])
            seen += bi.tolist()
        assert sorted(seen) == list(range(N))


def test_a_slot_is_handed_out_again_only_once_nothing_reads_it():
    arena = RowArena(SHAPE, np.float32, block_bytes=4 * 16384)
    rows = [arena.row() for _ in range(6)]
    assert arena.slots == 8 and arena.in_use == 6
    for k, r in enumerate(rows):
        assert r.shape == SHAPE and r.dtype == np.float32 and r.flags.writeable
        r[...] = k
    assert not any(np.shares_memory(a, b) for i, a in enumerate(rows) for b in rows[i + 1:])
    # what reads a row's memory: a view made from it, a tensor over it, the row itself
    view, tensor, kept, rest = rows[0][3:].reshape(-1), torch.from_numpy(rows[1]), rows[2], rows[3:]
    del rows
    new = [arena.row() for _ in range(3)]  # the two free slots of the second block, then a new block
    assert arena.slots == 12
    assert not any(np.shares_memory(n, old) for n in new for old in (view, tensor.numpy(), kept))
    assert (view == 0).all() and (tensor == 1).all() and (kept == 2).all()
    del view, tensor, kept, rest, new, r
    assert arena.in_use == 0
    again = [arena.row() for _ in range(12)]
    assert arena.slots == 12 and arena.in_use == len(again)  # every slot came back: no new block


def test_small_rows_and_unhashable_buffers_get_no_arena():
    assert arena_for(object(), (MIN_ROW_BYTES // 4 - 1,), np.float32) is None

    class Unhashable:
        __hash__ = None
    assert arena_for(Unhashable(), SHAPE, np.float32) is None
    buffer = MemoryTier(1 << 20)
    assert arena_for(buffer, SHAPE, np.float32) is arena_for(buffer, SHAPE, np.float32)


def test_kept_rows_lie_in_the_arena_and_batches_stay_the_files_rows(tmp_path):
    path = str(tmp_path / "a.h5")
    x = _write(path)
    ds = solar.H5Dataset(path, ("x", "i"))
    loader = solar.DataLoader(ds, batch_size=4, shuffle=True, distributed=True, buffer=f"{24 * 16 + 1}KiB")
    try:
        _epochs(loader, x)
        buffer = loader.batch_sampler.buffer
        kept = [buffer.get(k) for k in list(buffer.keys()) if k[0] == "x"]
        assert len(kept) == ds.stats.kept > 0
        arena = arena_for(buffer, SHAPE, np.float32)
        assert arena.in_use >= len(kept)
        blocks = [np.frombuffer(b, np.uint8) for b in arena._blocks]
        assert all(any(np.shares_memory(v, b) for b in blocks) for v in kept)
    finally:
        ds.close()


@pytest.fixture(params=["http", "s3"])
def remote(request):
    return putter(request, request.param)


def test_a_staged_copys_kept_rows_are_views_of_the_copy(remote, tmp_path):
    path = str(tmp_path / "s.h5")
    x = _write(path)
    url, opts = remote(path)
    d = tmp_path / "stage"
    d.mkdir()
    ds = solar.H5Dataset(url, ("x", "i"), backend_options={**opts, "stage": str(d)})
    loader = solar.DataLoader(ds, batch_size=4, shuffle=True, distributed=True, buffer=f"{24 * 16 + 1}KiB")
    try:
        _epochs(loader, x)
        buffer = loader.batch_sampler.buffer
        kept = [buffer.get(k) for k in list(buffer.keys()) if k[0] == "x"]
        assert len(kept) == ds.stats.kept > 0 and ds.stats.hits > 0
        copy = ds.backend._stage._flat
        assert all(np.shares_memory(v, copy) and not v.flags.writeable for v in kept)
    finally:
        ds.close()
    # the buffer's rows keep the copy's bytes after the close (its map goes with the last view)
    np.testing.assert_array_equal(np.stack([buffer.get(("x", i)) for i in range(N) if ("x", i) in buffer]),
                                  x[[i for i in range(N) if ("x", i) in buffer]])
