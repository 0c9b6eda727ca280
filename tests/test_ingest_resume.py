"""`solar ingest --resume`: the journal, the fingerprint (inputs changed, rewritten with the
same size and mtime, or replaced mid-run), finished outputs, the durable rename."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from ingest_helpers import _crash, _npy_inputs, _read_field

from solar.errors import InputError
from solar.ingest import ingest


def test_overwrite_replaces_atomically(tmp_path):
    paths, want = _npy_inputs(tmp_path, sizes=(5,))
    out = str(tmp_path / "o.h5")
    with open(out, "w") as fh:
        fh.write("old")
    ingest(paths, out, overwrite=True, progress=False)
    np.testing.assert_array_equal(_read_field(out, "x"), want)


def test_resume_continues_from_the_journal(tmp_path, monkeypatch):
    """A run that died after some batches (simulated in-process) resumes and matches a clean run."""
    import solar.ingest.write as ing

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
    from solar.ingest.sources import Source

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
    import solar.ingest.sources as sources

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
    _crash(paths, out, monkeypatch, 20, **kw)
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

    from solar.ingest.plan import validate

    paths, want = _npy_inputs(tmp_path, sizes=(30, 17), shape=(8, 8))
    out = str(tmp_path / "o.h5")
    _crash_after_two_batches(paths, out, monkeypatch)
    plan = validate(paths, out, None, None, None, True, False, 8, "auto", None)
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
    from solar.ingest.sources import digest_ranges

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
    from solar.ingest.sources import Source, digest_ranges

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
    from solar.ingest.sources import Source

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
