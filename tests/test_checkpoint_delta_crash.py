"""Reliability of delta saves (issue 23): SIGKILL a saver at random points, again and again.

As tests/test_checkpoint_crash.py, with ``deltas=True`` and sparse changes between consecutive
steps, so the savers write delta objects, re-base chunks (a small ``max_chain``) and collect chains
(``keep_last``) when they are killed. After each kill the newest committed version must load
bit-exact and ``verify`` pass; a full ``gc`` killed part-way must never leave a kept version
without a base it reads. The job writer's counterpart runs under mpirun below.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

STATE_SRC = '''
import torch

def make_state(step):
    """A function of the step alone; consecutive steps differ in about 1% of w's elements."""
    w = (torch.arange(64 * 1024, dtype=torch.float32) / 1000).to(torch.bfloat16)
    n = w.numel()
    for s in (step, step // 3, step // 7):  # a few overlapping, step-dependent patterns
        w[(s * 7919) % 211::211] += 0.25 * (1 + s % 5)
    emb = torch.zeros(256, 64, dtype=torch.bfloat16)
    emb[step % 256] = step
    return {"model": {"w": w, "w_tied": w, "emb": emb}, "step": step}
'''

ZYGOTE_SRC = '''
import os, random, signal, sys, time
from solar.checkpoint import CheckpointWriter, gc, list_versions
root = sys.argv[1]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        with CheckpointWriter(root + "-calibrate", chunk_size=16 * 1024, deltas=True) as w:
            w.save(make_state(0), 0)
            w.save(make_state(1), 1)
    finally:
        os._exit(0)
os.waitpid(pid, 0)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
print("ready", time.perf_counter() - t0, flush=True)
for line in sys.stdin:
    job, seed = line.split()
    seed = int(seed)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            rng = random.Random(seed)
            if job == "gc":
                gc(root, keep_last=rng.choice([1, 2]))
                os._exit(0)
            writer = CheckpointWriter(root, chunk_size=16 * 1024, deltas=True, max_chain=rng.choice([1, 2, 4]),
                                      keep_last=rng.choice([None, 2, 3]), pack=rng.random() < 0.5)
            versions = list_versions(root)
            step = versions[-1] + 1 if versions else 0
            while True:
                writer.save(make_state(step), step, blocking=rng.random() < 0.5)
                step += 1
        except BaseException as exc:
            print("saver failed:", repr(exc), file=sys.stderr, flush=True)
            code = 1
        finally:
            os._exit(code)
    print(pid, flush=True)
'''


def _gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.005)
    raise AssertionError(f"saver {pid} did not die after SIGKILL")


def _check(root, make_state, last: int) -> None:
    import torch

    from solar.checkpoint import load, verify

    got = load(root)
    want = make_state(last)
    for key in ("w", "w_tied", "emb"):
        assert got["model"][key].view(torch.int16).numpy().tobytes() == \
            want["model"][key].view(torch.int16).numpy().tobytes(), (last, key)
    assert got["model"]["w"].data_ptr() == got["model"]["w_tied"].data_ptr() and got["step"] == last
    rep = verify(root)
    assert rep.ok, rep.problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_while_saving_deltas_never_loses_the_last_committed_version(tmp_path):
    from solar.checkpoint import list_versions
    from solar.checkpoint.store import CheckpointStore

    ns: dict = {}
    exec(STATE_SRC, ns)
    make_state = ns["make_state"]
    root = tmp_path / "ck"
    zygote = subprocess.Popen([sys.executable, "-c", STATE_SRC + ZYGOTE_SRC, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    rng = random.Random(4321)
    kills, last, with_deltas = 0, -1, 0
    try:
        ready, save_s = zygote.stdout.readline().split()
        assert ready == "ready"
        save_window = max(0.3, 6 * float(save_s))
        for cycle in range(60):
            job = "gc" if cycle % 6 == 5 else "save"
            zygote.stdin.write(f"{job} {cycle}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.0, save_window if job == "save" else 0.02))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                assert job == "gc", f"saver {pid} exited before it was killed (its error is on stderr)"
                continue
            kills += 1
            _gone(pid)
            versions = list_versions(root)
            if not versions:
                continue
            assert versions[-1] >= last, "the newest committed version disappeared"
            last = versions[-1]
            with_deltas += bool(CheckpointStore(root).read_manifest(last).deltas)
            _check(root, make_state, last)
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    assert kills >= 50
    assert last > 10 and with_deltas >= 5, (last, with_deltas)
    print(f"{kills} SIGKILLs, newest step {last}, {with_deltas} checks on versions that read deltas")


SCRIPT = '''
import os, signal, sys
from mpi4py import MPI
sys.path.insert(0, sys.argv[4])
from test_checkpoint_delta_job import CHUNK, state
from solar.checkpoint import CheckpointWriter
comm = MPI.COMM_WORLD
root, point, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])

def hook(name, step):
    if name == point and step == 3 and comm.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)

with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, deltas=True, on_commit_point=hook) as w:
    for s in range(5):
        w.save(state(s, comm.rank), s, blocking=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["after-chunks", "after-part", "before-global", "after-global"])
def test_a_delta_save_killed_at_a_commit_point_keeps_the_last_committed_version(tmp_path, point):
    """Run from one process (not under mpirun itself): a 2-rank job one of whose ranks dies at ``point`` of step 3."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    root = str(tmp_path / "root")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    rank = "0" if point.endswith("global") else "1"  # rank 0 alone reaches the global manifest's points
    subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, str(script), root, point, rank,
                    os.path.dirname(__file__)], env=env, timeout=300, capture_output=True)
    from test_checkpoint_delta_job import same, state

    from solar.checkpoint import list_versions, load, verify

    want = 3 if point == "after-global" else 2
    assert list_versions(root) == list(range(want + 1))

    for r in (0, 1):
        assert same(load(root, want, rank=r), state(want, r))
    assert verify(root).ok
