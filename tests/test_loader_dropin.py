"""solar.DataLoader as a drop-in torch DataLoader: the same batches, lengths, errors, worker seeding
and attributes as torch's, on plain datasets and on storage-backed ones (H5Dataset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.testing.resume import batches_equal

from loader_helpers import Squares, Stream, _rank_loaders


def _init(worker_id):
    np.random.seed(worker_id)


def _collate(batch):
    return [b["i"] * 10 for b in batch]


CASES = {
    "defaults": dict(),
    "batch7": dict(batch_size=7),
    "drop_last": dict(batch_size=7, drop_last=True),
    "shuffle_gen": dict(batch_size=4, shuffle=True, generator="g"),
    "no_batch": dict(batch_size=None),
    "collate": dict(batch_size=5, collate_fn=_collate),
    "sampler": dict(batch_size=3, sampler=[5, 1, 9, 2, 2]),
    "batch_sampler": dict(batch_sampler=[[0, 1], [7, 3, 2]]),
    "distributed": dict(batch_size=4, sampler="dist"),
    "workers": dict(batch_size=4, shuffle=True, generator="g", num_workers=2, worker_init_fn=_init,
                    persistent_workers=True, prefetch_factor=3, timeout=30, multiprocessing_context="fork"),
    "pin": dict(batch_size=6, pin_memory=True),
}


def _build(cls, ds, kw):
    kw = dict(kw)
    if kw.get("generator") == "g":
        kw["generator"] = torch.Generator().manual_seed(5)
    if kw.get("sampler") == "dist":
        kw["sampler"] = tud.DistributedSampler(ds, num_replicas=3, rank=1, seed=2)
    return cls(ds, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_batches_as_torch_on_any_dataset(case):
    kw = CASES[case]
    if kw.get("pin_memory"):
        pytest.importorskip("torch.cuda")
    out = []
    for cls in (tud.DataLoader, solar.DataLoader):
        torch.manual_seed(0)
        loader = _build(cls, Squares(), kw)
        epochs = []
        for e in range(2):
            if kw.get("sampler") == "dist":
                loader.sampler.set_epoch(e)
            epochs.append(list(loader))
        out.append((len(loader), epochs))
    assert out[0][0] == out[1][0]
    assert batches_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_like_torch(workers):
    a = list(tud.DataLoader(Stream(), batch_size=3, num_workers=workers))
    b = list(solar.DataLoader(Stream(), batch_size=3, num_workers=workers))
    assert batches_equal(a, b)
    assert len(solar.DataLoader(Stream(), batch_size=3)) == len(tud.DataLoader(Stream(), batch_size=3))


def test_batch_sampler_keeps_the_wrapped_samplers_attributes(h5path):
    class EpochBatches(tud.BatchSampler):
        def set_epoch(self, epoch):
            self.epoch = epoch

    ds = solar.H5Dataset(h5path)
    bs = EpochBatches(tud.SequentialSampler(ds), batch_size=8, drop_last=False)
    loader = solar.DataLoader(ds, batch_sampler=bs)
    loader.batch_sampler.set_epoch(3)
    assert bs.epoch == loader.batch_sampler.epoch == 3
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loader.batch_sampler.nope


@pytest.mark.parametrize("kw", [
    dict(batch_size=2, batch_sampler=[[0]]),
    dict(shuffle=True, sampler=[0, 1]),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=-1),
    dict(prefetch_factor=2),
    dict(persistent_workers=True),
    dict(timeout=-1),
    dict(batch_size=0),
    dict(multiprocessing_context="fork"),
])
def test_same_value_errors_as_torch(kw):
    with pytest.raises(ValueError) as want:
        list(tud.DataLoader(Squares(), **kw))
    with pytest.raises(ValueError) as got:
        list(solar.DataLoader(Squares(), **kw))
    assert str(got.value) == str(want.value)


def test_workers_get_torch_seeding_and_worker_info():
    torch.manual_seed(3)
    a = list(tud.DataLoader(Squares(8), batch_size=2, num_workers=2))
    torch.manual_seed(3)
    b = list(solar.DataLoader(Squares(8), batch_size=2, num_workers=2))
    assert [x["worker"].tolist() for x in b] == [[0, 0], [1, 1], [0, 0], [1, 1]]
    assert batches_equal(a, b)


def test_attributes_stay_torchs():
    s = tud.DistributedSampler(Squares(), num_replicas=2, rank=0)
    loader = solar.DataLoader(Squares(), batch_size=4, sampler=s)
    assert loader.sampler is s and loader.batch_size == 4 and loader.drop_last is False
    with pytest.raises(ValueError, match="should not be set"):
        loader.batch_size = 3


@pytest.mark.parametrize("workers", [0, 2])
def test_world_size_one_matches_torch_and_hits_from_epoch_two(h5path, workers):
    ds = solar.H5Dataset(h5path)
    ref_s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=4)
    ref = tud.DataLoader(ds, batch_size=10, sampler=ref_s)
    loader = _rank_loaders(h5path, 1, 10, 0.5, num_workers=workers)[0]
    assert len(loader) == len(ref) == 10
    for e in range(3):
        ref_s.set_epoch(e)
        loader.sampler.set_epoch(e)
        assert batches_equal(list(ref), list(loader))
    stats = loader.dataset.stats
    assert stats.hits == 2 * 48  # epochs 2 and 3 hit the 48 samples the buffer keeps
    assert stats.misses == 3 * 96 - 2 * 48
    assert loader.solar_sampler.buffer.stats.hits == 2 * 48 * 2  # two fields


def test_shuffle_without_sampler_matches_torch_and_uses_the_buffer(h5path):
    ds = solar.H5Dataset(h5path)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    ref = tud.DataLoader(ds, batch_size=7, shuffle=True, generator=g1)
    loader = solar.DataLoader(solar.H5Dataset(h5path), batch_size=7, shuffle=True, generator=g2, buffer=24)
    assert loader.solar_sampler.mode == "passthrough"
    for _ in range(2):
        assert batches_equal(list(ref), list(loader))
    assert loader.dataset.stats.hits == 24


def test_ranks_split_each_global_batch_and_read_fewer_calls(h5path):
    P, b = 3, 4
    loaders = _rank_loaders(h5path, P, b, 0.5)
    for e in range(3):
        per_rank = []
        for loader in loaders:
            loader.sampler.set_epoch(e)
            per_rank.append([batch for batch in loader])
        for k in range(len(per_rank[0])):
            xs = torch.cat([per_rank[r][k][0] for r in range(P)])
            assert all(len(per_rank[r][k][0]) == b for r in range(P))
            order = solar.schedule.global_order(96, P, 4, e)[k * P * b:(k + 1) * P * b]
            ref = solar.H5Dataset(h5path).__getitems__(sorted(order.tolist()))
            want = torch.stack([s[0] for s in ref])
            assert torch.equal(torch.sort(xs.flatten(1), dim=0)[0], torch.sort(want.flatten(1), dim=0)[0])
    hits = sum(ld.dataset.stats.hits for ld in loaders)
    assert hits == 2 * 48  # every rank hits its pinned samples from epoch 2
    calls = sum(ld.dataset.stats.read_calls for ld in loaders)
    assert calls < 2 * (3 * 96 - hits)  # coalesced: fewer calls than samples x fields


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_larger_than_the_ranks_share_is_torchs_one_partial_batch(h5path, drop_last):
    ds = solar.H5Dataset(h5path)
    ref = tud.DataLoader(ds, batch_size=200, drop_last=drop_last,
                         sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=3))
    loader = solar.DataLoader(ds, batch_size=200, drop_last=drop_last, buffer=0.5,
                              sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=3))
    assert len(loader) == len(ref) == (0 if drop_last else 1)
    for _ in range(2):
        assert batches_equal(list(ref), list(loader))


def test_distributed_option_takes_rank_from_the_environment(h5path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    loader = solar.DataLoader(solar.H5Dataset(h5path), batch_size=4, shuffle=True, distributed=True, seed=3)
    assert loader.sampler.num_replicas == 4 and loader.sampler.rank == 2 and loader.solar_sampler.mode == "schedule"
    a = [b[0].shape[0] for b in loader]
    assert a == [4] * 6 and loader.sampler.epoch == 0
    list(loader)
    assert loader.sampler.epoch == 1  # advanced by itself
    for e in (2, 3):  # the torch idiom through the sampler: honoured, not advanced once more
        loader.sampler.set_epoch(e)
        list(loader)
        assert loader.sampler.epoch == e
    state = loader.state_dict()  # epoch 3 done
    list(loader)  # epoch 4
    loader.load_state_dict(state)  # back to after epoch 3: the next iteration is epoch 4, not 5
    list(loader)
    assert loader.sampler.epoch == 4


def test_an_empty_dataset_yields_no_batches(tmp_path):
    """A file whose dataset has 0 rows (extendible, nothing appended yet): torch's DataLoader yields
    nothing, and so does SOLAR's (it raised "cannot convert float NaN to integer" sizing its passes)."""
    import h5py

    path = str(tmp_path / "empty.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(0, 4), dtype=np.float32, maxshape=(None, 4), chunks=(8, 4))
    ds = solar.H5Dataset(path)
    assert list(tud.DataLoader(ds, batch_size=4)) == []
    assert list(solar.DataLoader(ds, batch_size=4)) == []
    with pytest.raises(IndexError, match="out of range for 0 samples \\(the dataset is empty\\)"):
        ds[0]
    ds.close()
