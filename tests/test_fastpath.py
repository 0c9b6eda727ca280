"""How bytes reach the batch: NOTE [ One copy into the batch ] and NOTE [ Batches that stay ] in
solar/fetch.py, and sieved rows left where they were read (PickedRows in solar/reads.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.fetch import Samples, collate
from solar.passes import FIRST_SAMPLES, in_groups


def _loader(path, workers=0, **kw):
    ds = solar.H5Dataset(path, kw.pop("fields", ("x", "y")), transform=kw.pop("transform", None),
                         sieve_bytes=kw.pop("sieve_bytes", 64 << 10))
    sampler = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    return solar.DataLoader(ds, batch_size=10, sampler=sampler, num_workers=workers, buffer=40, **kw)


def _epochs(loader, n=3):
    out = []
    for e in range(n):
        loader.sampler.set_epoch(e)
        out += [[t.clone() for t in (b if isinstance(b, list) else [b])] for b in loader]
    return out


def _torch_batches(path, fields=("x", "y")):
    """The same epochs through torch's own loader, sample by sample, with its default_collate."""
    ds = solar.H5Dataset(path, fields)
    sampler = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = tud.DataLoader(ds, batch_size=10, sampler=sampler, collate_fn=tud.default_collate)
    out = []
    for e in range(3):
        sampler.set_epoch(e)
        for batch in loader:
            out.append([t.clone() for t in (batch if isinstance(batch, list) else [batch])])
    return out


def _same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for s, t in zip(x, y):
            assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t)


def test_the_loaders_collate_gives_default_collates_batches(h5path):
    loader = _loader(h5path)
    assert loader.collate_fn is collate
    _same(_epochs(loader), _torch_batches(h5path))


def test_single_field_batches_are_one_tensor(h5path):
    got = _epochs(_loader(h5path, fields="x"))
    _same(got, _torch_batches(h5path, "x"))


def test_collate_returns_the_columns_without_a_copy():
    cols = (torch.arange(12.0).reshape(4, 3), torch.arange(8).reshape(4, 2))
    batch = Samples(tuple(c[i] for c in cols) for i in range(4))
    batch.columns = cols
    out = collate(batch)
    assert isinstance(out, list) and out[0].data_ptr() == cols[0].data_ptr() and out[1] is cols[1]
    batch[2] = (torch.zeros(3), torch.zeros(2, dtype=torch.int64))  # a changed list: default_collate
    changed = collate(batch)
    assert changed[0].data_ptr() != cols[0].data_ptr() and float(changed[0][2].sum()) == 0


def test_a_transform_or_a_users_collate_sees_samples_as_before(h5path):
    seen = []

    def mine(samples):
        seen.append(type(samples[0]))
        return tud.default_collate(samples)
    plain = _epochs(_loader(h5path))
    _same(_epochs(_loader(h5path, collate_fn=mine)), plain)
    assert seen and all(t is tuple for t in seen)
    doubled = _epochs(_loader(h5path, transform=lambda s: tuple(t * 2 for t in s)))
    _same(doubled, [[t * 2 for t in b] for b in plain])


@pytest.mark.parametrize("transform", [None, "double"])
def test_workers_give_the_batches_of_no_workers(h5path, transform):
    """Plain batches stay in the loader's process (NOTE [ Batches that stay ]); with a transform
    they travel to the workers in shared memory, as before. Both give the same batches."""
    fn = (lambda s: tuple(t * 2 for t in s)) if transform else None
    want = _epochs(_loader(h5path, transform=fn))
    loader = _loader(h5path, workers=2, transform=fn)
    got = _epochs(loader)
    _same(got, want)
    assert loader._batches_stay() is (transform is None)
    loader.sampler.set_epoch(5)
    batch = next(iter(loader))
    assert batch[0].is_shared() is (transform is not None)  # made in a worker: in shared memory


def _mark_worker(_):
    torch.utils.data.get_worker_info()  # (a worker_init_fn: workers must then exist)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_with_nothing_to_do_are_not_started(h5path, persistent):
    """NOTE [ Workers with nothing to do ]: plain batches with workers iterate in this process,
    torch's single-process iterator, giving num_workers=0's batches; a worker_init_fn (or a
    transform) keeps the workers."""
    want = _epochs(_loader(h5path))
    loader = _loader(h5path, workers=2, persistent_workers=persistent)
    _same(_epochs(loader), want)
    it = iter(loader)
    assert isinstance(it._it, tud.dataloader._SingleProcessDataLoaderIter) and loader.solar_sampler.shared is False
    next(it)
    del it
    assert loader._batches_stay()
    kept = _loader(h5path, workers=2, persistent_workers=persistent, worker_init_fn=_mark_worker)
    _same(_epochs(kept), want)
    assert isinstance(iter(kept)._it, tud.dataloader._MultiProcessingDataLoaderIter)
    doubled = _loader(h5path, workers=2, transform=lambda s: tuple(t * 2 for t in s))
    assert isinstance(iter(doubled)._it, tud.dataloader._MultiProcessingDataLoaderIter)


def test_a_persistent_loader_changes_kind_between_epochs(h5path):
    """A persistent loader whose dataset gains a transform between epochs starts its workers
    then (and drops them again when it loses it)."""
    loader = _loader(h5path, workers=2, persistent_workers=True)
    want = _epochs(_loader(h5path), 1)
    _same(_epochs(loader, 1), want)
    loader.dataset.transform = lambda s: tuple(t * 2 for t in s)
    _same(_epochs(loader, 1), [[t * 2 for t in b] for b in want])
    assert isinstance(loader._iterator, tud.dataloader._MultiProcessingDataLoaderIter)
    loader.dataset.transform = None
    _same(_epochs(loader, 1), want)
    assert not isinstance(loader._iterator, tud.dataloader._MultiProcessingDataLoaderIter)


def test_sieved_rows_are_read_in_place(h5path):
    """Rows read through gaps (sieving) reach the batch from where they were read."""
    sieved = _loader(h5path, sieve_bytes=1 << 30)
    exact = _loader(h5path, sieve_bytes=0)
    _same(_epochs(sieved), _epochs(exact))
    assert sieved.dataset.stats.bytes_in > exact.dataset.stats.bytes_in  # gaps were read


def test_a_worker_loader_left_early_then_run_again_gives_whole_epochs(h5path):
    loader = _loader(h5path, workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    del it
    want = _epochs(_loader(h5path))
    _same(_epochs(loader), want)
    assert np.isfinite(float(want[0][0].sum()))


def _steps(n, b):
    return iter([(list(range(k * b, (k + 1) * b)), None, None, None) for k in range(n)])


def test_passes_grow_to_their_size_so_the_first_batch_waits_for_one_step():
    """NOTE [ First batch ] in solar/passes.py: the first pass holds at most FIRST_SAMPLES
    samples in whole steps (one at least), each next one twice as many, up to the pass size."""
    assert FIRST_SAMPLES == 32
    assert [len(g) for g in in_groups(_steps(20, 32), 8)] == [1, 2, 4, 8, 5]
    assert [len(g) for g in in_groups(_steps(20, 64), 8)] == [1, 2, 4, 8, 5]
    assert [len(g) for g in in_groups(_steps(20, 16), 8)] == [2, 4, 8, 6]
    assert [len(g) for g in in_groups(_steps(12, 8), 4)] == [4, 4, 4]  # small steps: passes as before
    assert [len(g) for g in in_groups(_steps(3, 32), 1)] == [1, 1, 1]
    assert list(in_groups(iter([]), 8)) == []

    def failing():
        yield from _steps(5, 32)
        raise ValueError("sampler")
    got = []
    with pytest.raises(ValueError, match="sampler"):
        for g in in_groups(failing(), 8):
            got.append(len(g))
    assert got == [1, 2, 2]  # every step before the failure, then the error


def test_the_first_batch_comes_from_a_small_pass(h5path):
    loader = _loader(h5path)  # batches of 10: the first pass is 3 steps (30 samples)
    ds = loader.dataset
    loader.sampler.set_epoch(0)
    it = iter(loader)
    first = next(it)
    assert len(first[0]) == 10 and ds.stats.steps >= 1
    rest = list(it)
    assert len(rest) == len(loader) - 1
    assert ds.stats.steps == len(list(in_groups(_steps(len(loader), 10), 8))) == 3  # passes of 3, 6, 1 steps


def test_no_workers_with_a_timeout_is_torchs_iterator_as_before(h5path):
    """torch's single-process iterator refuses timeout= without workers; the loader leaves that
    case to it rather than iterating in its own (NOTE [ Workers with nothing to do ])."""
    ds = solar.H5Dataset(h5path)
    with pytest.raises(AssertionError, match="timeout == 0"):
        next(iter(tud.DataLoader(ds, batch_size=4, timeout=1)))
    with pytest.raises(AssertionError, match="timeout == 0"):
        next(iter(solar.DataLoader(ds, batch_size=4, timeout=1)))
