"""Checkpoint roots and output paths someone else prepared (issue 27): no code execution, no file
clobbering, no memory blow-up. Each test builds the crafted root or file a downloaded checkpoint
(or a hostile neighbour in a shared directory) could hold."""

from __future__ import annotations

import base64
import enum
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import textwrap
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
import xxhash

from solar.checkpoint import CheckpointWriter, load, verify
from solar.checkpoint.cli import main
from solar.checkpoint.collect import gc
from solar.errors import CheckpointError, CorruptDataError

KB = 1024
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mode(enum.IntEnum):
    TRAIN = 1


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def make_root(path, state=None, chunk_size=4 * KB):
    state = state if state is not None else {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    with CheckpointWriter(path, chunk_size=chunk_size) as wr:
        wr.save(state, 1)
    return path


def rewrite_manifest(root, step, mutate):
    """Apply ``mutate(header)`` to a manifest's JSON header and recompute its checksum, as a
    crafted root would: the result passes every integrity check."""
    path = os.path.join(root, "manifests", f"{step:020d}")
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack_from("<Q", data, 16)
    header = json.loads(data[24:24 + hlen])
    digests = data[24 + hlen:-24]
    mutate(header)
    head = json.dumps(header).encode()
    body = data[:16] + struct.pack("<Q", len(head)) + head + digests
    with open(path, "wb") as f:
        f.write(body + xxhash.xxh3_128_digest(body) + b"SOLAREND")


class _Plant:
    """Unpickling it creates the directory ``path``: a harmless stand-in for any code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def plant_pickle(root, marker):
    payload = base64.b64encode(pickle.dumps(_Plant(str(marker)))).decode()
    rewrite_manifest(root, 1, lambda h: h["skeleton"].__setitem__("evil", {"__pickle__": payload}))


# -- 1. no code execution on load --

def test_load_refuses_a_planted_pickle_by_default(tmp_path):
    root, marker = make_root(tmp_path / "ck"), tmp_path / "pwned"
    plant_pickle(root, marker)
    with pytest.raises(CheckpointError) as err:
        load(root)
    assert not marker.exists()
    msg = str(err.value)
    assert "'evil'" in msg and "mkdir" in msg and "weights_only=False" in msg and str(root) in msg
    # the explicit opt-in unpickles it: the way to load a root you trust
    state = load(root, weights_only=False)
    assert marker.exists() and state["evil"] is None


def test_restore_refuses_a_planted_pickle_without_trust_pickle(tmp_path, capsys):
    root, marker = make_root(tmp_path / "ck"), tmp_path / "pwned"
    plant_pickle(root, marker)
    code, _out, err = run_cli(capsys, "restore", root, "-o", tmp_path / "x.pt")
    assert code == 2 and not marker.exists() and not (tmp_path / "x.pt").exists()
    assert "--trust-pickle" in err and "evil" in err and len(err.strip().splitlines()) == 1
    code, _out, err = run_cli(capsys, "restore", root, "-o", tmp_path / "x.pt", "--trust-pickle")
    assert code == 0 and marker.exists()


def test_safe_pickled_values_load_by_default(tmp_path):
    """What real training states pickle (a numpy RNG state, a Fraction, an IntEnum of an imported
    module, sets) is on the allow-list, so ordinary roots load without the opt-in."""
    rng = np.random.RandomState(3).get_state()
    state = {"w": torch.ones(3), "rng": rng, "frac": Fraction(1, 3), "mode": Mode.TRAIN, "tags": {"a", "b"},
             "arr": np.arange(5, dtype=np.int16), "dt": np.dtype("float32"), "c": complex(1, 2)}
    root = make_root(tmp_path / "ck", state)
    got = load(root)
    assert got["rng"][0] == "MT19937" and np.array_equal(got["rng"][1], rng[1])
    assert got["frac"] == Fraction(1, 3) and got["mode"] is Mode.TRAIN and got["tags"] == {"a", "b"}
    assert np.array_equal(got["arr"], np.arange(5, dtype=np.int16)) and got["dt"] == np.dtype("float32")
    assert got["c"] == complex(1, 2)


# -- 2. no file clobbering through planted links --

@pytest.mark.parametrize("how", ["writer", "gc", "gc-dry-run", "verify-repair"])
def test_a_lock_symlink_never_touches_its_target(tmp_path, how):
    root = make_root(tmp_path / "ck")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    os.unlink(root / ".lock")
    os.symlink(victim, root / ".lock")
    with pytest.raises(CheckpointError) as err:
        if how == "writer":
            CheckpointWriter(root).close()
        elif how.startswith("gc"):
            gc(root, keep_last=1, dry_run=how == "gc-dry-run")
        else:
            verify(root, repair=True)
    assert victim.read_text() == "precious data\n"
    assert ".lock" in str(err.value) and "remove" in str(err.value)


def test_a_lock_hard_link_or_fifo_is_refused(tmp_path):
    root = make_root(tmp_path / "ck")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    os.unlink(root / ".lock")
    os.link(victim, root / ".lock")
    with pytest.raises(CheckpointError, match="lock"):
        gc(root, keep_last=1)
    assert victim.read_text() == "precious data\n"
    os.unlink(root / ".lock")
    os.mkfifo(root / ".lock")
    with pytest.raises(CheckpointError, match="not a regular file"):
        gc(root, keep_last=1)


def test_a_stale_lock_of_ours_is_reused(tmp_path):
    """The .lock a finished writer leaves holds its owner JSON: the next writer takes it over."""
    root = make_root(tmp_path / "ck")
    assert json.loads((root / ".lock").read_text())["pid"] == os.getpid()
    gc(root, keep_last=1)
    make_root(root)


def test_a_chunk_directory_symlink_gets_no_chunks(tmp_path):
    root, outside = tmp_path / "ck", tmp_path / "elsewhere"
    outside.mkdir()
    (root / "chunks").mkdir(parents=True)
    for i in range(256):
        os.symlink(outside, root / "chunks" / f"{i:02x}")
    with pytest.raises(CheckpointError) as err:
        make_root(root)
    assert os.listdir(outside) == []
    assert "symlink" in str(err.value) and str(root) in str(err.value)


def test_a_planted_symlink_or_fifo_is_not_read_through(tmp_path):
    """A manifest that is a symlink to a file elsewhere, or a FIFO (which would block the read
    forever), is refused instead of followed."""
    root = make_root(tmp_path / "ck")
    good = root / "manifests" / f"{1:020d}"
    (tmp_path / "copy").write_bytes(good.read_bytes())
    os.symlink(tmp_path / "copy", root / "manifests" / f"{2:020d}")
    os.mkfifo(root / "manifests" / f"{3:020d}")
    with pytest.raises(CorruptDataError, match="symlink"):
        load(root, step=2)
    with pytest.raises(CorruptDataError, match="not a regular file"):
        load(root, step=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load(root)["step"] == 1  # the newest good version: the planted ones are skipped
    assert sorted(str(w.message).split(":")[0] for w in seen) == ["skipping checkpoint step 2",
                                                                    "skipping checkpoint step 3"]


# -- 3. manifest sizes are checked before anything is allocated --

def _limited(code: str, limit_gib: int = 3) -> subprocess.CompletedProcess:
    """Run ``code`` in a child whose address space is capped: a huge allocation fails there
    instead of taking the machine down."""
    prelude = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit_gib << 30}, {limit_gib << 30}))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.mark.parametrize("mutate", [
    lambda h: h["blobs"][0].__setitem__("nbytes", 2 ** 50),
    lambda h: h.__setitem__("chunk_size", 1),
], ids=["nbytes-1PiB", "chunk_size-1"])
@pytest.mark.parametrize("how", ["load", "verify"])
def test_huge_sizes_are_corrupt_not_an_allocation(tmp_path, mutate, how):
    root = make_root(tmp_path / "ck")
    rewrite_manifest(root, 1, mutate)
    call = f"solar.checkpoint.load({str(root)!r}, step=1)" if how == "load" else \
        f"solar.checkpoint.cli.main(['verify', {str(root) + '@1'!r}])"
    res = _limited(f"""
        import solar.checkpoint, solar.checkpoint.cli
        from solar.errors import CorruptDataError
        try:
            code = {call}
        except CorruptDataError as exc:
            print("CORRUPT", exc)
        else:
            print("EXIT", code)
    """)
    out = res.stdout + res.stderr
    assert "CORRUPT" in out or "EXIT 2" in out, out[-2000:]
    assert "step 1" in out and ("blobs[0]" in out or "'chunk_size'" in out), out[-2000:]


@pytest.mark.parametrize("mutate, names", [
    (lambda h: h["tensors"][0].__setitem__("offset", 10 ** 6), "tensors[0] (tensor 'w')"),
    (lambda h: h["tensors"][0].__setitem__("shape", [-4096]), "tensors[0] (tensor 'w')"),
    (lambda h: h["tensors"][0].__setitem__("dtype", "object"), "tensors[0] (tensor 'w')"),
    (lambda h: h["tensors"][0].__setitem__("blob", 7), "tensors[0] (tensor 'w')"),
    (lambda h: h["tensors"][0].pop("stride"), "tensors[0]"),
    (lambda h: h["tensors"][0].__setitem__("evil", 1), "tensors[0]"),
    (lambda h: h["blobs"][0].__setitem__("first", 10 ** 6), "blobs[0]"),
    (lambda h: h["blobs"][0].__setitem__("nchunks", 1), "blobs[0]"),
    (lambda h: h.pop("chunk_size"), "chunk_size"),
    (lambda h: h.__setitem__("tensors", {"a": 1}), "tensors"),
    (lambda h: h.__setitem__("hash", "md5"), "hash"),
])
def test_bad_manifest_entries_are_corrupt_data(tmp_path, mutate, names):
    root = make_root(tmp_path / "ck")
    rewrite_manifest(root, 1, mutate)
    with pytest.raises(CorruptDataError) as err:
        load(root, step=1)
    assert "step 1" in str(err.value) and names in str(err.value) and str(root) in str(err.value)


# -- 4. outputs in shared directories --

def test_output_never_goes_through_a_predictable_temp_name(tmp_path, capsys):
    root = make_root(tmp_path / "ck")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    out = tmp_path / "shared" / "x.pt"
    out.parent.mkdir()
    for planted in (f"{out}.tmp{os.getpid()}", f"{out}.tmp"):  # the old name, and a guess at a fixed one
        os.symlink(victim, planted)
    assert run_cli(capsys, "restore", root, "-o", out)[0] == 0
    assert victim.read_text() == "precious data\n"
    assert torch.equal(torch.load(out)["w"], torch.arange(4096, dtype=torch.float32))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask


def test_write_atomic_temp_is_private_and_exclusive(tmp_path):
    from solar.fileio import write_atomic, write_text_atomic

    seen = []

    def write(tmp):
        seen.append((tmp, stat.S_IMODE(os.stat(tmp).st_mode)))
        with open(tmp, "w") as f:
            f.write("x")

    write_atomic(str(tmp_path / "r.json"), write, suffix=".json")
    (tmp, mode), = seen
    assert mode == 0o600 and tmp.endswith(".json") and os.path.dirname(tmp) == str(tmp_path)
    assert (tmp_path / "r.json").read_text() == "x" and os.listdir(tmp_path) == ["r.json"]
    write_text_atomic(str(tmp_path / "r.json"), "y")
    assert (tmp_path / "r.json").read_text() == "y"


def test_spill_directories_are_private(tmp_path):
    from solar.cache.spill import SpillTier

    tier = SpillTier.on_disk(str(tmp_path / "spill"), 0, 1 << 20)
    try:
        tier.put(1, np.arange(64, dtype=np.uint8))
        for d in (tmp_path / "spill", tier.second.root):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["packs", "deltas"])
def test_a_pack_or_delta_directory_symlink_is_not_read_through(tmp_path, kind):
    """Packs and deltas are read by opening their files directly: a directory of them that is
    a symlink out of the root (even to a faithful copy) is refused, naming it, as for chunks."""
    root, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    w = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    with CheckpointWriter(root, chunk_size=4 * KB, pack=(1 << 20) if kind == "packs" else False,
                          deltas=kind == "deltas") as writer:
        writer.save({"w": w}, 1).result()
        w[::1024] += 1  # one element in every chunk: each stored as a delta against step 1
        writer.save({"w": w}, 2).result()
    assert torch.equal(load(root, step=2)["w"], w)
    os.rename(root / kind, elsewhere)
    os.symlink(elsewhere, root / kind)
    with pytest.raises(CorruptDataError, match="symlink") as err:
        load(root, step=2)
    assert str(root) in str(err.value)
