"""The hdf5 backend's direct reads: NOTE [ Reads outside h5py's lock ] in io_backends/hdf5.py; the
conformance suites are in tests/test_backends.py."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from solar.errors import StorageError
from solar.io_backends.hdf5 import HDF5Backend
from solar.testing.backends import write_h5

# -- NOTE [ Reads outside h5py's lock ] ---------------------------------------------------------
def _layouts(path, userblock=512):
    """A file with one dataset per layout case: (name, array, read directly?)."""
    rng = np.random.default_rng(3)
    cases = [
        ("f32", rng.standard_normal((40, 3, 5)).astype(np.float32), True),
        ("f64_big_endian", rng.standard_normal((40, 2)).astype(">f8"), True),
        ("i16", rng.integers(-300, 300, (40,)).astype(np.int16), True),
        ("c64", (rng.standard_normal((40, 4)) + 1j).astype(np.complex64), True),
        # chunk addresses are counted differently by HDF5 versions when there is a user block
        ("chunked_rows", rng.standard_normal((40, 6)).astype(np.float32), userblock == 0),
        ("chunked_columns", rng.standard_normal((40, 6)).astype(np.float32), False),
        ("gzip", rng.standard_normal((40, 6)).astype(np.float32), False),
        ("compound", np.array([(i, 2.0 * i) for i in range(40)], dtype=[("a", "<i4"), ("b", "<f8")]), False),
        ("bytes", np.array([b"s%d" % i for i in range(40)], dtype="S4"), False),
    ]
    with h5py.File(path, "w", userblock_size=userblock) as f:  # offsets count from the file's start
        for name, a, _ in cases:
            kw = {"chunked_rows": {"chunks": (7, 6)}, "chunked_columns": {"chunks": (7, 3)},
                  "gzip": {"compression": "gzip"}}.get(name, {})
            f.create_dataset(name, data=a, **kw)
        f.create_dataset("unwritten", shape=(40, 2), dtype=np.float32, fillvalue=7.0)  # no storage: fill value
        # resizable like SOLAR's blob fields; chunks 0-1 and 5 written, the others never: fill value
        sparse = f.create_dataset("sparse", shape=(40,), maxshape=(None,), chunks=(6,), dtype=np.uint8, fillvalue=9)
        sparse[0:12] = np.arange(12)
        sparse[30:36] = np.arange(30, 36)
        # a 12-bit integer stored in 16 bits: h5py reads int16, HDF5 sign-extends (bytes differ)
        t12 = h5py.h5t.STD_I16LE.copy()
        t12.set_precision(12)
        h5py.h5d.create(f.id, b"int12", t12, h5py.h5s.create_simple((40,)))
        f["int12"][...] = np.arange(-20, 20, dtype=np.int16)
    want = np.full(40, 9, np.uint8)
    want[0:12], want[30:36] = np.arange(12), np.arange(30, 36)
    extra = [("unwritten", np.full((40, 2), 7.0, np.float32), False),
             ("int12", np.arange(-20, 20, dtype=np.int16), False)]
    if userblock == 0:
        extra.append(("sparse", want, None))
    return cases + extra


@pytest.mark.parametrize("userblock", [0, 512])
def test_contiguous_datasets_are_read_outside_h5py_with_h5pys_bytes(tmp_path, userblock):
    """Unfiltered numeric datasets (contiguous, or chunks of whole rows) are read with preadv at
    their file offsets (big-endian values, a user block before them), giving h5py's bytes for
    any ranges; every other layout or type reads through h5py (chunks too when there is a user
    block: HDF5 versions count chunk addresses differently then), as does every dataset with
    direct_reads=False."""
    path = str(tmp_path / "layouts.h5")
    cases = _layouts(path, userblock)
    ranges = [(0, 3), (5, 6), (9, 17), (39, 40)]
    h5 = HDF5Backend(path, direct_reads=False)
    for direct_reads in (True, False):
        b = HDF5Backend(path, direct_reads=direct_reads)
        for name, a, direct in cases:
            # "sparse": ranges inside written chunks (two chunks back to back, one apart) are
            # read directly; a range touching a never-written chunk reads through h5py
            for rs, direct_here in ([(ranges, direct)] if direct is not None else
                                    [([(1, 3), (4, 12), (31, 35)], True), ([(10, 14)], False), (ranges, False)]):
                before = b.stats.extra.get("direct_reads", 0)
                got = b.read_ranges(name, rs)
                want = h5.read_ranges(name, rs)  # h5py's read_direct: its dtype (byte order), bytes
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, rs)
                assert np.array_equal(got, np.concatenate([a[s:e] for s, e in rs])), (name, rs)
                used = b.stats.extra.get("direct_reads", 0) - before
                assert used == int(direct_here and direct_reads), (name, rs)
            assert b.serializes_reads(name) == (not (direct is not False and direct_reads)), name
        b.close()
    assert "direct_reads" not in h5.stats.extra
    h5.close()


def test_a_contiguous_dataset_cut_by_truncation_raises_on_the_direct_path(tmp_path):
    """A file cut inside a contiguous dataset's bytes raises StorageError naming the file (the
    size check at open: "shrank"); with no size pinned, the rows past the end are named."""
    path = str(tmp_path / "cut.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(4000, dtype=np.float64).reshape(1000, 4)
    b = HDF5Backend(path)
    np.testing.assert_array_equal(b.read_ranges("x", [(998, 1000)])[0], [3992, 3993, 3994, 3995])
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(StorageError, match=r"cut\.h5: the file shrank"):
        b.read_ranges("x", [(990, 1000)])
    b._pinned_size = None  # as if the file had been short already when opened
    with pytest.raises(StorageError, match=r"cut\.h5: 'x' rows 990-999 lie past the end of the file"):
        b.read_ranges("x", [(990, 1000)])
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 2)])[1], [4, 5, 6, 7])  # rows before the cut
    b.close()


def test_datasets_whose_file_bytes_are_not_h5pys_read_through_h5py(tmp_path):
    """An external link's target lives in another file than the one the descriptor reads, and a
    file a writer of this process holds open may have writes in HDF5's caches only: both read
    through h5py (the direct path read the linking file's bytes at the target's offsets)."""
    target, linking = str(tmp_path / "target.h5"), str(tmp_path / "linking.h5")
    a = np.arange(4000, dtype=np.float32).reshape(1000, 4) + 1000
    with h5py.File(target, "w") as f:
        f["x"] = a
    with h5py.File(linking, "w") as f:
        f["pad"] = np.zeros(50_000, np.float64)  # long enough for the target's offsets
        f["x"] = h5py.ExternalLink(target, "x")
    b = HDF5Backend(linking)
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 3), (990, 1000)]), np.r_[a[:3], a[990:]])
    assert b.serializes_reads("x") and "direct_reads" not in b.stats.extra
    b.close()
    with h5py.File(target, "r+") as w:  # a writer in this process, its last write maybe cached
        w["x"][0] = -1
        b = HDF5Backend(target)
        assert b.read_ranges("x", [(0, 1)])[0, 0] == -1
        assert b.serializes_reads("x")
        b.close()
    b = HDF5Backend(target)
    assert not b.serializes_reads("x")  # read-only: direct again
    assert b.read_ranges("x", [(0, 1)])[0, 0] == -1
    b.close()


def test_a_close_during_a_direct_read_leaves_that_read_its_own_file(tmp_path, monkeypatch):
    """close() from another thread while a direct read is in flight (a loop left early, its
    dataset closed under the read-ahead): the read finishes with its own file's bytes. It read
    through the file's descriptor number, which the next opened file reuses: another file's
    bytes, silently."""
    a = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    path, other = str(tmp_path / "a.h5"), str(tmp_path / "other.bin")
    write_h5(path, {"x": a})
    with open(other, "wb") as fh:
        fh.write(b"\xff" * 1_000_000)
    b = HDF5Backend(path, mmap=False)  # (the mapped path: test_a_close_during_a_mapped_read_...)
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 1)]), a[:1])
    real, opened = os.preadv, []

    def preadv(fd, bufs, offset):  # the close lands between the read's start and its syscall
        if not opened:
            b.close()
            opened.extend(os.open(other, os.O_RDONLY) for _ in range(3))  # reuse the freed numbers
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    try:
        np.testing.assert_array_equal(b.read_ranges("x", [(10, 20)]), a[10:20])
    finally:
        for fd in opened:
            os.close(fd)
    monkeypatch.setattr(os, "preadv", real)
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 2)]), a[:2])  # reopens on demand
    b.close()


def test_a_backend_dropped_without_close_releases_its_file():
    """A backend dropped without close() frees its descriptors with its last reference, as
    h5py's handle does: the direct path's private duplicate leaked, and its share of HDF5's file
    lock kept the file from being opened for writing in the same process."""
    import gc
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "dropped.h5")
        write_h5(path, {"x": np.zeros((10, 2), np.float32)})
        b = HDF5Backend(path)
        b.read_ranges("x", [(0, 5)])
        assert b.stats.extra["direct_reads"] == 1
        del b
        gc.collect()
        with h5py.File(path, "a"):  # no lock left behind
            pass


# -- NOTE [ Mapped reads ] ----------------------------------------------------------------------
def test_mapped_reads_give_h5pys_bytes_and_preadv_the_same(tmp_path):
    """With mmap=True every plain-bytes dataset (contiguous, chunks of whole rows, big-endian, a
    1-D field) is copied from the file's map, into one buffer and into row places, and gives
    h5py's bytes; mmap=False reads the same rows with preadv and maps nothing."""
    path = str(tmp_path / "layouts.h5")
    cases = [(n, a) for n, a, direct in _layouts(path, userblock=0) if direct]
    h5 = HDF5Backend(path, direct_reads=False)
    ranges = np.array([(0, 3), (5, 6), (9, 17), (39, 40)])
    for mmap in (True, False):
        b = HDF5Backend(path, mmap=mmap)
        for name, a in cases:
            assert b.mapped(name) is mmap, name
            want = h5.read_ranges(name, ranges)
            assert b.read_ranges(name, ranges).tobytes() == want.tobytes(), (name, mmap)
            places = [np.full(a.shape[1:], 0, a.dtype) for _ in range(len(want))]
            b.read_rows_to(name, ranges, places)
            assert b"".join(p.tobytes() for p in places) == want.tobytes(), (name, mmap)
        assert b.stats.extra.get("mapped_reads", 0) == (2 * len(cases) if mmap else 0)
        assert b.stats.extra["direct_reads"] == 2 * len(cases)
        b.close()
    h5.close()


def test_a_mapped_file_cut_shorter_raises_instead_of_sigbus(tmp_path):
    """A file cut inside a mapped dataset's bytes: the read checks the size first and raises
    StorageError naming the rows (touching the map past the end would kill the process with
    SIGBUS); rows before the cut still read from the map."""
    path = str(tmp_path / "cut.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(40000, dtype=np.float64).reshape(10000, 4)
    b = HDF5Backend(path, mmap=True)
    places = [np.empty(4) for _ in range(2)]
    b.read_rows_to("x", [(9998, 10000)], places)
    np.testing.assert_array_equal(places[1], [39996, 39997, 39998, 39999])
    os.truncate(path, os.path.getsize(path) - 100_000)
    with pytest.raises(StorageError, match=r"cut\.h5: the file shrank"):
        b.read_rows_to("x", [(9998, 10000)], places)
    b._pinned_size = None  # as if the file had been short already when opened
    with pytest.raises(StorageError, match=r"cut\.h5: 'x' rows 9990-9999 lie past the end of the file"):
        b.read_ranges("x", [(9990, 10000)])
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 2)])[1], [4, 5, 6, 7])
    assert b.stats.extra["mapped_reads"] == 2
    b.close()


def test_a_close_during_a_mapped_read_leaves_that_read_its_map(tmp_path, monkeypatch):
    """close() while another thread copies from the map (a loop left early, its dataset closed
    under the read-ahead) does not unmap it under the copy: the map goes with its last reference.
    Backends of one file in one process share one map; a reopened backend maps again."""
    from solar.io_backends.mapped import MappedFile

    a = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    path = str(tmp_path / "a.h5")
    write_h5(path, {"x": a})
    b, clone = HDF5Backend(path, mmap=True), HDF5Backend(path, mmap=True)
    assert b.mapped("x") and clone.mapped("x")
    assert clone._mapping() is b._mapping()  # one map per file and process
    real = MappedFile.file_size

    def file_size(self):  # the close lands between the read's size check and its copy
        b.close()
        clone.close()
        return real(self)

    monkeypatch.setattr(MappedFile, "file_size", file_size)
    np.testing.assert_array_equal(b.read_ranges("x", [(10, 20)]), a[10:20])
    assert "_map" not in b.__dict__
    monkeypatch.setattr(MappedFile, "file_size", real)
    np.testing.assert_array_equal(b.read_ranges("x", [(0, 2)]), a[:2])  # reopens and maps on demand
    b._mapping().drop_pages()  # (unmapped pages come back from the page cache on the next touch)
    np.testing.assert_array_equal(b.read_ranges("x", [(990, 1000)]), a[990:])
    assert b.stats.extra["mapped_reads"] == 3
    b.close()


def test_files_on_network_or_unknown_file_systems_are_not_mapped_by_default(tmp_path):
    """mmap="auto" maps files on local file systems only (the mount table's type); a file system
    that is not known to be local (here /proc's) keeps preadv; a bad option names the file."""
    from solar.errors import ConfigError
    from solar.io_backends.mapped import LOCAL_FS, fs_type, mappable

    assert fs_type("/proc/self/status") == "proc"
    assert not mappable("/proc/self/status", "auto")
    assert mappable("/proc/self/status", True)
    kind = fs_type(str(tmp_path))
    assert mappable(str(tmp_path / "f.h5"), "auto") == (kind in LOCAL_FS)
    with pytest.raises(ConfigError, match=r"f\.h5: backend_options mmap='yes'"):
        mappable(str(tmp_path / "f.h5"), "yes")
