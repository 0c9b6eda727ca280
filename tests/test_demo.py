"""`solar demo` end to end on a small configuration: ingest (raw and three bounds), the training runs
under `mpirun -n 2` when it is here, the kill and the resume, `solar-ckpt log`/`diff`, the tables and
the five-panel report."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import matplotlib.image
import numpy as np
import pytest
import torch

from solar.capabilities import h5py_has_mpi
from solar.cli import main
from solar.demo.data import statistics
from solar.demo.model import Surrogate
from solar.synthetic import ptycho_posed_block

LOADERS = ("torch raw", "solar raw", "solar rel 1e-02", "solar rel 1e-03", "solar rel 1e-04")
PANELS = ["epoch time per loader", "hit rate against the bound per epoch", "bytes read from storage",
          "checkpoint bytes per version", "validation loss per bound"]
NUM = r"([-+0-9.e]+)"


def _row(out: str, name: str) -> list[str]:
    """The cells of the loader table's row ``name``."""
    m = re.search(rf"^{re.escape(name)}\s+(.*)$", out, re.M)
    assert m, f"no row {name!r} in the loader table:\n{out}"
    return m.group(1).split()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # the reference decoder: no numba compile in the test's time
        rc = main(["demo", "--samples", "64", "--val-samples", "32", "--size", "16", "--epochs", "2",
                   "--batch-size", "8", "--seeds", "2", "--ckpt-every", "2", "--latency", "1e-4",
                   "--decoder", "reference", "--out", str(out)])
    text = buf.getvalue()
    assert rc == 0, text
    return out, text


def test_the_steps_run_under_mpirun_when_it_is_here(demo):
    out, text = demo
    report = json.load(open(out / "report.json"))
    if shutil.which("mpirun") and h5py_has_mpi():
        assert report["launcher"] == "mpirun -n 2" and "with mpirun -n 2" in text
        assert json.load(open(out / "runs" / "solar_raw.json"))["world"] == 2
    else:
        assert "1 process" in report["launcher"] and "note: 1 process" in text
    assert "read back samples [0, 32, 63]" in text and "MISMATCH" not in text


def test_the_loader_table_has_every_loader_with_wait_and_step_time(demo):
    _, text = demo
    assert re.search(r"loader\s+epoch 0 s\s+epoch s\s+wait s\s+step s\s+hit rate\s+bound\s+MiB read\s+requests", text)
    cells = {name: _row(text, name) for name in LOADERS}
    assert all(len(c) == 9 for c in cells.values()), cells
    assert cells["torch raw"][4:6] == ["-", "-"]  # torch's loader keeps nothing: no hit rate, no bound
    for name in LOADERS[1:]:
        hit, bound = float(cells[name][4]), float(cells[name][5])
        assert bound == 0.5 and hit == bound  # epoch 1 hits the half the buffer pinned: the bound
        assert int(cells[name][7]) < int(cells["torch raw"][7])  # coalesced reads: fewer requests
    for name in LOADERS[2:]:  # compressed files: fewer bytes from storage than the raw one
        assert float(cells[name][6]) < float(cells["solar raw"][6])
    assert float(cells["torch raw"][0]) > 0 and float(cells["solar raw"][2]) >= 0


def test_the_resumed_run_has_the_losses_of_the_uninterrupted_one(demo):
    out, text = demo
    runs = out / "runs"
    whole = json.load(open(runs / "solar_raw.json"))
    resumed = json.load(open(runs / "solar_raw_resumed.json"))
    start = resumed["first_step"]
    assert 0 < start < len(whole["losses"]) and resumed["resumed_from"] == start
    assert start % 2 == 0  # a checkpoint version (--ckpt-every 2)
    assert len(resumed["losses"]) == len(whole["losses"]) - start
    for got, want in zip(resumed["losses"], whole["losses"][start:]):
        assert abs(got - want) <= 1e-6 * abs(want)
    assert not (runs / "solar_raw_killed.json").exists()  # the killed job never finished
    check = json.load(open(out / "report.json"))["resume"]
    assert check["exit_code"] != 0 and check["killed_at"] > start
    assert re.search(rf"resume check: resumed from version {start} \(killed at step {check['killed_at']}\)", text)


def test_epochs_are_numbered_from_0_by_the_loop_the_loader_and_the_checkpoint(demo):
    """The loop's epoch (set_epoch), solar.DataLoader's stats.epoch and the checkpoint's epoch are
    one number, from 0 as torch's set_epoch; the report's table and panels use it too."""
    out, text = demo
    runs = out / "runs"
    for name in ("solar_raw", "solar_rel_1e-02", "torch_raw"):
        epochs = json.load(open(runs / f"{name}.json"))["epochs"]
        assert [e["epoch"] for e in epochs] == [0, 1]
        assert [e["loader_epoch"] for e in epochs] == ([None, None] if name == "torch_raw" else [0, 1])
    resumed = json.load(open(runs / "solar_raw_resumed.json"))
    per_epoch = 64 // resumed["world"] // 8  # steps: --samples 64 over the ranks, --batch-size 8
    first = resumed["first_step"] // per_epoch
    assert [e["epoch"] for e in resumed["epochs"]] == list(range(first, 2))
    assert all(e["loader_epoch"] == e["epoch"] for e in resumed["epochs"])
    assert "epoch 0 s" in text and "mean of epochs >= 1" in text
    own = text[text.index("own statistics, rank 0 (loader.report()"):]
    assert re.search(r"^epoch\s+batches\s+hits\s+misses\s+hit rate\s+bound", own, re.M)
    assert [int(m) for m in re.findall(r"^\s*(\d+)\s+\d+\s+\d+\s+\d+\s+[0-9.]+\s+0\.500", own, re.M)] == [0, 1]


def test_solar_ckpt_log_and_diff_of_two_versions_are_shown(demo):
    _, text = demo
    assert "$ solar-ckpt log" in text and "$ solar-ckpt diff" in text
    assert re.search(r"^changed\s+rank 0/model\.net\.0\.weight", text, re.M)  # the job root, every rank
    assert re.search(r"^job root, all ranks: \d+ versions, ", text, re.M)
    assert re.search(r"^\.\.\. \(\d+ more rows\)", text, re.M) and "changed chunks" in text


def test_the_validation_table_lists_the_three_bounds_and_the_raw_spread(demo):
    out, text = demo
    m = re.search(rf"^raw, 2 seeds\s+x1\.0\s+{NUM}\s+\+- {NUM} \(std; min {NUM}, max {NUM}", text, re.M)
    assert m, text
    mean, std, lo, hi = map(float, m.groups())
    assert lo <= mean <= hi and std > 0
    for bound in ("1e-02", "1e-03", "1e-04"):
        row = re.search(rf"^rel {bound}\s+x{NUM}\s+{NUM}\s+{NUM}%", text, re.M)
        assert row, f"no validation row for {bound}"
        assert float(row.group(1)) > 1 and float(row.group(2)) > 0
    report = json.load(open(out / "report.json"))["validation"]
    assert [r["data"] for r in report["bounds"]] == ["rel 1e-02", "rel 1e-03", "rel 1e-04"]
    assert report["raw"]["seeds"] == 2
    for r in report["bounds"]:  # each bound's verdict against the raw seeds, as printed
        assert re.search(r"^{}: (inside|above|below|worse|better) ".format(r["data"]), text, re.M)
        assert f"{r['data']}: {r['verdict']}" in text
    m = re.search(rf"^mean predictor\s+-\s+{NUM}\s+{NUM}%", text, re.M)
    assert m and float(m.group(1)) == pytest.approx(report["mean_predictor"], rel=1e-3)


def test_report_png_has_the_five_panels(demo):
    out, text = demo
    report = json.load(open(out / "report.json"))
    assert report["panels"] == PANELS  # the titles of the figure's axes, as drawn
    h, w = matplotlib.image.imread(out / "report.png").shape[:2]
    assert [w, h] == report["size_px"]
    assert f"wrote {out / 'report.png'} (5 panels" in text
    ckpt = json.load(open(out / "runs" / "solar_raw.json"))["ckpt"]
    assert [c["step"] for c in ckpt] == list(range(2, 2 * len(ckpt) + 1, 2)) and all(c["bytes_written"] for c in ckpt)


def test_without_mpirun_every_step_runs_in_one_process_and_says_so(tmp_path, capsys, monkeypatch):
    import solar.demo.data as data

    monkeypatch.setattr(data.shutil, "which", lambda name: None)  # as on a machine without OpenMPI
    assert main(["demo", "--samples", "16", "--val-samples", "4", "--size", "8", "--epochs", "0",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: 1 process: mpirun or MPI-enabled h5py not found" in out
    assert re.search(r"^  rel 1e-04 .* on 1 rank\(s\)$", out, re.M) and "match" in out


def test_the_surrogate_learns_the_demos_data_well_below_the_mean_predictor():
    """60 Adam steps on 256 samples (16x16) leave under 0.6 of the mean predictor's validation MSE:
    the demo's quality question compares trained models, not copies of the mean."""
    x, y = ptycho_posed_block(0, 256, 16)
    vx, vy = ptycho_posed_block(256, 320, 16)
    stats = statistics(x, y)
    mean_loss = float(np.mean((vy - stats["y_mean"]) ** 2))
    torch.manual_seed(0)
    model = Surrogate(stats)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    pick = torch.Generator().manual_seed(0)
    for _ in range(60):
        idx = torch.randint(0, len(x), (16,), generator=pick)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        val = float(torch.nn.functional.mse_loss(model(torch.from_numpy(vx)), torch.from_numpy(vy)))
    assert val < 0.6 * mean_loss
