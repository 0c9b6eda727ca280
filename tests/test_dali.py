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
    np.testing.assert_array_equal(torch.cat([g["y64"] for g in got]).numpy(), torch.cat([w[1] for w in want]).double().numpy())
