"""The on-disk format ``solar-ckpt/1`` against a committed golden root (tests/fixtures/checkpoint).

Regenerate only on a deliberate format change: ``SOLAR_REGEN_GOLDEN=1 pytest tests/test_checkpoint_golden.py``.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict

import pytest
import torch

from solar.checkpoint import CheckpointWriter, load, verify
from solar.checkpoint.manifest import MAGIC
from solar.checkpoint.store import CheckpointStore, manifest_key

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint", "root")
CHUNK = 1024


def golden_states():
    """Two versions built without RNG, so they are the same on every platform and torch version."""
    w = (torch.arange(24 * 32, dtype=torch.float32) / 7).reshape(24, 32)  # 3 KiB -> 3 chunks
    emb = torch.zeros(16, 8, dtype=torch.bfloat16)
    v1 = {"model": OrderedDict([("w", w), ("w_tied", w), ("emb", emb), ("ids", torch.arange(5, dtype=torch.int16))]),
          "optim": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99)}]},
          "epoch": 1}
    w2 = w.clone()
    w2[0, :4] = -1.0
    emb2 = emb.clone()
    emb2[3] = 2.5
    v2 = {"model": OrderedDict([("w", w2), ("w_tied", w2), ("emb", emb2), ("ids", torch.arange(5, dtype=torch.int16))]),
          "optim": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99)}]},
          "epoch": 2}
    return {1: v1, 2: v2}


def write(root):
    with CheckpointWriter(root, chunk_size=CHUNK) as w:
        for step, state in golden_states().items():
            w.save(state, step)


@pytest.fixture(scope="module")
def golden():
    if os.environ.get("SOLAR_REGEN_GOLDEN") == "1":
        shutil.rmtree(GOLDEN, ignore_errors=True)
        write(GOLDEN)
        os.unlink(os.path.join(GOLDEN, ".lock"))
    return GOLDEN


def test_golden_loads_bit_exact(golden):
    for step, want in golden_states().items():
        got = load(golden, step)
        assert got["epoch"] == want["epoch"]
        assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
        for k, t in want["model"].items():
            assert got["model"][k].dtype == t.dtype and torch.equal(got["model"][k], t), (step, k)
        assert got["optim"]["state"][0]["step"].item() == step
        assert got["model"]["w"].data_ptr() == got["model"]["w_tied"].data_ptr()
    assert verify(golden).ok


def test_writer_still_produces_the_golden_format(golden, tmp_path):
    write(tmp_path)
    old, new = CheckpointStore(golden), CheckpointStore(tmp_path)
    assert sorted(old.chunk_digests()) == sorted(new.chunk_digests())
    for step in (1, 2):
        a, b = old.read_manifest(step), new.read_manifest(step)
        assert ((a.root, a.hash, a.chunk_size, a.skeleton, a.parent, a.stats)
                == (b.root, b.hash, b.chunk_size, b.skeleton, b.parent, b.stats))
        assert [t.to_json() for t in a.tensors] == [t.to_json() for t in b.tensors]
        assert [x.to_json() for x in a.blobs] == [x.to_json() for x in b.blobs]
        assert a.digests.tobytes() == b.digests.tobytes()
        assert old.tier.get(manifest_key(step))[:16] == MAGIC


# -- solar-ckpt/2: chunks stored as deltas (issue 23) --

GOLDEN_DELTAS = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint", "root-deltas")


def golden_delta_states():
    """Three versions of a 6 KiB bf16 tensor (6 chunks of 1 KiB), a few elements changed each time, no RNG."""
    w = (torch.arange(3072, dtype=torch.float32) / 97).to(torch.bfloat16)
    out = {}
    for step in (1, 2, 3):
        if step > 1:
            w = w.clone()
            w[(step * 13) % 300::211] += 0.5 * step  # 14-15 elements over 6 chunks
        out[step] = {"w": w, "epoch": step}
    return out


def write_deltas(root):
    with CheckpointWriter(root, chunk_size=CHUNK, deltas=True) as w:
        for step, state in golden_delta_states().items():
            w.save(state, step)


@pytest.fixture(scope="module")
def golden_deltas():
    if os.environ.get("SOLAR_REGEN_GOLDEN") == "1":
        shutil.rmtree(GOLDEN_DELTAS, ignore_errors=True)
        write_deltas(GOLDEN_DELTAS)
        os.unlink(os.path.join(GOLDEN_DELTAS, ".lock"))
    return GOLDEN_DELTAS


def test_golden_deltas_load_bit_exact(golden_deltas):
    store = CheckpointStore(golden_deltas)
    assert store.read_manifest(3).deltas and store.read_manifest(3).stats["delta_chunks"] == 6
    for step, want in golden_delta_states().items():
        got = load(golden_deltas, step)
        assert got["epoch"] == step
        assert got["w"].view(torch.int16).tolist() == want["w"].view(torch.int16).tolist(), step
    assert verify(golden_deltas).ok


def test_writer_still_produces_the_golden_delta_format(golden_deltas, tmp_path):
    write_deltas(tmp_path)
    old, new = CheckpointStore(golden_deltas), CheckpointStore(tmp_path)
    assert sorted(old.chunk_digests()) == sorted(new.chunk_digests())
    for step in (1, 2, 3):
        a, b = old.read_manifest(step), new.read_manifest(step)
        assert (a.root, a.chunk_size, a.skeleton) == (b.root, b.chunk_size, b.skeleton)
        assert a.digests.tobytes() == b.digests.tobytes()
        # the same chains; the delta objects' sizes depend on the zstd release, so they are not compared
        chains = [{d: (r.base, r.depth) for d, r in m.deltas.items()} for m in (a, b)]
        assert chains[0] == chains[1]
        raw = old.tier.get(manifest_key(step))
        assert raw[:16] == MAGIC and (b'"format":"solar-ckpt/2"' in raw) == (step > 1)
