"""`solar ingest` on 2 real MPI ranks through parallel HDF5: same result as the serial run."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from solar.ingest import ingest, verify_file
from solar.layout import checksum_key

pytestmark = pytest.mark.mpi


def _inputs(comm, d):
    paths = [os.path.join(d, f"p{i}.npy") for i in range(3)]
    if comm.rank == 0:
        rng = np.random.default_rng(7)
        for i, p in enumerate(paths):
            np.save(p, rng.standard_normal((11 + 6 * i, 8, 8)).astype(np.float32))  # compressed: > a blob header
    comm.Barrier()
    return paths


@pytest.mark.parametrize("bound", [None, 0.01], ids=["raw", "compressed"])
def test_parallel_ingest_matches_serial(comm, shared_tmp, bound):
    paths = _inputs(comm, shared_tmp)
    par, ser = os.path.join(shared_tmp, f"par{bound}.h5"), os.path.join(shared_tmp, f"ser{bound}.h5")
    rep = ingest(paths, par, abs_error=bound, batch_size=5, verify=True, progress=False)  # comm auto: world
    assert rep.world_size == comm.size and rep.num_samples == 51
    if comm.rank == 0:
        ingest(paths, ser, abs_error=bound, batch_size=5, comm=None, progress=False)
    comm.Barrier()
    with h5py.File(par, "r") as a, h5py.File(ser, "r") as b:
        # identical stored bytes: same blobs, offsets and checksums whatever the world size
        keys = ["x"] if bound is None else ["x/data", "x/offsets"]
        for k in [*keys, checksum_key("x")]:
            np.testing.assert_array_equal(a[k][:], b[k][:])
    assert verify_file(par, comm=comm) > 0
    comm.Barrier()


def test_resuming_a_serially_started_compressed_ingest_under_mpirun(comm, shared_tmp, monkeypatch):
    """A serial run's OUT.tmp grows its chunked datasets as written, which parallel HDF5 cannot
    extend (MPI_ERR_TYPE on one rank, a hang on the other): the MPI run starts over instead."""
    import faulthandler

    from solar.ingest import journal

    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job instead of blocking CI
    paths = _inputs(comm, shared_tmp)
    out, ref = os.path.join(shared_tmp, "resumed.h5"), os.path.join(shared_tmp, "fresh.h5")
    if comm.rank == 0:
        _die_after_writes(monkeypatch, 12)  # the serial run dies after a few committed batches
        with pytest.raises(KeyboardInterrupt):
            ingest(paths, out, abs_error=0.01, batch_size=5, comm=None, progress=False, commit_interval=0)
        monkeypatch.undo()
        assert journal.read_journal(out + journal.JOURNAL_SUFFIX)["batches_done"] > 0
        ingest(paths, ref, abs_error=0.01, batch_size=5, comm=None, progress=False)
    comm.Barrier()
    rep = ingest(paths, out, abs_error=0.01, batch_size=5, resume=True, progress=False)
    assert rep.world_size == comm.size and rep.resumed_from_batch == 0  # started over
    with h5py.File(out, "r") as a, h5py.File(ref, "r") as b:
        for k in ("x/data", "x/offsets", checksum_key("x")):
            np.testing.assert_array_equal(a[k][:], b[k][:])
    faulthandler.cancel_dump_traceback_later()
    comm.Barrier()


def _die_after_writes(monkeypatch, n: int) -> None:
    """Make ingest raise KeyboardInterrupt (a crash) in its write number ``n + 1``."""
    import solar.ingest.write as si

    calls, real = {"n": 0}, si._write_rows

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(si, "_write_rows", dies)


def test_resume_under_mpirun_sees_an_input_rewritten_with_the_same_size_and_mtime(comm, shared_tmp, monkeypatch):
    """Audit finding (its `mpirun -n 2` case): an input regenerated between the crash and
    `--resume` and copied back with its size and mtime (`cp -p`, `rsync -a`) was resumed into,
    giving old rows followed by new ones. Rank 0 fingerprints the inputs, now with a digest of a
    sample of their bytes, and every rank starts over."""
    import faulthandler

    from solar.ingest import journal

    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job instead of blocking CI
    paths = _inputs(comm, shared_tmp)
    out = os.path.join(shared_tmp, "rewritten.h5")
    _die_after_writes(monkeypatch, 12)  # collective: every rank makes the same calls, so all die at the same one
    with pytest.raises(KeyboardInterrupt):
        ingest(paths, out, batch_size=5, progress=False, commit_interval=0)
    monkeypatch.undo()
    new = None
    if comm.rank == 0:
        assert journal.read_journal(out + journal.JOURNAL_SUFFIX)["batches_done"] > 0
        st = os.stat(paths[0])
        new = -np.load(paths[0])
        np.save(paths[0], new)
        os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    new = comm.bcast(new, root=0)
    rep = ingest(paths, out, batch_size=5, resume=True, progress=False)
    assert rep.world_size == comm.size and rep.resumed_from_batch == 0  # started over
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["x"][:len(new)], new)
    faulthandler.cancel_dump_traceback_later()
    comm.Barrier()


def test_rel_error_beyond_float64_stops_every_rank_before_writing(comm, shared_tmp):
    """Audit finding: under mpirun the overflowing bound (inf) failed inside the write loop, each
    rank aborting the job with exit 1 and a --resume hint that failed the same way. Every rank
    now raises the same InputError from the all-reduced range, before OUT.tmp exists."""
    from solar.errors import InputError

    src, out = os.path.join(shared_tmp, "huge.npy"), os.path.join(shared_tmp, "huge.h5")
    if comm.rank == 0:
        a = np.zeros((10, 64))
        a[1, 0], a[8, 0] = -1.7e308, 1.7e308  # each rank sees one end of the range
        np.save(src, a)
    comm.Barrier()
    with pytest.raises(InputError, match=r"field 'x': --rel-error 1 of its value range \[-1.7e\+308, 1.7e\+308\]"):
        ingest([src], out, rel_error=1.0, batch_size=5, progress=False)
    assert not os.path.exists(out + ".tmp") and not os.path.exists(out + ".ingest.json")
    comm.Barrier()


def test_an_input_replaced_during_the_run_stops_every_rank(comm, shared_tmp, monkeypatch):
    """An input regenerated while the ranks read it (here by rank 0, during its second read):
    rank 0 finds its identity changed before the rename, and every rank raises; no OUT, and the
    next --resume starts over with the new input."""
    import faulthandler

    import solar.ingest.sources as sources
    from solar.errors import InputError

    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job instead of blocking CI
    paths = _inputs(comm, shared_tmp)
    out = os.path.join(shared_tmp, "replaced.h5")
    new = np.ones((11, 8, 8), np.float32)
    if comm.rank == 0:
        real, calls = sources.Source.read, []

        def read(self, name, lo, hi):
            calls.append(lo)
            if len(calls) == 2:
                np.save(paths[0] + ".new.npy", new)
                os.replace(paths[0] + ".new.npy", paths[0])
            return real(self, name, lo, hi)

        monkeypatch.setattr(sources.Source, "read", read)
    with pytest.raises(InputError, match=f"input {paths[0]} changed while this run read it"):
        ingest(paths, out, batch_size=5, progress=False, commit_interval=0)
    monkeypatch.undo()
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    comm.Barrier()
    rep = ingest(paths, out, batch_size=5, resume=True, progress=False)
    assert rep.resumed_from_batch == 0
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["x"][:11], new)
    faulthandler.cancel_dump_traceback_later()
    comm.Barrier()
