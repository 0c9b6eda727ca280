"""docs/troubleshooting.md quotes the messages users meet; each quote is the real message.

Every ```text block of the page is a message, with ``…`` where the message names your file, value
or number, wrapped over lines for reading (runs of whitespace compare equal). Each trigger below
makes SOLAR raise (or warn) for real, on small real files, and the test checks that its message
matches exactly one block of the page; every block must be matched by some trigger. So a message
that changes, or a page entry whose error no longer exists, fails here. Messages that need several
MPI ranks (or a user without root's rights) are produced by the tests named in TESTED_ELSEWHERE,
and their blocks are checked against the library's source instead.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
import solar.codec as sc
from solar.checkpoint import CheckpointWriter, load, verify
from solar.ingest import ingest
from servers import python_http_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
SOLAR_CLI = str(pathlib.Path(sys.executable).parent / "solar")
CKPT_CLI = str(pathlib.Path(sys.executable).parent / "solar-ckpt")

# Blocks whose message needs several ranks (or root-less permissions): the test that produces
# each, and the message's start as the library source spells it.
TESTED_ELSEWHERE = {
    "the ranks disagree on what this iteration": "tests/test_failfast.py",
    "ranks cannot open it": "tests/test_failfast.py",
    "the other ranks to start this iteration": "tests/test_loader_mpi.py",
    "is not writable here": "tests/test_checkpoint_store.py",
}


def _ptycho(path, n=64, size=8):
    from solar.synthetic import write_ptycho_h5

    write_ptycho_h5(str(path), n, size, seed=0, progress=False)
    return str(path)


def _raises(fn, *exc):
    try:
        fn()
    except exc or Exception as e:  # noqa: BLE001 - the message is what is tested
        return str(e)
    raise AssertionError(f"{fn} raised nothing")


def _warns(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    assert seen, f"{fn} warned nothing"
    return str(seen[0].message)


def _cli(args, cwd, code=2, exe=SOLAR_CLI, out="stderr"):
    r = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    return getattr(r, out).strip()


# ---- the triggers: each returns the message a user sees ---------------------------------------

def missing_package(tmp):
    return _raises(lambda: solar.H5Dataset("gs://bucket/train.h5"))


def mpi_backend_outside_mpirun(tmp):
    return _raises(lambda: solar.H5Dataset(_ptycho(tmp / "t.h5"), backend="mpi-hdf5")[0])


def no_cuda(tmp):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    return _raises(lambda: solar.H5Dataset(_ptycho(tmp / "t.h5"), device="cuda"))


def file_missing(tmp):
    return _raises(lambda: solar.H5Dataset(str(tmp / "missing.h5")))


def not_hdf5(tmp):
    (tmp / "notes.h5").write_text("not an HDF5 file\n")
    return _raises(lambda: solar.H5Dataset(str(tmp / "notes.h5")))


def glob_matches_nothing(tmp):
    return _raises(lambda: solar.H5Dataset(f"{tmp}/shards/train-*.h5"))


def files_with_other_fields(tmp):
    for name, field in (("a1.h5", "x"), ("a2.h5", "z")):
        with h5py.File(tmp / name, "w") as f:
            f[field] = np.zeros((4, 2), np.float32)
    return _raises(lambda: solar.H5Dataset([str(tmp / "a1.h5"), str(tmp / "a2.h5")]))


def field_missing(tmp):
    return _raises(lambda: solar.H5Dataset(_ptycho(tmp / "t.h5"), fields=("x", "label")))


def fields_disagree(tmp):
    with h5py.File(tmp / "odd.h5", "w") as f:
        f["x"] = np.zeros((10, 4), np.float32)
        f["y"] = np.zeros((12, 4), np.float32)
    return _raises(lambda: solar.H5Dataset(str(tmp / "odd.h5"), fields=("x", "y")))


def index_out_of_range(tmp):
    return _raises(lambda: solar.H5Dataset(_ptycho(tmp / "t.h5"))[64])


def damaged_sample(tmp):
    raw = _ptycho(tmp / "t.h5")
    ingest([raw], str(tmp / "c.h5"), progress=False)
    with h5py.File(tmp / "c.h5", "r+") as f:
        f["x"][3] = f["x"][3] + 1
    return _raises(lambda: solar.H5Dataset(str(tmp / "c.h5"))[3])


def http_without_ranges(tmp):
    _ptycho(tmp / "t.h5", 64, 64)  # 3 MiB: more than one block of the HTTP block cache
    with python_http_server(str(tmp)) as url:  # Python's file server answers a Range request with the file
        return _raises(lambda: solar.H5Dataset(f"{url}/t.h5")[0])


def http_not_found(tmp):
    with python_http_server(str(tmp)) as url:
        return _raises(lambda: solar.H5Dataset(f"{url}/missing.h5"))


def http_forbidden(tmp):
    _ptycho(tmp / "t.h5")
    with python_http_server(str(tmp), forbidden=("t.h5",)) as url:
        return _raises(lambda: solar.H5Dataset(f"{url}/t.h5"))


def buffer_not_understood(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, buffer="lots"))


def buffer_fraction_out_of_range(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, buffer=1.5))


def buffer_larger_than_memory(tmp):
    with h5py.File(tmp / "huge.h5", "w") as f:  # 16 PiB of samples, none written: the file stays small
        f.create_dataset("x", shape=(2**22, 1024, 1024), dtype=np.float32, chunks=(1, 1024, 1024))
    ds = solar.H5Dataset(str(tmp / "huge.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, buffer=1.0))


def spill_needs_bytes(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, buffer=0.5, spill=(str(tmp), "1GiB")))


def spill_dir_missing(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, buffer="1MiB", spill=(str(tmp / "nvme"), "1GiB")))


def distributed_and_sampler(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _raises(lambda: solar.DataLoader(ds, batch_size=8, distributed=True, sampler=range(64)))


class _Wrapper(tud.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def wrapper_dataset(tmp):
    ds = solar.H5Dataset(_ptycho(tmp / "t.h5"))
    return _warns(lambda: solar.DataLoader(_Wrapper(ds), batch_size=8))


def buffer_on_plain_dataset(tmp):
    ds = tud.TensorDataset(torch.zeros(16, 2))
    return _warns(lambda: solar.DataLoader(ds, batch_size=8, buffer="1GiB"))


def _loader(path, **kw):
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=kw.pop("seed", 0))
    return solar.DataLoader(ds, batch_size=8, sampler=sampler, buffer=0.5, **kw), sampler


def resume_other_dataset(tmp):
    a, _ = _loader(_ptycho(tmp / "a.h5", 64))
    next(iter(a))
    b, _ = _loader(_ptycho(tmp / "b.h5", 48))
    return _raises(lambda: b.load_state_dict(a.state_dict()))


def resume_other_seed(tmp):
    a, _ = _loader(_ptycho(tmp / "a.h5"))
    next(iter(a))
    b, _ = _loader(str(tmp / "a.h5"), seed=1)
    return _raises(lambda: b.load_state_dict(a.state_dict()))


def resume_then_set_epoch(tmp):
    a, _ = _loader(_ptycho(tmp / "a.h5"))
    it = iter(a)
    next(it)
    state = a.state_dict()
    b, sampler = _loader(str(tmp / "a.h5"))
    b.load_state_dict(state)
    sampler.set_epoch(1)
    return _warns(lambda: next(iter(b)))


def codec_integer(tmp):
    return _raises(lambda: sc.encode(np.arange(16), abs_error=1))


def codec_two_bounds(tmp):
    return _raises(lambda: sc.encode(np.zeros(16, np.float32), abs_error=1e-3, rel_error=1e-3))


def codec_damaged_blob(tmp):
    blob = bytearray(sc.encode(np.random.default_rng(0).random(256, dtype=np.float32), abs_error=1e-3))
    blob[-5] ^= 0xFF
    return _raises(lambda: sc.decode_batch([bytes(blob)], names=[17]))


def ingest_output_exists(tmp):
    np.save(tmp / "X.npy", np.zeros((8, 4), np.float32))
    (tmp / "out.h5").write_bytes(b"")
    return _cli(["ingest", "X.npy", "-o", "out.h5", "--no-progress"], tmp)


def ingest_shapes_differ(tmp):
    np.save(tmp / "a.npy", np.zeros((8, 4), np.float32))
    np.save(tmp / "b.npy", np.zeros((8, 5), np.float32))
    return _cli(["ingest", "a.npy", "b.npy", "-o", "out.h5", "--no-progress"], tmp)


def ingest_missing_input(tmp):
    return _cli(["ingest", "run7.npy", "-o", "out.h5", "--no-progress"], tmp)


class _Stop(Exception):
    pass


def _stop_after_a_commit(batch, committed):
    if committed:
        raise _Stop


def ingest_interrupted(tmp):
    np.save(tmp / "X.npy", np.zeros((64, 4), np.float32))
    with contextlib.chdir(tmp), pytest.raises(_Stop):  # a run that ends after its first committed batch
        ingest(["X.npy"], "out.h5", batch_size=16, commit_interval=0, progress=False,
               on_batch_written=_stop_after_a_commit)
    return _cli(["ingest", "X.npy", "-o", "out.h5", "--no-progress"], tmp)


def ckpt_locked(tmp):
    w = CheckpointWriter(tmp / "ck")
    try:
        return _raises(lambda: CheckpointWriter(tmp / "ck"))
    finally:
        w.close()


def ckpt_not_a_root(tmp):
    with CheckpointWriter(tmp / "runs" / "ck") as w:
        w.save({"w": torch.zeros(4)}, 1)
    return _cli(["verify", str(tmp / "runs")], tmp, exe=CKPT_CLI)


class Config:  # an object of the user's own class in a state dict: pickled, refused on load
    lr = 0.1


def ckpt_untrusted_pickle(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"w": torch.zeros(4), "config": Config()}, 1)
    return _raises(lambda: load(tmp / "ck"))


def _damaged_root(tmp):
    """A root whose one chunk has a flipped byte."""
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"model.w": torch.arange(1024.0)}, 1)
    chunk = next(p for p in (tmp / "ck" / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    os.chmod(chunk, 0o644)
    chunk.write_bytes(bytes(data))
    return tmp / "ck"


def ckpt_damaged_chunk(tmp):
    root = _damaged_root(tmp)
    return _raises(lambda: load(root))


def ckpt_export_to_pt(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"w": torch.zeros(4)}, 1)
    return _cli(["export", f"{tmp / 'ck'}@1", "-o", "model.pt"], tmp, exe=CKPT_CLI)


def ckpt_meta_not_json(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        return _raises(lambda: w.save({"w": torch.zeros(4)}, 1, meta={"loss": float("nan")}))


def ckpt_sparse(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        return _raises(lambda: w.save({"emb": torch.zeros(4, 4).to_sparse()}, 1))


def ckpt_step_exists(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"w": torch.zeros(4)}, 1).result()
        return _warns(lambda: w.save({"w": torch.ones(4)}, 1).result())


def ckpt_step_exists_refused(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"w": torch.zeros(4)}, 1).result()
        return _raises(lambda: w.save({"w": torch.ones(4)}, 1, overwrite=False))


def ckpt_no_version(tmp):
    with CheckpointWriter(tmp / "ck") as w:
        w.save({"w": torch.zeros(4)}, 1)
    return _raises(lambda: load(tmp / "ck", step=7))


def ckpt_verify_damage(tmp):
    root = _damaged_root(tmp)
    assert not verify(root).ok
    return _cli(["verify", str(root)], tmp, code=1, exe=CKPT_CLI, out="stdout")


TRIGGERS = [glob_matches_nothing, files_with_other_fields,
            missing_package, mpi_backend_outside_mpirun, no_cuda, file_missing, not_hdf5, field_missing,
            fields_disagree, index_out_of_range, damaged_sample, http_without_ranges, http_not_found, http_forbidden,
            buffer_not_understood, buffer_fraction_out_of_range, buffer_larger_than_memory, spill_needs_bytes,
            spill_dir_missing, distributed_and_sampler, wrapper_dataset, buffer_on_plain_dataset,
            resume_other_dataset, resume_other_seed, resume_then_set_epoch, codec_integer, codec_two_bounds,
            codec_damaged_blob, ingest_output_exists, ingest_shapes_differ, ingest_missing_input,
            ingest_interrupted, ckpt_locked,
            ckpt_not_a_root, ckpt_untrusted_pickle, ckpt_damaged_chunk, ckpt_export_to_pt, ckpt_meta_not_json,
            ckpt_sparse, ckpt_no_version, ckpt_verify_damage, ckpt_step_exists, ckpt_step_exists_refused]


def _quotes() -> list[tuple[int, str]]:
    text = PAGE.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1).strip())
            for m in re.finditer(r"^```text\n(.*?)^```", text, re.S | re.M)]


def _pattern(quote: str) -> re.Pattern:
    parts = [re.escape(" ".join(p.split())) for p in quote.split("…")]
    return re.compile(r"\s*" + r".*?".join(parts) + r"\s*", re.S)


def _matches(quote: str, message: str) -> bool:
    return _pattern(quote).fullmatch(" ".join(message.split())) is not None


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    """Each trigger's real message (None where it cannot happen here, e.g. no CUDA test on a GPU)."""
    out = {}
    for trigger in TRIGGERS:
        try:
            out[trigger.__name__] = trigger(tmp_path_factory.mktemp(trigger.__name__))
        except pytest.skip.Exception:
            out[trigger.__name__] = None
    return out


@pytest.mark.parametrize("name", [t.__name__ for t in TRIGGERS])
def test_the_page_quotes_the_real_message(messages, name):
    message = messages[name]
    if message is None:
        pytest.skip("this message cannot happen on this machine")
    hits = [line for line, quote in _quotes() if _matches(quote, message)]
    assert len(hits) == 1, f"{name}: the message\n  {message}\nmatches {len(hits)} quotes of {PAGE.name} " \
                           f"(lines {hits}); quote it once, with … for the variable parts"


def test_every_quote_is_a_real_message(messages):
    source = " ".join(" ".join(p.read_text().split()) for d in ("solar", "io_backends", "cache")
                      for p in (ROOT / d).rglob("*.py"))
    for line, quote in _quotes():
        elsewhere = [k for k in TESTED_ELSEWHERE if k in quote]
        if elsewhere:  # produced under mpirun or without root by the test named; its words are the library's
            assert elsewhere[0] in source, f"line {line}: {elsewhere[0]!r} is no longer in the library's messages"
            assert (ROOT / TESTED_ELSEWHERE[elsewhere[0]]).exists(), TESTED_ELSEWHERE[elsewhere[0]]
            continue
        produced = [n for n, m in messages.items() if m is not None and _matches(quote, m)]
        assert produced, f"{PAGE.name}:{line}: no trigger here produces this message:\n{quote}"
