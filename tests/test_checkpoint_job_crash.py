"""Crash safety of the job-wide checkpoint under a real ``mpirun -n 2`` and ``-n 3``
(tests/ckpt_job.py is the job).

* Named crash points: a rank SIGKILLs itself at one point of the commit of step 2, through the
  writer's ``on_commit_point`` hook. Each point has one expected outcome (WiredTiger's and
  JuiceFS's crash tests): killed after its chunks, after its part or before the global manifest,
  step 2 is lost; killed after the global manifest, step 2 is kept. Either way the newest
  committed version loads bit-exactly on every rank, a relaunched job saves on from it, and a
  full ``gc`` leaves no part or chunk no version uses.
* Random kills: a job saves continuously (half the saves asynchronous, ``keep_last`` drawn per
  launch) and the test SIGKILLs one random rank, or every rank, after a random delay, again and
  again: the committed versions never go backwards, and the newest loads bit-exactly for every
  rank (no rank has a version another lacks).

Each case launches its own ``mpirun`` (nested under ``make test-mpi``'s ranks it is not
reliable), so this file runs in ``make test-unit``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from solar.checkpoint import COMMIT_POINTS, gc, list_versions, load
from solar.checkpoint.jobstore import JobStore
from solar.checkpoint.pack import located, pack_key, pack_names, packs_of
from solar.checkpoint.store import CheckpointStore, referenced

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "ckpt_job.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from ckpt_job import make_state  # noqa: E402  (the job's states, to check what was loaded)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")]

#: each point's one outcome for the step being committed
KEPT = {"after-chunks": False, "after-part": False, "before-global": False, "after-global": True}


def _env() -> dict:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    for var in list(env):
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_ess", "OMPI_MCA_orte")) \
                or var in ("SOLAR_EXPECT_WORLD", "MPI_LOCALNRANKS"):
            env.pop(var)
    return env


def _launch(n: int, *args: str) -> subprocess.Popen:
    cmd = ["mpirun", "-n", str(n), "--bind-to", "none", sys.executable, JOB, *args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the job hung after the kill:\n{out}\n{err[-3000:]}") from None


def _check_newest(root: str, n: int) -> int:
    """The newest committed version loads bit-exactly for every rank; every chunk it uses is there."""
    versions = list_versions(root)
    assert versions, "nothing committed"
    last = versions[-1]
    for rank in range(n):
        got, want = load(root, last, rank=rank), make_state(last, rank)
        for key in ("rep", "rep_tied", "own"):
            assert got["model"][key].numpy().tobytes() == want["model"][key].numpy().tobytes(), (last, rank, key)
        assert got["model"]["rep"].data_ptr() == got["model"]["rep_tied"].data_ptr()
        assert got["optim"]["m"].equal(want["optim"]["m"]) and got["note"] == want["note"]
        assert int(got["optim"]["step"]) == last
    return last


def _no_leftovers(root: str) -> None:
    """After a full gc: parts only of committed versions, chunk files and packs only ones they use."""
    gc(root)
    jobs = JobStore(CheckpointStore(root))
    committed = jobs.versions()
    assert sorted(jobs.part_steps()) == committed
    parts = [jobs.part(jm, r) for jm in jobs.valid() for r in range(jm.world_size)]
    live = set().union(*(jobs.referenced(jm) for jm in jobs.valid()))
    assert set(jobs.store.chunk_digests()) == live - set(located(parts))
    assert set(pack_names(jobs.store)) == packs_of(parts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_rank_killed_at_a_named_commit_point_has_one_outcome(tmp_path, point, n):
    root = str(tmp_path / "job")
    victim = 0 if point.endswith("global") else n - 1  # rank 0 alone writes the global manifest
    proc = _launch(n, root, "point", point, str(victim), "2", "4")
    out, err = _finish(proc)
    assert proc.returncode != 0, f"the job was not killed at {point}:\n{out}\n{err[-2000:]}"
    assert "saved 1" in out and "saved 3" not in out
    assert list_versions(root) == ([0, 1, 2] if KEPT[point] else [0, 1]), point
    _check_newest(root, n)
    # a relaunched job (same world size) saves on from the newest committed version
    proc = _launch(n, root, "point", "none", "0", "0", "4")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert list_versions(root) == [0, 1, 2, 3, 4]
    assert _check_newest(root, n) == 4
    _no_leftovers(root)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,cycles", [(2, 25), (3, 25)])
def test_sigkill_of_one_rank_or_the_whole_job_at_random_points_of_many_saves(tmp_path, n, cycles):
    root = str(tmp_path / "job")
    rng = random.Random(n)
    last, saves, kills = -1, 0, 0
    for cycle in range(cycles):
        proc = _launch(n, root, "loop", str(cycle))
        pids: dict[int, int] = {}
        while len(pids) < n:
            line = proc.stdout.readline()
            assert line, f"the job ended before it started: {proc.stderr.read()[-3000:]}"
            pids.update({int(r): int(p) for r, p in re.findall(r"pid (\d+) (\d+)", line)})
        time.sleep(rng.uniform(0.2, 1.5))
        victims = list(pids.values()) if rng.random() < 0.3 else [pids[rng.randrange(n)]]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kills += 1
        out, err = _finish(proc)
        assert proc.returncode != 0
        saves += out.count("saved ")
        if not list_versions(root):
            continue
        newest = _check_newest(root, n)
        assert newest >= last, "the newest committed version went backwards"
        last = newest
    assert kills == cycles
    assert saves >= 50, f"only {saves} saves committed; the kills did not hit many saves"
    _no_leftovers(root)
    _check_newest(root, n)
    print(f"{kills} kills over {saves} committed saves, newest step {last}")


def test_every_chunk_a_kept_version_uses_is_stored(tmp_path):
    """The check _no_leftovers relies on, against a root a single job wrote (no crash)."""
    root = str(tmp_path / "job")
    proc = _launch(2, root, "point", "none", "0", "0", "2")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    jobs = JobStore(CheckpointStore(root))
    for jm in jobs.valid():
        parts = [jobs.part(jm, r) for r in range(2)]
        packed = located(parts)
        assert packed, "the job writer packs its small chunks by default"
        assert all(jobs.store.has_chunk(d) for d in referenced(parts) if d not in packed)
        assert all(jobs.store.tier.exists(pack_key(loc.pack)) for loc in packed.values())
    _no_leftovers(root)
