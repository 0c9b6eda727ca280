"""NOTE [ Staging a remote file ] in io_backends/fsspec_stage.py: with ``stage=DIR`` an HDF5 file
over http or s3 (real nginx and moto servers on 127.0.0.1) is copied to DIR in pieces while its
rows are read from the copy: the same rows as h5py reads, nothing left in DIR, the version pinned,
and bad settings refused by name."""

from __future__ import annotations

import os
import threading

import fsspec
import h5py
import numpy as np
import pytest

import solar
from solar.io_backends import open_backend
from solar.io_backends.fsspec_stage import DIRECT_MIN, StagedFile
from test_remote_ranges import RANGES, _write, putter


@pytest.fixture(params=["http", "s3"])
def remote(request):
    """``put(local_path) -> (url, storage_options)``."""
    return putter(request, request.param)


PIECE_ = DIRECT_MIN  # pieces of the direct-read test: the smallest read directly


def _stage_dir(tmp_path) -> str:
    d = tmp_path / "stage"
    d.mkdir(exist_ok=True)
    return str(d)


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_staged_rows_are_h5pys_rows_and_leave_nothing_behind(remote, tmp_path, layout):
    local = str(tmp_path / f"{layout}.h5")
    data = _write(local, layout)
    url, opts = remote(local)
    d = _stage_dir(tmp_path)
    be = open_backend(url, "fsspec", storage_options=opts, stage=d)
    try:
        for key in ("x", "y"):
            got = be.read_ranges(key, RANGES)
            np.testing.assert_array_equal(got, np.concatenate([data[key][a:b] for a, b in RANGES.tolist()]))
            assert got.dtype == data[key].dtype
        assert be.stats.extra["stage_requests"] >= 1 and "range_requests" not in be.stats.extra
        assert os.listdir(d) == []  # the copy has no name: nothing to clean up, even after a kill
    finally:
        be.close()
    assert os.listdir(d) == []


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_rows_of_a_complete_copy_go_straight_to_their_places(remote, tmp_path, layout):
    """Once the copy is complete, rows are copied from its map into their batch slots
    (``scatter_ready``), a row place each; before, a read goes through one buffer. Both give
    h5py's rows, through a loader too."""
    local = str(tmp_path / f"{layout}.h5")
    data = _write(local, layout)
    url, opts = remote(local)
    ds = solar.H5Dataset(url, ("x", "y"), backend_options={**opts, "stage": _stage_dir(tmp_path)})
    be = ds.backend
    try:
        got = be.read_ranges("x", RANGES)  # (the copy is under way or done)
        np.testing.assert_array_equal(got, np.concatenate([data["x"][a:b] for a, b in RANGES.tolist()]))
        be._stage._ensure(np.arange(len(be._stage._done)))
        assert be.scatter_ready("x") and be.scatter_ready("y")
        for key in ("x", "y"):
            places = [np.full(data[key].shape[1:], -1, data[key].dtype) for _ in range(int(np.diff(RANGES).sum()))]
            be.read_rows_to(key, RANGES, places)
            want = np.concatenate([data[key][a:b] for a, b in RANGES.tolist()])
            np.testing.assert_array_equal(np.stack(places), want, err_msg=key)
        loader = solar.DataLoader(ds, batch_size=8, shuffle=True, buffer="1KiB")
        where = {int(v): i for i, v in enumerate(data["y"][:, 0])}  # (y's values are distinct)
        for _ in range(2):
            seen = []
            for x, y in loader:
                idx = [where[int(v)] for v in y[:, 0]]
                np.testing.assert_array_equal(x.numpy(), data["x"][idx])
                np.testing.assert_array_equal(y.numpy(), data["y"][idx])
                seen += idx
            assert sorted(seen) == list(range(40))
    finally:
        ds.close()


def test_a_copy_in_small_pieces_is_the_file(remote, tmp_path):
    """Many pieces, fetched by the copying threads and ahead of them for the reads that wait."""
    local = str(tmp_path / "p.h5")
    _write(local, "contiguous")
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts)
    be.ensure_open()
    size = os.path.getsize(local)
    st = StagedFile(url, size, be._fetch_ranges, _stage_dir(tmp_path), piece=1000, inflight=3)
    try:
        want = open(local, "rb").read()
        tail = bytearray(300)
        st.read_into([(size - 300, 300)], memoryview(tail))  # the last piece first
        assert bytes(tail) == want[-300:]
        out = bytearray(size)
        st.read_into([(0, size)], memoryview(out))
        assert bytes(out) == want and st.complete
        assert st.requests == -(-size // 1000)  # each piece fetched once
    finally:
        st.close()
        be.close()


def test_a_file_replaced_before_it_is_copied_is_refused(remote, tmp_path):
    local = str(tmp_path / "r.h5")
    _write(local, "contiguous")
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts)
    be.ensure_open()  # pinned to this version
    try:
        size = os.path.getsize(local)
        with h5py.File(local, "r+") as f:
            f.attrs["changed"] = np.arange(100)  # another version, of another size
        assert remote(local)[0] == url
        st = StagedFile(url, size, be._fetch_ranges, _stage_dir(tmp_path), piece=4096, inflight=2)
        try:
            with pytest.raises(solar.StorageError, match="changed since it was opened") as err:
                st.read_into([(0, 100)], memoryview(bytearray(100)))
            assert url.split("://")[1].split("/")[0] in str(err.value)
            with pytest.raises(solar.StorageError, match="changed since it was opened"):  # and again
                st.read_into([(size - 10, 10)], memoryview(bytearray(10)))
        finally:
            st.close()
    finally:
        be.close()


def test_a_stage_directory_that_cannot_hold_the_file_is_refused(remote, tmp_path):
    local = str(tmp_path / "s.h5")
    _write(local, "contiguous")
    url, opts = remote(local)
    with pytest.raises(solar.ConfigError, match="is not a directory"):
        open_backend(url, "fsspec", storage_options=opts, stage=str(tmp_path / "nowhere")).ensure_open()
    d = _stage_dir(tmp_path)
    with pytest.raises(solar.ConfigError, match="bytes free and the file takes"):
        StagedFile(url, 1 << 62, lambda a, b: [], d)
    assert os.listdir(d) == []


def test_a_missing_object_is_still_not_found(remote, tmp_path):
    local = str(tmp_path / "m.h5")
    _write(local, "contiguous")
    url, opts = remote(local)
    with pytest.raises(FileNotFoundError, match="no such file"):
        open_backend(url + ".gone", "fsspec", storage_options=opts, stage=_stage_dir(tmp_path)).ensure_open()


def test_rows_of_a_piece_not_on_its_way_are_read_directly(remote, tmp_path):
    """A read wanting a small part of a piece nobody fetches yet takes its bytes by range (and
    the copy still fetches the piece in its turn); a large part waits for the piece."""
    local = str(tmp_path / "big.bin")
    want = np.random.default_rng(3).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()
    with open(local, "wb") as f:
        f.write(want)
    url, opts = remote(local)
    gate = threading.Event()
    fs, path = fsspec.core.url_to_fs(url, **opts)

    def fetch(starts, ends):
        if ends[0] - starts[0] == PIECE_:  # the copy's requests wait until the reads are done
            gate.wait(30)
        return [fs.cat_file(path, start=a, end=b) for a, b in zip(starts, ends)]

    st = StagedFile(url, len(want), fetch, _stage_dir(tmp_path), piece=PIECE_, inflight=1)
    try:
        out = bytearray(300)
        st.read_into([(3 * PIECE_ + 5, 100), (3 * PIECE_ + 1000, 200)], memoryview(out))
        assert bytes(out) == want[3 * PIECE_ + 5:3 * PIECE_ + 105] + want[3 * PIECE_ + 1000:3 * PIECE_ + 1200]
        assert st.direct_requests == 2 and st.requests == 0
        gate.set()
        out = bytearray(PIECE_ // 2)  # half of piece 2: waits for it
        st.read_into([(2 * PIECE_, PIECE_ // 2)], memoryview(out))
        assert bytes(out) == want[2 * PIECE_:2 * PIECE_ + PIECE_ // 2] and st.direct_requests == 2
        out = bytearray(len(want))
        st.read_into([(0, len(want))], memoryview(out))
        assert bytes(out) == want and st.complete and st.requests == 4
    finally:
        st.close()
