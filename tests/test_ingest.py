"""`solar ingest`: layout, sample order, fields, bounds, verification, bad input, and a real
crash (SIGKILL of one rank of `mpirun -n 2 solar ingest`) followed by `--resume`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from servers import http_root, place, s3_root  # noqa: F401  (fixtures)

from solar.errors import ConfigError, CorruptDataError, InputError
from solar.ingest import ingest, verify_file
from solar.layout import FORMAT, checksum_key, describe_fields, sample_checksum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLAR = os.path.join(os.path.dirname(sys.executable), "solar")


def _npy_inputs(d, sizes=(13, 7, 20), shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    arrays, paths = [], []
    for i, n in enumerate(sizes):
        a = rng.standard_normal((n, *shape)).astype(np.float32)
        p = os.path.join(d, f"part{i}.npy")
        np.save(p, a)
        arrays.append(a)
        paths.append(p)
    return paths, np.concatenate(arrays)


def _read_field(path, name):
    from solar import codec

    with h5py.File(path, "r") as f:
        if isinstance(f[name], h5py.Dataset):
            return f[name][:]
        data, off = f[name]["data"][:], f[name]["offsets"][:]
        return np.stack([codec.decode(data[off[i]:off[i + 1]]).numpy() for i in range(len(off) - 1)])


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
    import solar.ingest as ing

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


def test_verify_catches_damage(tmp_path):
    paths, _ = _npy_inputs(tmp_path, sizes=(10,))
    out = str(tmp_path / "o.h5")
    ingest(paths, out, progress=False)
    with h5py.File(out, "r+") as f:
        f["x"][7, 0, 0] += 1
    with pytest.raises(CorruptDataError, match="field 'x' sample 7: checksum"):
        verify_file(out)


def test_verify_of_infinities_is_quiet_and_exact(tmp_path, recwarn):
    """--verify of a compressed field holding +-Inf printed numpy's "RuntimeWarning: invalid value
    encountered in subtract" (inf - inf); the verdict must stay: Inf and NaN come back exactly."""
    from solar.ingest import _validate

    x = np.random.default_rng(0).random((16, 64)).astype(np.float32)
    x[3, 2], x[4, 0], x[5, 1] = np.inf, -np.inf, np.nan
    src, out = str(tmp_path / "inf.npy"), str(tmp_path / "o.h5")
    np.save(src, x)
    ingest([src], out, abs_error=1e-3, verify=True, progress=False)
    with h5py.File(out, "r") as f:
        assert isinstance(f["x"], h5py.Group)  # compressed
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]
    for where, value in (((3, 2), -np.inf), ((3, 2), np.float32(3e38)), ((3, 2), np.nan), ((5, 1), np.inf),
                         ((6, 0), np.inf)):
        y = x.copy()
        y[where] = value
        np.save(src, y)
        plan = _validate([src], out, None, 1e-3, None, False, True, 256, "auto", None)
        with pytest.raises(CorruptDataError, match=f"field 'x' sample {where[0]} is off by more than the bound"):
            verify_file(out, plan=plan)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_verify_compares_raw_fields_exactly_whatever_the_bound(tmp_path):
    """Audit finding: with --abs-error 5 every field's plan carried the bound, so --verify let an
    int label off by 4 pass, and compared complex fields as float64 (their imaginary parts
    dropped). Only compressed fields have a bound now: raw ones must come back exactly. The job
    fingerprint is still the one earlier versions computed (--resume keeps recognising them)."""
    import hashlib
    from dataclasses import asdict

    from solar.ingest import _validate

    rng = np.random.default_rng(0)
    src, out = str(tmp_path / "in.npz"), str(tmp_path / "o.h5")
    np.savez(src, img=rng.standard_normal((8, 32, 32)).astype(np.float32),
             label=rng.integers(0, 1000, (8, 4)), half=rng.standard_normal((8, 16)).astype(np.float16),
             phase=(rng.standard_normal((8, 16)) + 1j * rng.standard_normal((8, 16))).astype(np.complex64))
    ingest([src], out, abs_error=5.0, verify=True, progress=False)
    plan = _validate([src], out, None, 5.0, None, False, True, 256, "auto", None)
    assert {p.name: (p.compress, p.abs_error) for p in plan.fields} == {
        "img": (True, 5.0), "label": (False, None), "half": (False, None), "phase": (False, None)}
    ids = plan.input_identities()
    fields = [{**asdict(f), "abs_error": 5.0 if f.name != "img" else f.abs_error} for f in plan.fields]
    desc = {"inputs": [(s.url, s.n, s.per_file, s.keys, i[1:]) for s, i in zip(plan.sources, ids)],
            "fields": fields, "batch_size": 256}  # the previous version's fingerprint, verbatim
    assert plan.fingerprint(ids) == "v2-" + hashlib.sha256(json.dumps(desc, sort_keys=True, default=str)
                                                           .encode()).hexdigest()[:32]
    assert verify_file(out, plan=plan, comm=None) == 8
    for name, i, change in (("label", 3, lambda r: r + np.array([4, 0, 0, 0])),
                            ("half", 2, lambda r: r + np.float16(0.5)),
                            ("phase", 5, lambda r: r + 1j)):  # within the bound, yet not what was put in
        with h5py.File(out, "r+") as f:  # as a write bug would: stored values wrong, checksums agree
            good = f[name][i]
            f[name][i] = change(good)
            f[checksum_key(name)][i] = sample_checksum(f[name][i])
        with pytest.raises(CorruptDataError, match=f"field '{name}' sample {i} differs from the input"):
            verify_file(out, plan=plan, comm=None)
        with h5py.File(out, "r+") as f:
            f[name][i] = good
            f[checksum_key(name)][i] = sample_checksum(good)
    assert verify_file(out, plan=plan, comm=None) == 8


def test_overwrite_replaces_atomically(tmp_path):
    paths, want = _npy_inputs(tmp_path, sizes=(5,))
    out = str(tmp_path / "o.h5")
    with open(out, "w") as fh:
        fh.write("old")
    ingest(paths, out, overwrite=True, progress=False)
    np.testing.assert_array_equal(_read_field(out, "x"), want)


def test_resume_continues_from_the_journal(tmp_path, monkeypatch):
    """A run that died after some batches (simulated in-process) resumes and matches a clean run."""
    import solar.ingest as ing

    paths, want = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))  # compressed: see test_tiny_float_fields_stay_raw
    out = str(tmp_path / "o.h5")
    real = ing.sample_checksum
    calls = {"n": 0}

    def dying(buf):
        calls["n"] += 1
        if calls["n"] > 20:  # dies during the third batch of 8
            raise KeyboardInterrupt
        return real(buf)

    monkeypatch.setattr(ing, "sample_checksum", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest(paths, out, batch_size=8, abs_error=0.05, progress=False, commit_interval=0)
    assert not os.path.exists(out) and os.path.exists(out + ".tmp")
    assert json.load(open(out + ".ingest.json"))["batches_done"] == 2
    monkeypatch.setattr(ing, "sample_checksum", real)
    with pytest.raises(InputError, match="already exists|resume"):
        open(out, "w").close()
        ingest(paths, out, batch_size=8, abs_error=0.05, progress=False)
    os.remove(out)
    rep = ingest(paths, out, batch_size=8, abs_error=0.05, resume=True, verify=True, progress=False)
    assert rep.resumed_from_batch == 2
    assert np.abs(_read_field(out, "x") - want).max() <= 0.05
    mtime = os.stat(out).st_mtime_ns
    again = ingest(paths, out, batch_size=8, abs_error=0.05, resume=True, verify=True, progress=False)
    assert again.resumed_from_batch == 6 and os.stat(out).st_mtime_ns == mtime  # finished: nothing redone
    with pytest.raises(InputError, match="different job.*--overwrite"):  # see the next test
        ingest(paths[:1], out, batch_size=8, abs_error=0.05, resume=True, progress=False)
    other = ingest(paths[:1], out, batch_size=8, abs_error=0.05, resume=True, overwrite=True, progress=False)
    assert other.num_samples == 30  # a different job replaces the output only with --overwrite


def test_resume_starts_over_when_an_input_changed(tmp_path, monkeypatch, capsys):
    """Same shapes, new values: the fingerprint carries each input's size and mtime, so the
    interrupted file's batches (made from the old values) are not kept."""
    paths, _ = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _crash_after_two_batches(paths, out, monkeypatch, abs_error=0.05)
    new = np.load(paths[0]) + 10.0  # regenerated input: same shape and dtype, other values
    np.save(paths[0], new)
    rep = ingest(paths, out, batch_size=8, abs_error=0.05, resume=True, verify=True, progress=False)
    assert rep.resumed_from_batch == 0 and "starting over" in capsys.readouterr().err
    assert np.abs(_read_field(out, "x")[:30] - new).max() <= 0.05
    with pytest.raises(InputError, match="different job"):  # a finished output of the old input
        os.utime(paths[1])
        ingest(paths, out, batch_size=8, abs_error=0.05, resume=True, progress=False)


def test_http_input_stamp_sees_a_regenerated_file_without_etag(tmp_path):
    """Python's http.server sends Last-Modified but no ETag (fsspec reports it as
    "Last-Modified"): a same-size rewrite must still change the input's stamp."""
    from servers import python_http_server
    from solar.ingest_sources import Source

    np.save(tmp_path / "a.npy", np.zeros((4, 3), np.float32))
    with python_http_server(str(tmp_path)) as base:
        src = Source(f"{base}/a.npy", "npy", False, {"x": "x"})
        before = src.stamp()
        np.save(tmp_path / "a.npy", np.ones((4, 3), np.float32))
        st = os.stat(tmp_path / "a.npy")
        os.utime(tmp_path / "a.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # HTTP dates are in seconds
        after = src.stamp()
    assert before[0] == after[0] and before[1] is not None and before != after


def _replace_during_read(monkeypatch, path, array, at_read, after=False, keep_mtime=False):
    """Make the ingest's ``at_read``-th input read (one per batch and field and input) find
    ``path`` regenerated as ``array`` (``os.replace``, as a pipeline writing a new version does;
    ``keep_mtime``: as ``cp -p`` leaves it); with ``after``, the file is renamed away right after
    that read instead."""
    import solar.ingest_sources as sources

    real, calls = sources.Source.read, []

    def read(self, name, lo, hi):
        calls.append(lo)
        if len(calls) == at_read and not after:
            st = os.stat(path)
            np.save(path + ".new.npy", array)
            os.replace(path + ".new.npy", path)
            if keep_mtime:
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        rows = real(self, name, lo, hi)
        if len(calls) == at_read and after:
            os.rename(path, path + ".away")
        return rows

    monkeypatch.setattr(sources.Source, "read", read)


def test_an_input_replaced_during_the_run_creates_no_output(tmp_path, monkeypatch, capsys):
    """Audit finding: a .npy input regenerated while the ingest read it gave an output of old and
    new rows, exit 0, with a fingerprint of the old input. The inputs' identities are taken again
    before the rename: a change stops the job on every rank (exit 2, as bad input), names the
    input, keeps nothing of the mixed OUT.tmp, and the next run (--resume too) starts over."""
    from solar.cli import main

    paths, _ = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    new = np.ones((30, 8, 8), np.float32)
    args = ["ingest", *paths, "-o", out, "--batch-size", "8", "--commit-interval", "0", "--no-progress"]
    _replace_during_read(monkeypatch, paths[0], new, at_read=2)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (f"solar ingest: input {paths[0]} changed while this run read it (its size or modification time "
                   f"differs): the rows written may mix old and new contents, so {out} was not created (and "
                   f"{out}.tmp was removed); run the job again once the inputs stay unchanged (--resume starts "
                   "over)\n")
    assert sorted(os.listdir(tmp_path)) == ["part0.npy", "part1.npy"]
    monkeypatch.undo()
    rep = ingest(paths, out, batch_size=8, resume=True, progress=False)
    assert rep.resumed_from_batch == 0
    np.testing.assert_array_equal(_read_field(out, "x"), np.concatenate([new, np.load(paths[1])]))


def test_an_input_replaced_keeping_size_and_mtime_during_verify_is_named(tmp_path, monkeypatch):
    """A same-size rewrite (cp -p) while --verify reads the inputs: the content digest sees it,
    and the error names the changed input rather than a verification failure."""
    paths, _ = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    # 7 reads for the 6 batches (batch 3 reads both inputs), then verify reads part0 and part1
    _replace_during_read(monkeypatch, paths[1], np.ones((17, 8, 8), np.float32), at_read=9, keep_mtime=True)
    with pytest.raises(InputError, match=f"input {paths[1]} changed while this run read it \\(same size and "
                                         "modification time, other contents"):
        ingest(paths, out, batch_size=8, verify=True, progress=False, commit_interval=0)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def test_an_input_gone_at_the_final_check_keeps_the_run_for_resume(tmp_path, monkeypatch):
    """The final identity check cannot stat an input (here renamed away after its last read):
    a storage failure, OUT.tmp and the journal kept; once the input is back, --resume finishes."""
    from solar.errors import StorageError

    paths, want = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _replace_during_read(monkeypatch, paths[1], None, at_read=7, after=True)  # the last (batch 3 reads both)
    with pytest.raises(StorageError, match=f"checking that the inputs did not change while this run read them "
                                           f"failed .*{paths[1]}.*so {out} was not created"):
        ingest(paths, out, batch_size=8, progress=False, commit_interval=0)
    assert not os.path.exists(out) and json.load(open(out + ".ingest.json"))["batches_done"] == 6
    monkeypatch.undo()
    os.rename(paths[1] + ".away", paths[1])
    rep = ingest(paths, out, batch_size=8, resume=True, verify=True, progress=False)
    assert rep.resumed_from_batch == 6
    np.testing.assert_array_equal(_read_field(out, "x"), want)


def _crash_after_two_batches(paths, out, monkeypatch, **kw):
    """Run an ingest that dies during its third batch of 8 (two committed), as the resume tests do."""
    import solar.ingest as ing

    real, calls = ing.sample_checksum, {"n": 0}

    def dying(buf):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real(buf)

    monkeypatch.setattr(ing, "sample_checksum", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest(paths, out, batch_size=8, progress=False, commit_interval=0, **kw)
    monkeypatch.setattr(ing, "sample_checksum", real)
    assert json.load(open(out + ".ingest.json"))["batches_done"] == 2


def _rewrite_keeping_size_and_mtime(path, array):
    """Regenerate an input as `cp -p`/`rsync -a` of a regenerated file leave it: new bytes, same
    size and mtime (also what a coarse-mtime file system shows for two writes within a tick)."""
    st = os.stat(path)
    np.save(path, array)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_resume_starts_over_when_an_input_is_rewritten_with_the_same_size_and_mtime(tmp_path, monkeypatch, capsys):
    """Audit finding: the fingerprint had each input's size and mtime only, so an input
    regenerated between the crash and `--resume` and copied back with `cp -p` resumed, exit 0,
    into an output of old rows followed by new ones (which verify_file passes: the checksums are
    of the stored bytes). Now the fingerprint has a digest of a sample of each input's bytes:
    the resume names the input and starts over."""
    paths, _ = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _crash_after_two_batches(paths, out, monkeypatch)
    new = -np.load(paths[0])
    _rewrite_keeping_size_and_mtime(paths[0], new)
    rep = ingest(paths, out, batch_size=8, resume=True, progress=False)
    err = capsys.readouterr().err
    assert rep.resumed_from_batch == 0, "resumed into rows of the old input"
    assert f"input {paths[0]} changed since that run (same size and modification time" in err
    assert "starting over" in err and paths[1] not in err
    np.testing.assert_array_equal(_read_field(out, "x")[:30], new)  # no old rows left
    with pytest.raises(InputError, match="different job"):  # a finished output of the old contents
        _rewrite_keeping_size_and_mtime(paths[0], -new)
        ingest(paths, out, batch_size=8, resume=True, progress=False)


def test_resume_of_a_run_started_before_inputs_were_content_sampled(tmp_path, monkeypatch, capsys):
    """A journal (or a finished output) written by the previous version carries the old
    fingerprint (size and mtime only, no `v2-` prefix, no `inputs`): with unchanged inputs it
    still resumes (or counts as complete), with a note saying how to be sure."""
    import hashlib
    from dataclasses import asdict

    from solar.ingest import _validate

    paths, want = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _crash_after_two_batches(paths, out, monkeypatch)
    plan = _validate(paths, out, None, None, None, True, False, 8, "auto", None)
    # the previous version's Plan.fingerprint(), verbatim
    stamps = [[os.stat(s.url).st_size, os.stat(s.url).st_mtime_ns] for s in plan.sources]
    desc = {"inputs": [(s.url, s.n, s.per_file, s.keys, st) for s, st in zip(plan.sources, stamps)],
            "fields": [asdict(f) for f in plan.fields], "batch_size": plan.batch_size}
    old = hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]
    rec = json.load(open(out + ".ingest.json"))
    assert rec["fingerprint"].startswith("v2-") and len(rec["inputs"]) == 2
    json.dump({k: v for k, v in rec.items() if k != "inputs"} | {"fingerprint": old}, open(out + ".ingest.json", "w"))
    rep = ingest(paths, out, batch_size=8, resume=True, verify=True, progress=False)
    assert rep.resumed_from_batch == 2
    assert "written by an older solar ingest" in capsys.readouterr().err
    np.testing.assert_array_equal(_read_field(out, "x"), want)
    with h5py.File(out, "r+") as f:  # an output finished by the previous version
        f.attrs["provenance"] = json.dumps({**json.loads(f.attrs["provenance"]), "fingerprint": old})
    rep = ingest(paths, out, batch_size=8, resume=True, progress=False)
    assert rep.already_complete and "finished by an older solar ingest" in capsys.readouterr().err


def test_journal_without_inputs_changed_in_contents_starts_over(tmp_path, monkeypatch, capsys):
    """A journal of this version whose inputs changed in contents only, and whose input list
    cannot name them (hand-edited, truncated record): still a different job, starting over."""
    paths, _ = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _crash_after_two_batches(paths, out, monkeypatch)
    rec = json.load(open(out + ".ingest.json"))
    json.dump({**rec, "inputs": None}, open(out + ".ingest.json", "w"))
    _rewrite_keeping_size_and_mtime(paths[1], np.load(paths[1]) + 1)
    assert ingest(paths, out, batch_size=8, resume=True, progress=False).resumed_from_batch == 0
    assert "belongs to a different job" in capsys.readouterr().err


def test_content_digest_reads_a_bounded_sample():
    from solar.ingest_sources import digest_ranges

    assert digest_ranges(0) == [(0, 0)] and digest_ranges(1000) == [(0, 1000)]
    for size in (300_000, 10**12):
        r = digest_ranges(size)
        assert r[0][0] == 0 and r[-1][1] == size and len(r) == 10
        assert sum(b - a for a, b in r) == 256 << 10  # whatever the size
        assert all(a < b <= c for (a, b), (c, _) in zip(r, r[1:]))  # ordered, disjoint


def test_content_digest_over_every_fsspec_protocol(tmp_path, place):
    """The content sample is read through the input's own URL and storage_options (file, memory,
    http via nginx with Range requests, s3): equal bytes give equal digests, a same-size rewrite
    that changes one middle block gives another."""
    from solar.ingest_sources import Source, digest_ranges

    data = bytearray(np.random.default_rng(1).integers(0, 256, 1 << 20, np.uint8).tobytes())
    url = place.put_bytes("a.npy", bytes(data))
    src = Source(url, "npy", False, {"x": "x"}, storage_options=place.storage_options)
    first = src.identity()
    assert first[0] == len(data) and first[2] is not None
    mid = digest_ranges(len(data))[5][0]
    data[mid + 100] ^= 0xFF
    place.put_bytes("a.npy", bytes(data))
    changed = src.identity()
    assert changed[0] == first[0] and changed[2] != first[2]
    data[mid + 100] ^= 0xFF
    place.put_bytes("a.npy", bytes(data))
    assert src.identity()[2] == first[2]


def test_content_digest_with_a_server_that_ignores_range_requests(tmp_path):
    from servers import python_http_server
    from solar.ingest_sources import Source

    np.save(tmp_path / "a.npy", np.zeros((40000, 3), np.float32))
    with python_http_server(str(tmp_path)) as base:
        src = Source(f"{base}/a.npy", "npy", False, {"x": "x"})
        before = src.identity()
        np.save(tmp_path / "a.npy", np.ones((40000, 3), np.float32))
        after = src.identity()
    assert before[0] == after[0] and None not in (before[2], after[2]) and before[2] != after[2]


def test_resume_never_replaces_a_finished_output(tmp_path, capsys):
    """`--resume` used to treat an existing OUT like --overwrite and silently replace a finished file
    of another job. Now: the same job's OUT is reported complete (nothing written, exit 0); any
    other existing OUT is refused (exit 2) unless --overwrite is given."""
    from solar.cli import main

    paths, want = _npy_inputs(tmp_path, sizes=(12, 9))
    out = str(tmp_path / "o.h5")
    ingest(paths, out, batch_size=4, progress=False)
    before = (os.stat(out).st_mtime_ns, open(out, "rb").read())
    listing = set(os.listdir(tmp_path))
    with pytest.raises(InputError, match=r"o\.h5 already exists and was written by a different job.*--overwrite"):
        ingest(paths[1:], out, batch_size=4, resume=True, progress=False)  # other inputs
    with pytest.raises(InputError, match="different job.*--overwrite"):
        ingest(paths, out, batch_size=8, resume=True, progress=False)  # other options
    assert main(["ingest", paths[1], "-o", out, "--no-progress", "--resume"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (os.stat(out).st_mtime_ns, open(out, "rb").read()) == before
    assert set(os.listdir(tmp_path)) == listing  # no OUT.tmp, no journal
    # the same job: already complete, nothing rewritten
    rep = ingest(paths, out, batch_size=4, resume=True, progress=False)
    assert rep.already_complete and rep.num_samples == 21
    assert main(["ingest", *paths, "-o", out, "--no-progress", "--resume", "--batch-size", "4"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert (os.stat(out).st_mtime_ns, open(out, "rb").read()) == before
    # a file `solar ingest` did not finish is refused too; --overwrite still replaces either
    other = str(tmp_path / "other.h5")
    with open(other, "w") as fh:
        fh.write("not mine")
    with pytest.raises(InputError, match=r"other\.h5 already exists and is not a finished .*--overwrite"):
        ingest(paths, other, resume=True, progress=False)
    assert open(other).read() == "not mine" and not os.path.exists(other + ".tmp")
    rep = ingest(paths[1:], out, batch_size=4, resume=True, overwrite=True, progress=False)
    assert not rep.already_complete and rep.num_samples == 9
    np.testing.assert_array_equal(_read_field(out, "x"), want[12:])


def test_serial_ingest_fsyncs_the_output_before_the_rename(tmp_path, monkeypatch):
    """Serial ingest renamed OUT.tmp to OUT without an fsync (only the MPI path synced, via
    MPI_File_sync), so a crash could leave OUT named but empty; the directory is synced after."""
    paths, _ = _npy_inputs(tmp_path, sizes=(5,))
    out = str(tmp_path / "o.h5")
    real, synced = os.fsync, []

    def recording(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.path.exists(out)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    ingest(paths, out, progress=False)
    assert (os.path.realpath(out + ".tmp"), False) in synced  # the data, before the rename
    assert (os.path.realpath(tmp_path), True) in synced  # the directory entry, after it


def _children(pid: int) -> list[int]:
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _mpirun_env() -> dict:
    """An environment for a nested `mpirun` (as root, oversubscribed, slowed so a test can act mid-run)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "SOLAR_INGEST_TEST_DELAY": "0.25"}
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "SOLAR_EXPECT_WORLD"):
        env.pop(var, None)
    return env


def _mpirun(args, env, **kw):
    return subprocess.Popen(["mpirun", "-n", "2", "--bind-to", "none", SOLAR, "ingest", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


@pytest.mark.slow
def test_sigkill_one_rank_then_resume_under_mpirun(tmp_path):
    """The real thing: `mpirun -n 2 solar ingest`, SIGKILL of rank 1 mid-run, `--resume --verify`."""
    paths, want = _npy_inputs(tmp_path, sizes=(64, 40), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    env = _mpirun_env()
    args = [*paths, "-o", out, "--batch-size", "8", "--abs-error", "0.01", "--no-progress", "--commit-interval", "0"]
    proc = _mpirun(args, env)
    journal = out + ".ingest.json"
    deadline = time.monotonic() + 120
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            done = json.load(open(journal))["batches_done"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"ingest ended before it could be killed: {proc.communicate()}"
    ranks = [p for p in _children(proc.pid) if "python" in open(f"/proc/{p}/cmdline").read()]
    assert len(ranks) == 2, f"expected 2 rank processes under mpirun, found {ranks}"
    os.kill(max(ranks), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not os.path.exists(out), "a killed run must not leave the output"
    assert os.path.exists(out + ".tmp")
    killed_at = json.load(open(journal))["batches_done"]
    assert 3 <= killed_at < 13
    env["SOLAR_INGEST_TEST_DELAY"] = "0"
    res = _mpirun([*args, "--resume", "--verify", "--json"], env)
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
    with h5py.File(out, "r") as f:
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

    import solar.ingest_sources as sources
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

    import solar.ingest as ing

    tmp = str(tmp_path / "o.h5.tmp")
    sec2 = OSError(errno.ENOSPC, "Can't write data (file write failed: time = Sun Nov 22 18:14:20 2026\n, "
                                 f"filename = '{tmp}', errno = 28, error message = 'No space left on device', buf = 0x1)")
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
    assert ing._storage_failure(flush, "writing x", tmp).errno == errno.EFBIG
    assert ing._storage_failure(RuntimeError("a bug"), "writing x", tmp) is None
    assert ing.failure_lines(mpio, tmp, 0) == ["OSError: Can't write data (file write failed)"]  # no batches: no hint


@pytest.mark.slow
def test_storage_failure_under_mpirun_is_one_line_and_exit_code_4(tmp_path):
    """Audit finding: a full disk under `mpirun -n 2 solar ingest` printed "rank 0 failed:
    OSError: Can't write data (file write failed)" (no file, no cause, no word of the committed
    batches), then MPI_Abort(1): exit 1, where the serial run prints one clear line and exits 4.
    The failure here is real, without a mount: mid-run both ranks get RLIMIT_FSIZE at OUT.tmp's
    size, so the file cannot grow (EFBIG; HDF5 may report it from a write, a resize or a flush)."""
    import resource

    paths, want = _npy_inputs(tmp_path, sizes=(64, 40), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    env = _mpirun_env()
    args = [*paths, "-o", out, "--batch-size", "8", "--abs-error", "0.01", "--no-progress", "--commit-interval", "0"]
    proc = _mpirun(args, env)
    journal, deadline, done = out + ".ingest.json", time.monotonic() + 120, 0
    while time.monotonic() < deadline and proc.poll() is None and done < 3:
        try:
            done = json.load(open(journal))["batches_done"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    assert proc.poll() is None, f"ingest ended before the disk could fill: {proc.communicate()}"
    ranks = [p for p in _children(proc.pid) if "python" in open(f"/proc/{p}/cmdline").read()]
    assert len(ranks) == 2, f"expected 2 rank processes under mpirun, found {ranks}"
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
    env["SOLAR_INGEST_TEST_DELAY"] = "0"
    res = _mpirun([*args, "--resume", "--verify", "--json"], env)
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
    env = {**_mpirun_env(), "SOLAR_INGEST_TEST_DELAY": "0"}
    proc = _mpirun([url, "-o", out, "--no-progress"], env)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("solar ingest: ")]
    assert lines and all(ln.startswith("solar ingest: rank ") and f": {url}: 'x' is a virtual dataset" in ln
                         for ln in lines), stderr
    assert "Traceback" not in stderr and "--resume" not in stderr and not os.path.exists(out)


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
    from solar.ingest import _validate

    paths = []
    for i in range(12):
        paths.append(str(tmp_path / f"in{i}.h5"))
        with h5py.File(paths[-1], "w") as f:
            f["x"] = np.full((3, 2), i, np.float32)
    plan = _validate(paths, str(tmp_path / "o.h5"), None, None, None, False, False, 4, "auto", None)
    for lo in range(0, 36, 4):
        np.testing.assert_array_equal(plan.read("x", lo, lo + 4)[:, 0], np.arange(lo, lo + 4) // 3)
        assert sum(s._handle is not None for s in plan.sources) <= 2
    np.testing.assert_array_equal(plan.read("x", 0, 3)[:, 0], 0)  # a new pass reopens lazily
    out = str(tmp_path / "o.h5")
    ingest(paths, out, batch_size=4, verify=True, progress=False)
    np.testing.assert_array_equal(_read_field(out, "x")[:, 0], np.arange(36) // 3)


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
    code = ("import sys; from solar.ingest import ingest; "
            f"ingest({paths!r}, {out!r}, batch_size=2, progress=False, commit_interval=0)")
    first = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "SOLAR_INGEST_TEST_DELAY": "0.2"},
                             stderr=subprocess.PIPE, text=True)
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
