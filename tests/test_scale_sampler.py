"""The sampler's way to the first batch holds no O(N) array for raw fields (issue 22: at N = 2e7
``sample_nbytes()`` was 160 MB, built three times per iteration): passes are sized and a buffer
in bytes is counted from the fields' shapes, with the same results as from every sample's size."""

from __future__ import annotations

import pytest
import torch.utils.data as tud

import solar
from solar.sampler import mean_stored_bytes
from solar.schedule import capacity_for_bytes
from solar.synthetic import write_ptycho_h5


@pytest.fixture(scope="module")
def raw_h5(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scale_sampler") / "ptycho.h5")
    write_ptycho_h5(path, 96, 8, seed=1, progress=False)
    return path


def _loader(path, buffer, P=2, rank=0, b=4):
    ds = solar.H5Dataset(path)
    s = tud.DistributedSampler(ds, num_replicas=P, rank=rank, seed=3)
    return solar.DataLoader(ds, batch_size=b, sampler=s, buffer=buffer, prefetch=2)


@pytest.mark.parametrize("buffer", [0.5, "3KiB", "100KiB"])
def test_raw_fields_are_sized_without_every_samples_size(raw_h5, monkeypatch, buffer):
    loader = _loader(raw_h5, buffer)
    ds, ss = loader.dataset, loader.solar_sampler
    sizes = ds.sample_nbytes()
    assert mean_stored_bytes(ds) == pytest.approx(float(sizes.mean()))
    want_group = ss.group_size(4)
    monkeypatch.setattr(ds, "sample_nbytes", lambda *a: pytest.fail("an O(N) sizes array was built"))
    assert ss.group_size(4) == want_group
    if ss.buffer_spec.nbytes is not None:  # a geometry not seen yet: counted now, from the shapes
        assert ss.capacity(3, 4) == capacity_for_bytes(sizes, ss.buffer_spec.nbytes, 3, 4)
    before = ds.stats.hits
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        got = [b for b in loader]
        assert len(got) == len(loader)
    assert (ds.stats.hits > before) == (ss.plan_config().capacity > 0)
