"""Reliability of delta saves (issue 23): SIGKILL a saver at random points, again and again.

As tests/test_checkpoint_crash.py (the harness is tests/ckpt_zygote.py), with ``deltas=True``
and sparse changes between consecutive steps, so the savers write delta objects, re-base chunks
(a small ``max_chain``) and collect chains (``keep_last``) when they are killed. After each
kill the newest committed version must load bit-exact and ``verify`` pass; a full ``gc`` killed
part-way must never leave a kept version without a base it reads. The job writer's counterpart runs under mpirun below.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ckpt_zygote import kill_cycles

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
    from solar.checkpoint.store import CheckpointStore

    ns: dict = {}
    exec(STATE_SRC, ns)
    make_state = ns["make_state"]
    root = tmp_path / "ck"
    with_deltas = []

    def check(cycle: int, last: int | None) -> None:
        if last is not None:
            with_deltas.append(bool(CheckpointStore(root).read_manifest(last).deltas))
            _check(root, make_state, last)

    writer = ("deltas=True, max_chain=rng.choice([1, 2, 4]), keep_last=rng.choice([None, 2, 3]), "
              "pack=rng.random() < 0.5")
    kills, last = kill_cycles(root, STATE_SRC, seed=4321, writer=writer, options="{'deltas': True}",
                              calibrate_saves=2, window=(0.3, 6.0), check=check)
    assert kills >= 50
    assert last > 10 and sum(with_deltas) >= 5, (last, sum(with_deltas))
    print(f"{kills} SIGKILLs, newest step {last}, {sum(with_deltas)} checks on versions that read deltas")


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
