"""Golden fixtures for the on-disk formats this part writes: a ``solar-h5/1`` file made by
``solar ingest`` (one raw, one compressed field) and a sharded ``.npy`` store. Files written by
earlier versions must keep reading the same; regenerate only on purpose, with
``SOLAR_REGEN_GOLDEN=1 pytest tests/test_ingest_golden.py``, and say why in the commit."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest

from solar.ingest import ingest, verify_file
from solar.io_backends import open_backend
from solar.layout import FORMAT, checksum_key, describe_fields, sample_checksum

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "ingest")
GOLDEN_H5 = os.path.join(HERE, "golden-solar-h5-1.h5")
GOLDEN_NPY = os.path.join(HERE, "golden-npy-store")
BOUND = 1e-3


def _inputs():
    t = np.linspace(0, 1, 8 * 8, dtype=np.float64).reshape(8, 8)
    x = np.stack([np.sin(6 * t + k) * (1 + k / 3) for k in range(6)]).astype(np.float32)[:, None]
    return x, np.arange(6, dtype=np.int64) * 7


def _make_h5(path, tmp):
    x, y = _inputs()
    np.savez(os.path.join(tmp, "in.npz"), x=x, y=y)
    ingest([os.path.join(tmp, "in.npz")], path, abs_error=BOUND, batch_size=4, progress=False, overwrite=True)


def _make_npy(path):
    from solar.io_backends.fsspec import write_npy_store

    x, y = _inputs()
    shutil.rmtree(path, ignore_errors=True)
    write_npy_store(path, {"x": x, "meta/y": y}, {"/": {"fields": ["x", "meta/y"], "title": "golden"},
                                                  "x": {"units": "a.u."}}, shard_rows=4)


@pytest.mark.skipif(not os.environ.get("SOLAR_REGEN_GOLDEN"), reason="regenerates fixtures on request only")
def test_regenerate(tmp_path):
    os.makedirs(HERE, exist_ok=True)
    _make_h5(GOLDEN_H5, str(tmp_path))
    _make_npy(GOLDEN_NPY)


def test_golden_solar_h5_still_reads_and_verifies():
    x, y = _inputs()
    with h5py.File(GOLDEN_H5, "r") as f:
        assert f.attrs["solar_format"] == FORMAT and int(f.attrs["num_samples"]) == 6
        assert json.loads(f.attrs["fields"]) == ["x", "y"] and bool(f.attrs["complete"])
        g = f["x"]
        assert g.attrs["codec"].startswith("ebq/") and float(g.attrs["abs_error"]) == BOUND
        np.testing.assert_array_equal(f["y"][:], y)
        assert [int(v) for v in f[checksum_key("y")][:]] == [sample_checksum(r) for r in y]
    n, specs = describe_fields(open_backend(GOLDEN_H5))
    assert n == 6 and [(s.name, s.kind) for s in specs] == [("x", "codec"), ("y", "raw")]
    assert specs[0].sample_shape == (1, 8, 8) and specs[0].dtype == np.float32
    assert verify_file(GOLDEN_H5) == 6
    from solar import codec

    with h5py.File(GOLDEN_H5, "r") as f:
        data, off = f["x/data"][:], f["x/offsets"][:]
    got = np.stack([codec.decode(data[off[i]:off[i + 1]]).numpy() for i in range(6)])
    assert np.abs(got - x).max() <= BOUND


def test_todays_ingest_writes_the_golden_layout(tmp_path):
    """Same inputs today: the same objects, attributes, raw bytes and checksums of raw fields."""
    path = str(tmp_path / "now.h5")
    _make_h5(path, str(tmp_path))
    with h5py.File(GOLDEN_H5, "r") as old, h5py.File(path, "r") as new:
        walk = []
        old.visit(walk.append)
        now = []
        new.visit(now.append)
        assert walk == now
        for key in ("x",):
            assert set(old[key].attrs) == set(new[key].attrs)
        assert set(old.attrs) == set(new.attrs)
        np.testing.assert_array_equal(old["y"][:], new["y"][:])
        np.testing.assert_array_equal(old[checksum_key("y")][:], new[checksum_key("y")][:])


def test_golden_npy_store_reads():
    x, y = _inputs()
    b = open_backend(GOLDEN_NPY)
    assert b.keys() == ["x", "meta/y"] and b.attrs("/")["title"] == "golden" and b.attrs("x")["units"] == "a.u."
    np.testing.assert_array_equal(b.read_ranges("x", [(1, 2), (3, 6)]), np.concatenate([x[1:2], x[3:6]]))
    np.testing.assert_array_equal(b.read_all("meta/y"), y)
    assert sorted(os.listdir(GOLDEN_NPY)) == ["attrs.json", "meta", "x.00000.npy", "x.00001.npy"]
