"""The `solar` entry point: --version, info, unknown commands."""

from __future__ import annotations

import json
import subprocess
import sys

import solar
from solar.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"solar {solar.__version__}"


def test_info_json_reports_capabilities(capsys):
    assert main(["info", "--json"]) == 0
    caps = json.loads(capsys.readouterr().out)
    for key in ("torch", "h5py", "h5py_mpi", "world_size", "dali", "cuda_devices", "fsspec_protocols"):
        assert key in caps
    assert caps["world_size"] >= 1
    assert "file" in caps["fsspec_protocols"] and "memory" in caps["fsspec_protocols"]


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "solar.cli", "info"], capture_output=True, text=True, check=True).stdout
    assert "h5py_mpi" in out and "torch" in out


def test_unknown_command_fails():
    try:
        rc = main(["frobnicate"])
    except SystemExit as exc:
        rc = exc.code
    assert rc != 0


def test_demo_writes_and_reads_back(tmp_path, capsys):
    rc = main(["demo", "--samples", "24", "--size", "16", "--out", str(tmp_path), "--ranks", "1", "--epochs", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "match" in out and "MISMATCH" not in out
    assert (tmp_path / "ptycho.h5").exists()
    assert not (tmp_path / "ptycho.h5.tmp").exists()


def test_bench_lists_and_rejects_unknown(capsys):
    from solar.cli import bench

    names = bench.available()
    assert {"loader", "codec", "checkpoint"} <= set(names)
    assert main(["bench", "no-such-bench"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_info_names_the_mpi_library_without_initializing_mpi_here(capsys):
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return
    assert main(["info", "--json"]) == 0
    lib = json.loads(capsys.readouterr().out)["mpi_library"]
    assert lib and "\x00" not in lib and "MPI" in lib
    mpi_mod = sys.modules.get("mpi4py.MPI")
    assert mpi_mod is None or not mpi_mod.Is_initialized()


def test_bench_without_a_name_reports_only_the_name(capsys):
    try:
        rc = main(["bench"])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines()[-1] == "solar bench: error: the following arguments are required: name"


def test_demo_refuses_bad_arguments_in_one_line_before_writing(tmp_path, capsys):
    """They were tracebacks with exit 1, some only after the dataset was written (--buffer 5)."""
    import pytest

    for argv, says in ((["--samples", "0"], "--samples: must be >= 1"),
                       (["--batch-size", "0"], "--batch-size: must be >= 1"),
                       (["--buffer", "5"], "--buffer: is a fraction of the dataset"),
                       (["--size", "x"], "expected a number")):
        with pytest.raises(SystemExit) as info:
            main(["demo", "--out", str(tmp_path / "d"), "--no-progress", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "Traceback" not in err
        assert not (tmp_path / "d").exists()


def test_solar_errors_from_a_command_are_one_line_with_exit_code_2(tmp_path, capsys, monkeypatch):
    import solar.cli.demo as demo

    def boom(args):
        raise solar.ConfigError("buffer=5.0 is not a fraction; pass 0..1")

    monkeypatch.setattr(demo, "run", boom)
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip() == "solar demo: buffer=5.0 is not a fraction; pass 0..1"


def test_bench_writes_a_relative_out_where_the_caller_runs_it(tmp_path, monkeypatch):
    """The benchmark runs in the checkout's root, its JSON lands in the caller's directory."""
    from solar.cli import bench

    monkeypatch.chdir(tmp_path)
    assert bench._here(["--samples", "8", "--out", "r.json", "--out=s.json", "--out", "/abs/t.json"]) == [
        "--samples", "8", "--out", str(tmp_path / "r.json"), f"--out={tmp_path / 's.json'}", "--out", "/abs/t.json"]
    assert main(["bench", "plan", "--samples", "4096", "--epochs", "2", "--out", "mine.json"]) == 0
    assert (tmp_path / "mine.json").is_file()
    assert not (bench.bench_dir().parent / "mine.json").exists()
