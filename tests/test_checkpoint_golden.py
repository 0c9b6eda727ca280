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
