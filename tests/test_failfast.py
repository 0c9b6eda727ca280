"""Fail fast under a real ``mpirun -n 2`` and ``-n 3``: one rank fails at a named point of the
README's training loop (tests/fail_job.py), and the whole job must end non-zero, with the failing
rank and its reason on stderr, and no rank left running (NOTE [ Fail fast ] in
solar/failfast.py). The controls must end with 0: every rank leaving the loop at the same step,
and one rank ending 8 s after the others.

Each case launches its own ``mpirun`` (a nested one under ``make test-mpi``'s ranks is not
reliable), so this file runs in ``make test-unit``, and needs mpirun and parallel h5py.
``HANG_S`` is not a speed bar: a job still running after it has hung (before the fix these
jobs ran until the allocation's wall time).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "fail_job.py")
HANG_S = 45

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    h5py = pytest.importorskip("h5py")
    if not h5py.get_config().mpi:
        pytest.skip("needs h5py built against parallel HDF5 (make setup)")
    from solar.synthetic import write_ptycho_h5

    path = str(tmp_path_factory.mktemp("failfast") / "train.h5")
    write_ptycho_h5(path, 192, size=16, progress=False)
    return path


def _env(token: str) -> dict:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "SOLAR_FAILFAST_TEST": token, "PYTHONFAULTHANDLER": "1"}
    for var in list(env):
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_ess", "OMPI_MCA_orte")) \
                or var in ("SOLAR_EXPECT_WORLD", "MPI_LOCALNRANKS"):
            env.pop(var)
    return env


def _left_running(token: str) -> list[int]:
    """Processes of this case still alive (they carry its token in their environment)."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as fh:
                if f"SOLAR_FAILFAST_TEST={token}".encode() in fh.read():
                    pids.append(int(p))
        except OSError:
            pass
    return pids


def run_job(path: str, point: str, ranks: int, fail_rank: int = 1) -> subprocess.CompletedProcess:
    token = uuid.uuid4().hex
    cmd = ["mpirun", "-n", str(ranks), "--bind-to", "none", sys.executable, JOB, path, point, str(fail_rank)]
    proc = subprocess.Popen(cmd, env=_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        for pid in _left_running(token):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{point} on {ranks} ranks: the job hung (still running after {HANG_S} s)\n{err[-3000:]}")
    left = _left_running(token)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{point} on {ranks} ranks: processes left running after mpirun ended: {left}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


RANKS = [2, 3]

# point -> what stderr must say (besides the failing rank's number)
FAILURES = {
    "before-first-batch": "injected failure on rank {r} before the first batch",
    "mid-epoch": "injected failure on rank {r} in the training loop at step 3",
    "read-ahead": "injected failure on rank {r} in the read-ahead",
    "collective-read": "injected failure on rank {r} inside a collective read",
    "worker": "injected failure on rank {r} in a DataLoader worker",
    "at-exit": "injected failure on rank {r} at the end of the script",
    "exit-mid-epoch": "rank {r} has ended",
    "early-end": "rank {r} has ended",
    "missing-file": "rank {r} on",
}


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("point", sorted(FAILURES))
def test_a_failure_on_one_rank_ends_the_whole_job(data, point, ranks):
    fail_rank = ranks - 1
    res = run_job(data, point, ranks, fail_rank)
    assert res.returncode != 0, f"{point}: the job ended with 0\n{res.stderr[-3000:]}"
    want = FAILURES[point].format(r=fail_rank)
    assert want in res.stderr, f"{point}: stderr lacks {want!r}\n{res.stderr[-4000:]}"
    if point == "missing-file":
        assert "cannot open it" in res.stderr and "every rank must see it" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("point", ["disagree-batch", "disagree-seed"])
def test_ranks_that_disagree_fail_naming_the_ranks_and_values(data, point, ranks):
    res = run_job(data, point, ranks, ranks - 1)
    assert res.returncode != 0, res.stderr[-3000:]
    what = {"disagree-batch": ("batch_size", "16", "8"), "disagree-seed": ("seed", "1", "0")}[point]
    assert "ranks disagree" in res.stderr and all(w in res.stderr for w in what), res.stderr[-4000:]
    assert f"rank {ranks - 1}" in res.stderr, res.stderr[-4000:]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("point", ["none", "break", "slow-end", "persistent-workers"])
def test_jobs_that_end_together_or_late_end_cleanly(data, point, ranks):
    res = run_job(data, point, ranks, 0)
    assert res.returncode == 0, f"{point}: rc {res.returncode}\n{res.stderr[-4000:]}"
    assert res.stdout.count("done") == ranks, res.stdout
    # no h5py teardown noise ("Can't decrement id ref count") from files never closed by the script
    assert "Traceback" not in res.stderr and "MPI_ABORT" not in res.stderr, res.stderr[-4000:]


def test_exit_closes_run_once_in_opening_order_and_a_failing_one_does_not_skip_the_rest(capsys):
    """The exit handler's collective closes (NOTE [ Fail fast ]) keep the order of the opens,
    which is the same on every rank; a backend closed before exit is taken off the list, and a
    backend dropped without close() keeps its place with the close of its parked handles."""
    from solar import failfast

    done = []
    a = failfast.register_exit_close(lambda: done.append("a"))
    b = failfast.register_exit_close(lambda: done.append("b"))
    c = failfast.register_exit_close(lambda: 1 / 0)
    d = failfast.register_exit_close(lambda: done.append("d"))
    failfast.unregister_exit_close(b)
    failfast.replace_exit_close(a, lambda: done.append("a parked"))
    assert a < c < d
    failfast._at_exit()
    assert done == ["a parked", "d"]
    assert "ZeroDivisionError" in capsys.readouterr().err
    failfast._at_exit()  # each close runs once
    assert done == ["a parked", "d"]


def test_an_error_is_agreed_only_when_an_agreement_raised_it():
    from solar.failfast import agreed, is_agreed

    plain = ValueError("a bug on one rank")
    assert not is_agreed(plain)
    assert is_agreed(agreed(IndexError("sample 7 out of range on rank 1")))
