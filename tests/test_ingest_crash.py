"""`solar ingest` failing for real: SIGKILL of one rank of `mpirun -n 2 solar ingest` then
`--resume`, storage failures and unusable inputs (serially and under mpirun, exit codes), and
a second run to the same output while the first still writes."""

from __future__ import annotations

import json
import os
import signal
import time

import h5py
import numpy as np
import pytest

from ingest_helpers import _ranks_after_commits, _mpirun, _mpirun_env, _npy_inputs, _read_field

from solar.errors import InputError
from solar.ingest import ingest, verify_file
from solar.layout import describe_fields


def _slowed_ingest(tmp_path):
    """`mpirun -n 2 solar ingest` of two .npy inputs, slowed and committing every batch, started:
    (expected rows, output, journal, its arguments, environment, process)."""
    paths, want = _npy_inputs(tmp_path, sizes=(64, 40), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    env = _mpirun_env()
    args = [*paths, "-o", out, "--batch-size", "8", "--abs-error", "0.01", "--no-progress", "--commit-interval", "0"]
    return want, out, out + ".ingest.json", args, env, _mpirun(args, env)


@pytest.mark.slow
def test_sigkill_one_rank_then_resume_under_mpirun(tmp_path):
    """The real thing: `mpirun -n 2 solar ingest`, SIGKILL of rank 1 mid-run, `--resume --verify`."""
    want, out, journal, args, env, proc = _slowed_ingest(tmp_path)
    ranks = _ranks_after_commits(proc, journal)
    os.kill(max(ranks), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not os.path.exists(out), "a killed run must not leave the output"
    assert os.path.exists(out + ".tmp")
    killed_at = json.load(open(journal))["batches_done"]
    assert 3 <= killed_at < 13
    res = _mpirun([*args, "--resume", "--verify", "--json"], env, delay=0)
    stdout, stderr = res.communicate(timeout=120)
    assert res.returncode == 0, stderr
    rep = json.loads(stdout.strip().splitlines()[-1])
    assert rep["resumed_from_batch"] >= killed_at and rep["verified"] and rep["world_size"] == 2
    got = _read_field(out, "x")
    assert got.shape == want.shape and np.abs(got - want).max() <= 0.01
    verify_file(out)
    assert not os.path.exists(out + ".tmp") and not os.path.exists(journal)


def test_cli_serial_and_exit_codes(tmp_path):
    from solar.cli import main

    paths, want = _npy_inputs(tmp_path, sizes=(6,))
    out = str(tmp_path / "o.h5")
    assert main(["ingest", *paths, "-o", out, "--no-progress", "--verify"]) == 0
    assert main(["ingest", *paths, "-o", out, "--no-progress"]) == 2  # exists
    with h5py.File(out, "r"):
        from solar.io_backends import open_backend

        n, specs = describe_fields(open_backend(out))
        assert n == 6 and specs[0].name == "x"


def test_cli_reports_an_unusable_input_in_one_line_with_exit_code_2(tmp_path, http_root, capsys):
    """Audit finding: a truncated .npy passed the checks and failed mid-run with a
    DatasetFormatError traceback (exit 1). It is now refused when the inputs are described; and
    an input that a read finds unusable mid-run (a virtual HDF5 dataset over http, which h5py
    cannot read from a file object) is one line with exit code 2 too, not a traceback."""
    from solar.cli import main

    paths, _ = _npy_inputs(tmp_path, sizes=(40,))
    with open(paths[0], "r+b") as fh:
        fh.truncate(1000)
    out = str(tmp_path / "o.h5")
    assert main(["ingest", paths[0], "-o", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"solar ingest: {paths[0]}: its .npy header promises 40 rows") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["part0.npy"]
    url = _virtual_dataset_over_http(http_root)
    assert main(["ingest", url, "-o", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"solar ingest: {url}: 'x' is a virtual dataset") and err.count("\n") == 1, err
    assert not os.path.exists(out)


def _virtual_dataset_over_http(http_root) -> str:
    """The URL of an HDF5 file whose dataset ``x`` is virtual: described fine, refused when read
    over http (DatasetFormatError; h5py would crash reading it from a file object)."""
    import uuid

    sub = os.path.join(http_root[0], uuid.uuid4().hex[:10])
    os.makedirs(sub)
    x = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    with h5py.File(os.path.join(sub, "src.h5"), "w") as f:
        f["x"] = x
    layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
    layout[:] = h5py.VirtualSource(os.path.join(sub, "src.h5"), "x", x.shape)
    with h5py.File(os.path.join(sub, "vds.h5"), "w") as f:
        f.create_virtual_dataset("x", layout)
    for name in os.listdir(sub):
        os.chmod(os.path.join(sub, name), 0o644)
    return f"{http_root[1]}/{os.path.basename(sub)}/vds.h5"


def test_storage_failure_mid_run_is_one_line_with_a_resume_hint(tmp_path, http_root, monkeypatch, capsys):
    """An input server failing mid-run (the audit killed nginx; here it answers 403 once the file
    is unreadable) ended in an 80-line traceback with exit 1 and no word of --resume. Now: one
    line naming the URL, a --resume hint once batches are committed, exit 4; --resume finishes."""
    import uuid

    import solar.ingest.sources as sources
    from solar.cli import main

    root, base = http_root
    sub = uuid.uuid4().hex[:10]
    os.makedirs(os.path.join(root, sub))
    path, url = os.path.join(root, sub, "a.npy"), f"{base}/{sub}/a.npy"
    a = np.random.default_rng(7).standard_normal((40, 4, 4)).astype(np.float32)
    np.save(path, a)
    os.chmod(path, 0o644)
    out = str(tmp_path / "o.h5")
    args = ["ingest", url, "-o", out, "--no-progress", "--batch-size", "8", "--commit-interval", "0"]
    real = sources.Source.read

    def run_failing_at(k):  # the k-th read (one per batch: raw, one field) finds the file unreadable
        calls = []

        def read(self, name, lo, hi):
            calls.append(lo)
            if len(calls) == k:
                os.chmod(path, 0)
            return real(self, name, lo, hi)

        monkeypatch.setattr(sources.Source, "read", read)
        try:
            return main(args)
        finally:
            os.chmod(path, 0o644)
            monkeypatch.setattr(sources.Source, "read", real)

    assert run_failing_at(1) == 4  # nothing committed yet: nothing to resume, no hint
    err = capsys.readouterr().err
    assert err.startswith(f"solar ingest: {url}") and "403" in err and len(err.strip().splitlines()) == 1
    assert run_failing_at(3) == 4  # two batches committed (--commit-interval 0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"solar ingest: {url}") and "403" in lines[0]
    assert lines[1] == (f"solar ingest: {out}.tmp keeps the 2 batch(es) committed so far; once the storage "
                        "answers again, rerun the same command with --resume to continue from there")
    assert not os.path.exists(out)
    assert main(args + ["--resume"]) == 0
    assert "resumed at batch 2" in capsys.readouterr().out
    np.testing.assert_array_equal(_read_field(out, "x"), a)


def test_storage_failure_lines_name_the_file_and_the_cause(tmp_path, monkeypatch):
    """The lines both the serial CLI and a failing rank under mpirun print (failure_lines): the
    file, the cause from the errno (HDF5's sec2 driver puts it in the message), or, from the
    MPI-IO driver, which drops it, "No space left" inferred from the output's free space."""
    import errno

    import solar.ingest.failures as ing

    tmp = str(tmp_path / "o.h5.tmp")
    sec2 = OSError(errno.ENOSPC, "Can't write data (file write failed: time = Sun Nov 22 18:14:20 2026\n, "
                                 f"filename = '{tmp}', errno = 28, error message = 'No space left on device', "
                                 "buf = 0x1)")
    err = ing.storage_error(sec2, f"writing {tmp}", tmp)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err).startswith(f"writing {tmp} failed: No space left on device (errno 28; its file system has ")
    assert "time =" not in str(err) and "\n" not in str(err)
    mpio = OSError("Can't write data (file write failed)")
    monkeypatch.setattr(ing, "_free_bytes", lambda path: 4096)
    lines = ing.failure_lines(ing.storage_error(mpio, f"writing {tmp}", tmp, need=1000), tmp, 31, rank=1)
    assert lines == [f"rank 1: writing {tmp} failed: No space left on device (inferred: the error gives no reason, "
                     "and its file system has 0.0 MB free) [OSError: Can't write data (file write failed)]",
                     f"{tmp} keeps the 31 batch(es) committed so far; once there is free space on its file system "
                     "again, rerun the same command with --resume to continue from there"]
    monkeypatch.setattr(ing, "_free_bytes", lambda path: 10**12)  # plenty of room: no guess
    assert str(ing.storage_error(mpio, f"writing {tmp}", tmp, need=1000)) == (
        f"writing {tmp} failed: OSError: Can't write data (file write failed)")
    flush = RuntimeError("Unable to flush file's cached information (unable to extend file properly, errno = 27, "
                         "error message = 'File too large')")  # how HDF5 reports a failed flush
    assert ing.as_storage_error(flush, "writing x", tmp).errno == errno.EFBIG
    assert ing.as_storage_error(RuntimeError("a bug"), "writing x", tmp) is None
    assert ing.failure_lines(mpio, tmp, 0) == ["OSError: Can't write data (file write failed)"]  # no batches: no hint


@pytest.mark.slow
def test_storage_failure_under_mpirun_is_one_line_and_exit_code_4(tmp_path):
    """Audit finding: a full disk under `mpirun -n 2 solar ingest` printed "rank 0 failed:
    OSError: Can't write data (file write failed)" (no file, no cause, no word of the committed
    batches), then MPI_Abort(1): exit 1, where the serial run prints one clear line and exits 4.
    The failure here is real, without a mount: mid-run both ranks get RLIMIT_FSIZE at OUT.tmp's
    size, so the file cannot grow (EFBIG; HDF5 may report it from a write, a resize or a flush)."""
    import resource

    want, out, journal, args, env, proc = _slowed_ingest(tmp_path)
    ranks = _ranks_after_commits(proc, journal, then="the disk could fill")
    size = os.path.getsize(out + ".tmp")
    for pid in ranks:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, size))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 4, stderr  # EXIT_STORAGE, as serially (MPI_Abort(4); was 1)
    lines = [ln for ln in stderr.splitlines() if ln.startswith("solar ingest: ")]
    assert lines, stderr
    failed = [ln for ln in lines if ln.startswith("solar ingest: rank ")]
    assert failed and all(f"writing {out}.tmp failed: " in ln for ln in failed), stderr
    committed = json.load(open(journal))["batches_done"]
    assert f"solar ingest: {out}.tmp keeps the {committed} batch(es) committed so far; once the storage answers " \
           "again, rerun the same command with --resume to continue from there" in lines, stderr
    assert "Traceback" not in stderr and not os.path.exists(out)
    res = _mpirun([*args, "--resume", "--verify", "--json"], env, delay=0)
    stdout, stderr = res.communicate(timeout=120)
    assert res.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["resumed_from_batch"] == committed
    assert np.abs(_read_field(out, "x") - want).max() <= 0.01


@pytest.mark.slow
def test_an_unusable_input_under_mpirun_is_exit_code_2(tmp_path, http_root):
    """Under mpirun an input that the write loop's reads find unusable ended the job with exit 1
    and "resume with --resume" (which fails the same way); now each rank says what it found, as
    the serial run does, and the job's exit code is 2 (bad input)."""
    url, out = _virtual_dataset_over_http(http_root), str(tmp_path / "o.h5")
    env = _mpirun_env()
    proc = _mpirun([url, "-o", out, "--no-progress"], env, delay=0)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("solar ingest: ")]
    assert lines and all(ln.startswith("solar ingest: rank ") and f": {url}: 'x' is a virtual dataset" in ln
                         for ln in lines), stderr
    assert "Traceback" not in stderr and "--resume" not in stderr and not os.path.exists(out)


def _batches_done(out):
    try:
        with open(out + ".ingest.json") as f:
            return json.load(f)["batches_done"]
    except (FileNotFoundError, ValueError):  # not written yet (or being replaced)
        return 0


@pytest.mark.parametrize("hdf5_locking", ["default", "FALSE"])
def test_a_second_run_to_the_same_output_stops_before_writing(tmp_path, monkeypatch, hdf5_locking):
    """A second run to one output failed with HDF5's 'unable to lock file' on OUT.tmp, or, with
    HDF5_USE_FILE_LOCKING=FALSE (as HPC sites set it), wrote the first run's OUT.tmp and journal
    too. It now stops before writing, naming the first run; a run whose holder died (the kernel
    dropped its flock) goes ahead and resumes."""
    import signal
    import subprocess
    import sys

    if hdf5_locking != "default":
        monkeypatch.setenv("HDF5_USE_FILE_LOCKING", hdf5_locking)
    paths, want = _npy_inputs(tmp_path, sizes=(30, 20))
    out = str(tmp_path / "o.h5")
    code = ("import time; from solar.ingest import ingest; "
            f"ingest({paths!r}, {out!r}, batch_size=2, progress=False, commit_interval=0, "
            "on_batch_written=lambda batch, committed: time.sleep(0.2))")  # slowed: the test acts mid-run
    first = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _batches_done(out) < 2:  # the first run has committed batches
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        with pytest.raises(InputError, match=r"o\.h5 is being written by another solar ingest .*\"pid\": "
                                             f"{first.pid}.*another -o"):
            ingest(paths, out, overwrite=True, progress=False)
        with pytest.raises(InputError, match="being written by another"):
            ingest(paths, out, resume=True, progress=False)
        first.send_signal(signal.SIGKILL)  # dies holding the lock
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        first.stderr.close()
    assert os.path.exists(out + ".ingest.lock")  # left behind, but nobody holds it
    rep = ingest(paths, out, resume=True, progress=False, batch_size=2, commit_interval=0)
    assert rep.resumed_from_batch > 0  # the dead run's committed batches were kept
    np.testing.assert_array_equal(_read_field(out, "x"), want)
    assert not os.path.exists(out + ".ingest.lock")
