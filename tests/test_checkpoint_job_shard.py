"""Sharded state saved with its global layout (tests/ckpt_shard.py is the job): plain per-rank
``Shard``s and DTensors (row-sharded and replicated, gloo on CPU) saved by ``mpirun -n 2`` load
with ``load_into`` on 2 ranks reading exactly their own shards, on 3 ranks, and in one process,
with equal values.

Each run launches its own ``mpirun``, so this file runs in ``make test-unit``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from solar.checkpoint import Shard, load, load_into
from solar.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "ckpt_shard.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from ckpt_shard import globals_  # noqa: E402  (the global tensors the job shards)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")]


def _run(n: int, mode: str, root: str) -> dict[int, tuple[int, int]]:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    for var in list(env):
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")) or var == "SOLAR_EXPECT_WORLD":
            env.pop(var)
    res = subprocess.run(["mpirun", "-n", str(n), "--bind-to", "none", sys.executable, JOB, mode, root], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    found = {int(r): (int(b), int(o)) for r, b, o in re.findall(r"ok (\d+) (\d+) (\d+)", res.stdout)}
    assert sorted(found) == list(range(n)), res.stdout
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shard") / "job")
    return root, _run(2, "save", root)


def test_on_the_same_world_size_each_rank_reads_exactly_its_own_shards(saved):
    _root, ranks = saved
    assert all(read == own for read, own in ranks.values()), ranks


def test_saved_on_two_ranks_loads_on_three_with_equal_values(saved):
    root, _ = saved
    ranks = _run(3, "load", root)
    # each rank reads about its own share: its shards, rounded out to whole chunks (1 KiB here)
    assert all(read < own + 6 * 2 * 1024 for read, own in ranks.values()), ranks


def test_saved_on_two_ranks_loads_in_one_process_as_whole_tensors(saved):
    root, _ = saved
    want = globals_()
    template = {k: torch.zeros_like(v) for k, v in want.items()}
    got = load_into(root, template)
    assert got.step == 1 and got.tensors == 4
    assert all(template[k].equal(v) for k, v in want.items())
    part = Shard(torch.zeros(3, 100), (8, 600), (2, 250))  # any box of it
    load_into(root, {"w": part})
    assert part.local.equal(want["w"][2:5, 250:350])
    assert load(root, rank=1)["w"].shape == (4, 600)  # each rank's own piece, as saved


def test_a_template_that_does_not_fit_is_refused_naming_the_key(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"key 'w': the template's tensor has shape \[8, 6\]"):
        load_into(root, {"w": torch.zeros(8, 6)})
    with pytest.raises(CheckpointError, match="key 'nope' of the template is not in step 1"):
        load_into(root, {"nope": torch.zeros(3)})


def test_solar_ckpt_restore_writes_the_whole_job_with_shards_reassembled(saved, tmp_path):
    from solar.checkpoint.cli import main

    root, _ = saved
    out = str(tmp_path / "whole.pt")
    assert main(["restore", f"{root}@1", "-o", out]) == 0
    got, want = torch.load(out), globals_()
    assert sorted(got) == sorted(want) and all(got[k].equal(v) for k, v in want.items())
    from safetensors.torch import load_file

    st = str(tmp_path / "x.safetensors")
    assert main(["export", f"{root}@1", "-o", st]) == 0  # the whole job too, shards reassembled
    flat = load_file(st)
    assert sorted(flat) == sorted(want) and all(flat[k].equal(v) for k, v in want.items())
    assert os.stat(st).st_mode == os.stat(out).st_mode  # export writes files with restore's mode
    assert main(["restore", f"{root}@1", "--rank", "1", "-o", out]) == 0
    assert torch.load(out)["w"].equal(want["w"][4:8])


def test_solar_ckpt_export_dcp_writes_a_directory_dcp_loads_and_diff_reads(saved, tmp_path, capsys):
    import json

    import torch.distributed.checkpoint as dcp

    from solar.checkpoint.cli import main

    root, _ = saved
    out = str(tmp_path / "dcp")
    assert main(["export", f"{root}@1", "--format", "dcp", "-o", out]) == 0
    want = globals_()
    template = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(template, checkpoint_id=out, no_dist=True)
    assert all(template[k].equal(v) for k, v in want.items())
    assert main(["export", f"{root}@1", "--format", "dcp", "-o", out]) == 2  # never over an existing one
    capsys.readouterr()
    whole = str(tmp_path / "whole.pt")
    assert main(["restore", f"{root}@1", "-o", whole]) == 0
    capsys.readouterr()
    # the DCP directory's files have the mode restore gives its file
    assert {os.stat(os.path.join(out, f)).st_mode for f in os.listdir(out)} == {os.stat(whole).st_mode}
    assert main(["diff", whole, out, "--json", "--exit-code"]) == 0, capsys.readouterr().out
    assert json.loads(capsys.readouterr().out)["identical"]


def test_solar_ckpt_import_saves_a_dcp_directory_as_a_version(saved, tmp_path):
    from solar.checkpoint.cli import main

    root, _ = saved
    out = str(tmp_path / "dcp")
    assert main(["export", f"{root}@1", "--format", "dcp", "-o", out]) == 0
    assert main(["import", out, str(tmp_path / "ck"), "--step", "7"]) == 0
    got, want = load(tmp_path / "ck", 7), globals_()
    assert all(got[k].equal(v) for k, v in want.items())
    assert main(["import", str(tmp_path), str(tmp_path / "ck2"), "--step", "1"]) == 2  # no .metadata there
