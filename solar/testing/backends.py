"""The storage-backend conformance suite, shipped so outside backends can run it too.

A backend passes when a subclass of :class:`BackendTests` that says how to store arrays for it
passes::

    from solar.testing.backends import BackendTests, write_h5

    class TestMyBackend(BackendTests):
        def make_backend(self, arrays, attrs, tmp_path):
            path = write_h5(tmp_path / "c.h5", arrays, attrs)
            return MyBackend(str(path))

The suite checks the contract of :class:`solar.io_backends.Backend`: row ranges (empty, one row,
many, adjacent, random), errors (unsorted or overlapping -> ``ValueError``, past the end ->
``IndexError``, unknown key -> ``KeyError``, wrong ``out`` -> ``ValueError``), reading into
``out=``, metadata, statistics, pickling, and reopening in a forked child. Collective backends
(parallel HDF5) run it under ``mpirun`` with every rank calling every test; they skip the fork
test (MPI does not survive fork) and read on rank-dependent ranges so a rank with nothing to read
still joins the collective call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from typing import Any

import numpy as np
import pytest

from solar.dist import get_dist_info
from solar.io_backends import Backend

__all__ = ["BackendTests", "write_h5", "sample_arrays", "SAMPLE_ATTRS"]

N_ROWS = 37
SAMPLE_ATTRS = {"/": {"title": "conformance", "n": N_ROWS}, "x": {"units": "counts"}}


def sample_arrays(n: int = N_ROWS) -> dict[str, np.ndarray]:
    """The arrays every conformance test reads: three dtypes, nested key, 0-d rows included."""
    return {
        "x": np.arange(n * 12, dtype=np.float32).reshape(n, 3, 4) / 7,
        "y": np.arange(n, dtype=np.int64) * -3,
        "grp/z": (np.arange(n * 5) % 251).astype(np.uint8).reshape(n, 5),
    }


def write_h5(path, arrays: dict[str, np.ndarray], attrs: dict[str, dict[str, Any]] | None = None):
    """Write ``arrays`` (key -> array, ``/`` for groups) and ``attrs`` to an HDF5 file; returns path."""
    import h5py  # heavy; only the suites that write HDF5 files need it

    with h5py.File(path, "w") as f:
        for key, a in arrays.items():
            f.create_dataset(key, data=a)
        for key, values in (attrs or {}).items():
            obj = f if key == "/" else f[key]
            for k, v in values.items():
                obj.attrs[k] = v
    return path


def _read_in_child(backend: Backend, key: str, ranges, queue) -> None:  # pragma: no cover - child
    try:
        queue.put(("ok", backend.read_ranges(key, ranges), os.getpid()))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", repr(exc), os.getpid()))


class BackendTests:
    """Conformance tests; subclasses implement :meth:`make_backend`."""

    def make_backend(self, arrays: dict[str, np.ndarray], attrs: dict[str, dict[str, Any]], tmp_path) -> Backend:
        """Store ``arrays`` and ``attrs`` for this backend and return an (unopened) backend on them."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_backend(arrays, attrs, tmp_path)")

    # -- fixtures ----------------------------------------------------------------------------------
    @pytest.fixture
    def arrays(self) -> dict[str, np.ndarray]:
        return sample_arrays()

    @pytest.fixture
    def backend(self, arrays, tmp_path):
        b = self.make_backend(arrays, SAMPLE_ATTRS, tmp_path)
        yield b
        b.close()

    def mine(self, backend: Backend, ranges):
        """``ranges`` for this rank; on a collective backend only rank 0 reads, the others pass []."""
        if backend.collective:
            if get_dist_info().rank != 0:
                return []
        return ranges

    @staticmethod
    def expect(a: np.ndarray, ranges) -> np.ndarray:
        parts = [a[s:e] for s, e in ranges]
        return np.concatenate(parts) if parts else a[:0]

    def check(self, backend: Backend, arrays, key: str, ranges) -> np.ndarray:
        ranges = self.mine(backend, ranges)
        got = backend.read_ranges(key, ranges)
        want = self.expect(arrays[key], ranges)
        assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
        np.testing.assert_array_equal(got, want)
        return got

    # -- metadata ----------------------------------------------------------------------------------
    def test_keys(self, backend, arrays):
        assert set(arrays) <= set(backend.keys())

    def test_info(self, backend, arrays):
        for key, a in arrays.items():
            info = backend.info(key)
            assert info.shape == a.shape and info.dtype == a.dtype
            assert info.row_nbytes == a[0].nbytes

    def test_attrs(self, backend):
        root = backend.attrs("/")
        assert root["title"] == "conformance" and int(root["n"]) == N_ROWS
        assert backend.attrs("x")["units"] == "counts"

    def test_unknown_key(self, backend):
        with pytest.raises(KeyError, match="nope"):
            backend.info("nope")

    # -- reads -------------------------------------------------------------------------------------
    def test_read_empty(self, backend, arrays):
        got = backend.read_ranges("x", [])
        assert got.shape == (0, 3, 4) and got.dtype == np.float32

    def test_read_one_row(self, backend, arrays):
        self.check(backend, arrays, "x", [(5, 6)])
        self.check(backend, arrays, "y", [(N_ROWS - 1, N_ROWS)])

    def test_read_many_ranges(self, backend, arrays):
        ranges = [(0, 2), (2, 3), (7, 11), (20, 21), (30, N_ROWS)]  # includes adjacent ranges
        for key in arrays:
            self.check(backend, arrays, key, ranges)

    def test_read_all(self, backend, arrays):
        np.testing.assert_array_equal(backend.read_all("grp/z"), arrays["grp/z"])

    def test_random_ranges(self, backend, arrays):
        rng = np.random.default_rng(1234)
        for _ in range(20):
            cuts = np.sort(rng.choice(np.arange(N_ROWS + 1), size=2 * int(rng.integers(1, 6)), replace=False))
            ranges = cuts.reshape(-1, 2).tolist()
            self.check(backend, arrays, str(rng.choice(list(arrays))), ranges)

    def test_read_into_out(self, backend, arrays):
        ranges = self.mine(backend, [(3, 5), (9, 10)])
        n = sum(e - s for s, e in ranges)
        out = np.full((n, 3, 4), -1, np.float32)
        got = backend.read_ranges("x", ranges, out=out)
        assert got is out
        np.testing.assert_array_equal(out, self.expect(arrays["x"], ranges))

    def test_read_fields_into_buffers(self, backend, arrays):
        ranges = self.mine(backend, [(0, 2), (30, 33)])
        n = sum(e - s for s, e in ranges)
        xbuf = np.zeros((n, 3, 4), np.float32)
        got = backend.read_fields(["x", "y"], ranges, out={"x": xbuf})
        assert got["x"] is xbuf and list(got) == ["x", "y"]
        for key in ("x", "y"):
            np.testing.assert_array_equal(got[key], self.expect(arrays[key], ranges))

    def test_out_of_wrong_shape_or_dtype(self, backend):
        with pytest.raises(ValueError, match="out has shape"):
            backend.read_ranges("x", [(0, 2)], out=np.empty((3, 3, 4), np.float32))
        with pytest.raises(ValueError, match="out has shape"):
            backend.read_ranges("x", [(0, 2)], out=np.empty((2, 3, 4), np.float64))
        with pytest.raises(ValueError, match="not C-contiguous"):  # every backend alike
            backend.read_ranges("x", [(0, 2)], out=np.empty((2, 3, 8), np.float32)[:, :, ::2])

    def test_unsorted_or_overlapping_ranges(self, backend):
        with pytest.raises(ValueError, match="sorted"):
            backend.read_ranges("x", [(5, 7), (1, 2)])
        with pytest.raises(ValueError, match="sorted"):
            backend.read_ranges("x", [(1, 5), (4, 7)])
        with pytest.raises(ValueError, match="stop > start"):
            backend.read_ranges("x", [(3, 3)])

    def test_out_of_range(self, backend):
        with pytest.raises(IndexError, match="out of range"):
            backend.read_ranges("x", [(N_ROWS - 1, N_ROWS + 1)])
        for bad in ([(-3, -1)], [(-2, 1)]):  # not Python's from-the-end rows: an error
            with pytest.raises(IndexError, match="no negative rows"):
                backend.read_ranges("x", bad)

    # -- statistics --------------------------------------------------------------------------------
    def test_stats(self, backend, arrays):
        backend.ensure_open()
        backend.stats.reset()
        ranges = self.mine(backend, [(0, 4), (10, 12), (20, 21)])
        backend.read_ranges("x", ranges)
        rows = sum(e - s for s, e in ranges)
        assert backend.stats.rows_read == rows
        assert backend.stats.bytes_read == rows * arrays["x"][0].nbytes
        if backend.collective:
            assert backend.stats.read_calls == 1  # one collective call, even with nothing to read
        else:
            assert 1 <= backend.stats.read_calls <= len(ranges)
        assert backend.stats.as_dict()["rows_read"] == rows

    # -- processes ---------------------------------------------------------------------------------
    def test_pickle_roundtrip(self, backend, arrays):
        self.check(backend, arrays, "x", [(1, 3)])  # opened before pickling
        clone = pickle.loads(pickle.dumps(backend))
        try:
            assert clone.stats.read_calls == 0
            self.check(clone, arrays, "x", [(4, 9)])
            assert clone.keys() == backend.keys()
        finally:
            clone.close()

    def test_reopens_after_fork(self, backend, arrays):
        # collective backends too: a child reads through a serial handle (NOTE [ mpi-hdf5 in a
        # child process ] in io_backends/mpi_hdf5.py), as a torch DataLoader worker does
        self.check(backend, arrays, "x", [(0, 1)])  # open in the parent first
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=_read_in_child, args=(backend, "x", [(2, 6), (8, 9)], queue))
        proc.start()
        status, payload, pid = queue.get(timeout=60)
        proc.join(60)
        assert status == "ok", f"child failed: {payload}"
        assert pid != os.getpid()
        np.testing.assert_array_equal(payload, self.expect(arrays["x"], [(2, 6), (8, 9)]))
        self.check(backend, arrays, "x", [(10, 12)])  # the parent's handle still works
