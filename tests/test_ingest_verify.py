"""`solar ingest --verify` and `verify_file`: damage is caught, raw fields compare exactly,
infinities quietly."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from ingest_helpers import _npy_inputs

from solar.errors import CorruptDataError
from solar.ingest import ingest, verify_file
from solar.layout import checksum_key, sample_checksum


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
    from solar.ingest.plan import validate

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
        plan = validate([src], out, None, 1e-3, None, False, True, 256, "auto", None)
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

    from solar.ingest.plan import validate

    rng = np.random.default_rng(0)
    src, out = str(tmp_path / "in.npz"), str(tmp_path / "o.h5")
    np.savez(src, img=rng.standard_normal((8, 32, 32)).astype(np.float32),
             label=rng.integers(0, 1000, (8, 4)), half=rng.standard_normal((8, 16)).astype(np.float16),
             phase=(rng.standard_normal((8, 16)) + 1j * rng.standard_normal((8, 16))).astype(np.complex64))
    ingest([src], out, abs_error=5.0, verify=True, progress=False)
    plan = validate([src], out, None, 5.0, None, False, True, 256, "auto", None)
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
