"""Resume from a job-wide checkpoint that holds the loader too (tests/ckpt_train.py is the run):
a 2-rank training run killed mid-epoch and restored from its newest version (model, optimizer
and loader, one ``load(..., comm=, loader=)``) produces the same losses, bit for bit, as the
uninterrupted run; restored on 3 ranks, the rest of the epoch trains on the same samples.

Each run launches its own ``mpirun``, so this file runs in ``make test-unit``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from solar.checkpoint import Reader, list_versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tests", "ckpt_train.py")
KILL_AT = 16  # epoch 1, its 4th of 12 steps; the newest version is step 15

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")]


def _run(n: int, *args: str, ok: bool = True) -> None:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    for var in list(env):
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")) or var == "SOLAR_EXPECT_WORLD":
            env.pop(var)
    res = subprocess.run(["mpirun", "-n", str(n), "--bind-to", "none", sys.executable, TRAIN, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert (res.returncode == 0) == ok, res.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    out = {k: str(d / f"{k}.json") for k in ("full", "crash", "resume", "resume3")}
    _run(2, "full", str(d / "full"), out["full"])
    _run(2, "crash", str(d / "crash"), out["crash"], str(KILL_AT), ok=False)
    shutil.copytree(d / "crash", d / "crash3")
    _run(2, "resume", str(d / "crash"), out["resume"])
    _run(3, "resume-rank0", str(d / "crash3"), out["resume3"])
    return {k: json.load(open(v)) for k, v in out.items()}, d


def test_a_run_killed_mid_epoch_resumes_with_the_same_losses_bit_for_bit(runs):
    got, d = runs
    full = {s: loss for s, loss in got["full"]["losses"]}
    assert len(full) == 24
    crashed = got["crash"]["losses"]
    assert [s for s, _ in crashed] == list(range(1, KILL_AT + 1))
    assert all(full[s] == loss for s, loss in crashed)
    resumed = got["resume"]["losses"]
    assert [s for s, _ in resumed] == list(range(KILL_AT, 25)), "resumed from the newest version, step 15"
    assert [loss for _, loss in resumed] == [full[s] for s, _ in resumed]
    assert got["resume"]["samples"] == [e for e in got["full"]["samples"] if e[0] >= KILL_AT]


def test_the_version_holds_every_ranks_loader_state(runs):
    _got, d = runs
    root = str(d / "crash3")
    step = 15
    assert step in list_versions(root)
    for rank in range(2):
        state = Reader(root, step, rank=rank).loader_state()
        assert state["mode"] == "schedule" and state["epoch"] == 1 and state["world_size"] == 2
        assert state["position"] == 3 * 8  # three global batches of 2 x 4 into epoch 1


def test_restored_on_three_ranks_the_rest_of_the_epoch_trains_on_the_same_samples(runs):
    got, _d = runs
    rest = sorted(i for s, e, idx in got["full"]["samples"] if e == 1 and s > 15 for i in idx)
    resumed = [(s, e, idx) for s, e, idx in got["resume3"]["samples"]]
    assert resumed[0][0] == 16
    assert sorted(i for s, e, idx in resumed if e == 1 for i in idx) == rest
    assert all(len(idx) == 12 for s, e, idx in resumed if e == 1)  # global batches of 3 x 4
