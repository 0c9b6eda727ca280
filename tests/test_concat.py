"""Several files in one loader: a ``ConcatDataset`` of H5Datasets, of Subsets of them, and a
``random_split`` of one (NOTE [ Several files ] in solar/concat.py; MPI: test_loader_mpi.py)."""

from __future__ import annotations

import shutil
import warnings

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

import solar
from solar.ingest import ingest
from solar.synthetic import write_ptycho_h5

SIZES = (40, 25, 31)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    paths = []
    for i, n in enumerate(SIZES):
        paths.append(str(d / f"shard{i}.h5"))
        write_ptycho_h5(paths[-1], n, 8, seed=10 + i, progress=False)
    return paths


def _open(paths, **kw):
    return [solar.H5Dataset(p, **kw) for p in paths]


def _same_epochs(loader, torch_loader, epochs):
    for e in range(epochs):  # whole epochs of both (torch's RandomSampler draws at its end)
        got, want = list(loader), list(torch_loader)
        assert len(got) == len(want) > 0, f"epoch {e}"
        for g, w in zip(got, want):
            g, w = (g, w) if isinstance(g, (list, tuple)) else ((g,), (w,))
            assert all(torch.equal(a, b) for a, b in zip(g, w)), f"epoch {e}"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_concat_dataset_of_files_is_one_schedule_with_torchs_batches(shards, workers):
    """Three files of different sizes joined with ConcatDataset: torch's batches, epoch after
    epoch; every sample a hit from the second epoch (buffer=1.0), and each file read in a few
    coalesced requests per pass instead of one per batch."""
    dss, refs = _open(shards), _open(shards)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = solar.DataLoader(tud.ConcatDataset(dss), batch_size=8, shuffle=True, buffer=1.0,
                                  num_workers=workers, generator=torch.Generator().manual_seed(3))
    assert isinstance(loader.dataset, solar.StoredConcat) and loader.solar_sampler is not None
    assert loader.dataset.datasets == dss and len(loader.dataset) == sum(SIZES) and loader.dataset.distinct
    torch_loader = tud.DataLoader(tud.ConcatDataset(refs), batch_size=8, shuffle=True, num_workers=workers,
                                  generator=torch.Generator().manual_seed(3))
    _same_epochs(loader, torch_loader, 3)
    assert [d.stats.hits for d in dss] == [2 * n for n in SIZES]
    if not workers:  # (torch's workers count their reads in their own processes)
        assert sum(d.stats.read_calls for d in dss) < sum(r.stats.read_calls for r in refs) / 10
    for d in dss + refs:
        d.close()


def test_mixed_members_overlaps_transforms_and_a_split_of_the_whole(shards):
    """Members that are files, Subsets (repeating a row, overlapping another member) and a nested
    ConcatDataset, each file with its own transform; then a random_split of that concatenation.
    Each gives torch's batches; the overlap makes the reads non-disjoint."""
    def build(dss):
        a, b, c = dss
        return tud.ConcatDataset([a, tud.Subset(b, [3, 3, -1, 0, 7]),
                                  tud.ConcatDataset([c, tud.Subset(a, list(range(5, 15)))])])

    dss, refs = _open(shards), _open(shards)
    for i, (d, r) in enumerate(zip(dss, refs)):
        d.transform = r.transform = (lambda s, i=i: (s[0] + 100 * i, s[1]))
    cat, ref = build(dss), build(refs)
    loader = solar.DataLoader(cat, batch_size=6, shuffle=True, buffer=0.5, generator=torch.Generator().manual_seed(1))
    assert loader.solar_sampler is not None and not loader.dataset.distinct and len(loader.dataset.parts) == 4
    _same_epochs(loader, tud.DataLoader(ref, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1)), 2)
    split = [0.7, 0.3]
    tr, _ = tud.random_split(cat, split, generator=torch.Generator().manual_seed(5))
    rtr, _ = tud.random_split(ref, split, generator=torch.Generator().manual_seed(5))
    loader = solar.DataLoader(tr, batch_size=5, shuffle=True, buffer=1.0, generator=torch.Generator().manual_seed(2))
    assert isinstance(loader.dataset, solar.StoredSubset) and isinstance(loader.dataset.base, solar.StoredConcat)
    _same_epochs(loader, tud.DataLoader(rtr, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(2)), 2)
    # that split (its rows interleave the files) as a member of another concatenation, twice over
    mix = tud.ConcatDataset([tr, tud.Subset(dss[1], [2, 0]), tud.ConcatDataset([tud.Subset(tr, [4, 1, 4])])])
    rmix = tud.ConcatDataset([rtr, tud.Subset(refs[1], [2, 0]), tud.ConcatDataset([tud.Subset(rtr, [4, 1, 4])])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = solar.DataLoader(mix, batch_size=7, shuffle=True, buffer=0.5,
                                  generator=torch.Generator().manual_seed(3))
    assert isinstance(loader.dataset, solar.StoredConcat) and loader.dataset.perm is not None
    assert not loader.dataset.distinct  # row 4 of the split twice
    _same_epochs(loader, tud.DataLoader(rmix, batch_size=7, shuffle=True,
                                        generator=torch.Generator().manual_seed(3)), 2)
    for d in dss + refs:
        d.close()


def test_a_compressed_and_a_raw_file_decode_each_their_own_and_errors_name_the_file(shards, tmp_path):
    """A compressed shard beside a raw one: each file's part of a pass is decoded by its own
    dataset (whole passes at once without workers). A damaged blob in the compressed shard is
    named by that file and its sample number."""
    comp = str(tmp_path / "comp.h5")
    ingest([shards[1]], comp, rel_error=1e-2, comm=None, progress=False)
    dss, refs = _open([shards[0], comp]), _open([shards[0], comp])
    loader = solar.DataLoader(tud.ConcatDataset(dss), batch_size=8, shuffle=True, buffer=0.5,
                              generator=torch.Generator().manual_seed(4))
    assert loader.dataset.compressed and loader.solar_sampler._decode_ahead
    torch_loader = tud.DataLoader(tud.ConcatDataset(refs), batch_size=8, shuffle=True,
                                  generator=torch.Generator().manual_seed(4))
    _same_epochs(loader, torch_loader, 2)
    bad = str(tmp_path / "damaged.h5")
    shutil.copy(comp, bad)
    spec = dss[1].specs[0]
    start = int(dss[1]._offsets_of(spec)[7])
    with h5py.File(bad, "r+") as f:
        f[spec.data_key][start] ^= 0xFF  # the magic of sample 7's blob of field x
    damaged = solar.H5Dataset(bad, verify=False)
    loader = solar.DataLoader(tud.ConcatDataset([dss[0], damaged]), batch_size=8, shuffle=True)
    with pytest.raises(solar.CorruptDataError, match=r"sample '7 of .*damaged.h5:x'"):
        list(loader)
    for d in dss + refs + [damaged]:
        d.close()


def test_concatenations_the_loader_cannot_drive_warn_and_run_as_torchs(shards, tmp_path):
    """Files with different field names (or a member that is not a file) cannot share one pass:
    the loader warns, naming a file, and runs as torch's; the batches are still right."""
    other = str(tmp_path / "other.h5")
    with h5py.File(other, "w") as f:
        f["z"] = np.arange(12, dtype=np.float32).reshape(6, 2)
    a, o = solar.H5Dataset(shards[0], "x"), solar.H5Dataset(other)
    for cat in (tud.ConcatDataset([a, o]),
                tud.ConcatDataset([a, tud.TensorDataset(torch.zeros(4, 1, 8, 8)).tensors[0]])):
        with pytest.warns(UserWarning, match=r"ConcatDataset of H5Dataset .*shard0.h5.*runs as torch's would"):
            loader = solar.DataLoader(cat, batch_size=4)
        assert loader.solar_sampler is None and loader.dataset is cat
        assert len(list(loader)) == -(-len(cat) // 4)
    a.close()
    o.close()


def test_an_index_past_the_end_is_refused_naming_the_files(shards):
    """Read outside the loader (torch's fetcher calls __getitems__ with plain indices), a
    negative index counts from the end of the concatenation; one past it names the files."""
    dss = _open(shards)
    loader = solar.DataLoader(tud.ConcatDataset(dss), batch_size=4)
    with pytest.raises(IndexError, match=r"shard0.h5 and 2 more files: sample index 96 out of range for 96"):
        loader.dataset.fetch_stored([0, 96])
    last, first = loader.dataset.__getitems__([-1, 0])
    assert torch.equal(last[1], dss[2][30][1]) and torch.equal(first[0], dss[0][0][0])
    for d in dss:
        d.close()


def test_subclasses_that_make_their_own_items_run_as_torchs(shards):
    """A ConcatDataset subclass that tags each sample with its shard, a Subset subclass with its
    own __getitems__, and an H5Dataset subclass with its own __getitems__ inside a Subset: the
    loader cannot know how they make items, so it leaves them to torch (same batches as torch,
    with the warning) instead of replacing them and losing the change."""

    class Tagged(tud.ConcatDataset):
        def __getitem__(self, i):
            return (*super().__getitem__(i), int(np.searchsorted(self.cumulative_sizes, i, side="right")))

    class Doubled(tud.Subset):
        def __getitems__(self, indices):
            return [(2 * x, y) for x, y in super().__getitems__(indices)]

    class WithIndex(solar.H5Dataset):
        def __getitems__(self, indices):
            return [(*s, i) for s, i in zip(super().__getitems__(indices), indices)]

    def cases(paths):
        return [Tagged(_open(paths)), Doubled(solar.H5Dataset(paths[0]), [3, 1, 2]),
                tud.Subset(WithIndex(paths[1]), [0, 4, 5])]

    for mine, ref in zip(cases(shards), cases(shards)):
        with pytest.warns(UserWarning, match="cannot drive.*not subclasses"):
            loader = solar.DataLoader(mine, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
        assert loader.solar_sampler is None and loader.dataset is mine
        _same_epochs(loader, tud.DataLoader(ref, batch_size=2, shuffle=True,
                                            generator=torch.Generator().manual_seed(0)), 1)


def test_an_empty_split_is_driven_and_the_concatenation_answers_for_its_files(shards):
    """An empty part of a split (falsy: len 0) is still driven, with no warning. A StoredConcat
    gives its files' field names, summed counters, its length as num_samples, and closes them."""
    dss = _open(shards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Length of split at index 1 is 0"
        train, empty = tud.random_split(dss[0], [1.0, 0.0], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = solar.DataLoader(empty, batch_size=4)
    assert isinstance(loader.dataset, solar.StoredSubset) and list(loader) == []
    loader = solar.DataLoader(tud.ConcatDataset(dss), batch_size=8)
    cat = loader.dataset
    assert sum(len(b[0]) for b in loader) == sum(SIZES)
    assert cat.fields == ("x", "y") and cat.num_samples == sum(SIZES)
    assert cat.stats.misses == sum(SIZES) == sum(d.stats.misses for d in dss)
    assert all(d.backend._pid is not None for d in dss)  # open
    cat.close()
    assert all(d.backend._pid is None for d in dss)


def test_a_pass_over_many_files_reads_them_side_by_side_without_a_pool_each(tmp_path):
    """Each file's share of a pass is small: the files are read side by side, each in one
    thread, instead of giving every file its own pool of io_threads request threads (100 files
    made about 400 threads). The concatenation keeps that one pool across passes (a pool per
    pass started its threads every pass); a pickled copy carries no threads, and close() ends
    them."""
    import pickle
    import threading

    paths = []
    for i in range(24):  # 16 samples of 48 KiB each
        paths.append(str(tmp_path / f"f{i}.h5"))
        write_ptycho_h5(paths[-1], 16, 64, seed=i, progress=False)
    dss, refs = _open(paths, io_threads=4), _open(paths)
    loader = solar.DataLoader(tud.ConcatDataset(dss), batch_size=64, shuffle=True, buffer=0,
                              generator=torch.Generator().manual_seed(0))
    torch_loader = tud.DataLoader(tud.ConcatDataset(refs), batch_size=64, shuffle=True,
                                  generator=torch.Generator().manual_seed(0))
    before, most, pools, started = threading.active_count(), 0, set(), set()
    earlier = {t.ident for t in threading.enumerate()}  # other tests' datasets may keep pools
    for _ in range(2):
        got = []
        for b in loader:
            most = max(most, threading.active_count())
            pools.add(id(loader.dataset.__dict__.get("_pool")))
            started |= {t.ident for t in threading.enumerate()  # (None: started, not yet running)
                        if t.name.startswith("solar-io") and t.ident is not None} - earlier
            got.append(b)
        want = list(torch_loader)
        assert len(got) == len(want) and all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))
    assert most - before <= 4 + 2  # one pool of io_threads (and the loader's own threads)
    assert all(d.__dict__.get("_pool") is None for d in dss)
    pool = loader.dataset.__dict__.get("_pool")
    assert pool is not None and pools == {id(pool)}  # one pool for every pass of both epochs
    assert len(started) <= 4  # its threads, started once
    assert "_pool" not in pickle.loads(pickle.dumps(loader.dataset)).__dict__
    loader.dataset.close()
    assert "_pool" not in loader.dataset.__dict__ and pool._shutdown
    for d in refs:
        d.close()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, max(n - 1, 0)), max_size=60)
                                                       if n else st.just([]))))
def test_distinct_rows_agrees_with_a_sort(case):
    """The O(n) bitmap check that tells whether a split's passes may be disjoint collective reads."""
    from solar.subset import distinct_rows

    n, rows = case
    rows = np.asarray(rows, dtype=np.int64)
    assert distinct_rows(rows, n) == (len(np.unique(rows)) == len(rows))


def test_splits_of_one_concatenation_share_its_files_and_a_stored_one_splits_again(shards):
    """ConcatDataset([train, val]) of one random_split of a concatenation: both members select
    from the same files, which are parts once (not once per member: twice the read calls, and
    no disjoint collective reads), and no row repeats. A split of the loader's own StoredConcat
    is driven too."""
    dss, refs = _open(shards), _open(shards)

    def build(files):
        whole = tud.ConcatDataset(files)
        train, val = tud.random_split(whole, [0.7, 0.3], generator=torch.Generator().manual_seed(4))
        return tud.ConcatDataset([val, train])

    loader = solar.DataLoader(build(dss), batch_size=8, shuffle=True, buffer=0.5,
                              generator=torch.Generator().manual_seed(6))
    cat = loader.dataset
    assert isinstance(cat, solar.StoredConcat) and len(cat.parts) == len(shards) and cat.distinct
    _same_epochs(loader, tud.DataLoader(build(refs), batch_size=8, shuffle=True,
                                        generator=torch.Generator().manual_seed(6)), 2)
    part, _ = tud.random_split(cat, [0.5, 0.5], generator=torch.Generator().manual_seed(7))
    rpart, _ = tud.random_split(build(refs), [0.5, 0.5], generator=torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = solar.DataLoader(part, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(8))
    assert isinstance(again.dataset, solar.StoredSubset) and again.dataset.base is cat
    _same_epochs(again, tud.DataLoader(rpart, batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(8)), 1)
    for d in dss + refs:
        d.close()


def test_a_list_or_a_glob_of_files_is_a_concat_dataset_solar_plans_as_one(shards):
    """H5Dataset over a glob (sorted by name) or a list (in its order): a torch ConcatDataset of one
    H5Dataset per file made with the same arguments; solar.DataLoader plans it as one dataset and
    gives torch's batches over the files opened one by one, every sample a hit from epoch 2."""
    pattern = shards[0].replace("shard0", "shard*")
    cat = solar.H5Dataset(pattern, ("x", "y"), sieve_bytes=0)
    assert type(cat) is tud.ConcatDataset and len(cat) == sum(SIZES)
    assert [d.path for d in cat.datasets] == sorted(shards)
    assert all(type(d) is solar.H5Dataset and d.sieve_bytes == 0 for d in cat.datasets)
    backwards = solar.H5Dataset(list(reversed(shards)), "x")
    assert [d.path for d in backwards.datasets] == list(reversed(shards))
    with h5py.File(shards[2]) as f:
        assert torch.equal(backwards[5], torch.from_numpy(f["x"][5]))  # the list's first file is shards[2]
    refs = _open(shards)
    loader = solar.DataLoader(cat, batch_size=8, shuffle=True, buffer=1.0, generator=torch.Generator().manual_seed(5))
    assert isinstance(loader.dataset, solar.StoredConcat) and loader.dataset.datasets == cat.datasets
    _same_epochs(loader, tud.DataLoader(tud.ConcatDataset(refs), batch_size=8, shuffle=True,
                                        generator=torch.Generator().manual_seed(5)), 2)
    assert [d.stats.hits for d in cat.datasets] == list(SIZES)
    for d in cat.datasets + backwards.datasets + refs:
        d.close()


def test_samples_are_a_tensor_for_a_field_name_and_a_tuple_otherwise_over_files_too(shards):
    """fields a string: a tensor per sample and one batched tensor per batch; a tuple, a list or None
    (also of one field): a tuple per sample and a list of batched tensors per batch (torch's
    default_collate), from one file or several, with either loader."""
    with h5py.File(shards[0]) as f:
        x0 = torch.from_numpy(f["x"][0])
    for path in (shards[0], shards[:2]):
        one = solar.H5Dataset(path, "x")
        assert isinstance(one[0], torch.Tensor) and torch.equal(one[0], x0)
        for make in (tud.DataLoader, solar.DataLoader):
            batch = next(iter(make(one, batch_size=4)))
            assert isinstance(batch, torch.Tensor) and batch.shape == (4, *x0.shape)
        for fields, width in ((("x",), 1), (["x", "y"], 2), (None, 2)):
            ds = solar.H5Dataset(path, fields)
            assert type(ds[0]) is tuple and len(ds[0]) == width and torch.equal(ds[0][0], x0)
            for make in (tud.DataLoader, solar.DataLoader):
                batch = next(iter(make(ds, batch_size=4)))
                assert type(batch) is list and len(batch) == width and torch.equal(batch[0][0], x0)
            for d in getattr(ds, "datasets", [ds]):
                d.close()
        for d in getattr(one, "datasets", [one]):
            d.close()


def test_a_list_or_glob_that_cannot_be_one_dataset_is_refused_naming_the_files(shards, tmp_path):
    other = str(tmp_path / "other.h5")
    with h5py.File(other, "w") as f:
        f["z"] = np.arange(12, dtype=np.float32).reshape(6, 2)
    with pytest.raises(solar.InputError, match="the list of files is empty"):
        solar.H5Dataset([])
    with pytest.raises(solar.InputError, match=r"nothing-\*\.h5: no file matches this pattern"):
        solar.H5Dataset(str(tmp_path / "nothing-*.h5"))
    with pytest.raises(solar.ConfigError, match=r"other\.h5 has the fields \['z'\], .*shard0\.h5 has \['x', 'y'\]"):
        solar.H5Dataset([shards[0], other])
    first = solar.H5Dataset(shards[0])
    with pytest.raises(solar.ConfigError, match="is an instance, which reads one file"):
        solar.H5Dataset(shards[:2], backend=first.backend)
    first.close()
    odd = tmp_path / "odd[1].h5"  # a name with glob characters that exists is one file
    shutil.copy(shards[1], odd)
    ds = solar.H5Dataset(str(odd))
    assert type(ds) is solar.H5Dataset and len(ds) == SIZES[1]
    ds.close()
