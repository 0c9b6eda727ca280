"""`solar ingest x=X.npy y=Y.npy`: fields from separate files, side by side, serial and under
mpirun; mismatched or ambiguous NAME=FILE inputs refused before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from ingest_helpers import _read_field

from solar.errors import InputError
from solar.ingest import ingest, verify_file


def _pair(d, n=30, seed=0, tag=""):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 9, (n, 2)).astype(np.int64)
    px, py = os.path.join(d, f"X{tag}.npy"), os.path.join(d, f"Y{tag}.npy")
    np.save(px, x)
    np.save(py, y)
    return (px, x), (py, y)


@pytest.mark.parametrize("bound", [None, 1e-3], ids=["raw", "compressed"])
def test_named_files_become_fields_side_by_side(tmp_path, bound):
    (px, x), (py, y) = _pair(tmp_path)
    out = str(tmp_path / "o.h5")
    rep = ingest([f"x={px}", f"y={py}"], out, abs_error=bound, batch_size=7, verify=True, progress=False)
    assert rep.fields == ["x", "y"] and rep.num_samples == 30
    got = _read_field(out, "x")
    if bound is None:
        np.testing.assert_array_equal(got, x)
    else:
        assert np.abs(got - x).max() <= bound
    np.testing.assert_array_equal(_read_field(out, "y"), y)  # ints stay raw, exactly
    assert verify_file(out) == 30


def test_groups_of_named_files_concatenate_in_order(tmp_path):
    (px0, x0), (py0, y0) = _pair(tmp_path, 12, 0, "0")
    (px1, x1), (py1, y1) = _pair(tmp_path, 5, 1, "1")
    out = str(tmp_path / "o.h5")
    rep = ingest([f"x={px0}", f"y={py0}", f"x={px1}", f"y={py1}"], out, samples="axis0", progress=False)
    assert rep.num_samples == 17
    np.testing.assert_array_equal(_read_field(out, "x"), np.concatenate([x0, x1]))
    np.testing.assert_array_equal(_read_field(out, "y"), np.concatenate([y0, y1]))


def test_one_sample_per_file_pairs(tmp_path):
    rng = np.random.default_rng(3)
    xs, ys, args = [], [], []
    for i in range(4):
        xs.append(rng.standard_normal((6, 6)).astype(np.float32))
        ys.append(rng.standard_normal((2,)).astype(np.float32))
        np.save(tmp_path / f"a{i}.npy", xs[-1])
        np.save(tmp_path / f"b{i}.npy", ys[-1])
        args += [f"img={tmp_path / f'a{i}.npy'}", f"label={tmp_path / f'b{i}.npy'}"]
    out = str(tmp_path / "o.h5")
    rep = ingest(args, out, progress=False)  # auto: several files of equal shapes -> one sample each
    assert rep.num_samples == 4 and rep.fields == ["img", "label"]
    np.testing.assert_array_equal(_read_field(out, "img"), np.stack(xs))
    np.testing.assert_array_equal(_read_field(out, "label"), np.stack(ys))


def test_an_hdf5_dataset_picked_by_path_is_a_named_field(tmp_path):
    (px, x), _ = _pair(tmp_path)
    h5 = str(tmp_path / "in.h5")
    with h5py.File(h5, "w") as f:
        f["group/target"] = np.arange(30 * 3, dtype=np.float64).reshape(30, 3)
    wide = str(tmp_path / "wide.h5")
    with h5py.File(wide, "w") as f:
        f["a"], f["b"] = np.zeros((30,)), np.ones((30, 2))
    out = str(tmp_path / "o.h5")
    ingest([f"x={px}", f"t={h5}:/group/target"], out, progress=False)
    np.testing.assert_array_equal(_read_field(out, "t"), np.arange(90, dtype=np.float64).reshape(30, 3))
    with pytest.raises(InputError, match=r"t=.*wide\.h5 holds 2 arrays \(a, b\); pick one with t=.*wide\.h5:/DATASET"):
        ingest([f"x={px}", f"t={wide}"], str(tmp_path / "o2.h5"), progress=False)


def test_a_file_whose_name_looks_like_name_equals_file_is_a_plain_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("a=b.npy", np.ones((4, 3), np.float32))
    rep = ingest(["a=b.npy"], "o.h5", progress=False)
    assert rep.fields == ["x"] and rep.num_samples == 4


@pytest.mark.parametrize("args, match", [
    (["x={px}", "y={short}"], r"x=.*X\.npy y=.*S\.npy: its fields have different numbers of samples "
                              r"\(\{'x': 30, 'y': 29\}\); the files given together must hold equally many"),
    (["x={px}", "x={px}", "y={py}"], r"each field a different number of files \(\{'x': 2, 'y': 1\}\)"),
    (["x={px}", "{py}"], r"NAME=FILE inputs \(x=\.\.\.\) name every field; they cannot be mixed with plain "
                         r"inputs \(.*Y\.npy\)"),
    (["x={px}", "y={missing}"], r"nope\.npy: input not found"),
])
def test_mismatched_named_inputs_are_refused_before_writing(tmp_path, args, match):
    (px, _), (py, _) = _pair(tmp_path)
    short = str(tmp_path / "S.npy")
    np.save(short, np.zeros((29, 2), np.float32))
    names = {"px": px, "py": py, "short": short, "missing": str(tmp_path / "nope.npy")}
    out = str(tmp_path / "o.h5")
    with pytest.raises(InputError, match=match):
        ingest([a.format(**names) for a in args], out, progress=False)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def test_named_inputs_with_fields_are_refused(tmp_path):
    (px, _), (py, _) = _pair(tmp_path)
    with pytest.raises(InputError, match=r"cannot be mixed with --fields"):
        ingest([f"x={px}", f"y={py}"], str(tmp_path / "o.h5"), fields=["x"], progress=False)


def test_resume_fingerprint_sees_a_changed_named_file(tmp_path):
    """The fingerprint covers every file of a named group: a finished job rerun with --resume is
    complete, and the same command over a changed Y.npy is another job."""
    (px, _), (py, _) = _pair(tmp_path)
    out = str(tmp_path / "o.h5")
    ingest([f"x={px}", f"y={py}"], out, progress=False)
    assert ingest([f"x={px}", f"y={py}"], out, resume=True, progress=False).already_complete
    np.save(py, np.full((30, 2), 5, np.int64))
    with pytest.raises(InputError, match="--overwrite"):
        ingest([f"x={px}", f"y={py}"], out, resume=True, progress=False)


def test_cli_takes_named_inputs(tmp_path):
    (px, x), (py, _) = _pair(tmp_path)
    out = str(tmp_path / "o.h5")
    r = subprocess.run([sys.executable, "-m", "solar.cli", "ingest", f"x={px}", f"y={py}", "-o", out, "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fields x, y" in r.stdout
    np.testing.assert_array_equal(_read_field(out, "x"), x)


@pytest.mark.mpi
def test_named_inputs_under_mpirun_match_the_serial_run(comm, shared_tmp):
    d = os.path.join(shared_tmp, "named")
    if comm.rank == 0:
        os.makedirs(d, exist_ok=True)
        _pair(d, 41)
    comm.Barrier()
    args = [f"x={os.path.join(d, 'X.npy')}", f"y={os.path.join(d, 'Y.npy')}"]
    par, ser = os.path.join(d, "par.h5"), os.path.join(d, "ser.h5")
    rep = ingest(args, par, abs_error=1e-2, batch_size=5, verify=True, progress=False)
    assert rep.world_size == comm.size and rep.num_samples == 41
    if comm.rank == 0:
        ingest(args, ser, abs_error=1e-2, batch_size=5, comm=None, progress=False)
    comm.Barrier()
    with h5py.File(par, "r") as a, h5py.File(ser, "r") as b:
        for k in ["x/data", "x/offsets", "y"]:
            np.testing.assert_array_equal(a[k][:], b[k][:])
    comm.Barrier()
