"""solar.dali: a CPU-only DALI pipeline fed by SOLAR's schedule gives solar.DataLoader's batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.dali


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    from solar.synthetic import write_ptycho_h5

    path = str(tmp_path_factory.mktemp("dali") / "d.h5")
    write_ptycho_h5(path, 45, 16, seed=3, progress=False)
    return path


def _solar_batches(path, epoch, **kw):
    import solar

    loader = solar.DataLoader(solar.H5Dataset(path), batch_size=8, distributed=True, **kw)
    loader.set_epoch(epoch)
    return [tuple(t.clone() for t in b) for b in loader]


def test_batches_match_solar_dataloader_for_the_same_seed(h5):
    import solar
    from solar.dali import DALILoader

    kw = dict(shuffle=True, seed=11, buffer=0.5)
    dl = DALILoader(solar.H5Dataset(h5), batch_size=8, **kw)
    ref = solar.DataLoader(solar.H5Dataset(h5), batch_size=8, distributed=True, **kw)
    assert dl.output_map == ["x", "y"]
    orders = []
    for epoch in (0, 1, 2):  # from epoch 1 on the buffer holds samples: hits are remapped alike
        dl.set_epoch(epoch)
        ref.set_epoch(epoch)
        got = [(b["x"].clone(), b["y"].clone()) for b in dl]
        want = [tuple(t.clone() for t in b) for b in ref]
        assert [len(g[0]) for g in got] == [len(w[0]) for w in want] == [8] * 5 + [5]  # short last batch kept
        for (gx, gy), (wx, wy) in zip(got, want):
            assert gx.dtype == torch.float32 and gx.device.type == "cpu"
            torch.testing.assert_close(gx, wx, rtol=0, atol=0)
            torch.testing.assert_close(gy, wy, rtol=0, atol=0)
        orders.append(torch.cat([g[0].flatten(1)[:, :4] for g in got]))
    assert not torch.equal(orders[0], orders[1])  # the epoch changed the order


def test_dali_operators_run_on_solar_batches(h5):
    import nvidia.dali.fn as fn

    import solar
    from solar.dali import DALILoader

    def define(x, y):
        return x * 2.0, fn.cast(y, dtype=__import__("nvidia.dali.types", fromlist=["FLOAT64"]).FLOAT64)

    dl = DALILoader(solar.H5Dataset(h5), batch_size=16, define=define, output_map=["x2", "y64"], shuffle=False)
    want = _solar_batches(h5, 0, shuffle=False)
    got = list(dl)
    assert len(got) == 3 and got[-1]["x2"].shape[0] == 13
    ref = torch.cat([w[0] for w in want])
    torch.testing.assert_close(torch.cat([g["x2"] for g in got]), ref * 2)
    assert got[0]["y64"].dtype == torch.float64
    np.testing.assert_array_equal(torch.cat([g["y64"] for g in got]).numpy(),
                                  torch.cat([w[1] for w in want]).double().numpy())


def _keys(batch):
    """Per-sample identity of a batch: the first values of each sample's first field."""
    return [tuple(r) for r in batch.flatten(1)[:, :3].tolist()]


def test_each_iteration_starts_a_fresh_epoch_whatever_the_previous_one_did(h5):
    # a break (DALI has already prefetched batches of the old epoch), a break right after the last
    # batch and an iter() never consumed must all leave the next iteration on a whole new epoch,
    # the one solar.DataLoader gives after the same steps (set_epoch or the automatic advance)
    import solar
    from solar.dali import DALILoader

    kw = dict(shuffle=True, seed=5, buffer=0)
    dl = DALILoader(solar.H5Dataset(h5), batch_size=8, prefetch_queue_depth=3, **kw)
    ref = solar.DataLoader(solar.H5Dataset(h5), batch_size=8, distributed=True, **kw)

    def run(loader, get, stop=None):
        out = []
        for i, b in enumerate(loader):
            out.append(_keys(get(b)))
            if stop is not None and i + 1 == stop:
                break
        return out

    steps = [(0, 1), (1, None), (None, 2), (None, 6), (5, 0), (None, None), (2, None)]
    for epoch, stop in steps:
        if epoch is not None:
            dl.set_epoch(epoch)
            ref.set_epoch(epoch)
        if stop == 0:
            iter(dl), iter(ref)  # started, nothing taken
            continue
        got, want = run(dl, lambda b: b["x"], stop), run(ref, lambda b: b[0], stop)
        assert got == want, f"set_epoch({epoch}), stop after {stop}: DALILoader's epoch differs from solar.DataLoader's"
        assert len(got) == (stop or 6)


def test_state_dict_counts_the_batches_the_caller_received_not_dalis_prefetch(h5):
    import solar
    from solar.dali import DALILoader
    from solar.testing.resume import check_save_load_state

    def make():
        return DALILoader(solar.H5Dataset(h5), batch_size=8, shuffle=True, seed=5, buffer=0.5, prefetch_queue_depth=3)

    assert check_save_load_state(make) == 8  # every save point 0..6, and after the loop
    dl = make()
    dl.set_epoch(0)
    it = iter(dl)
    next(it), next(it)
    assert dl.state_dict()["position"] == 16  # two batches of 8 received, though DALI pulled more


def test_documented_flip_example_flips_the_width_axis_of_chw_samples(h5):
    import nvidia.dali.fn as fn

    import solar
    from solar.dali import DALILoader

    want = _solar_batches(h5, 0, shuffle=False)
    for kwargs, axis in (({"horizontal": 1}, -1), ({"horizontal": 0, "vertical": 1}, -2)):  # horizontal defaults to 1
        dl = DALILoader(solar.H5Dataset(h5), batch_size=8, shuffle=False, define=lambda x, y: (fn.flip(x, **kwargs), y))
        got = list(dl)
        for g, (wx, wy) in zip(got, want, strict=True):
            torch.testing.assert_close(g["x"], wx.flip(axis), rtol=0, atol=0)
            torch.testing.assert_close(g["y"], wy, rtol=0, atol=0)
        assert dl.layout == ["CHW", "CHW"]


def test_layout_follows_the_sample_rank_and_can_be_overridden():
    import nvidia.dali.fn as fn

    import solar
    from solar.dali import DALILoader
    from torch.utils.data import TensorDataset

    hw = torch.arange(10 * 4 * 6, dtype=torch.float32).view(10, 4, 6)
    hwc = torch.arange(10 * 4 * 6 * 3, dtype=torch.float32).view(10, 4, 6, 3)
    labels = torch.arange(10)
    flip = lambda *nodes: (fn.flip(nodes[0], horizontal=1), *nodes[1:])  # noqa: E731

    def layouts(x, y):  # the layout DALI's operators see, as bytes
        return fn.get_property(x, key="layout"), fn.get_property(y, key="layout")

    batch = next(iter(DALILoader(TensorDataset(hw, labels), batch_size=4, define=layouts)))
    assert bytes(batch["out0"][0].numpy()) == b"HW" and bytes(batch["out1"][0].numpy()) == b""
    dl = DALILoader(TensorDataset(hw.unsqueeze(1)), batch_size=4, define=flip)  # (C, H, W)
    torch.testing.assert_close(torch.cat([b["out0"] for b in dl]), hw.unsqueeze(1).flip(-1), rtol=0, atol=0)
    assert dl.layout == ["CHW"]
    dl = DALILoader(TensorDataset(hwc), batch_size=4, define=flip, layout="HWC")  # channels-last data
    torch.testing.assert_close(torch.cat([b["out0"] for b in dl]), hwc.flip(-2), rtol=0, atol=0)
    assert dl.layout == ["HWC"]
    with pytest.raises(solar.ConfigError, match="layout has 1 entries for 2 fields"):
        DALILoader(TensorDataset(hw, labels), batch_size=4, layout=["HW"])
    with pytest.raises(solar.ConfigError, match="'CHW'.*field 0.*2-D"):
        DALILoader(TensorDataset(hw, labels), batch_size=4, layout=["CHW", None])


def test_plain_tuple_dataset_gives_one_output_per_field():
    import solar
    from solar.dali import DALILoader
    from torch.utils.data import TensorDataset

    x = torch.arange(40, dtype=torch.float32).view(20, 2)
    y = torch.arange(20)
    ds = TensorDataset(x, y)
    dl = DALILoader(ds, batch_size=8)
    assert dl.output_map == ["out0", "out1"]
    got = list(dl)
    want = list(solar.DataLoader(ds, batch_size=8, distributed=True))
    assert [len(g["out0"]) for g in got] == [8, 8, 4]
    for g, (wx, wy) in zip(got, want, strict=True):
        torch.testing.assert_close(g["out0"], wx, rtol=0, atol=0)
        torch.testing.assert_close(g["out1"], wy, rtol=0, atol=0)


def test_a_transform_or_dict_samples_set_the_pipeline_inputs(h5):
    """A transform that adds a field, and torch-style dict samples: the pipeline gets one input per
    field of the sample (before: built for the file's 2 fields, then failed at the first batch)."""
    import solar
    from solar.dali import DALILoader

    ds = solar.H5Dataset(h5, ("x", "y"), transform=lambda s: (s[0], s[1], s[0].mean()))
    dl = DALILoader(ds, batch_size=8, shuffle=True, seed=1)
    got = next(iter(dl))
    assert dl.output_map == ["out0", "out1", "out2"] and dl.layout[0] == "CHW"
    ref = next(iter(solar.DataLoader(ds, batch_size=8, shuffle=True, seed=1, distributed=True)))
    for name, t in zip(dl.output_map, ref):
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"img": torch.full((3, 4, 4), float(i)), "label": i}

    dl = DALILoader(Dicts(), batch_size=4)
    assert dl.output_map == ["img", "label"] and dl.layout == ["CHW", ""]
    got = list(dl)
    assert torch.equal(torch.cat([b["label"] for b in got]), torch.arange(10))
    assert torch.equal(got[0]["img"][:, 0, 0, 0], torch.arange(4, dtype=torch.float32))


def test_iterable_datasets_batch_samplers_and_bad_defines(h5):
    import solar
    from solar.dali import DALILoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(10, dtype=torch.float32).view(10, 1))

    got = torch.cat([b["out0"] for b in DALILoader(Stream(), batch_size=4)])  # not sharded, not a TypeError
    assert torch.equal(got.flatten(), torch.arange(10, dtype=torch.float32))
    ds = solar.H5Dataset(h5)
    bs = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(len(ds))), 8, drop_last=False)
    sizes = [len(b["y"]) for b in DALILoader(ds, batch_size=8, batch_sampler=bs)]
    assert sizes == [8, 8, 8, 8, 8, 5]
    with pytest.raises(solar.ConfigError, match="define returned no outputs"):
        DALILoader(ds, batch_size=4, define=lambda *nodes: ())
    with pytest.raises(solar.ConfigError, match="pipeline_options sets batch_size"):
        DALILoader(ds, batch_size=4, pipeline_options={"batch_size": 2})


def test_dali_random_operators_repeat_for_the_same_seed(h5):
    import nvidia.dali.fn as fn

    import solar
    from solar.dali import DALILoader

    def noisy(x, y):
        return x + fn.random.uniform(range=(0.0, 1.0), shape=()), y

    runs = [torch.cat([b["x"] for b in DALILoader(solar.H5Dataset(h5), batch_size=8, seed=7, define=noisy)])
            for _ in range(2)]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    other = torch.cat([b["x"] for b in DALILoader(solar.H5Dataset(h5), batch_size=8, seed=7, define=noisy,
                                                    pipeline_options={"seed": 12345})])
    assert not torch.equal(other, runs[0])
