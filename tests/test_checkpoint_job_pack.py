"""Pack files (``pack=True``; the job writer's default): a save writes its small chunks (small
tensors, blob tails) into one pack, so it makes a few files whatever the tensor count; dedup,
gc, verify and repair keep working, and roots without packs load as before."""

from __future__ import annotations

import os

import torch

from solar.checkpoint import CheckpointWriter, gc, load, verify

CHUNK = 4096


def many_small(step: int) -> dict:
    """200 small tensors (under one chunk each) and one large one."""
    g = torch.Generator().manual_seed(0)
    small = {f"layer{i}.bias": torch.randn(16, generator=g) for i in range(200)}
    small["layer7.bias"] = small["layer7.bias"] + step  # one small tensor changes per step
    return {"small": small, "big": torch.arange(4 * CHUNK, dtype=torch.float32), "step": torch.tensor(step)}


def files(root) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, _s, fs in os.walk(root):
        for f in fs:
            top = os.path.relpath(os.path.join(d, f), root).split(os.sep)[0]
            out[top] = out.get(top, 0) + 1
    return out


def same(a: dict, b: dict) -> bool:
    return all(a["small"][k].equal(v) for k, v in b["small"].items()) and a["big"].equal(b["big"]) \
        and a["step"].equal(b["step"])


def test_a_save_of_many_small_tensors_makes_a_few_files(tmp_path):
    packed, loose = tmp_path / "packed", tmp_path / "loose"
    with CheckpointWriter(packed, chunk_size=CHUNK, pack=True) as w:
        first = w.save(many_small(0), 0).result()
    with CheckpointWriter(loose, chunk_size=CHUNK) as w:
        w.save(many_small(0), 0)
    assert files(packed) == {"packs": 1, "manifests": 1, "chunks": 16, ".lock": 1}  # `big`'s 16 full chunks
    assert files(loose)["chunks"] > 200
    assert first.chunks_written == 200 + 1 + 16  # the biases, `step` and `big`'s chunks, no two alike
    assert same(load(packed), many_small(0)) and verify(packed).ok


def test_dedup_gc_verify_and_repair_work_through_packs(tmp_path):
    root = tmp_path / "ck"
    with CheckpointWriter(root, chunk_size=CHUNK, pack=True, keep_last=2) as w:
        again = [w.save(many_small(0), s).result() for s in (0, 1)][1]
        assert again.bytes_written == 0  # nothing new: no pack either
        one = w.save(many_small(1), 2).result()
        assert one.chunks_written == 2  # layer7.bias and step, in one new pack
        w.save(many_small(2), 3)
    # the first save's pack stays (versions 2 and 3 use most of its chunks), beside one pack each
    assert files(root)["packs"] == 3
    for s in (2, 3):
        assert same(load(root, s), many_small(s - 1))
    assert verify(root).ok
    rep = gc(root, keep_last=1)
    assert rep.removed_versions == [2] and rep.removed_packs == 1 and same(load(root), many_small(2))
    # damage in a pack: verify names the tensor; repair marks the chunk but keeps the pack (it holds others)
    pack = next(os.path.join(d, f) for d, _s, fs in os.walk(root / "packs") for f in fs)
    data = bytearray(open(pack, "rb").read())
    data[0] ^= 0xFF
    open(pack, "wb").write(bytes(data))
    bad = verify(root, repair=True)
    assert not bad.ok and bad.problems[0]["packed"] and bad.removed_chunks == [] and len(bad.marked_chunks) == 1
    assert os.path.exists(pack)
    with CheckpointWriter(root, chunk_size=CHUNK, pack=True) as w:
        healed = w.save(many_small(2), 4).result()
    assert healed.chunks_written == 1 and same(load(root, 4), many_small(2))


def test_packs_and_staging_are_refused_together(tmp_path):
    import pytest

    from solar.errors import ConfigError

    with pytest.raises(ConfigError, match="pack=True and staging="):
        CheckpointWriter(tmp_path / "ck", pack=True, staging=tmp_path / "stage")
