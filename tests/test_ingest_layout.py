"""`solar ingest`: layout, sample order, fields, inputs over every protocol, bounds, bad
input stopped before anything is written."""

from __future__ import annotations

import json
import os
import sys

import h5py
import numpy as np
import pytest

from ingest_helpers import _npy_inputs, _read_field

from solar.errors import ConfigError, InputError
from solar.ingest import ingest, verify_file
from solar.layout import FORMAT, checksum_key, describe_fields, sample_checksum


def test_npy_parts_keep_input_order_and_layout(tmp_path):
    paths, want = _npy_inputs(tmp_path)
    out = str(tmp_path / "o.h5")
    rep = ingest(paths[::-1], out, batch_size=8, progress=False)
    assert rep.num_samples == 40 and rep.fields == ["x"] and rep.world_size == 1
    expect = np.concatenate([np.load(p) for p in paths[::-1]])
    with h5py.File(out, "r") as f:  # plain h5py reads it
        assert f.attrs["solar_format"] == FORMAT and f.attrs["num_samples"] == 40
        assert bool(f.attrs["complete"])
        assert json.loads(f.attrs["fields"]) == ["x"]
        np.testing.assert_array_equal(f["x"][:], expect)
        sums = f[checksum_key("x")][:]
        assert all(int(sums[i]) == sample_checksum(expect[i]) for i in range(40))
        prov = json.loads(f.attrs["provenance"])
        assert [i["url"] for i in prov["inputs"]] == paths[::-1]
        assert [i["first_sample"] for i in prov["inputs"]] == [0, 20, 27]
    assert not os.path.exists(out + ".tmp") and not os.path.exists(out + ".ingest.json")
    assert verify_file(out) == 40


def test_one_sample_per_file_and_field_name(tmp_path):
    rng = np.random.default_rng(1)
    samples = [rng.standard_normal((4, 4)).astype(np.float64) for _ in range(6)]
    paths = []
    for i, s in enumerate(samples):
        paths.append(str(tmp_path / f"s{i}.npy"))
        np.save(paths[-1], s)
    out = str(tmp_path / "o.h5")
    ingest(paths, out, fields=["img"], progress=False)  # auto: same shapes -> one sample per file
    np.testing.assert_array_equal(_read_field(out, "img"), np.stack(samples))
    out2 = str(tmp_path / "o2.h5")
    ingest(paths, out2, samples="axis0", progress=False)  # each file's rows are samples
    assert _read_field(out2, "x").shape == (24, 4)


def test_samples_auto_says_when_it_takes_each_file_as_one_sample(tmp_path, capsys):
    """Runs of equal length (README's `solar ingest run*.npy`) became one sample per file without a
    word; rank 0 now says what auto chose and how to get the leading axis as samples."""
    paths, _ = _npy_inputs(tmp_path, sizes=(10, 10), shape=(2, 3))
    ingest(paths, str(tmp_path / "o.h5"), progress=False)
    err = capsys.readouterr().err
    assert ("solar ingest: 2 inputs of equal shape (10, 2, 3): each file is one sample (--samples file); "
            "pass --samples axis0") in err
    for samples, n in (("file", 2), ("axis0", 20)):  # asked for explicitly: nothing to say
        assert ingest(paths, str(tmp_path / f"{samples}.h5"), samples=samples, progress=False).num_samples == n
        assert "each file is one sample" not in capsys.readouterr().err
    ingest(paths[:1], str(tmp_path / "one.h5"), progress=False)  # one input: auto takes axis 0, silently
    assert "each file is one sample" not in capsys.readouterr().err


def test_npz_and_hdf5_inputs_with_fields_and_compression(tmp_path):
    rng = np.random.default_rng(2)
    img1, img2 = rng.standard_normal((10, 8, 8)).astype(np.float32), rng.standard_normal((15, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "a.npz", image=img1, label=np.arange(10))
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["grp/image"] = img2
        f["label"] = np.arange(10, 25)
        f["junk"] = np.zeros((15, 2))
    out = str(tmp_path / "o.h5")
    # b.h5 lists grp/image as a nested dataset: select and rename it per input kind
    with pytest.raises(InputError, match="b.h5.*fields.*junk.*but .*a.npz has"):
        ingest([str(tmp_path / "a.npz"), str(tmp_path / "b.h5")], out, progress=False)
    h5in = f"{tmp_path / 'b.h5'}:/grp/image"
    ingest([str(tmp_path / "a.npz")], out, fields=["image"], abs_error=1e-2, verify=True, progress=False)
    got = _read_field(out, "image")
    assert np.abs(got - img1).max() <= 1e-2
    with h5py.File(out, "r") as f:
        g = f["image"]
        assert g.attrs["codec"].startswith("ebq/") and g.attrs["abs_error"] == pytest.approx(1e-2)
        assert g["offsets"].shape == (11,) and g["offsets"][-1] == g["data"].shape[0]
        assert tuple(g.attrs["sample_shape"]) == (8, 8) and g.attrs["dtype"] == "float32"
    out2 = str(tmp_path / "o2.h5")
    ingest([h5in], out2, fields=["img=image"], rel_error=1e-3, verify=True, progress=False)
    with h5py.File(out2, "r") as f:
        bound = f["img"].attrs["abs_error"]
        assert bound == pytest.approx(1e-3 * (img2.max() - img2.min()))  # relative to the field's range
    assert np.abs(_read_field(out2, "img") - img2).max() <= bound


def test_fields_pick_hdf5_datasets_before_comparing_lengths(tmp_path, capsys):
    """`--fields a` of a file whose other datasets have another length failed with "fields have
    different numbers of samples: {'a': 50, 'b': 70}" (every dataset was described, and their
    lengths compared, before --fields chose): only the chosen datasets count now."""
    from solar.cli import main

    src = str(tmp_path / "mixed.h5")
    a, c = np.arange(50, dtype=np.float32).reshape(50, 1), np.arange(100, dtype=np.int64).reshape(50, 2)
    with h5py.File(src, "w") as f:
        f["a"] = a
        f["b"] = np.arange(70, dtype=np.float32)
        f["grp/c"] = c
        f["other/c"] = c
        f["version"] = 3  # a scalar: not a field, and not asked for
    out = str(tmp_path / "o.h5")
    assert main(["ingest", src, "--fields", "a", "-o", out, "--no-progress"]) == 0
    np.testing.assert_array_equal(_read_field(out, "a"), a)
    # a nested dataset by its full path, renamed
    ingest([src], out, fields=["a", "cc=grp/c"], overwrite=True, verify=True, progress=False)
    with h5py.File(out, "r") as f:
        assert json.loads(f.attrs["fields"]) == ["a", "cc"]
    np.testing.assert_array_equal(_read_field(out, "cc"), c)
    # the chosen fields still must agree; unknown and ambiguous names are refused, naming the file
    with pytest.raises(InputError, match=r"mixed.h5: its fields have different numbers of samples.*'b': 70.*--fields"):
        ingest([src], out, fields=["a", "b"], overwrite=True, progress=False)
    with pytest.raises(InputError, match=r"mixed.h5: no array 'zz'; it has: a, b, grp/c, other/c, version"):
        ingest([src], out, fields=["zz"], overwrite=True, progress=False)
    with pytest.raises(InputError, match=r"mixed.h5: 'c' names several datasets \(grp/c, other/c\).*--fields c=grp/c"):
        ingest([src], out, fields=["c"], overwrite=True, progress=False)
    capsys.readouterr()
    assert main(["ingest", src, "-o", str(tmp_path / "all.h5"), "--no-progress"]) == 2  # every field: a and b differ
    assert "different numbers of samples" in capsys.readouterr().err


def test_integer_fields_stay_raw_when_compressing(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones((5, 64), np.float32), y=np.arange(5))
    out = str(tmp_path / "o.h5")
    ingest([str(tmp_path / "a.npz")], out, abs_error=0.1, progress=False)
    with h5py.File(out, "r") as f:
        assert isinstance(f["x"], h5py.Group) and isinstance(f["y"], h5py.Dataset)


def test_tiny_float_fields_stay_raw(tmp_path, capsys):
    """With a bound, a float32 field of one value per sample went from 4 kB to 144 kB (a 136 B blob
    per 4 B value: the codec's fixed header) and an (N, 3) float64 field grew 6.5x. A field whose
    raw sample is no larger than the codec's smallest blob for it is stored raw (exactly, in the
    raw layout), and the decision is printed; larger float fields are still compressed."""
    from solar.cli import main
    from solar.io_backends import open_backend

    rng = np.random.default_rng(0)
    img = rng.standard_normal((300, 16, 16)).cumsum(-1).astype(np.float32)
    energy, pos = rng.random(300).astype(np.float32), rng.random((300, 3))
    src = str(tmp_path / "labels.h5")
    with h5py.File(src, "w") as f:
        f["img"], f["energy"], f["pos"] = img, energy, pos
    out = str(tmp_path / "o.h5")
    assert main(["ingest", src, "-o", out, "--rel-error", "1e-3", "--verify", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "field 'energy' is stored raw" in err and "field 'pos' is stored raw" in err and "'img'" not in err
    n, specs = describe_fields(open_backend(out))
    assert n == 300 and {s.name: s.kind for s in specs} == {"energy": "raw", "img": "codec", "pos": "raw"}
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["energy"][:], energy)
        np.testing.assert_array_equal(f["pos"][:], pos)
        assert f["energy"].nbytes == energy.nbytes and f["pos"].nbytes == pos.nbytes
        assert set(json.loads(f.attrs["provenance"])["bounds"]) == {"img"}
        assert [int(v) for v in f[checksum_key("energy")][:5]] == [sample_checksum(r) for r in energy[:5]]
    assert verify_file(out) == 300


def test_fsspec_inputs(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    buf = __import__("io").BytesIO()
    np.save(buf, a)
    fs.pipe("/ingest-in/a.npy", buf.getvalue())
    out = str(tmp_path / "o.h5")
    ingest(["memory://ingest-in/a.npy", "memory://ingest-in/a.npy"], out, samples="axis0", progress=False)
    np.testing.assert_array_equal(_read_field(out, "x"), np.concatenate([a, a]))


def test_provenance_keeps_no_credentials(tmp_path, monkeypatch):
    """The output's provenance records the command line: --storage-options keeps its keys only
    and URLs lose user info and query strings (a presigned signature), since outputs get shared."""
    import fsspec

    from solar.cli import main

    buf = __import__("io").BytesIO()
    np.save(buf, np.ones((4, 3), np.float32))
    fsspec.filesystem("memory").pipe("/prov-in/a.npy", buf.getvalue())
    out = str(tmp_path / "o.h5")
    argv = ["solar", "ingest", "memory://prov-in/a.npy", "-o", out, "--no-progress",
            "--storage-options", json.dumps({"key": "AKIA-ID", "secret": "MY-SECRET"})]
    monkeypatch.setattr(sys, "argv", argv)
    assert main(argv[1:]) == 0
    with h5py.File(out, "r") as f:
        prov = f.attrs["provenance"]
    assert "MY-SECRET" not in prov and "AKIA-ID" not in prov
    assert json.loads(json.loads(prov)["argv"][-1]) == {"key": "<redacted>", "secret": "<redacted>"}
    from solar.ingest import redact_argv

    assert redact_argv(["x", "https://u:p@h.example/a.npy?X-Amz-Signature=abc", "--storage-options={bad"]) == [
        "x", "https://<redacted>@h.example/a.npy?<redacted>", "--storage-options=<redacted>"]


@pytest.mark.parametrize("case", ["missing", "shape", "dtype", "exists", "both-bounds", "npy-fields", "url-out",
                                  "5d-second-field", "unicode-npy", "bytes-npz", "truncated-npy", "out-is-a-dir"])
def test_bad_input_stops_before_writing(tmp_path, case):
    paths, _ = _npy_inputs(tmp_path, sizes=(4, 4))
    out = str(tmp_path / "o.h5")
    kw: dict = {}
    if case == "missing":
        paths.append(str(tmp_path / "gone.npy"))
        match, err = "gone.npy.*not found", InputError
    elif case == "shape":
        np.save(tmp_path / "odd.npy", np.zeros((3, 3, 4), np.float32))
        paths.append(str(tmp_path / "odd.npy"))
        match, err = r"odd.npy.*shape \(3, 4\).*part0.npy", InputError
    elif case == "dtype":
        np.save(tmp_path / "odd.npy", np.zeros((3, 3, 5), np.float64))
        paths.append(str(tmp_path / "odd.npy"))
        match, err = "odd.npy.*float64", InputError
    elif case == "exists":
        open(out, "wb").close()
        match, err = "already exists.*--overwrite", InputError
    elif case == "both-bounds":
        kw = {"abs_error": 0.1, "rel_error": 0.1}
        match, err = "not both", ConfigError
    elif case == "npy-fields":
        kw = {"fields": ["a", "b"]}
        match, err = "part0.npy.*one --fields name", InputError
    elif case == "5d-second-field":  # the codec takes up to 4-D samples; every field is checked
        paths = [str(tmp_path / "two.npz")]
        np.savez(paths[0], a=np.zeros((3, 4), np.float32), b=np.zeros((3, 1, 1, 1, 2, 2), np.float32))
        kw = {"rel_error": 1e-3}
        match, err = "field 'b' has 5-D samples", ConfigError
    elif case == "unicode-npy":  # h5py failed with a TypeError once OUT.tmp existed
        np.save(tmp_path / "s.npy", np.array([["ab"] * 5] * 3))
        paths = [str(tmp_path / "s.npy")]
        match, err = r"s\.npy: field 'x' has dtype <U2, which a tensor cannot hold .*convert it to a numeric " \
                     "array, or leave this input out", InputError
    elif case == "bytes-npz":  # was written, into a file SOLAR could not read back
        paths = [str(tmp_path / "b.npz")]
        np.savez(paths[0], a=np.zeros((3, 4), np.float32), name=np.array([b"ab", b"cd", b"ef"]))
        match, err = r"b\.npz: field 'name' has dtype \|S2, .*leave it out with --fields", InputError
    elif case == "truncated-npy":  # failed with a traceback when the write loop reached the missing rows
        with open(paths[0], "rb") as fh:
            head = fh.read(200)
        with open(paths[0], "wb") as fh:
            fh.write(head)
        match, err = (r"part0\.npy: its \.npy header promises 4 rows of shape \(3, 5\) float32 \(368 bytes with "
                      r"the header\), but the file has 200 bytes: it is truncated"), InputError
    elif case == "out-is-a-dir":  # ran the whole job, then failed at the rename (and every --resume)
        out = str(tmp_path / "adir")
        os.mkdir(out)
        kw = {"overwrite": True}
        match, err = "adir is a directory: -o must name a file, not a directory", InputError
    else:
        out = "s3://bucket/o.h5"
        match, err = "local", ConfigError
    before = set(os.listdir(tmp_path))
    with pytest.raises(err, match=match):
        ingest(paths, out, progress=False, **kw)
    after = set(os.listdir(tmp_path))
    assert after == before, f"files appeared: {after - before}"


def test_a_string_field_left_out_with_fields_does_not_stop_the_job(tmp_path):
    """What the refusal of a string field suggests works: --fields naming the others."""
    src, out = str(tmp_path / "b.npz"), str(tmp_path / "o.h5")
    np.savez(src, a=np.arange(12, dtype=np.float32).reshape(3, 4), name=np.array(["ab", "cd", "ef"]))
    assert ingest([src], out, fields=["a"], verify=True, progress=False).fields == ["a"]
    np.testing.assert_array_equal(_read_field(out, "a"), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_rel_error_over_a_float64_range_beyond_float64(tmp_path, capsys):
    """Audit finding: --rel-error over values of +-1.7e308 made max - min overflow to inf; the codec
    refused the bound mid-run ("abs_error must be a finite number >= 0, got inf": no field, no
    --rel-error), after OUT.tmp and the journal were written. The bound is now computed without
    that overflow, and one that is still not finite stops the job before anything is written."""
    from solar.cli import main

    a = np.random.default_rng(3).uniform(-1, 1, (6, 64)) * 1.7e308  # compressed: larger than a blob
    a[0, 0], a[0, 1] = -1.7e308, 1.7e308
    src, out = str(tmp_path / "big.npy"), str(tmp_path / "o.h5")
    np.save(src, a)
    assert main(["ingest", src, "-o", out, "--rel-error", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "solar ingest: field 'x': --rel-error 1 of its value range [-1.7e+308, 1.7e+308] is not a finite number "
        "(the range is beyond float64); give an absolute bound with --abs-error, or store the field raw (no "
        "--abs-error/--rel-error)\n")
    assert sorted(os.listdir(tmp_path)) == ["big.npy"]
    ingest([src], out, rel_error=1e-3, verify=True, progress=False)  # 3.4e305: finite, though max - min is not
    with h5py.File(out, "r") as f:
        assert f["x"].attrs["abs_error"] == pytest.approx(3.4e305)
    assert np.abs(_read_field(out, "x") - a).max() <= 3.4e305


def test_nan_where_the_codec_cannot_keep_it(tmp_path, monkeypatch):
    import solar.ingest.plan as ing

    a = np.ones((6, 64), np.float32)  # samples bigger than a blob's header: compressed
    a[4, 2] = np.nan
    np.save(tmp_path / "n.npy", a)
    out = str(tmp_path / "o.h5")
    ingest([str(tmp_path / "n.npy")], out, abs_error=0.01, verify=True, progress=False)  # ebq keeps NaN
    assert np.isnan(_read_field(out, "x")[4, 2])
    monkeypatch.setattr(ing, "_codec_keeps_nan", lambda: False)
    with pytest.raises(InputError, match=r"sample 4 of field 'x' \(input .*n.npy, sample 4\) contains NaN"):
        ingest([str(tmp_path / "n.npy")], str(tmp_path / "o2.h5"), abs_error=0.01, progress=False)
    assert not os.path.exists(tmp_path / "o2.h5.tmp")


def test_empty_input_reports_no_infinite_ratio(tmp_path, capsys):
    """A 0-sample ingest printed "(xinf)" and --json wrote "ratio": Infinity, which is not JSON."""
    from solar.cli import main

    src, out = str(tmp_path / "e.npy"), str(tmp_path / "o.h5")
    np.save(src, np.zeros((0, 4), np.float32))
    assert main(["ingest", src, "-o", out, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "0 samples" in text and "xinf" not in text
    for extra in ([], ["--resume"]):  # a fresh run, and the report of an already complete one
        assert main(["ingest", src, "-o", out, "--no-progress", "--json", "--overwrite", *extra]) == 0
        rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1],
                         parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
        assert rep["num_samples"] == 0 and rep["ratio"] == 1.0


def test_inputs_over_every_fsspec_protocol(tmp_path, place):
    """.npy and HDF5 inputs read from file, memory, http (nginx) and s3 (moto) URLs."""
    import io

    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((9, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, a)
    u1 = place.put_bytes("a.npy", buf.getvalue())
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f["x"] = b
    u2 = place.put_bytes("b.h5", buf.getvalue())
    out = str(tmp_path / "o.h5")
    ingest([u1, u2], out, storage_options=place.storage_options, verify=True, progress=False)
    np.testing.assert_array_equal(_read_field(out, "x"), np.concatenate([a, b]))


def test_progress_bar_shows_samples_and_megabytes_per_second(tmp_path, capsys):
    paths, _ = _npy_inputs(tmp_path, sizes=(20,))
    ingest(paths, str(tmp_path / "o.h5"), batch_size=5, progress=True)
    err = capsys.readouterr().err
    assert "20/20" in err and "sample/s" in err and "MB/s" in err


def test_many_inputs_do_not_stay_open(tmp_path):
    """Inputs behind the write position are closed: a run over many files holds few handles."""
    from solar.ingest.plan import validate

    paths = []
    for i in range(12):
        paths.append(str(tmp_path / f"in{i}.h5"))
        with h5py.File(paths[-1], "w") as f:
            f["x"] = np.full((3, 2), i, np.float32)
    plan = validate(paths, str(tmp_path / "o.h5"), None, None, None, False, False, 4, "auto", None)
    for lo in range(0, 36, 4):
        np.testing.assert_array_equal(plan.read("x", lo, lo + 4)[:, 0], np.arange(lo, lo + 4) // 3)
        assert sum(s._handle is not None for s in plan.sources) <= 2
    np.testing.assert_array_equal(plan.read("x", 0, 3)[:, 0], 0)  # a new pass reopens lazily
    out = str(tmp_path / "o.h5")
    ingest(paths, out, batch_size=4, verify=True, progress=False)
    np.testing.assert_array_equal(_read_field(out, "x")[:, 0], np.arange(36) // 3)
