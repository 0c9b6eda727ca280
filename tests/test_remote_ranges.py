"""NOTE [ Remote rows by byte ranges ] in io_backends/fsspec.py: HDF5 rows over http and s3 (real
nginx and moto servers on 127.0.0.1) are read as byte ranges when their layout allows, with the same
rows as h5py reads, and through h5py otherwise."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

import solar
from solar.io_backends import open_backend

RANGES = np.array([[0, 3], [5, 6], [9, 17], [30, 40]])


def _write(path: str, layout: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    data = {"x": rng.random((40, 3, 5), dtype=np.float32), "y": rng.integers(0, 1 << 30, (40, 2)).astype(">i8")}
    kw = {"contiguous": {}, "chunked": {"chunks": (4, 3, 5)}, "filtered": {"chunks": (4, 3, 5), "compression": "gzip"}}
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data["x"], **kw[layout])
        f.create_dataset("y", data=data["y"], **({} if layout == "contiguous" else {"chunks": (8, 2)}),
                         **({"compression": "gzip"} if layout == "filtered" else {}))
    return data


def putter(request, protocol: str):
    """``put(local_path) -> (url, storage_options)`` on the ``protocol`` server of the session."""
    if protocol == "http":
        root, base = request.getfixturevalue("http_root")

        def put(local: str):
            name = f"{os.getpid()}-{os.path.basename(local)}"
            shutil.copy(local, os.path.join(root, name))
            os.chmod(os.path.join(root, name), 0o644)
            return f"{base}/{name}", {}
    else:
        bucket, opts = request.getfixturevalue("s3_root")
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)

        def put(local: str):
            url = f"{bucket}/{os.getpid()}-{os.path.basename(local)}"
            fs.put_file(local, url)
            return url, opts
    return put


@pytest.fixture(params=["http", "s3"])
def remote(request, tmp_path):
    """``put(local_path) -> (url, storage_options)``."""
    return putter(request, request.param)


def test_reads_under_a_block_use_the_block_cache(remote, tmp_path):
    local = str(tmp_path / "s.h5")
    data = _write(local, "contiguous")
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts)  # block_size 1 MiB: more than the file
    try:
        np.testing.assert_array_equal(be.read_ranges("x", RANGES), np.concatenate([data["x"][a:b] for a, b in RANGES]))
        assert "range_requests" not in be.stats.extra
    finally:
        be.close()


@pytest.mark.parametrize("layout", ["contiguous", "chunked", "filtered"])
def test_rows_read_by_byte_ranges_are_h5pys_rows(remote, tmp_path, layout):
    local = str(tmp_path / f"{layout}.h5")
    data = _write(local, layout)
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts, block_size=256)  # (smaller reads: h5py's block cache)
    try:
        for key in ("x", "y"):
            got = be.read_ranges(key, RANGES)
            want = np.concatenate([data[key][a:b] for a, b in RANGES.tolist()])
            np.testing.assert_array_equal(got, want)
            assert got.dtype == data[key].dtype
        direct = layout != "filtered"
        assert (be.stats.extra.get("range_requests", 0) > 0) == direct
    finally:
        be.close()


def test_direct_reads_false_reads_through_h5py(remote, tmp_path):
    local = str(tmp_path / "c.h5")
    data = _write(local, "contiguous")
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts, direct_reads=False, block_size=256)
    try:
        np.testing.assert_array_equal(be.read_ranges("x", RANGES[:1]), data["x"][:3])
        assert "range_requests" not in be.stats.extra
    finally:
        be.close()


@pytest.mark.parametrize("stage", [False, True], ids=["ranges", "staged"])
def test_a_loader_over_a_remote_file_gives_the_local_files_batches(remote, tmp_path, stage):
    """By byte ranges, and from a staged copy (NOTE [ Staging a remote file ])."""
    local = str(tmp_path / "l.h5")
    _write(local, "chunked")
    url, opts = remote(local)
    batches = []
    remote_options = {"storage_options": opts, "block_size": 256}
    if stage:
        os.makedirs(tmp_path / "stage")
        remote_options["stage"] = str(tmp_path / "stage")
    for path, bo in ((local, None), (url, remote_options)):
        ds = solar.H5Dataset(path, ("x", "y"), backend_options=bo)
        loader = solar.DataLoader(ds, batch_size=6, shuffle=True, distributed=True, buffer=10)
        try:
            batches.append([[t.clone() for t in b] for e in range(2) for b in loader])
        finally:
            ds.close()
    assert len(batches[0]) == len(batches[1]) > 0
    for a, b in zip(*batches):
        for ta, tb in zip(a, b):
            assert ta.dtype == tb.dtype and bool((ta == tb).all())


def test_a_file_replaced_after_the_open_is_refused(remote, tmp_path):
    local = str(tmp_path / "r.h5")
    _write(local, "contiguous")
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts, block_size=256)
    try:
        be.read_ranges("x", RANGES[:1])
        with h5py.File(local, "r+") as f:
            f.attrs["changed"] = np.arange(100)  # another version, of another size
        url2, _ = remote(local)
        assert url2 == url
        with pytest.raises(solar.StorageError, match=url.split("://")[1].split("/")[0]):
            be.read_ranges("x", RANGES)
    finally:
        be.close()
