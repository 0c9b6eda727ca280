"""solar.DataLoader over Subsets (random_split, nested, changed between epochs) and concatenations:
SOLAR drives them and gives torch's batches (NOTE [ Subsets ])."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar


def _epochs(loader, n, set_epoch=None):
    out = []
    for e in range(n):
        if set_epoch is not None:
            set_epoch(e)
        out.append([tuple(t.clone() for t in b) for b in loader])  # whole epochs: see torch's RandomSampler
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_random_split_is_driven_by_solar_and_gives_torchs_batches(h5path, workers):
    """NOTE [ Subsets ]: PtychoNN's script splits its dataset with random_split. The loader drives
    the Subset (schedule, buffer, coalesced read-ahead) instead of running as torch's: the same
    batches as torch's loader over the same Subset, epoch after epoch, with every sample of the
    split a hit from the second epoch (buffer=1.0) and fewer storage requests."""
    import warnings

    ds, ref = solar.H5Dataset(h5path), solar.H5Dataset(h5path)
    split = [0.75, 0.25]
    train, val = tud.random_split(ds, split, generator=torch.Generator().manual_seed(0))
    ref_train, _ = tud.random_split(ref, split, generator=torch.Generator().manual_seed(0))
    kw = dict(batch_size=8, shuffle=True, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs as torch's would" warning any more
        loader = solar.DataLoader(train, generator=torch.Generator().manual_seed(3), buffer=1.0, **kw)
    assert loader.solar_sampler is not None and isinstance(loader.dataset, tud.Subset)
    assert loader.dataset.dataset is ds and list(loader.dataset.indices) == list(train.indices)
    torch_loader = tud.DataLoader(ref_train, generator=torch.Generator().manual_seed(3), **kw)
    got, want = _epochs(loader, 3), _epochs(torch_loader, 3)
    assert len(got[0]) == len(want[0]) == 9
    for e, (g, w) in enumerate(zip(got, want)):
        assert all(torch.equal(a, b) for gb, wb in zip(g, w) for a, b in zip(gb, wb)), f"epoch {e}"
    assert ds.stats.hits == 2 * len(train)  # epochs 2 and 3: all of the split from the buffer
    if not workers:  # (torch's workers count their reads in their own processes)
        assert ds.stats.read_calls < ref.stats.read_calls
    # the other part of the split, with another loader over the same dataset
    v = [b for b in solar.DataLoader(val, batch_size=8)]
    assert torch.equal(torch.cat([b[1] for b in v]), torch.stack([ref[i][1] for i in val.indices]))
    ds.close()
    ref.close()


def test_nested_subsets_with_repeats_and_negative_indices_read_the_right_rows(h5path):
    """A Subset of a Subset composes its indices (negative ones count from the end, as in torch);
    a repeated row is two samples. Every batch equals torch's; errors and batch labels name the
    file's sample, and a bad position says it is a position in a Subset."""
    ds, ref = solar.H5Dataset(h5path), solar.H5Dataset(h5path)
    inner_idx, outer_idx = [5, 90, -1, 7, 7, 40], [1, -1, 3, 4, 0, 2, 5, 1]
    sub = tud.Subset(tud.Subset(ds, inner_idx), outer_idx)
    rows = np.arange(96)[inner_idx][outer_idx]
    loader = solar.DataLoader(sub, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1),
                              buffer=4)
    assert loader.solar_sampler is not None and not loader.dataset.distinct
    assert loader.dataset.rows.tolist() == rows.tolist()
    want = tud.DataLoader(tud.Subset(tud.Subset(ref, inner_idx), outer_idx), batch_size=3, shuffle=True,
                          generator=torch.Generator().manual_seed(1))
    for g, w in zip(_epochs(loader, 2), _epochs(want, 2)):
        assert all(torch.equal(a, b) for gb, wb in zip(g, w) for a, b in zip(gb, wb))
    stored = loader.dataset.fetch_stored([0, 4, -1])
    assert stored.indices == rows[[0, 4, -1]].tolist()  # what error messages name
    with pytest.raises(IndexError, match=r"sample index 8 of a Subset out of range for 8 samples"):
        loader.dataset.fetch_stored([8])
    with pytest.raises(IndexError, match=r"ptycho.h5: Subset index 6 out of range for the 6 samples .*position 2"):
        solar.DataLoader(tud.Subset(tud.Subset(ds, inner_idx), [0, 1, 6]), batch_size=2)
    ds.close()
    ref.close()


def test_plain_datasets_subsets_and_concatenations_stay_silent(h5path):
    """The "runs as torch's would" warning is for wrappers the loader cannot drive
    (tests/test_concat.py); datasets it drives, and datasets that are not storage-backed, get
    none. Unbatched (batch_size=None), the loader is torch's and keeps the dataset as given."""
    import warnings

    ds = solar.H5Dataset(h5path)
    train, _ = tud.random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert solar.DataLoader(tud.TensorDataset(torch.zeros(8)), batch_size=4).solar_sampler is None
        assert solar.DataLoader(ds, batch_size=4).solar_sampler is not None
        assert solar.DataLoader(train, batch_size=4).solar_sampler is not None
        both = tud.ConcatDataset([tud.Subset(ds, range(8)), train])
        assert solar.DataLoader(both, batch_size=4).solar_sampler is not None
        assert solar.DataLoader(train, batch_size=None).dataset is train
    ds.close()


@pytest.mark.parametrize("buffer", [0, 0.5])
def test_a_subset_whose_indices_change_between_epochs_is_followed_as_torch_follows_it(h5path, buffer):
    """NOTE [ Subsets ]: an active-learning pool that grows (in place), is replaced in place, or
    is re-assigned between epochs: the loader reads what the Subset selects now, as torch's does
    (before: a misleading IndexError after a growth, and the old samples, from the buffer too,
    after a replacement)."""
    ds = solar.H5Dataset(h5path)
    want = lambda idx: torch.stack([ds[i][1] for i in idx])  # noqa: E731
    pool = tud.Subset(ds, [0, 1, 2, 3])
    loader = solar.DataLoader(pool, batch_size=4, buffer=buffer)
    assert loader.solar_sampler is not None

    def check(idx):
        for _ in range(2):  # twice: the second epoch's hits come from the buffer
            got = torch.cat([y for _, y in loader])
            assert torch.equal(got, want(idx))

    check([0, 1, 2, 3])
    pool.indices.extend([30, 31])
    check([0, 1, 2, 3, 30, 31])
    pool.indices[:] = [10, 11, 12, 13]
    check([10, 11, 12, 13])
    pool.indices = [20, 21, 22]
    check([20, 21, 22])
    nested = tud.Subset(tud.Subset(ds, list(range(40, 60))), [0, 1])
    loader = solar.DataLoader(nested, batch_size=2, buffer=buffer)
    nested.dataset.indices[0] = 77  # an inner level changed
    assert torch.equal(torch.cat([y for _, y in loader]), want([77, 41]))
    loader = solar.DataLoader(tud.Subset(ds, [0]), batch_size=1)
    loader.dataset.source.indices = [500]
    with pytest.raises(IndexError, match="Subset index 500 out of range"):
        next(iter(loader))
