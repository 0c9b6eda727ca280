"""``solar-ckpt`` / ``solar ckpt``: log, diff (SOLAR, .pt, .safetensors), show, verify, restore, export, gc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from solar.checkpoint import CheckpointWriter, list_versions, load
from solar.checkpoint.cli import main
from solar.checkpoint.report import fmt_bytes
from solar.checkpoint.store import CheckpointStore, chunk_key

KB = 1024
BIN = os.path.dirname(sys.executable)


@pytest.fixture
def root(tmp_path):
    """Three versions: a sparse change (one chunk of 'w') then a new tensor and a dtype change."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)  # 64 KiB = 16 chunks of 4 KiB
    state = {"model": {"w": w, "b": torch.zeros(16)}, "optim": {"step": 1, "lr": 0.1}}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 10)
        w[0, :3] += 1.0
        state["optim"]["step"] = 2
        wr.save(state, 20)
        state["model"]["extra"] = torch.ones(5)
        state["model"]["b"] = torch.zeros(16, dtype=torch.float64)
        wr.save(state, 30)
    return tmp_path / "ck", state


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_log_json_and_table(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "log", path, "--json")
    data = json.loads(out)
    assert code == 0 and [v["step"] for v in data["versions"]] == [10, 20, 30]
    assert data["versions"][1]["bytes_written"] == 4 * KB and data["versions"][1]["chunks_written"] == 1
    assert data["versions"][1]["dedup_ratio"] > 10
    code, out, _ = run_cli(capsys, "log", path)
    assert "step" in out and "de-duplication" in out and "4.0 KiB" in out


def test_diff_manifest_only(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@20", "--json")
    rep = json.loads(out)
    assert code == 0 and not rep["identical"]
    assert [c["name"] for c in rep["changed"]] == ["model.w"]
    assert rep["changed"][0]["chunks"] == 1 and rep["changed"][0]["bytes"] == 4 * KB
    code, out, _ = run_cli(capsys, "diff", f"{path}@20", f"{path}@30", "--json")
    rep = json.loads(out)
    assert rep["added"] == ["model.extra"]
    assert rep["changed"][0]["name"] == "model.b" and rep["changed"][0]["dtype"] == ["float32", "float64"]
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@10", "--exit-code")
    assert code == 0 and "identical" in out
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@20", "--exit-code")
    assert code == 1 and "model.w" in out and "1/16" in out


def test_diff_values_with_tolerances(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@20", "--values", "--json")
    (chg,) = json.loads(out)["changed"]
    assert chg["changed_elements"] == 3 and chg["max_abs"] == pytest.approx(1.0, abs=1e-6)
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@20", "--values", "--atol", "1.5", "--json")
    assert json.loads(out)["identical"]
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{path}@20", "--values")
    assert "max|Δ|" in out and "3/16384" in out


def test_diff_plain_pt_and_safetensors_files(root, tmp_path, capsys):
    from safetensors.torch import save_file

    path, state = root
    torch.save(state["model"], tmp_path / "model.pt")
    save_file({k: v.clone() for k, v in state["model"].items()}, tmp_path / "model.safetensors")
    # a full checkpoint against a bare model file: matched under the 'model.' prefix, identical
    code, out, _ = run_cli(capsys, "diff", f"{path}@30", tmp_path / "model.safetensors", "--json")
    rep = json.loads(out)
    assert rep["identical"] and rep["prefix"] == ["model.", ""] and rep["unchanged"] == 3
    code, out, _ = run_cli(capsys, "diff", tmp_path / "model.pt", tmp_path / "model.safetensors", "--values", "--json")
    assert json.loads(out)["identical"]
    code, out, _ = run_cli(capsys, "diff", tmp_path / "model.pt", f"{path}@10", "--json")
    rep = json.loads(out)
    assert {c["name"] for c in rep["changed"]} == {"w", "b"} and rep["removed"] == ["extra"]
    code, _out, err = run_cli(capsys, "diff", tmp_path / "missing.pt", f"{path}@10")
    assert code == 2 and "missing.pt" in err


def test_diff_compares_plain_values(tmp_path, capsys):
    """Tensors alone made two versions whose lr, epoch and note differ "identical" (exit 0 with
    --exit-code): plain values are part of a checkpoint and are compared too."""
    from safetensors.torch import save_file

    t = torch.arange(10.0)
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save({"w": t, "lr": 0.1, "epoch": 1, "note": "a", "gone": [1]}, 1)
        wr.save({"w": t, "lr": 0.01, "epoch": 2, "note": "b", "new": None}, 2)
        wr.save({"w": t, "lr": 0.1 + 1e-9, "epoch": 1, "note": "a", "gone": [1]}, 3)
    a, b, c = (f"{tmp_path / 'ck'}@{s}" for s in (1, 2, 3))
    code, out, _ = run_cli(capsys, "diff", a, b, "--exit-code")
    assert code == 1 and out.splitlines()[2] == "tensors identical (1 tensors)"
    assert "lr" in out and "0.01" in out and "epoch" in out and '"b"' in out and "1 added, 1 removed, 3 changed" in out
    code, out, _ = run_cli(capsys, "diff", a, b, "--json")
    rep = json.loads(out)
    assert code == 0 and not rep["identical"] and rep["changed"] == [] and rep["plain"]["compared"]
    assert rep["plain"]["changed"] == [{"name": "lr", "a": 0.1, "b": 0.01}, {"name": "epoch", "a": 1, "b": 2},
                                       {"name": "note", "a": "a", "b": "b"}]
    assert rep["plain"]["added"] == [{"name": "new", "value": None}]
    assert rep["plain"]["removed"] == [{"name": "gone.0", "value": 1}]
    code, out, _ = run_cli(capsys, "diff", a, a, "--exit-code")
    assert code == 0 and "identical (1 tensors, 4 plain values)" in out
    # --values tolerances apply to numbers as to tensor elements
    assert run_cli(capsys, "diff", a, c, "--exit-code")[0] == 1
    code, out, _ = run_cli(capsys, "diff", a, c, "--values", "--atol", "1e-6", "--exit-code")
    assert code == 0 and "identical" in out
    # a plain safetensors file holds tensors only: said so, not every value reported as removed
    save_file({"w": t.clone()}, tmp_path / "w.safetensors")
    code, out, _ = run_cli(capsys, "diff", a, tmp_path / "w.safetensors", "--exit-code")
    assert code == 0 and "plain values not compared" in out and "w.safetensors" in out
    code, out, _ = run_cli(capsys, "diff", tmp_path / "w.safetensors", b, "--json")
    rep = json.loads(out)
    assert rep["identical"] and not rep["plain"]["compared"] and "w.safetensors" in rep["plain"]["note"]
    # one `solar-ckpt export` wrote keeps the skeleton, so its plain values are compared
    assert run_cli(capsys, "export", b, "-o", tmp_path / "e2.safetensors")[0] == 0
    code, out, _ = run_cli(capsys, "diff", tmp_path / "e2.safetensors", b, "--exit-code")
    assert code == 0 and "4 plain values" in out
    code, out, _ = run_cli(capsys, "diff", tmp_path / "e2.safetensors", a, "--exit-code", "--json")
    assert code == 1 and {e["name"] for e in json.loads(out)["plain"]["changed"]} == {"lr", "epoch", "note"}


def test_diff_of_a_restored_pt_holding_numpy_state(tmp_path, capsys):
    """`restore -o F.pt` writes a numpy RNG state back as a pickle, which torch's safe loader refuses:
    diff said so with torch's long multi-line error; now one line naming the file and the way out,
    and --trust-pickle (an explicit opt-in) compares it."""
    import numpy as np

    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save({"model": {"w": torch.ones(4)}, "np_rng": np.random.get_state(), "step": 1}, 1)
    ref, pt = f"{tmp_path / 'ck'}@1", tmp_path / "rd.pt"
    assert run_cli(capsys, "restore", ref, "-o", pt)[0] == 0
    for argv in ((pt, ref), (ref, pt)):
        code, _out, err = run_cli(capsys, "diff", *argv)
        _one_line_error(code, err, pt, "non-tensor objects", "numpy", "ROOT@STEP", "--trust-pickle")
        assert "Weights only load failed" not in err
    code, out, _ = run_cli(capsys, "diff", pt, ref, "--trust-pickle", "--exit-code")
    assert code == 0 and "identical (1 tensors, 6 plain values)" in out
    np.random.seed(1)
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save({"model": {"w": torch.ones(4)}, "np_rng": np.random.get_state(), "step": 2}, 2)
    code, out, _ = run_cli(capsys, "diff", pt, f"{tmp_path / 'ck'}@2", "--trust-pickle", "--json")
    assert {"np_rng.1", "step"} <= {e["name"] for e in json.loads(out)["plain"]["changed"]}


def test_diff_against_a_dcp_checkpoint(root, tmp_path, capsys):
    import warnings

    import torch.distributed.checkpoint as dcp

    path, state = root
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the whole state: its plain values (optim.step, optim.lr) are compared too
        dcp.save({"model": {k: v.clone() for k, v in state["model"].items()}, "optim": dict(state["optim"])},
                 checkpoint_id=str(tmp_path / "dcp"))
    code, out, _ = run_cli(capsys, "diff", tmp_path / "dcp", f"{path}@30", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["identical"] and rep["unchanged"] == 3 and rep["plain"]["unchanged"] == 2
    code, out, _ = run_cli(capsys, "diff", tmp_path / "dcp", f"{path}@10", "--values", "--json")
    rep = json.loads(out)
    assert {c["name"] for c in rep["changed"]} == {"model.w", "model.b"}
    assert rep["plain"]["changed"] == [{"name": "optim.step", "a": 2, "b": 1}]


def test_diff_across_chunk_sizes_rehashes(root, tmp_path, capsys):
    path, state = root
    with CheckpointWriter(tmp_path / "other", chunk_size=16 * KB) as wr:
        wr.save(state, 1)
    code, out, _ = run_cli(capsys, "diff", f"{path}@30", f"{tmp_path / 'other'}@1", "--json")
    rep = json.loads(out)
    assert rep["identical"] and rep["unchanged"] == 3
    code, out, _ = run_cli(capsys, "diff", f"{path}@10", f"{tmp_path / 'other'}@1", "--json")
    (w,) = [c for c in json.loads(out)["changed"] if c["name"] == "model.w"]
    assert w["chunks"] == 1 and w["total_chunks"] == 4  # counted in B's 16 KiB chunks


def test_show(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "show", f"{path}@30")
    assert code == 0 and "model.extra" in out and "float64" in out and "optim.step" in out
    code, out, _ = run_cli(capsys, "show", f"{path}@20", "--json")
    data = json.loads(out)
    assert data["step"] == 20 and data["values"]["optim.step"] == "2"


def test_verify_finds_and_names_corruption(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "verify", path)
    assert code == 0 and "OK" in out
    store = CheckpointStore(path)
    digest = store.read_manifest(20).blob_digests(0)[0].tobytes()  # first chunk of model.w at step 20
    fname = store.tier.path(chunk_key(digest))
    data = bytearray(open(fname, "rb").read())
    data[7] ^= 0x80
    open(fname, "wb").write(bytes(data))
    code, out, _ = run_cli(capsys, "verify", f"{path}@20", "--json")
    rep = json.loads(out)
    assert code == 1 and rep["problems"][0]["chunk"] == digest.hex() and rep["problems"][0]["tensors"] == ["model.w"]
    code, out, _ = run_cli(capsys, "verify", f"{path}@10")
    assert code == 0  # step 10 does not use that chunk
    code, out, _ = run_cli(capsys, "verify", path)
    assert code == 1 and f"CORRUPT chunk {digest.hex()}" in out and "model.w" in out
    code, out, _ = run_cli(capsys, "verify", path, "--repair", "--json")
    assert code == 1 and json.loads(out)["removed_chunks"] == [digest.hex()] and not os.path.exists(fname)


def test_restore_and_export(root, tmp_path, capsys):
    from safetensors import safe_open

    path, state = root
    code, out, _ = run_cli(capsys, "restore", f"{path}@30", "-o", tmp_path / "r.pt")
    assert code == 0
    restored = torch.load(tmp_path / "r.pt", weights_only=True)
    assert torch.equal(restored["model"]["w"], state["model"]["w"]) and restored["optim"] == state["optim"]
    code, out, _ = run_cli(capsys, "export", f"{path}@30", "-o", tmp_path / "r.safetensors")
    assert code == 0
    with safe_open(tmp_path / "r.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["model.b", "model.extra", "model.w"]
        assert torch.equal(f.get_tensor("model.w"), state["model"]["w"])
        assert json.loads(f.metadata()["solar_skeleton"])["optim"] == {"step": 2, "lr": 0.1}
    code, out, _ = run_cli(capsys, "restore", f"{path}@10", "-o", tmp_path / "r10.safetensors")
    assert code == 0 and (tmp_path / "r10.safetensors").exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_export_refuses_an_output_named_for_the_other_format(root, tmp_path, capsys):
    """`export -o model.pt` wrote safetensors bytes into a .pt that torch.load then rejected;
    a name contradicting the format is now refused before anything is written."""
    path, state = root
    ref = f"{path}@30"
    for argv in (("export", ref, "-o", tmp_path / "model.pt"),
                 ("export", ref, "-o", tmp_path / "model.pth", "--format", "safetensors"),
                 ("restore", ref, "-o", tmp_path / "model.pt", "--format", "safetensors")):
        code, _out, err = run_cli(capsys, *argv)
        _one_line_error(code, err, argv[3], "restore")
        assert not argv[3].exists()
    code, _out, err = run_cli(capsys, "restore", ref, "-o", tmp_path / "m.safetensors", "--format", "pt")
    _one_line_error(code, err, tmp_path / "m.safetensors", "--format pt")
    # the advice works: restore picks torch.save from the extension; export --format pt is explicit
    assert run_cli(capsys, "restore", ref, "-o", tmp_path / "model.pt")[0] == 0
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["model"]["w"], state["model"]["w"])
    assert run_cli(capsys, "export", ref, "-o", tmp_path / "e.pt", "--format", "pt")[0] == 0
    assert torch.load(tmp_path / "e.pt", weights_only=True)["optim"] == state["optim"]
    code, out, _ = run_cli(capsys, "export", ref, "-o", tmp_path / "model.data", "--format", "safetensors")
    assert code == 0 and "safetensors" in out
    assert run_cli(capsys, "diff", tmp_path / "model.pt", ref, "--exit-code")[0] == 0


def test_gc(root, capsys):
    path, _ = root
    code, out, _ = run_cli(capsys, "gc", path, "--keep-last", "1", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["removed_versions"] == [10, 20] and list_versions(path) == [10, 20, 30]
    code, out, _ = run_cli(capsys, "gc", path, "--keep-last", "1")
    assert code == 0 and list_versions(path) == [30]
    assert load(path)["model"]["extra"].sum() == 5
    code, _out, err = run_cli(capsys, "gc", path, "--keep-last", "0")
    assert code == 2 and "keep_last" in err


def test_errors_exit_2(tmp_path, capsys):
    code, _out, err = run_cli(capsys, "show", f"{tmp_path}@3")
    assert code == 2 and "no checkpoint step 3" in err


def test_verify_and_gc_refuse_a_directory_that_is_not_a_root(root, tmp_path, capsys):
    """`verify /scratch/run42` meant for `/scratch/run42/ckpt` said "OK: 0 versions" (exit 0, so a
    script gating on it passed), and `gc` there reported success and left a `.lock` behind."""
    from solar.checkpoint import NotACheckpointRootError, gc, verify

    path, _ = root  # tmp_path/ck: the parent is the mistake
    for argv in (["verify", tmp_path], ["verify", tmp_path, "--repair"], ["gc", tmp_path, "--keep-last", "1"],
                 ["log", tmp_path]):
        code, out, err = run_cli(capsys, *argv)
        _one_line_error(code, err, f"{tmp_path} is not a checkpoint root", "neither manifests/ nor chunks/",
                        f"roots below it: {path};")
        assert "OK" not in out
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no .lock left behind
    (tmp_path / ".lock").touch()  # the .lock such a gc of an older version left there
    for argv in (["verify", tmp_path], ["gc", tmp_path, "--keep-last", "1"]):
        code, out, err = run_cli(capsys, *argv)
        _one_line_error(code, err, f"{tmp_path} is not a checkpoint root", "only a .lock file",
                        f"roots below it: {path};")
        assert "OK" not in out and "kept" not in out
    (tmp_path / ".lock").unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    for attempt in (lambda: verify(empty), lambda: gc(empty, keep_last=1)):
        with pytest.raises(NotACheckpointRootError, match=f"find {empty} -maxdepth 3 -type d -name manifests") as info:
            attempt()
        assert isinstance(info.value, FileNotFoundError)
    assert os.listdir(empty) == []
    # a root whose first save has written chunks but no manifest yet: nothing to verify, gc sweeps
    torn = tmp_path / "torn"
    CheckpointStore(torn, create=True).put_chunk(b"\x01" * 16, b"x" * 100)
    code, _out, err = run_cli(capsys, "verify", torn)
    _one_line_error(code, err, "holds no committed version yet")
    code, out, _ = run_cli(capsys, "gc", torn)
    assert code == 0 and "1 unreferenced chunks" in out
    code, out, _ = run_cli(capsys, "verify", path)  # a real root still verifies
    assert code == 0 and "OK: 3 versions" in out


def test_a_truncated_manifest_is_called_damaged_and_log_counts_only_complete_versions(root, capsys):
    """A manifest is committed atomically, so a truncated one is damage, not "a save that did not
    finish"; `log` counted unreadable manifests among its versions."""
    path, _ = root
    good = (path / "manifests" / f"{30:020d}").read_bytes()
    (path / "manifests" / f"{40:020d}").write_bytes(good[:-3])
    code, out, _ = run_cli(capsys, "verify", path)
    assert code == 1 and "manifest of step 40" in out and "is truncated or damaged (no end marker)" in out
    assert "did not finish" not in out
    code, out, _ = run_cli(capsys, "log", path)
    assert code == 0 and "\n3 versions (+1 unreadable manifests), " in out


def test_console_scripts(root):
    path, _ = root
    out = subprocess.run([os.path.join(BIN, "solar-ckpt"), "log", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [v["step"] for v in json.loads(out.stdout)["versions"]] == [10, 20, 30]
    out = subprocess.run([os.path.join(BIN, "solar"), "ckpt", "diff", f"{path}@10", f"{path}@20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "model.w" in out.stdout, out.stderr


# -- bad input and bad output paths: one line naming the file, exit 2 (1 means "differences found") --

def _one_line_error(code, err, *names):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, err


def test_diff_refuses_an_ambiguous_prefix_and_takes_an_explicit_one(tmp_path, capsys):
    """A checkpoint holding a model and its EMA copy (same parameter names) against a bare model
    file: 'model.' and 'ema.' match equally well. The sub-model compared used to depend on set
    order (PYTHONHASHSEED), so the same command said "identical" (exit 0) or differed (exit 1)."""
    from safetensors.torch import save_file

    model = {"w": torch.ones(4), "b": torch.zeros(2)}
    ema = {"w": torch.full((4,), 2.0), "b": torch.zeros(2)}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save({"model": model, "ema": ema, "step": 1}, 1)
    save_file(model, tmp_path / "model.safetensors")
    for a, b in ((f"{tmp_path}/ck@1", tmp_path / "model.safetensors"),
                 (tmp_path / "model.safetensors", f"{tmp_path}/ck")):
        code, _out, err = run_cli(capsys, "diff", a, b, "--exit-code")
        _one_line_error(code, err, "ambiguous prefix", "'ema.'", "'model.'", "--prefix ema.", "--prefix ''")
    code, out, _ = run_cli(capsys, "diff", f"{tmp_path}/ck@1", tmp_path / "model.safetensors", "--exit-code",
                           "--prefix", "model.")
    assert code == 0 and "(tensors under 'model.')" in out and "identical (2 tensors" in out
    code, out, _ = run_cli(capsys, "diff", tmp_path / "model.safetensors", f"{tmp_path}/ck@1", "--exit-code",
                           "--prefix", "ema", "--json")  # the trailing dot is added; found on side b
    rep = json.loads(out)
    assert code == 1 and rep["prefix"] == ["", "ema."] and [c["name"] for c in rep["changed"]] == ["w"]
    code, out, _ = run_cli(capsys, "diff", f"{tmp_path}/ck@1", f"{tmp_path}/ck@1", "--prefix", "", "--json")
    assert code == 0 and json.loads(out)["prefix"] == ["", ""] and json.loads(out)["unchanged"] == 4
    code, _out, err = run_cli(capsys, "diff", f"{tmp_path}/ck@1", tmp_path / "model.safetensors", "--prefix", "optim.")
    _one_line_error(code, err, "prefix 'optim.' matches no tensor")


def test_diff_damaged_safetensors_names_the_file_exit_2(root, tmp_path, capsys):
    from safetensors.torch import save_file

    path, state = root
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"garbage\n")
    save_file({"w": state["model"]["w"].clone()}, tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((tmp_path / "good.safetensors").read_bytes()[:-100])
    for bad in (garbage, truncated):
        code, _out, err = run_cli(capsys, "diff", f"{path}@10", bad, "--exit-code")
        _one_line_error(code, err, bad)
        code, _out, err = run_cli(capsys, "diff", bad, f"{path}@10")
        _one_line_error(code, err, bad)


@pytest.mark.parametrize("output", ["nodir/x.pt", "nodir/x.safetensors", "adir", "adir/"])
@pytest.mark.parametrize("command", ["restore", "export"])
def test_restore_to_a_bad_output_path_exit_2(root, tmp_path, capsys, command, output):
    path, _ = root
    (tmp_path / "adir").mkdir()
    target = os.path.join(tmp_path, output)
    code, _out, err = run_cli(capsys, command, f"{path}@30", "-o", target)
    _one_line_error(code, err, target.rstrip("/"))
    assert not (tmp_path / "nodir").exists() and os.listdir(tmp_path / "adir") == []


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_export_of_a_dtype_safetensors_cannot_store_names_the_tensor(tmp_path, capsys):
    state = {"model": {"c": torch.randn(3, dtype=torch.complex64).to(torch.complex32), "w": torch.ones(2)}}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 1)
    out = tmp_path / "c.safetensors"
    code, _out, err = run_cli(capsys, "export", f"{tmp_path / 'ck'}@1", "-o", out)
    _one_line_error(code, err, out, "'model.c'", "complex32")
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    code, _out, err = run_cli(capsys, "restore", f"{tmp_path / 'ck'}@1", "-o", tmp_path / "c.pt")  # the advice works
    assert code == 0, err
    assert torch.load(tmp_path / "c.pt", weights_only=True)["model"]["c"].dtype == torch.complex32


def test_a_failing_output_write_is_one_line_exit_2(root, tmp_path, capsys, monkeypatch):
    import errno

    path, _ = root

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    code, _out, err = run_cli(capsys, "restore", f"{path}@30", "-o", tmp_path / "r.pt")
    _one_line_error(code, err, tmp_path / "r.pt", "No space left")
    assert os.listdir(tmp_path) == ["ck"]


def test_log_json_is_strict_json_when_a_version_writes_nothing(tmp_path, capsys):
    state = {"w": torch.ones(10)}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 1)
        wr.save(state, 2)  # every chunk de-duplicated: 0 bytes written, an infinite ratio

    def reject(token):
        raise AssertionError(f"invalid JSON token {token}")

    code, out, _ = run_cli(capsys, "log", tmp_path / "ck", "--json")
    data = json.loads(out, parse_constant=reject)
    assert code == 0 and data["versions"][1]["bytes_written"] == 0 and data["versions"][1]["dedup_ratio"] is None
    assert data["versions"][0]["dedup_ratio"] == 1.0
    code, out, _ = run_cli(capsys, "log", tmp_path / "ck")
    assert code == 0 and "inf" in out.splitlines()[2]


def test_diff_json_is_strict_json_when_values_become_inf_or_nan(tmp_path, capsys):
    import json

    from solar.checkpoint import CheckpointWriter

    t = torch.ones(8)
    t[3] = float("nan")
    with CheckpointWriter(tmp_path, chunk_size=4096) as w:
        w.save({"w": torch.ones(8)}, 1, blocking=True)
        w.save({"w": t}, 2, blocking=True)
    main(["diff", f"{tmp_path}@1", f"{tmp_path}@2", "--values", "--json"])
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert out["changed"][0]["max_abs"] is None and out["changed"][0]["changed_elements"] == 1


# -- environment errors: a read-only root; a version removed by a keep_last writer while read --

@pytest.mark.parametrize("err", ["EROFS", "EACCES"])
def test_gc_and_repair_on_a_read_only_root_one_line_exit_2(root, tmp_path, capsys, monkeypatch, err):
    """Used to be a traceback of OSError on ROOT/.lock with exit 1 ("a check failed")."""
    import errno

    path, state = root
    code = getattr(errno, err)
    real_open = os.open

    def read_only_open(p, flags, *args, **kwargs):  # tests run as root, which chmod cannot stop
        if os.path.basename(os.fspath(p)) == ".lock" and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(code, os.strerror(code), os.fspath(p))
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    for argv in (["gc", path, "--keep-last", "1"], ["verify", path, "--repair"]):
        rc, _out, err_text = run_cli(capsys, *argv)
        _one_line_error(rc, err_text, f"checkpoint root {path} is not writable here", os.strerror(code), "write access")
    assert list_versions(path) == [10, 20, 30]
    rc, out, err_text = run_cli(capsys, "verify", path)  # read-only commands still work
    assert rc == 0 and "OK" in out, err_text
    rc, _out, err_text = run_cli(capsys, "restore", f"{path}@30", "-o", tmp_path / "r.pt")
    assert rc == 0, err_text


def test_any_other_os_error_is_one_line_exit_2(root, capsys, monkeypatch):
    import errno

    from solar.checkpoint import collect

    path, _ = root

    def io_error(*_a, **_k):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(collect, "collect", io_error)
    rc, _out, err_text = run_cli(capsys, "gc", path, "--keep-last", "1")
    _one_line_error(rc, err_text, path, "Input/output error")


def test_export_of_the_newest_version_follows_a_keep_last_writer(tmp_path, capsys, monkeypatch):
    """``export ROOT`` (no step) starts over on the new newest version when the writer's retention
    removes the one being exported; ``export ROOT@STEP`` says the step was removed, exit 2."""
    from safetensors.torch import load_file

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"a": torch.randn(2048, generator=g), "b": torch.randn(2048, generator=g)}

    ck = tmp_path / "ck"
    with CheckpointWriter(ck, chunk_size=4 * KB, keep_last=1) as w:
        w.save(state(1), 1, blocking=True)
        original = CheckpointStore.read_chunk_into
        armed = []  # steps to commit at the next chunk read (keep_last=1 then removes the version read)

        def read_chunk_into(self, digest, out):
            if armed:
                step = armed.pop()
                w.save(state(step), step, blocking=True)
            return original(self, digest, out)

        monkeypatch.setattr(CheckpointStore, "read_chunk_into", read_chunk_into)
        out = tmp_path / "x.safetensors"
        armed.append(2)
        rc, text, err = run_cli(capsys, "export", ck, "-o", out)
        assert rc == 0 and "of step 2 to" in text, err
        got = load_file(out)
        assert all(torch.equal(got[k], state(2)[k]) for k in ("a", "b"))
        armed.append(3)
        rc, _text, err = run_cli(capsys, "export", f"{ck}@2", "-o", tmp_path / "y.safetensors")
        _one_line_error(rc, err, f"step 2 of {ck} was removed while it was being read", "keep_last", "[3]")
        assert not (tmp_path / "y.safetensors").exists()


def test_log_after_gc_reports_what_is_stored_not_what_every_save_wrote(tmp_path, capsys):
    """(issue 24) After gc kept the two newest of four versions, the totals are the bytes the root
    holds for them, not the sum of what their saves wrote (those de-duplicated against the removed
    first version, whose chunks the kept ones still use)."""
    from solar.checkpoint import gc

    w = torch.randn(40 * 1024)
    root = tmp_path / "ck"
    with CheckpointWriter(root, chunk_size=4 * KB) as wr:
        for s in range(4):
            w[s * 1024] += 1  # one chunk of 40 changes per save
            wr.save({"w": w}, s)
    before = json.loads(run_cli(capsys, "log", root, "--json")[1])
    gc(root, keep_last=2)
    code, out, _ = run_cli(capsys, "log", root, "--json")
    after = json.loads(out)
    assert code == 0 and [v["step"] for v in after["versions"]] == [2, 3]
    assert after["bytes_written"] == 2 * 4 * KB  # what the two kept saves wrote: their changed chunks
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs if f != ".lock")
    assert after["stored_bytes"] == on_disk and 160 * KB < on_disk < before["stored_bytes"]
    assert after["dedup_ratio"] == after["logical_bytes"] / after["stored_bytes"]
    text = run_cli(capsys, "log", root)[1]
    assert f"2 versions, {fmt_bytes(after['logical_bytes'])} logical, {fmt_bytes(on_disk)} stored (" in text
