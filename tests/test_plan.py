"""`solar plan`: JSON report, verifiable dumps, plots, bad input."""

from __future__ import annotations

import json

import pytest
from torch.utils.data import DistributedSampler

from solar.cli import main
from solar.testing.plans import check_dump


def _plan(capsys, *extra):
    rc = main(["plan", "--samples", "300", "--epochs", "3", "--world-size", "4", "--batch-size", "8",
               "--buffer", "30", "--seed", "5", "--json", *extra])
    out = capsys.readouterr()
    return rc, out


@pytest.mark.parametrize("policy", ["solar", "lru", "fifo"])
def test_json_report_and_dump_verify_independently(capsys, tmp_path, policy):
    dump = tmp_path / "plan.json"
    rc, out = _plan(capsys, "--policy", policy, "--dump", str(dump))
    assert rc == 0, out.err
    rep = json.loads(out.out)
    assert set(rep) >= {"hit_rate", "bound", "balanced", "epochs"}
    assert rep["bound"] == pytest.approx(0.4) and rep["balanced"] is True
    assert [e["epoch"] for e in rep["epochs"]] == [0, 1, 2]
    assert rep["hit_rate"] == pytest.approx((rep["epochs"][1]["hit_rate"] + rep["epochs"][2]["hit_rate"]) / 2)
    data = json.loads(dump.read_text())
    stats = check_dump(data, capacity=30, batch_size=8)
    for e, ep in enumerate(data["epochs"]):
        hits = sum(h for step in ep["steps"] for rank in step for _, h in rank)
        assert ep["epoch"] == e and hits == round(rep["epochs"][e]["hit_rate"] * 300)
        samplers = [DistributedSampler(range(300), num_replicas=4, rank=r, seed=5) for r in range(4)]
        for s in samplers:
            s.set_epoch(e)
        per = [list(s) for s in samplers]
        for k, step in enumerate(ep["steps"]):
            assert sorted(i for rank in step for i, _ in rank) == sorted(x for p in per for x in p[k * 8:(k + 1) * 8])
    if policy == "solar":
        assert rep["hit_rate"] >= 0.97 * rep["bound"]
        assert stats["max_kept"] <= 30


def test_plot_and_human_output(capsys, tmp_path):
    png = tmp_path / "hits.png"
    rc = main(["plan", "--samples", "200", "--epochs", "3", "--world-size", "2", "--batch-size", "4",
               "--buffer", "25", "--plot", str(png), "--drop-last"])
    out = capsys.readouterr().out
    assert rc == 0 and "bound min(1, PC/N): 0.2500" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, match", [
    (["--buffer", "-3"], "buffer capacity"),
    (["--batch-size", "400"], "larger than the dataset"),
])
def test_nonsense_is_refused_with_a_reason(capsys, args, match):
    base = {"--samples": "300", "--world-size": "1", "--batch-size": "8", "--buffer": "10"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    rc = main(["plan", *[x for kv in base.items() for x in kv]])
    assert rc == 2 and match in capsys.readouterr().err


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "loader"


def test_golden_plan_is_stable(tmp_path, capsys):
    """The committed dump (solar-plan v1) must be reproduced exactly: a changed schedule would change
    which rank reads what for users resuming or comparing runs across SOLAR versions."""
    dump = tmp_path / "plan.json"
    rc = main(["plan", "--samples", "40", "--epochs", "3", "--world-size", "2", "--batch-size", "4",
               "--buffer", "6", "--seed", "3", "--json", "--dump", str(dump)])
    assert rc == 0
    capsys.readouterr()
    golden = json.loads((FIXTURES / "plan-v1-N40-P2-b4-C6-s3.json").read_text())
    assert json.loads(dump.read_text()) == golden
    assert check_dump(golden, capacity=6, batch_size=4)["hits"] > 0
