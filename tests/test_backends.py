"""Storage backends: the conformance suite over every registered backend (mpi-hdf5 runs it in
tests/test_backends_mpi.py; fsspec specifics in tests/test_backends_fsspec.py, the hdf5 backend's
direct reads in tests/test_backends_hdf5.py), the registry and the auto rule, throttling."""

from __future__ import annotations

import io
import os

import h5py
import numpy as np
import pytest
from servers import Place

from solar.errors import ConfigError, MissingDependencyError, MPIUnavailableError
from solar.io_backends import choose_backend, open_backend, registry
from solar.io_backends.fsspec import FsspecBackend, write_npy_store
from solar.io_backends.hdf5 import HDF5Backend
from solar.io_backends.throttled import ThrottledBackend
from solar.testing.backends import SAMPLE_ATTRS, BackendTests, sample_arrays, write_h5


def _h5_bytes(arrays, attrs) -> bytes:
    buf = io.BytesIO()
    write_h5(buf, arrays, attrs)
    return buf.getvalue()


class TestHDF5(BackendTests):
    def make_backend(self, arrays, attrs, tmp_path):
        return HDF5Backend(str(write_h5(tmp_path / "c.h5", arrays, attrs)))


class _OverEveryProtocol(BackendTests):
    """Runs the suite once per :data:`servers.PROTOCOLS` entry (the ``place`` fixture)."""

    @pytest.fixture
    def backend(self, arrays, tmp_path, place):
        b = self.make_backend(arrays, SAMPLE_ATTRS, tmp_path, place)
        yield b
        b.close()


class TestFsspecHDF5(_OverEveryProtocol):
    """HDF5 through block-cached fsspec file objects, over file, memory, http (nginx) and s3 (moto)."""

    def make_backend(self, arrays, attrs, tmp_path, place: Place):
        url = place.put_bytes("c.h5", _h5_bytes(arrays, attrs))
        return FsspecBackend(url, storage_options=place.storage_options, block_size=4096)


class TestFsspecNpy(_OverEveryProtocol):
    """``.npy`` stores (sharded, nested keys, attrs.json) read by byte ranges, over every protocol."""

    def make_backend(self, arrays, attrs, tmp_path, place: Place):
        write_npy_store(place.write_url("store"), arrays, attrs, shard_rows=10, **place.write_options)
        return FsspecBackend(place.url("store"), storage_options=place.storage_options)


class TestThrottled(BackendTests):
    def make_backend(self, arrays, attrs, tmp_path):
        inner = HDF5Backend(str(write_h5(tmp_path / "c.h5", arrays, attrs)))
        return ThrottledBackend(inner, bandwidth=5e9, latency=1e-5)


class TestThrottledByName(BackendTests):
    def make_backend(self, arrays, attrs, tmp_path):
        path = str(write_h5(tmp_path / "c.h5", arrays, attrs))
        return open_backend(path, "throttled", inner="fsspec", bandwidth=5e9, block_size=4096)


#: every registered backend -> the conformance class that covers it
COVERED = {"hdf5": TestHDF5, "fsspec": TestFsspecNpy, "throttled": TestThrottled, "mpi-hdf5": "test_backends_mpi.py"}


def test_every_registered_backend_runs_the_conformance_suite():
    missing = set(registry.names()) - set(COVERED)
    assert not missing, f"backends without a conformance test class: {missing}; add one to tests/test_backends.py"
    assert os.path.exists(os.path.join(os.path.dirname(__file__), COVERED["mpi-hdf5"]))


# -- registry and the auto rule ---------------------------------------------------------------------
def test_missing_dependency_names_what_to_install():
    registry.register("needs-missing", "solar_no_such_module.x:Backend", hint="pip install solar-no-such-thing")
    try:
        with pytest.raises(MissingDependencyError, match="pip install solar-no-such-thing"):
            open_backend("/tmp/whatever.h5", "needs-missing")
    finally:
        registry._entries.pop("needs-missing")


def test_mpi_hdf5_outside_mpirun_says_how_to_fix(tmp_path, monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    path = write_h5(tmp_path / "c.h5", sample_arrays())
    with pytest.raises(MPIUnavailableError, match="not running under mpirun.*launch with `mpirun"):
        open_backend(str(path), "mpi-hdf5")
    real = h5py.get_config()

    class SerialBuild:  # what a pip-wheel h5py reports
        mpi = False

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(h5py, "get_config", lambda: SerialBuild())
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(MPIUnavailableError, match="built without MPI support.*parallel HDF5"):
        open_backend(str(path), "mpi-hdf5")


def test_auto_rule(tmp_path, monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    h5 = str(write_h5(tmp_path / "c.h5", sample_arrays()))
    write_npy_store(str(tmp_path / "store"), sample_arrays())
    assert choose_backend(h5) == "hdf5" and choose_backend("file://" + h5) == "hdf5"
    assert choose_backend(str(tmp_path / "store")) == "fsspec"
    assert choose_backend("http://127.0.0.1:1/c.h5") == "fsspec"
    assert choose_backend("s3://bucket/c.h5") == "fsspec"
    assert type(open_backend("file://" + h5)) is HDF5Backend
    b = open_backend(str(tmp_path / "store"))
    assert type(b) is FsspecBackend and b.kind == "npy"


# -- throttled --------------------------------------------------------------------------------------
def test_throttle_model_and_errors(tmp_path):
    path = str(write_h5(tmp_path / "c.h5", sample_arrays()))
    t = ThrottledBackend(HDF5Backend(path), bandwidth=1e6, latency=0.02)
    assert t.delay_for(3, 500_000) == pytest.approx(0.56)
    t.read_ranges("x", [(0, 1), (3, 4), (9, 10)])
    assert t.stats.read_calls == 3 == t.inner.stats.read_calls
    assert t.stats.extra["throttle_sleep_us"] > 0  # three tiny local reads are far faster than 3 x 20 ms
    with pytest.raises(ConfigError, match="bandwidth"):
        ThrottledBackend(HDF5Backend(path), bandwidth=0)
    with pytest.raises(ConfigError, match="latency"):
        ThrottledBackend(HDF5Backend(path), latency=-1)
    with pytest.raises(ConfigError, match="inner"):
        ThrottledBackend(path, inner="throttled")


def test_throttle_charges_each_concurrent_caller_its_own_requests(tmp_path):
    """Four threads reading at once: each call is charged its own ranges, not its neighbours'."""
    from concurrent.futures import ThreadPoolExecutor

    path = str(write_h5(tmp_path / "c.h5", sample_arrays()))
    t = ThrottledBackend(HDF5Backend(path), latency=0.01)
    t.ensure_open()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: t.read_ranges("x", [(i, i + 1), (i + 10, i + 12)]), range(8)))
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o, sample_arrays()["x"][[i, i + 10, i + 11]])
    # 8 calls x 2 requests x 10 ms of modelled latency; the real reads are far faster
    assert t.stats.extra["throttle_sleep_us"] <= 8 * 2 * 10_000


def test_a_fork_while_the_throttles_lock_is_held_leaves_the_child_its_own_lock():
    """The lock that models h5py's is held across the modelled wait: a fork at that moment (a
    DataLoader starting workers) left the child a lock no thread of it would release, and every
    h5py-modelled read there hung (h5py itself re-creates its lock after fork)."""
    import threading

    import solar.io_backends.throttled as thr

    held, release = threading.Event(), threading.Event()

    def hold():
        with thr._SERIAL:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the lock must be free here
            os._exit(0 if thr._SERIAL.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


class _Inner(HDF5Backend):
    """An HDF5 backend that says whether its reads hold h5py's lock (as the tests ask)."""

    def __init__(self, path, serial: bool):
        super().__init__(path)
        self.serial = serial

    def serializes_reads(self, key: str) -> bool:
        return self.serial


@pytest.mark.parametrize("serial", [True, False], ids=["h5py-reads", "direct-reads"])
def test_throttle_serializes_the_waits_of_reads_that_hold_h5pys_lock(tmp_path, monkeypatch, serial):
    """NOTE [ Throttle model ]: reads that hold h5py's lock on real storage (through h5py) take
    turns here too, modelled wait included; reads outside it (direct reads, byte ranges) wait
    side by side. Two threads read at once; the modelled waits meet at a barrier when they may
    overlap, and are counted when they must not."""
    import threading
    import time as _time

    import solar.io_backends.throttled as thr

    path = str(tmp_path / "t.h5")
    write_h5(path, {"x": np.zeros((8, 4), np.float32)})
    b = ThrottledBackend(_Inner(path, serial), latency=0.2)
    meet = threading.Barrier(2, timeout=10)
    state = {"in": 0, "max": 0}
    lock = threading.Lock()
    real_sleep = _time.sleep

    def sleep(s):
        with lock:
            state["in"] += 1
            state["max"] = max(state["max"], state["in"])
        if not serial:
            meet.wait()  # both waits at once, or a BrokenBarrierError
        real_sleep(s)
        with lock:
            state["in"] -= 1

    monkeypatch.setattr(thr.time, "sleep", sleep)
    errors = []

    def read():
        try:
            b.read_ranges("x", [(0, 2)])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert state["max"] == (1 if serial else 2)
    assert b.serializes_reads("x") is serial
    b.close()
