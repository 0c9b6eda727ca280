"""State-dict values the checkpoint flattener must refuse by name or round-trip exactly, and what
``verify`` says about a stored chunk that has grown."""

from __future__ import annotations

import enum
import threading

import pytest
import torch

from solar.checkpoint import CheckpointWriter, load, verify
from solar.checkpoint.flatten import flatten
from solar.checkpoint.store import CheckpointStore, chunk_key
from solar.errors import InputError

KB = 1024


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


class Split(enum.StrEnum):
    TRAIN = "train"


class Perm(enum.IntFlag):
    R = 4
    W = 2


@pytest.mark.parametrize("value, type_name", [(lambda e: 0.9 ** e, "function"), (threading.Lock(), "lock")])
def test_unpicklable_value_is_refused_naming_key_and_type(tmp_path, value, type_name):
    state = {"sched": {"fn": value}, "w": torch.zeros(2)}
    with pytest.raises(InputError, match=r"'sched\.fn'.*" + type_name + r".*drop it") as info:
        flatten(state)
    assert isinstance(info.value, ValueError)
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        with pytest.raises(InputError, match=r"'sched\.fn'"):
            wr.save(state, 1, blocking=True)
        wr.save({"w": torch.zeros(2)}, 2, blocking=True)  # the writer is still usable
    assert load(tmp_path / "ck")["w"].shape == (2,)


def test_enum_values_and_keys_round_trip_as_themselves(tmp_path):
    state = {"mode": Mode.EVAL, "split": Split.TRAIN, "perm": Perm.R | Perm.W, "by_mode": {Mode.TRAIN: 1.5},
             "by_split": {Split.TRAIN: 3}, "modes": [Mode.TRAIN, (Mode.EVAL,)], "plain": {"i": 7, "s": "x", "b": True}}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 1)
    out = load(tmp_path / "ck", 1)
    assert out == state
    assert type(out["mode"]) is Mode and type(out["split"]) is Split and type(out["perm"]) is Perm
    assert type(next(iter(out["by_mode"]))) is Mode and type(next(iter(out["by_split"]))) is Split
    assert type(out["modes"][0]) is Mode and type(out["modes"][1][0]) is Mode
    # plain values stay readable JSON in the manifest (the on-disk format is unchanged for them)
    assert flatten(state["plain"]).skeleton == {"i": 7, "s": "x", "b": True}


def test_complex_requires_grad_round_trips_like_real(tmp_path):
    c = torch.randn(3, dtype=torch.complex64).requires_grad_(True)
    state = {"c": c, "c128": torch.randn(2, dtype=torch.complex128).requires_grad_(True),
             "r": torch.randn(3).requires_grad_(True), "p": torch.nn.Parameter(torch.randn(2, dtype=torch.complex64)),
             "frozen": torch.randn(2, dtype=torch.complex64)}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 1)
    out = load(tmp_path / "ck", 1)
    for name in ("c", "c128", "r", "p"):
        assert out[name].requires_grad, name
        assert torch.equal(out[name].detach(), state[name].detach())
    assert isinstance(out["p"], torch.nn.Parameter) and not out["frozen"].requires_grad


def test_verify_reports_an_oversized_chunk_with_its_expected_size(tmp_path):
    root = tmp_path / "ck"
    with CheckpointWriter(root, chunk_size=4 * KB) as wr:
        wr.save({"w": torch.randn(1024), "b": torch.zeros(4)}, 1)  # w: one full 4 KiB chunk
    store = CheckpointStore(root)
    m = store.read_manifest(1)
    (blob,) = [i for i in range(len(m.blobs)) if m.tensors_of_blob(i) == ["w"]]
    digest = m.blob_digests(blob)[0].tobytes()
    with open(store.tier.path(chunk_key(digest)), "ab") as f:
        f.write(b"\0" * 100)  # now larger than any chunk of the version
    rep = verify(root)
    assert not rep.ok
    (p,) = rep.problems
    assert p["chunk"] == digest.hex() and p["tensors"] == ["w"]
    assert p["detail"] == f"larger than expected ({4 * KB} B)" and "-1" not in p["detail"]
