"""Drop-in guards of solar.DataLoader (issue 19, items 4-7): an H5Dataset subclass's own
``__getitem__`` is applied, a state from another loader is refused, a dataset SOLAR cannot drive
says so when given SOLAR's options, and a buffer larger than the node's memory is refused."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.synthetic import write_ptycho_h5
from solar.testing.resume import batches_equal

N = 96


@pytest.fixture(scope="module")
def h5path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("guards") / "ptycho.h5")
    write_ptycho_h5(path, N, 8, seed=1, progress=False)
    return path


def _scaled(x, y, i):
    """What the subclasses below make of a sample: log-scaled, normalized input, the amplitude,
    the index they were asked for."""
    return torch.log1p(x) * 2 - 1, y[:1], i


class LogScaled(solar.H5Dataset):
    """The common pattern: a subclass that overrides ``__getitem__`` only."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return _scaled(x, y, i)


class PlainEquivalent(tud.Dataset):
    """The same samples as ``LogScaled``, read per sample with h5py: what torch users have."""

    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.n = len(f["x"])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with h5py.File(self.path, "r") as f:
            x, y = torch.from_numpy(f["x"][i]), torch.from_numpy(f["y"][i])
        return _scaled(x, y, i)


def _epochs(loader, n, set_epoch=False):
    out = []
    for e in range(n):
        if set_epoch:
            loader.sampler.set_epoch(e)
        out.append(list(loader))
    return out


# -- item 4: an H5Dataset subclass that overrides __getitem__ ---------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampling", ["shuffle", "distributed"])
def test_a_subclass_getitem_is_applied_and_keeps_solars_buffer(h5path, workers, sampling):
    """solar.DataLoader over the subclass gives torch's batches over the plain equivalent (the
    override applied to every sample, with the index it was asked for), and still drives it: the
    second epoch is served from the buffer, with no warning."""
    ds = LogScaled(h5path)

    def kw(dataset):
        if sampling == "shuffle":
            return dict(batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3), num_workers=workers)
        return dict(batch_size=8, num_workers=workers,
                    sampler=tud.DistributedSampler(dataset, num_replicas=1, rank=0, seed=5))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = solar.DataLoader(ds, buffer=1.0, **kw(ds))
    ref = PlainEquivalent(h5path)
    want = _epochs(tud.DataLoader(ref, **kw(ref)), 2, sampling == "distributed")
    got = _epochs(loader, 2, sampling == "distributed")
    assert loader.solar_sampler is not None
    assert len(got[0]) == 12 and batches_equal(got, want)
    assert ds.stats.hits == N  # epoch 2 from the buffer: the fast path stayed
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_split_of_the_subclass_is_driven_with_the_override(h5path, workers):
    """A random_split of the subclass: driven (no warning that calls torch's bypass 'correct'),
    the override called with the file's sample index, as torch's Subset calls it."""
    ds, ref = LogScaled(h5path), PlainEquivalent(h5path)
    train, _ = tud.random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    ref_train, _ = tud.random_split(ref, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    kw = dict(batch_size=8, shuffle=True, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = solar.DataLoader(train, buffer=1.0, generator=torch.Generator().manual_seed(1), **kw)
    assert loader.solar_sampler is not None
    got = _epochs(loader, 2)
    want = _epochs(tud.DataLoader(ref_train, generator=torch.Generator().manual_seed(1), **kw), 2)
    assert batches_equal(got, want)
    assert ds.stats.hits == len(train)
    # and inside a ConcatDataset with a plain file: each file's own items
    both = tud.ConcatDataset([ds, solar.H5Dataset(h5path)])
    ref_both = tud.ConcatDataset([ref, solar.H5Dataset(h5path)])
    got = list(solar.DataLoader(both, batch_size=1, sampler=[0, N + 0, 5, N + 7], collate_fn=lambda b: b[0]))
    want = [ref_both[i] for i in (0, N + 0, 5, N + 7)]
    assert batches_equal(got, want)
    ds.close()


def test_torchs_own_loader_applies_the_subclass_getitem(h5path):
    """torch's DataLoader calls ``__getitems__`` when a dataset has one: the override must still
    be applied (it was bypassed), directly and through torch's Subset."""
    ds, ref = LogScaled(h5path), PlainEquivalent(h5path)
    kw = dict(batch_size=8, shuffle=True)
    got = list(tud.DataLoader(ds, generator=torch.Generator().manual_seed(2), **kw))
    want = list(tud.DataLoader(ref, generator=torch.Generator().manual_seed(2), **kw))
    assert batches_equal(got, want)
    sub, ref_sub = tud.Subset(ds, [5, 90, 7, 7]), tud.Subset(ref, [5, 90, 7, 7])
    assert batches_equal(list(tud.DataLoader(sub, batch_size=3)), list(tud.DataLoader(ref_sub, batch_size=3)))
    assert batches_equal(ds[-1], ref[N - 1][:2] + (-1,))  # ds[i] is the override, index as given
    ds.close()


def test_an_override_reading_other_samples_and_a_getitems_override(h5path):
    """An override that asks its base for another sample (the next one) gets it, in or out of
    the batch; a subclass's own ``__getitems__`` is what the loader calls, fed SOLAR's bytes."""

    class WithNext(solar.H5Dataset):
        def __getitem__(self, i):
            return super().__getitem__(i)[0], super().__getitem__((i + 1) % len(self))[0]

    class Tagged(solar.H5Dataset):
        def __getitems__(self, indices):
            return [(*s, "tag") for s in super().__getitems__(indices)]

    class ViaBatch(solar.H5Dataset):
        def __getitem__(self, i):  # H5Dataset's own sample through its batch method
            return super().__getitems__([i])[0][1] * 2

    plain = solar.H5Dataset(h5path)
    nxt = WithNext(h5path)
    got = list(solar.DataLoader(nxt, batch_size=4, sampler=[3, 4, 40, 95, 10], buffer=1.0))
    for batch, idx in zip(got, ([3, 4, 40, 95], [10])):
        assert torch.equal(batch[0], torch.stack([plain[i][0] for i in idx]))
        assert torch.equal(batch[1], torch.stack([plain[(i + 1) % N][0] for i in idx]))
    via = ViaBatch(h5path)
    got = list(solar.DataLoader(via, batch_size=4, sampler=[3, 4, 40], num_workers=0))
    assert torch.equal(got[0], torch.stack([plain[i][1] * 2 for i in (3, 4, 40)]))
    via.close()
    tagged = Tagged(h5path)
    loader = solar.DataLoader(tagged, batch_size=8, buffer=1.0)
    for _ in range(2):
        batches = list(loader)
    assert all(list(b[2]) == ["tag"] * len(b[0]) for b in batches) and tagged.stats.hits == N
    for d in (plain, nxt, tagged):
        d.close()


def test_the_warning_for_a_wrapper_it_cannot_drive_does_not_call_it_correct(h5path):
    """A Subset of a subclass with its own ``__getitems__`` is still left to torch; the warning
    says what happens (torch's batches, without SOLAR's buffer), not that it is 'correct'."""

    class OwnBatch(solar.H5Dataset):
        def __getitems__(self, indices):
            return [(*s, i) for s, i in zip(super().__getitems__(indices), indices)]

    ds = OwnBatch(h5path)
    with pytest.warns(UserWarning) as rec:
        loader = solar.DataLoader(tud.Subset(ds, [3, 1, 2]), batch_size=2)
    text = " ".join(str(w.message) for w in rec)
    assert loader.solar_sampler is None and "correct" not in text and "OwnBatch" in text
    ds.close()


# -- item 5: load_state_dict refuses a state from another loader ------------------------------------
def _saved(loader, batches):
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize("change, pattern", [
    (dict(batch_size=16), r"batch_size=32.*batch_size=16"),
    (dict(shuffle=False), r"shuffle=True.*shuffle=False"),
    (dict(seed=6), r"seed 5.*seed 6"),
    (dict(seed=None), r"seed 5.*no generator"),
])
def test_a_passthrough_state_from_another_loader_is_refused_naming_both_values(h5path, change, pattern):
    """A state saved after 2 batches of 32, shuffled with a generator seeded 5: a loader with
    another batch size (which would train samples twice), no shuffle or another seed refuses it
    with a ValueError naming both values; the same loader takes it."""
    ds = solar.H5Dataset(h5path)

    def make(batch_size=32, shuffle=True, seed=5):
        g = None if seed is None else torch.Generator().manual_seed(seed)
        return solar.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g, buffer=8)

    state = _saved(make(), 2)
    with pytest.raises(ValueError, match=pattern):
        make(**change).load_state_dict(state)
    same = make()
    same.load_state_dict(state)
    assert len(list(same)) == 1
    ds.close()


def test_a_state_from_another_sampler_class_or_dataset_size_is_refused(h5path, tmp_path):
    ds = solar.H5Dataset(h5path)
    state = _saved(solar.DataLoader(ds, batch_size=8, sampler=list(range(N))), 2)
    with pytest.raises(ValueError, match=r"sampler .*list.*SequentialSampler"):
        solar.DataLoader(ds, batch_size=8).load_state_dict(state)
    small_path = str(tmp_path / "small.h5")
    write_ptycho_h5(small_path, 40, 8, progress=False)
    small = solar.H5Dataset(small_path)
    with pytest.raises(ValueError, match=r"96 samples.*has 40"):
        solar.DataLoader(small, batch_size=8).load_state_dict(_saved(solar.DataLoader(ds, batch_size=8), 1))
    ds.close()
    small.close()


def test_a_version_1_passthrough_state_still_loads(h5path):
    """A state of the first format has none of the new keys: nothing is checked that it lacks."""
    ds = solar.H5Dataset(h5path)
    state = _saved(solar.DataLoader(ds, batch_size=8), 3)
    old = {k: state[k] for k in ("mode", "num_samples", "batch_size", "batches", "epoch_done", "rng")}
    old["version"] = 1
    loader = solar.DataLoader(ds, batch_size=8)
    loader.load_state_dict(old)
    assert len(list(loader)) == 12 - 3
    ds.close()


def test_set_epoch_to_another_epoch_after_a_mid_epoch_load_warns(h5path):
    """Schedule mode: a state saved at global position 24 of epoch 0, then set_epoch(1) before
    the loop: the position is dropped (epoch 1 runs whole), with a warning naming both epochs and
    the position. The same epoch, or an epoch-end state, says nothing."""
    ds = solar.H5Dataset(h5path)

    def make():
        return solar.DataLoader(ds, batch_size=8, buffer=8,
                                sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=4))

    state = _saved(make(), 3)
    assert state["epoch"] == 0 and state["position"] == 24
    loader = make()
    loader.load_state_dict(state)
    loader.sampler.set_epoch(1)
    with pytest.warns(UserWarning, match=r"epoch 0 at global position 24.*epoch 1"):
        assert len(list(loader)) == 12
    for epoch, saved in ((0, state), (1, _epoch_end_state(make()))):
        loader = make()
        loader.load_state_dict(saved)
        loader.sampler.set_epoch(epoch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(loader)) == (12 - 3 if epoch == 0 else 12)
    ds.close()


def _epoch_end_state(loader):
    list(loader)
    return loader.state_dict()


# -- item 6: a dataset SOLAR cannot drive, given SOLAR's options ------------------------------------
class Wrapper(tud.Dataset):
    """A plain Dataset holding an H5Dataset: SOLAR sees no storage here."""

    def __init__(self, path):
        self.h5 = solar.H5Dataset(path)

    def __len__(self):
        return len(self.h5)

    def __getitem__(self, i):
        x, y = self.h5[i]
        return torch.log1p(x), y


def _messages(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


def test_a_wrapper_around_an_h5dataset_warns_once_with_what_to_do(h5path):
    for kw in (dict(buffer=1.0), dict()):
        wrapped = Wrapper(h5path)
        msgs = _messages(lambda: solar.DataLoader(wrapped, batch_size=8, **kw))
        assert len(msgs) == 1, msgs
        assert "Wrapper" in msgs[0] and "h5" in msgs[0] and "subclass H5Dataset" in msgs[0] \
            and "buffer" in msgs[0], msgs[0]
        wrapped.h5.close()


def test_buffer_or_spill_on_a_dataset_solar_cannot_drive_warns(h5path, tmp_path):
    tensors = tud.TensorDataset(torch.zeros(16, 2))
    for kw in (dict(buffer="2GiB"), dict(buffer="1MB", spill=(str(tmp_path), "1GiB"))):
        msgs = _messages(lambda: solar.DataLoader(tensors, batch_size=4, **kw))
        assert len(msgs) == 1 and "TensorDataset" in msgs[0] and "buffer" in msgs[0], msgs
    ds = solar.H5Dataset(h5path)
    msgs = _messages(lambda: solar.DataLoader(ds, batch_size=None, buffer=1.0))
    assert len(msgs) == 1 and "batch_size=None" in msgs[0], msgs
    # nothing asked of SOLAR, or a dataset it drives: no warning
    for make in (lambda: solar.DataLoader(tensors, batch_size=4), lambda: solar.DataLoader(tensors, buffer=0),
                 lambda: solar.DataLoader(ds, batch_size=4, buffer=1.0)):
        assert _messages(make) == []
    ds.close()


# -- item 7: a buffer larger than the node's memory -------------------------------------------------
@pytest.fixture(scope="module")
def huge_path(tmp_path_factory):
    """10^6 samples of 16 MiB (16 TiB), none written: HDF5 stores no chunk, the file is tiny."""
    path = str(tmp_path_factory.mktemp("huge") / "huge.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(10**6, 4096, 1024), dtype=np.float32, chunks=(1, 4096, 1024))
    return path


@pytest.mark.parametrize("buffer", ["10TiB", 0.5])
def test_a_buffer_larger_than_the_nodes_memory_is_refused(huge_path, buffer, monkeypatch):
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ds = solar.H5Dataset(huge_path)
    with pytest.raises(solar.ConfigError, match=r"buffer=.*per rank.*available over 1 rank.*Pass buffer=") as err:
        solar.DataLoader(ds, batch_size=4, buffer=buffer)
    assert "spill=" in str(err.value)
    # with 8 ranks the share is still 2 TiB per rank
    with pytest.raises(solar.ConfigError, match="per rank"):
        solar.DataLoader(ds, batch_size=4, buffer=buffer,
                         sampler=tud.DistributedSampler(ds, num_replicas=8, rank=3))
    ds.close()


def test_the_memory_check_counts_the_ranks_on_the_node_and_the_effective_buffer(h5path, monkeypatch):
    """A big buffer on a small dataset is what the rank's share fills (72 KiB here): accepted.
    The available memory is shared by the node's ranks (the launcher's count)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ds = solar.H5Dataset(h5path)
    solar.DataLoader(ds, batch_size=4, buffer="10TiB")
    solar.DataLoader(ds, batch_size=4, buffer="10TiB", spill=None)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(10**9))  # ~100 bytes of memory each
    with pytest.raises(solar.ConfigError, match=r"1000000000 ranks.*OMPI_COMM_WORLD_LOCAL_SIZE"):
        solar.DataLoader(ds, batch_size=4, buffer="10TiB")
    solar.DataLoader(ds, batch_size=4, buffer=0)  # no buffer: nothing to check
    ds.close()
