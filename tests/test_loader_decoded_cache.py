"""NOTE [ Decoded copies ] (solar/decoded.py): a compressed buffer's left-over bytes hold decoded
copies of resident samples. Batches, hits and misses are those of a run without copies; compressed
and decoded bytes together stay within ``buffer=``; a damaged blob is still refused by name."""

from __future__ import annotations

import gc
import shutil

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
import solar.passes as passes
from solar.cache import MemoryTier
from solar.decoded import DecodedCopies, usage
from test_loader_compressed import BATCH, N, SEED, SIZE
from test_loader_compressed import files  # noqa: F401 (the fixture: raw and compressed file)


@pytest.fixture(scope="module")
def comp(files):  # noqa: F811 (the fixture imported above)
    return files[1]


class Counting(solar.H5Dataset):
    """Counts the samples its ``decode`` decodes."""

    decoded = 0

    def decode(self, stored):
        self.decoded += stored.n
        return super().decode(stored)


def loader_over(path, budget, num_workers=0, cls=None, **kw):
    ds = (cls or Counting)(path, backend="hdf5", io_threads=1)
    return ds, solar.DataLoader(ds, batch_size=BATCH, buffer=str(budget), num_workers=num_workers,
                                sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED), **kw)


def epochs(path, budget, n=3, num_workers=0, monkeypatch=None, copies=True, cls=None):
    """Every batch of ``n`` epochs (cloned), the samples decoded per epoch (counted by a Counting
    dataset; else None), the dataset's hits and misses, and the buffer's usage after each epoch."""
    monkeypatch.setenv("SOLAR_DECODED_COPIES", "1" if copies else "0")
    ds, loader = loader_over(path, budget, num_workers, cls)
    batches, decoded, used = [], [], []
    for e in range(n):
        loader.sampler.set_epoch(e)
        before = getattr(ds, "decoded", None)
        batches += [[t.clone() for t in b] for b in loader]
        decoded.append(ds.decoded - before if before is not None else None)
        used.append(loader.solar_sampler.buffer_usage())
    ds.close()
    return batches, decoded, (ds.stats.hits, ds.stats.misses), used


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for p, q in zip(a, b) for x, y in zip(p, q))


def stored_bytes(path) -> int:
    ds = solar.H5Dataset(path, backend="hdf5")
    try:
        return int(ds.sample_nbytes().sum())
    finally:
        ds.close()


@pytest.mark.parametrize("by_step, cls", [(False, Counting), (True, Counting), (True, solar.H5Dataset)])
def test_copies_change_no_batch_and_no_hit_and_stay_in_the_budget(comp, monkeypatch, by_step, cls):
    """Three epochs with copies: bit-identical batches, the same hits and misses as without; from
    the second epoch on fewer samples are decoded (the copies serve the rest); compressed plus
    decoded bytes never exceed the budget. ``by_step``: passes decoded step by step on the decode
    threads (NOTE [ Decoding ahead in parallel ] in solar/passes.py), else one decode per pass.
    A subclass's decode decodes whole samples, so the budget holds copies of 40 whole samples;
    H5Dataset's own decodes field by field, straight into the rows, and the budget goes to the
    field that costs the most decode time per byte first: all of its rows, the rest to the other."""
    if by_step:
        monkeypatch.setattr(passes, "DECODE_STEP_SAMPLES", BATCH)
        monkeypatch.setattr(passes, "_cores", lambda: 2)
    budget = stored_bytes(comp) + 40 * SIZE * SIZE * 3 * 4  # every blob, and copies of 40 samples
    want, want_decoded, want_counts, want_used = epochs(comp, budget, monkeypatch=monkeypatch, copies=False, cls=cls)
    got, decoded, counts, used = epochs(comp, budget, monkeypatch=monkeypatch, cls=cls)
    assert same(got, want)
    assert counts == want_counts  # the plan's hits and misses, exactly
    assert all(u.decoded_rows == 0 for u in want_used)
    for u in used:
        assert u.stored_bytes + u.decoded_bytes <= u.budget_bytes == budget
        assert u.decoded_rows == used[0].decoded_rows  # every copy made in the first epoch, none dropped
    assert used[-1].decoded_hits == 2 * used[-1].decoded_rows  # each copy served once per later epoch
    if cls is Counting:
        assert want_decoded == [N, N, N]
        assert decoded[0] == N and decoded[1] == decoded[2] == N - 40  # 40 samples served from copies
        assert used[-1].decoded_samples == 40 and used[-1].decoded_rows == 2 * 40
    else:  # x's rows (4 KiB) or y's (8 KiB) first: all N of x and the rest in y's, or y's only
        left, y_row = budget - used[-1].stored_bytes, 2 * SIZE * SIZE * 4
        assert 0 <= left - used[-1].decoded_bytes < y_row  # the budget filled
        assert used[-1].decoded_samples in (N, left // y_row) and used[-1].decoded_rows > 2 * 40


def test_no_room_left_no_copies(comp, monkeypatch):
    """A budget the plan's compressed samples fill leaves no room: no copies, the run as before."""
    budget = stored_bytes(comp) // 2
    got, decoded, counts, used = epochs(comp, budget, n=2, monkeypatch=monkeypatch)
    want, _, want_counts, _ = epochs(comp, budget, n=2, monkeypatch=monkeypatch, copies=False)
    assert same(got, want) and counts == want_counts
    assert decoded == [N, N] and all(u.decoded_bytes == 0 and u.decoded_rows == 0 for u in used)
    assert all(u.stored_bytes <= budget for u in used)


def test_resume_mid_epoch_with_copies_gives_the_uninterrupted_batches(comp, monkeypatch):
    """Epoch 0 whole, epoch 1 stopped after 5 batches, its state loaded into a new loader (whose
    buffer starts empty): the batches are those of one uninterrupted run without copies, the
    resumed loader's own copies included."""
    budget = 4 << 20
    want, _, _, _ = epochs(comp, budget, n=3, monkeypatch=monkeypatch, copies=False)
    monkeypatch.setenv("SOLAR_DECODED_COPIES", "1")
    ds, loader = loader_over(comp, budget)
    got = []
    loader.sampler.set_epoch(0)
    got += [[t.clone() for t in b] for b in loader]
    loader.sampler.set_epoch(1)
    it = iter(loader)
    got += [[t.clone() for t in next(it)] for _ in range(5)]
    state = loader.state_dict()
    assert usage(loader.solar_sampler.buffer).decoded_hits > 0
    del it
    gc.collect()  # (the stopped iteration's read-ahead ends here, not in a thread of its own)
    ds2, loader2 = loader_over(comp, budget)
    loader2.load_state_dict(state)
    got += [[t.clone() for t in b] for b in loader2]
    loader2.sampler.set_epoch(2)
    got += [[t.clone() for t in b] for b in loader2]
    assert usage(loader2.solar_sampler.buffer).decoded_hits > 0
    assert same(got, want)
    ds.close()
    ds2.close()


def test_a_damaged_blob_is_refused_by_name_with_copies(comp, tmp_path, monkeypatch):
    """Sample 10's blob of field x damaged in the file: the pass that reads it raises
    CorruptDataError naming it, though the buffer has room for copies."""
    bad = shutil.copy(comp, tmp_path / "damaged.h5")
    probe = solar.H5Dataset(comp, backend="hdf5")
    key, at = probe.specs[0].data_key, int(probe._offsets_of(probe.specs[0])[10]) + 40
    probe.close()
    with h5py.File(bad, "r+") as f:
        f[key][at] ^= 0xFF  # a payload byte of sample 10's blob of field x
    monkeypatch.setenv("SOLAR_DECODED_COPIES", "1")
    ds = solar.H5Dataset(bad, backend="hdf5", io_threads=1, verify=False)
    loader = solar.DataLoader(ds, batch_size=BATCH, buffer=str(4 << 20),
                              sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
    with pytest.raises(solar.CorruptDataError, match=r"sample '10 of .*damaged.h5:x'"):
        list(loader)
    gc.collect()  # (the failed iteration's read-ahead ends here, not in a thread of its own)
    ds.close()


def test_workers_decode_their_batches_without_copies(comp, monkeypatch):
    """num_workers=2: the workers decode every batch (no copies are made in the loader's
    process), to the batches of a run without workers."""
    budget = 4 << 20
    want, _, want_counts, _ = epochs(comp, budget, n=2, monkeypatch=monkeypatch, copies=False)
    got, _, counts, used = epochs(comp, budget, n=2, num_workers=2, monkeypatch=monkeypatch)
    assert same(got, want) and counts == want_counts
    assert all(u.decoded_samples == 0 for u in used)


def test_copies_follow_their_samples_out_of_the_buffer():
    """A copy is made only of a resident sample, goes when its sample leaves the buffer, and no
    more copies are kept than the rows the left-over bytes hold."""
    spec = type("Spec", (), {"name": "x", "sample_shape": (2, 3), "dtype": np.dtype("<f4"), "kind": "codec"})()
    buf = MemoryTier(1 << 20)
    for k in range(6):
        buf.put(("x", k), np.zeros(10, np.uint8))
    store = DecodedCopies(3 * 24 + 10, [spec], capacity=6)  # room for 3 rows
    assert store.rows == 3
    dec = {"x": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 2, 3)}
    store.admit(list(range(8)), dec, np.arange(8), lambda k: ("x", k) in buf)  # samples 6, 7 are not resident
    assert len(store) == 3 and store.nbytes == 72
    out = {"x": torch.zeros(4, 2, 3)}
    hit = store.take([2, 7, 0, 1], out)["x"]
    assert hit.tolist() == [True, False, True, True]
    assert torch.equal(out["x"][0], dec["x"][2]) and torch.equal(out["x"][2], dec["x"][0])
    assert not out["x"][1].any()
    buf.delete(("x", 1))
    store.sync(buf, "x")
    assert len(store) == 2 and store.take([1], {"x": torch.zeros(1, 2, 3)})["x"].tolist() == [False]
    store.admit([3, 4], {"x": dec["x"][3:5]}, np.arange(2), lambda k: ("x", k) in buf)  # one row free again
    assert len(store) == 3 and store.take([3, 4], {"x": torch.zeros(2, 2, 3)})["x"].tolist() == [True, False]


def test_blobs_of_another_shape_than_the_field_declares_are_refused_by_name(tmp_path, monkeypatch):
    """A field whose declared sample shape its blobs do not have: the step decoded straight into
    its rows (``decode_into``) refuses it as ``decode`` does, naming the sample."""
    from solar.ingest import ingest

    monkeypatch.setattr(passes, "DECODE_STEP_SAMPLES", 2)
    monkeypatch.setattr(passes, "_cores", lambda: 2)
    monkeypatch.setenv("SOLAR_DECODED_COPIES", "1")
    src, path = str(tmp_path / "x.npy"), str(tmp_path / "c.h5")
    np.save(src, np.random.default_rng(0).standard_normal((8, 8, 8)).astype(np.float32))
    ingest([src], path, rel_error=1e-3, progress=False)
    with h5py.File(path, "r+") as f:
        f["x"].attrs["sample_shape"] = np.array([4, 16])
    ds = solar.H5Dataset(path, backend="hdf5", io_threads=1)
    assert ds.decodes_into()
    loader = solar.DataLoader(ds, batch_size=2, buffer=str(1 << 20),
                              sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
    with pytest.raises(solar.CorruptDataError, match=r"sample \d+ of .*c.h5:x decodes to float32 \(8, 8\), "
                                                     r"but field 'x' .* declares"):
        list(loader)
    gc.collect()  # (the failed iteration's read-ahead ends here, not in a thread of its own)
    ds.close()


@pytest.mark.parametrize("decoder", ["auto", "reference"])
def test_decode_batch_into_rows_of_out_gives_the_decoded_bits(decoder):
    """``decode_batch(out=, at=)``: blob ``i`` lands in ``out[at[i]]`` with the bits a plain
    decode gives, by the cpu-kernel path and by the reference; rows not named stay untouched."""
    import solar.codec as sc

    rng = np.random.default_rng(4)
    blobs = [sc.encode(rng.standard_normal((3, 5)).astype(np.float32), rel_error=1e-3) for _ in range(4)]
    want = sc.decode_batch(blobs, decoder=decoder)
    out = torch.full((6, 3, 5), 7.0)
    assert sc.decode_batch(blobs, decoder=decoder, out=out, at=[5, 0, 2, 3]) is out
    assert torch.equal(out[[5, 0, 2, 3]], want) and torch.equal(out[[1, 4]], torch.full((2, 3, 5), 7.0))
    with pytest.raises(solar.ConfigError, match="one row of out"):
        sc.decode_batch(blobs, out=out, at=[0, 1, 6, 2])
    with pytest.raises(solar.ConfigError, match="rows of torch.float32 \\(5, 3\\)"):
        sc.decode_batch(blobs, decoder=decoder, out=torch.empty(4, 5, 3))


@pytest.mark.parametrize("numba", [True, False])
def test_copy_rows_copies_the_rows_it_names(monkeypatch, numba):
    """``solar.codec.copy_rows``: the compiled loop and torch's index ops copy the same rows."""
    import solar.codec as sc
    from solar.codec import paths

    if not numba:
        monkeypatch.setattr(paths, "_kernels", lambda: None)
    src = torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(5, 2, 3)
    dst = torch.zeros(4, 2, 3)
    sc.copy_rows(src, [4, 0, 2], dst, [1, 3, 0])
    assert torch.equal(dst[1], src[4]) and torch.equal(dst[3], src[0]) and torch.equal(dst[0], src[2])
    assert not dst[2].any()
    sc.copy_rows(src, [], dst, [])


def test_the_budget_goes_to_the_field_that_costs_most_per_byte():
    """Once each field's decode time per row is known, the rows go to the costlier field per
    byte first, up to every resident sample, and the rest to the next (no copy held yet)."""
    specs = [type("Spec", (), {"name": n, "sample_shape": shape, "dtype": np.dtype("<f4"), "kind": "codec"})()
             for n, shape in (("x", (1, 4)), ("y", (2, 4)))]  # rows of 16 and 32 bytes
    store = DecodedCopies(10 * 48 + 8, specs, capacity=12)
    assert store.rows == 10 and [f.rows for f in store.fields.values()] == [10, 10]
    store.note("x", 2.0, 10)  # 0.2 s per row of 16 bytes: the costlier per byte
    assert not store.sized_by_cost
    store.note("y", 3.0, 10)  # 0.3 s per row of 32 bytes
    assert store.sized_by_cost
    assert store.fields["x"].rows == 12 and store.fields["y"].rows == (10 * 48 + 8 - 12 * 16) // 32


def test_the_reserve_is_the_plans_largest_compressed_samples(monkeypatch):
    """The copies get the budget less the ``capacity`` largest stored samples (what the plan may
    keep at most); none where that leaves less than a row."""
    from solar.decoded import copies_for

    monkeypatch.setenv("SOLAR_DECODED_COPIES", "1")
    spec = type("Spec", (), {"name": "x", "sample_shape": (2, 3), "dtype": np.dtype("<f4"), "kind": "codec"})()

    class Stub:
        keeps_decoded_copies, specs, device = True, [spec], "cpu"

        def sample_nbytes(self):
            return np.array([100, 50, 200, 10])

    for capacity, left in ((2, 1000 - 300), (4, 1000 - 360), (9, 1000 - 360), (1, 1000 - 200)):
        store = copies_for(MemoryTier(1000), Stub(), capacity)
        assert store.budget == left and store.rows == left // 24
    assert copies_for(MemoryTier(360 + 23), Stub(), 4) is None  # less than a row left
    assert copies_for(MemoryTier(1000), solar.H5Dataset.__new__(solar.H5Dataset), 4) is None  # no fields
