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


@pytest.mark.parametrize("small_first", [True, False])
def test_two_storages_starting_at_one_address_round_trip_in_either_order(tmp_path, small_first):
    """``torch.from_numpy(a[:10])`` and ``torch.from_numpy(a)`` are two storages at one address;
    with the smaller first, its span was staged from the smaller storage: a bare RuntimeError."""
    import numpy as np

    a = np.arange(1000, dtype=np.float32)
    items = [("small", torch.from_numpy(a[:10])), ("big", torch.from_numpy(a))]
    state = dict(items if small_first else items[::-1])
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save(state, 1)
    out = load(tmp_path / "ck", 1)
    assert list(out) == list(state)
    assert torch.equal(out["small"], state["small"]) and torch.equal(out["big"], state["big"])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_and_meta_tensors_are_refused_by_name(tmp_path):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(InputError, match=r"tensor 'model\.n' is a nested tensor; save its parts \(\.unbind\(\)\)"):
        flatten({"model": {"n": nested}})
    with pytest.raises(InputError, match=r"'m' is on the meta device .* materialize it") as info:
        flatten({"m": torch.empty(3, device="meta")})
    assert "dequantize" not in str(info.value)


@pytest.mark.parametrize("meta", [{"loss": float("nan")}, {"cfg": torch.ones(1)},
                                  {"path": __import__("pathlib").Path("/x")}, ["not", "a", "dict"]])
def test_meta_that_is_not_json_is_refused_when_save_is_called(tmp_path, meta):
    """It failed only in the background commit, after every chunk was written, with a bare json
    error that did not mention meta."""
    from solar.errors import ConfigError

    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        with pytest.raises(ConfigError, match="meta of step 1 "):
            wr.save({"w": torch.ones(4)}, 1, meta=meta)
    assert not (tmp_path / "ck" / "chunks").exists()  # refused before anything was staged or written


def test_meta_is_copied_when_save_is_called(tmp_path):
    meta = {"git": "abc123", "cfg": {"lr": 0.1}}
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        fut = wr.save({"w": torch.ones(4)}, 1, meta=meta)
        meta["git"] = "CHANGED-AFTER-RETURN"
        meta["cfg"]["lr"] = 1.0
        fut.result()
    assert CheckpointStore(tmp_path / "ck").read_manifest(1).meta == {"git": "abc123", "cfg": {"lr": 0.1}}


def test_map_location_callables_of_either_form(tmp_path):
    """torch.load calls ``fn(storage, location)``; SOLAR's own form is ``fn(location)``."""
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as wr:
        wr.save({"w": torch.arange(4.0)}, 1)
    for fn in (lambda storage, loc: storage, lambda storage, loc: None, lambda storage, loc: "cpu",
               lambda loc: "cpu", lambda loc: torch.device("cpu")):
        out = load(tmp_path / "ck", 1, map_location=fn)
        assert torch.equal(out["w"], torch.arange(4.0)) and out["w"].device.type == "cpu"
