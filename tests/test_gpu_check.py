"""scripts/gpu-check.sh (``make gpu-check``) in its quick mode, on whatever this machine has: without
CUDA that is the CPU fallback, the same steps with CPU figures, marked ``"device": "cpu"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    out = tmp / "results.json"
    outdir = tmp / "OUT"
    outdir.mkdir()
    env = {**os.environ, "SOLAR_GPU_CHECK_QUICK": "1", "SOLAR_GPU_CHECK_OUT": str(out), "OUT": str(outdir),
           "PYTHON": sys.executable, "TMPDIR": str(tmp)}
    env.pop("SOLAR_GPU_CHECK_FORCE_INSTALL", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    return proc, out, outdir


def test_quick_run_writes_the_results(quick_run):
    proc, out, outdir = quick_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for key in ("what", "date", "quick", "device", "device_name", "torch", "python", "packages", "wheels",
                "total_s", "steps", "ok"):
        assert key in res, key
    assert res["quick"] is True and res["ok"] is True
    import torch

    assert res["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert res["torch"] == torch.__version__  # the script never replaces torch
    assert set(res["steps"]) == {"pytest_gpu", "codec", "loader"}
    for step in res["steps"].values():
        assert {"status", "rc", "seconds", "limit_s"} <= set(step)
    assert res["steps"]["pytest_gpu"]["tests"] >= 1
    codec = res["steps"]["codec"]["figures"]
    assert codec["device"] == res["device"] and codec["all_within_bound"]
    assert codec["solar_ebq_zstd"] and codec["solar_ebq_zstd"][0]["dec_MBps"] > 0
    loader = res["steps"]["loader"]["figures"]
    assert loader["device"] == res["device"]
    assert loader["throttled"]["compressed"]["within_bound"]
    # the device tool's $OUT gets the results and the logs
    assert json.loads((outdir / "results.json").read_text()) == res
    assert {"pytest_gpu.log", "codec.log", "loader.log"} <= {p.name for p in outdir.iterdir()}


def test_the_wheels_folder_is_ignored_and_the_makefile_has_the_targets():
    make = (ROOT / "Makefile").read_text()
    assert "gpu-wheels:" in make and "gpu-check:" in make
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu-wheels/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0
