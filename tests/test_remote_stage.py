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
from solar.io_backends import fsspec_stage as stage_module
from solar.io_backends.fsspec_stage import DIRECT_MIN, IOV_MAX, StagedFile, _write_all
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


@pytest.mark.parametrize("pieces", ["joined", "as received"])
def test_a_file_replaced_before_it_is_copied_is_refused(remote, tmp_path, pieces):
    """Pieces fetched as ranges of one byte string each, or as the chunks received (the
    backend's own ``_fetch_piece``), are pinned to the version opened alike."""
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
        st = StagedFile(url, size, be._fetch_ranges, _stage_dir(tmp_path), piece=4096, inflight=2,
                        fetch_piece=be._fetch_piece if pieces == "as received" else None)
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


def _served_bytes(remote, tmp_path, name: str, seed: int, gate: threading.Event | None = None):
    """``(bytes, url, fetch)``: 4 MiB of random bytes served as ``name``; ``fetch`` for a
    :class:`StagedFile`, whose requests of a whole ``PIECE_`` (the copy's) wait for ``gate``."""
    local = str(tmp_path / name)
    want = np.random.default_rng(seed).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()
    with open(local, "wb") as f:
        f.write(want)
    url, opts = remote(local)
    fs, path = fsspec.core.url_to_fs(url, **opts)

    def fetch(starts, ends):
        if gate is not None and ends[0] - starts[0] == PIECE_:  # the copy waits until the reads are done
            gate.wait(30)
        return [fs.cat_file(path, start=a, end=b) for a, b in zip(starts, ends)]
    return want, url, fetch


def test_rows_of_a_piece_not_on_its_way_are_read_directly(remote, tmp_path):
    """A read wanting a small part of a piece nobody fetches yet takes its bytes by range (and
    the copy still fetches the piece in its turn); a large part waits for the piece."""
    gate = threading.Event()
    want, url, fetch = _served_bytes(remote, tmp_path, "big.bin", 3, gate)
    st = StagedFile(url, len(want), fetch, _stage_dir(tmp_path), piece=PIECE_, inflight=1, direct_ahead=PIECE_)
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


def test_a_piece_near_the_copy_is_waited_for_not_read_directly(remote, tmp_path):
    """A small part of a piece nobody fetches yet, but near the copy's front (less than
    ``direct_ahead`` past it), is waited for: no direct request."""
    want, url, fetch = _served_bytes(remote, tmp_path, "near.bin", 4)
    st = StagedFile(url, len(want), fetch, _stage_dir(tmp_path), piece=PIECE_, inflight=1, direct_ahead=4 * PIECE_)
    try:
        out = bytearray(300)
        st.read_into([(3 * PIECE_ + 5, 100), (3 * PIECE_ + 1000, 200)], memoryview(out))
        assert bytes(out) == want[3 * PIECE_ + 5:3 * PIECE_ + 105] + want[3 * PIECE_ + 1000:3 * PIECE_ + 1200]
        assert st.direct_requests == 0 and st._done[3]
    finally:
        st.close()


def test_row_views_before_and_after_the_copy_is_complete(remote, tmp_path):
    """``row_views``: rows of pieces far past the copy's front are requested directly (adjacent
    rows as one range), the others wait for their pieces and are views of the copy's map, a row
    across two pieces too; the views keep their bytes after ``close``."""
    gate = threading.Event()
    want, url, fetch = _served_bytes(remote, tmp_path, "rows.bin", 5, gate)
    row = 1000
    st = StagedFile(url, len(want), fetch, _stage_dir(tmp_path), piece=PIECE_, inflight=1, direct_ahead=3 * PIECE_)
    try:
        far = [(3 * PIECE_ + 3000, 2 * row), (3 * PIECE_ + 9000, row)]
        views = st.row_views(far, row, np.dtype(np.uint8), (row,))
        assert [bytes(v) for v in views] == [want[a:a + row] for a in (3 * PIECE_ + 3000, 3 * PIECE_ + 4000,
                                                                          3 * PIECE_ + 9000)]
        assert st.direct_requests == 2 and st.requests == 0
        gate.set()
        near = [(PIECE_ - row // 2, row), (2 * PIECE_, row)]  # (the first across pieces 0 and 1)
        views = st.row_views(near, row, np.dtype(np.uint8), (row,))
        assert st.direct_requests == 2 and st._done[:3].all()
        assert [bytes(v) for v in views] == [want[PIECE_ - row // 2:PIECE_ + row // 2],
                                             want[2 * PIECE_:2 * PIECE_ + row]]
        st._ensure(np.arange(len(st._done)))
        views = st.row_views([(0, 2 * row)], row, np.dtype(np.uint8), (row,))
    finally:
        st.close()
    assert [bytes(v) for v in views] == [want[:row], want[row:2 * row]]


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_mapped_rows_of_a_staged_file_are_h5pys_rows(remote, tmp_path, layout):
    """``mapped_rows`` of a staged file: views of its rows whether the copy is complete or not
    (their values h5py's), none for a dataset read without a stage."""
    local = str(tmp_path / f"{layout}.h5")
    data = _write(local, layout)
    url, opts = remote(local)
    be = open_backend(url, "fsspec", storage_options=opts, stage=_stage_dir(tmp_path))
    plain = open_backend(url, "fsspec", storage_options=opts)
    try:
        for key in ("x", "y"):
            got = be.mapped_rows(key, RANGES)
            want = np.concatenate([data[key][a:b] for a, b in RANGES.tolist()])
            got.check()
            np.testing.assert_array_equal(np.stack(got.views), want, err_msg=key)
            assert plain.mapped_rows(key, RANGES) is None
    finally:
        be.close()
        plain.close()


def test_pieces_received_in_many_chunks_are_written_in_order(tmp_path):
    """A piece arrives as many byte strings (more than one ``pwritev`` takes, some empty): they
    land one after another at the piece's offset."""
    rng = np.random.default_rng(6)
    data = [rng.integers(0, 255, int(n), dtype=np.uint8).tobytes() for n in rng.integers(0, 50, IOV_MAX + 300)]
    path = str(tmp_path / "w.bin")
    with open(path, "wb") as f:
        f.write(b"\xff" * 7)
    fd = os.open(path, os.O_WRONLY)
    try:
        _write_all(fd, data, 7)
    finally:
        os.close(fd)
    assert open(path, "rb").read() == b"\xff" * 7 + b"".join(data)


def test_a_failed_write_is_a_storage_error_and_the_next_read_retries(remote, tmp_path, monkeypatch):
    """A write of the copy that fails (a full disk) reaches the read waiting for it as a
    StorageError saying what to do; the next read fetches and writes the piece again."""
    want, url, fetch = _served_bytes(remote, tmp_path, "full.bin", 7)
    real, failed = stage_module._write_all, []

    def write_once_full(fd, data, at):
        if not failed:
            failed.append(at)
            raise OSError(28, "No space left on device")
        real(fd, data, at)

    monkeypatch.setattr(stage_module, "_write_all", write_once_full)
    st = StagedFile(url, len(want), fetch, _stage_dir(tmp_path), piece=PIECE_, inflight=2)
    try:
        out = bytearray(len(want))
        with pytest.raises(solar.StorageError, match="writing its copy to the stage directory failed.*free space"):
            st.read_into([(0, len(want))], memoryview(out))
        st.read_into([(0, len(want))], memoryview(out))
        assert bytes(out) == want and st.complete and len(failed) == 1
    finally:
        st.close()
