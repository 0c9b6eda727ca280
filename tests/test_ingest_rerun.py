"""`solar ingest` run again without `--resume` after a crash: the batches the crashed run
committed to OUT.tmp are kept and the run is refused, saying what it found and how to go on
(`--resume` continues them, `--overwrite` discards them)."""

from __future__ import annotations

import hashlib
import json
import os
import signal

import h5py
import numpy as np
import pytest

from ingest_helpers import _ranks_after_commits, _crash, _mpirun, _mpirun_env

from solar.errors import InputError
from solar.ingest import ingest


def _inputs(d, sizes=(30, 17)):
    rng = np.random.default_rng(3)
    paths, arrays = [], []
    for i, n in enumerate(sizes):
        a = rng.standard_normal((n, 8, 8)).astype(np.float32)
        p = os.path.join(d, f"part{i}.npy")
        np.save(p, a)
        paths.append(p)
        arrays.append(a)
    return paths, np.concatenate(arrays)


def _state(out):
    """The bytes of OUT.tmp and the journal, to show that a refused run left them alone."""
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (out + ".tmp", out + ".ingest.json")}


def _read_x(path):
    with h5py.File(path, "r") as f:
        return f["x"][:]


def test_rerun_without_resume_keeps_the_committed_batches_and_says_how_to_continue(tmp_path, monkeypatch, capsys):
    from solar.cli import main

    paths, want = _inputs(tmp_path)
    out = str(tmp_path / "o.h5")
    _crash(paths, out, monkeypatch, 20)  # dies in the third batch: two committed
    assert json.load(open(out + ".ingest.json"))["batches_done"] == 2
    before = _state(out)
    says = (f"{out}.tmp holds 2 committed batch(es) (16 samples) of {paths[0]}, {paths[1]} from an earlier run "
            f"that did not finish ({out}.ingest.json); rerun the same command with --resume to continue from "
            "there, or with --overwrite to discard them and start over")
    with pytest.raises(InputError) as err:
        ingest(paths, out, batch_size=8, progress=False)
    assert str(err.value) == says
    assert main(["ingest", *paths, "-o", out, "--no-progress", "--batch-size", "8"]) == 2
    assert capsys.readouterr().err == f"solar ingest: {says}\n"
    assert _state(out) == before and not os.path.exists(out)
    assert not os.path.exists(out + ".ingest.lock")  # a refused run leaves no lock file behind
    rep = ingest(paths, out, batch_size=8, resume=True, verify=True, progress=False)
    assert rep.resumed_from_batch == 2
    np.testing.assert_array_equal(_read_x(out), want)


def test_overwrite_discards_the_committed_batches(tmp_path, monkeypatch):
    paths, want = _inputs(tmp_path)
    out = str(tmp_path / "o.h5")
    _crash(paths, out, monkeypatch, 20)
    rep = ingest(paths, out, batch_size=8, overwrite=True, progress=False)
    assert rep.resumed_from_batch == 0 and rep.num_samples == 47
    np.testing.assert_array_equal(_read_x(out), want)
    assert not os.path.exists(out + ".tmp") and not os.path.exists(out + ".ingest.json")


def test_a_crash_before_the_first_commit_leaves_nothing_to_keep(tmp_path, monkeypatch):
    """OUT.tmp whose journal has no committed batch: a plain rerun starts over, as before."""
    paths, want = _inputs(tmp_path)
    out = str(tmp_path / "o.h5")
    _crash(paths, out, monkeypatch, 3)  # dies in the first batch
    assert os.path.exists(out + ".tmp") and json.load(open(out + ".ingest.json"))["batches_done"] == 0
    ingest(paths, out, batch_size=8, progress=False)
    np.testing.assert_array_equal(_read_x(out), want)


def test_a_journal_of_an_older_version_is_named_without_a_sample_count(tmp_path, monkeypatch):
    """A journal written before it recorded ``samples_done`` (or ``inputs``) still stops the run."""
    paths, _ = _inputs(tmp_path)
    out = str(tmp_path / "o.h5")
    _crash(paths, out, monkeypatch, 20)
    rec = json.load(open(out + ".ingest.json"))
    json.dump({k: v for k, v in rec.items() if k not in ("samples_done", "inputs")}, open(out + ".ingest.json", "w"))
    with pytest.raises(InputError, match=r"^.*o\.h5\.tmp holds 2 committed batch\(es\) from an earlier run .*--resume.*"
                                         r"--overwrite"):
        ingest(paths, out, batch_size=8, progress=False)


@pytest.mark.slow
def test_rerun_without_resume_after_sigkill_under_mpirun_is_refused_on_every_rank(tmp_path):
    """The real case: `mpirun -n 2 solar ingest`, SIGKILL of rank 1 after some commits, then the
    same command again without --resume: exit 2, one line, OUT.tmp and the journal untouched."""
    paths, want = _inputs(tmp_path, sizes=(64, 40))
    out = str(tmp_path / "o.h5")
    env = _mpirun_env()
    args = [*paths, "-o", out, "--batch-size", "8", "--abs-error", "0.01", "--no-progress", "--commit-interval", "0"]

    def mpirun(extra, delay=0.0):  # each batch `delay` s slower, so that the test can act mid-run
        return _mpirun([*args, *extra], env, delay)

    proc = mpirun([], delay=0.25)
    journal = out + ".ingest.json"
    ranks = _ranks_after_commits(proc, journal)
    os.kill(max(ranks), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and not os.path.exists(out)
    rec = json.load(open(journal))
    before = _state(out)
    again = mpirun([])
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("solar ingest: ")]
    assert lines == [f"solar ingest: {out}.tmp holds {rec['batches_done']} committed batch(es) "
                     f"({rec['samples_done']} samples) of {paths[0]}, {paths[1]} from an earlier run that did not "
                     f"finish ({journal}); rerun the same command with --resume to continue from there, or with "
                     "--overwrite to discard them and start over"], stderr
    assert "Traceback" not in stderr and "MPI_ABORT" not in stderr
    assert _state(out) == before and not os.path.exists(out)
    res = mpirun(["--resume", "--json"])
    stdout, stderr = res.communicate(timeout=120)
    assert res.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["resumed_from_batch"] >= rec["batches_done"]


@pytest.mark.mpi
def test_rerun_without_resume_is_refused_alike_on_every_rank(comm, shared_tmp, monkeypatch):
    """Under mpirun rank 0 decides (from OUT.tmp and its journal) and every rank raises the
    same InputError, before any collective write; --overwrite then starts over on every rank."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job instead of blocking CI
    paths = [os.path.join(shared_tmp, f"part{i}.npy") for i in range(2)]
    out = os.path.join(shared_tmp, "o.h5")
    if comm.rank == 0:
        _, want = _inputs(shared_tmp)
        _crash(paths, out, monkeypatch, 20, comm=None)
        before = _state(out)
    comm.Barrier()
    with pytest.raises(InputError) as err:
        ingest(paths, out, batch_size=8, progress=False)
    said = comm.allgather(str(err.value))
    assert len(set(said)) == 1 and said[0].startswith(f"{out}.tmp holds 2 committed batch(es) (16 samples)"), said
    comm.Barrier()
    if comm.rank == 0:
        assert _state(out) == before
    rep = ingest(paths, out, batch_size=8, overwrite=True, progress=False)
    assert rep.resumed_from_batch == 0 and rep.world_size == comm.size
    if comm.rank == 0:
        np.testing.assert_array_equal(_read_x(out), want)
    faulthandler.cancel_dump_traceback_later()
    comm.Barrier()
