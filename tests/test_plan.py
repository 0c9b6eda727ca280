"""`solar plan`: JSON report, verifiable dumps, plots, bad input."""

from __future__ import annotations

import json
import shutil

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


def _run_plan(capsys, *args):
    rc = main(["plan", "--samples", "10", "--batch-size", "3", "--buffer", "5", *args])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("option, where", [
    ("--dump", "missing/x.json"), ("--dump", "dir/"), ("--dump", "dir"),
    ("--plot", "missing/x.png"), ("--plot", "dir/"),
])
def test_bad_output_paths_are_refused_before_planning(capsys, tmp_path, option, where):
    (tmp_path / "dir").mkdir()
    path = str(tmp_path / where) + ("/" if where.endswith("/") else "")
    rc, out = _run_plan(capsys, option, path)
    assert rc == 2 and out.out == ""
    err = out.err.strip()
    assert "\n" not in err and err.startswith(f"solar plan: {option} ")
    assert ("is a directory" in err) if "dir" in where else ("does not exist" in err and "mkdir -p" in err)


def test_a_failed_write_is_one_line(capsys, tmp_path, monkeypatch):
    import errno

    from solar.cli import plan

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(plan, "write_text_atomic", full)
    rc, out = _run_plan(capsys, "--dump", str(tmp_path / "plan.json"))
    assert rc == 1
    assert out.err.strip() == (f"solar plan: cannot write --dump {tmp_path / 'plan.json'} (No space left on device); "
                               f"check free space and permissions there; {tmp_path / 'plan.json'} was not written")


@pytest.mark.parametrize("args, match", [
    (["--seed", "99999999999999999999"], "seed must be an integer in [-2**63, 2**63-1]"),
    (["--seed", str(-2**63 - 1)], "seed must be an integer"),
    (["--buffer", "99999999999999999999"], "buffer capacity must be at most 2**63-1"),
    (["--samples", "99999999999999999999"], "num_samples must be at most 2**63-1"),
    (["--batch-size", "99999999999999999999"], "batch_size must be at most 2**63-1"),
    (["--world-size", "99999999999999999999"], "world_size must be at most 2**63-1"),
])
def test_out_of_range_numbers_are_config_errors(capsys, args, match):
    rc, out = _run_plan(capsys, *args)
    assert rc == 2 and out.err.strip() == out.err.strip().splitlines()[0]
    assert match in out.err


def test_extreme_int64_seeds_still_plan(capsys):
    from solar.errors import ConfigError
    from solar.schedule import PlanConfig

    for seed in (2**63 - 1, -2**63, -1):
        rc, out = _run_plan(capsys, "--seed", str(seed), "--json")
        assert rc == 0, out.err
    with pytest.raises(ConfigError, match="seed"):
        PlanConfig(10, seed=2**64 - 1)


def test_plan_larger_than_memory_is_refused_before_allocating(capsys, monkeypatch, tmp_path):
    from solar.cli import plan
    from solar.schedule import Planner

    def boom(self, config):
        raise AssertionError("the planner must not be built")

    monkeypatch.setattr(Planner, "__init__", boom)
    rc, out = _run_plan(capsys, "--samples", "100000000000", "--batch-size", "1", "--buffer", "1", "--epochs", "1")
    assert rc == 2 and "GiB of memory" in out.err and "use fewer --samples (N=100000000000)" in out.err
    monkeypatch.setattr(plan, "available_memory", lambda: 2**30)
    rc, out = _run_plan(capsys, "--samples", "10", "--batch-size", "1", "--world-size", str(2**40))
    assert rc == 2 and "use a smaller --world-size" in out.err
    rc, out = _run_plan(capsys, "--samples", "5000000", "--plot", str(tmp_path / "hits.png"))
    assert rc == 2 and "leave out --plot" in out.err and "\n" not in out.err.strip()


def test_plan_that_fits_is_not_refused(capsys, monkeypatch):
    from solar.cli import plan

    monkeypatch.setattr(plan, "available_memory", lambda: None)  # unknown: never refuse
    assert _run_plan(capsys, "--json")[0] == 0
    monkeypatch.setattr(plan, "available_memory", lambda: 2**30)
    assert _run_plan(capsys, "--json")[0] == 0


@pytest.mark.parametrize("epochs", ["0", "-1"])
def test_zero_epochs_is_a_usage_error(capsys, epochs):
    rc, out = _run_plan(capsys, "--epochs", epochs)
    assert rc == 2 and out.err.strip() == f"solar plan: --epochs must be >= 1, got {epochs}"


def test_one_epoch_has_no_hit_rate_to_report(capsys):
    """The reported hit rate is that of epochs >= 1, numbered from 0 as set_epoch; with one epoch there is none."""
    rc, out = _run_plan(capsys, "--epochs", "1", "--json")
    rep = json.loads(out.out)
    assert rc == 0 and rep["hit_rate"] is None and len(rep["epochs"]) == 1
    rc, out = _run_plan(capsys, "--epochs", "1")
    assert rc == 0 and "hit rate (epochs >= 1): n/a" in out.out


@pytest.mark.parametrize("rank", [0, 3])
def test_one_ranks_view_is_its_share_of_the_whole_plan(capsys, rank):
    """--rank R (NOTE [ Sharded planning ]): rank R's batches, hits and misses of each epoch are
    its part of the plan every rank would compute, and the job's hit rate is the same."""
    from solar.schedule import PlanConfig, Planner

    rc, out = _plan(capsys, "--rank", str(rank))
    assert rc == 0, out.err
    view = json.loads(out.out)
    _, whole = _plan(capsys)
    assert view["hit_rate"] == pytest.approx(json.loads(whole.out)["hit_rate"]) and view["rank"] == rank
    planner = Planner(PlanConfig(300, 4, 8, 30, 5))
    for e in view["epochs"]:
        plan = planner.plan(e["epoch"])
        mine = plan.rank == rank
        assert (e["rank_samples"], e["rank_hits"]) == (int(mine.sum()), int(plan.hit[mine].sum()))
    assert view["rank_private_bytes"] > 0


def test_one_ranks_view_of_the_feistel_order_and_bad_ranks(capsys, tmp_path):
    rc, out = _plan(capsys, "--rank", "1", "--order", "feistel", "--plot", str(tmp_path / "r.png"))
    assert rc == 0, out.err
    view = json.loads(out.out)
    assert view["order"] == "feistel" and view["hit_rate"] >= 0.97 * view["bound"]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    for extra, match in ((["--rank", "4"], "outside --world-size 4"), (["--rank", "0", "--dump", str(tmp_path / "d")],
                                                                       "leave out --rank")):
        rc, out = _plan(capsys, *extra)
        assert rc == 2 and match in out.err


def test_one_ranks_view_without_mpirun_is_refused_when_every_share_would_not_fit(capsys, monkeypatch):
    """Without mpirun, --rank plans every rank's share in this process: refused up front when
    that would not fit, as the whole plan is."""
    monkeypatch.setattr("solar.cli.plan.available_memory", lambda: 1 << 30)
    rc = main(["plan", "--samples", "10000000", "--world-size", "4096", "--batch-size", "32", "--buffer", "1220",
               "--rank", "5", "--json"])
    assert rc == 2 and "GiB of memory" in capsys.readouterr().err


def test_one_ranks_view_with_spilled_exchanges_is_the_same(capsys, tmp_path, monkeypatch):
    """From SPILL_FROM samples on, the simulation spills each exchange round to a file in the
    temporary directory: the same view, the files gone afterwards, and --plot still draws."""
    rc, out = _plan(capsys, "--rank", "2")
    assert rc == 0, out.err
    kept = json.loads(out.out)
    monkeypatch.setattr("solar.cli.plan_rank.SPILL_FROM", 100)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rc, out = _plan(capsys, "--rank", "2", "--plot", str(tmp_path / "r.png"))
    assert rc == 0, out.err
    spilled = json.loads(out.out)
    for r in (kept, spilled):
        del r["plan_seconds_per_epoch"], r["rank_private_bytes"]
    assert spilled == kept
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.png"]


def test_one_ranks_view_is_refused_when_its_spilled_exchanges_would_not_fit_on_disk(capsys, monkeypatch):
    monkeypatch.setattr("solar.cli.plan.available_memory", lambda: 1 << 40)
    monkeypatch.setattr("solar.cli.plan.shutil.disk_usage", lambda where: shutil._ntuple_diskusage(1, 1, 1 << 20))
    rc = main(["plan", "--samples", "10000000", "--world-size", "4096", "--batch-size", "32", "--buffer", "1220",
               "--rank", "5", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and "free" in err and "TMPDIR" in err and "mpirun -n 4096" in err


@pytest.mark.parametrize("buffer, extra, capacity", [
    ("500", [], 500), ("0.5", [], 1250),
    ("40KiB", ["--sample-bytes", "64"], 640), ("1MB", ["--sample-bytes", "64"], 2500),
])
def test_buffer_takes_the_loaders_forms(capsys, buffer, extra, capacity):
    """--buffer is samples per rank, a fraction of the dataset over the ranks, or bytes per rank
    with --sample-bytes, counted as solar.DataLoader counts them (capped at a rank's share)."""
    rc = main(["plan", "--samples", "10000", "--world-size", "4", "--batch-size", "8", "--epochs", "2",
               "--buffer", buffer, *extra, "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["buffer"] == capacity


@pytest.mark.parametrize("buffer, match", [
    ("40KiB", "--buffer 40KiB is bytes per rank; give --sample-bytes B"),
    ("1.5", "as a float is a fraction of the dataset and must be in [0, 1]"),
    ("lots", "buffer='lots' is not understood"),
])
def test_buffer_forms_that_cannot_be_planned_are_refused(capsys, buffer, match):
    rc = main(["plan", "--samples", "100", "--batch-size", "4", "--buffer", buffer])
    assert rc == 2 and match in capsys.readouterr().err


def test_plot_and_dump_say_where_they_wrote(capsys, tmp_path):
    png, dump = tmp_path / "hits.png", tmp_path / "plan.json"
    rc = main(["plan", "--samples", "100", "--batch-size", "4", "--buffer", "0.5", "--plot", str(png),
               "--dump", str(dump)])
    err = capsys.readouterr().err
    assert rc == 0 and f"wrote --plot {png}" in err and f"wrote --dump {dump}" in err
