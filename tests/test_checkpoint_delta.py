"""Fine-grained increments (issue 23): changed chunks stored as deltas against the previous save's chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solar.checkpoint import CheckpointWriter, load, verify
from solar.checkpoint.delta import (DENSE, SPARSE, SPARSE16, XOR, apply, changed_leaves, changed_positions, encode,
                                    header, xor_delta)
from solar.checkpoint.deltastore import delta_key, delta_keys
from solar.checkpoint.store import CheckpointStore
from solar.errors import ConfigError

BASE = bytes(range(16))


def _bf16(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _touch(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """``t`` with about ``frac`` of its elements nudged, at random positions."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    m = torch.rand(t.numel(), generator=g) < frac
    out[m] = (out[m].float() * 1.03 + 0.01).to(t.dtype)
    return out


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("frac", [0.0005, 0.01, 0.1])
def test_encode_apply_round_trip_and_size(frac):
    old = _bf16(1 << 19)
    new = _touch(old, frac, 1)
    a, b = _bytes(new), _bytes(old)
    enc = encode(a, b, BASE, 2)
    assert enc.changed == int((new.view(torch.int16) != old.view(torch.int16)).sum())
    assert enc.data is not None and len(enc.data) < 3.2 * enc.changed * 2 + 64
    if frac < 0.05:
        assert header(enc.data).kind == SPARSE16  # every gap below 2**16 elements
    out = bytearray(b)
    apply(enc.data, memoryview(out), BASE)
    assert bytes(out) == bytes(a)


def test_gaps_of_2_to_the_16_elements_or_more_use_wide_positions():
    old = torch.zeros(1 << 18, dtype=torch.int32)
    new = old.clone()
    new[[3, 100_000, 200_000]] = 7
    enc = encode(_bytes(new), _bytes(old), BASE, 4)
    assert header(enc.data).kind == SPARSE
    out = bytearray(_bytes(old))
    apply(enc.data, memoryview(out), BASE)
    assert bytes(out) == bytes(_bytes(new))


def test_moderately_dense_changes_encode_the_smaller_form_and_dense_ones_are_refused():
    g = torch.Generator().manual_seed(4)
    old = torch.zeros(1 << 18, dtype=torch.int32)
    new = old.clone()
    pos = torch.randperm(old.numel(), generator=g)[: old.numel() // 5]
    new[pos] = torch.randint(1, 8, (len(pos),), generator=g, dtype=torch.int32)  # 20% changed, small XORs
    enc = encode(_bytes(new), _bytes(old), BASE, 4)
    xor = xor_delta(_bytes(new), _bytes(old), BASE, 4)
    assert enc.data is not None and len(enc.data) <= len(xor)
    assert header(enc.data).kind == (XOR if enc.data == xor else SPARSE16)
    for data in (enc.data, xor):
        out = bytearray(_bytes(old))
        apply(data, memoryview(out), BASE)
        assert bytes(out) == bytes(_bytes(new))
    dense = old + torch.arange(old.numel(), dtype=torch.int32)
    got = encode(_bytes(dense), _bytes(old), BASE, 4)
    assert got.data is None and got.changed == -1
    assert DENSE < 1


def test_apply_refuses_another_base_and_damage():
    old = _bf16(4096)
    new = _touch(old, 0.01, 2)
    enc = encode(_bytes(new), _bytes(old), BASE, 2)
    with pytest.raises(ValueError, match="delta against chunk"):
        apply(enc.data, memoryview(bytearray(_bytes(old))), bytes(16))
    bad = bytearray(enc.data)
    bad[-3] ^= 0xFF
    with pytest.raises(ValueError):
        apply(bytes(bad), memoryview(bytearray(_bytes(old))), BASE)
    with pytest.raises(ValueError, match="not a delta object"):
        apply(b"nonsense" * 8, memoryview(bytearray(_bytes(old))), BASE)


def test_change_detection_in_torch_on_the_tensors_device():
    old = _bf16(10_000).view(torch.uint8)
    new = old.clone()
    new[[5, 4097, 9999]] ^= 1
    idx, leaves = changed_leaves(new, old, 1024)
    assert idx.tolist() == [0, 4, 9] and leaves.shape == (3, 1024) and leaves.device.type == "cpu"
    assert torch.equal(leaves[1], new[4096:5120])
    assert changed_positions(new, old, 2).tolist() == [2, 2048, 4999]
    assert changed_positions(_bytes(new.view(torch.bfloat16)), _bytes(old.view(torch.bfloat16)), 2).tolist() == \
        [2, 2048, 4999]
    assert changed_positions(new, old, 2, dense=0.0001) is None


@pytest.mark.gpu
def test_change_detection_runs_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    old = _bf16(1 << 20).view(torch.uint8).cuda()
    new = old.clone()
    new[[7, 300_000]] ^= 4
    idx, leaves = changed_leaves(new, old, 4096)
    assert idx.tolist() == [0, 73] and leaves.device.type == "cpu"
    assert torch.equal(leaves[1], new[73 * 4096:74 * 4096].cpu())
    assert changed_positions(new, old, 2).device.type == "cuda"


def _series(root, steps: int, frac: float = 0.01, **kw):
    w = _bf16(3 << 19, seed=3)  # 3 MiB: 3 chunks of 1 MiB
    saved = []
    results = []
    with CheckpointWriter(root, deltas=True, **kw) as wr:
        for step in range(steps):
            if step:
                w = _touch(w, frac, 100 + step)
            saved.append(w.clone())
            results.append(wr.save({"w": w, "bias": torch.full((7,), float(step))}, step).result())
    return saved, results


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.view(torch.int16).numpy().tobytes() == b.view(torch.int16).numpy().tobytes()


def test_sparse_increments_write_deltas_and_every_version_restores_bit_exact(tmp_path):
    saved, results = _series(tmp_path, 6, max_chain=8)
    full = results[0].bytes_written
    for r in results[1:]:
        assert r.bytes_written < 0.03 * full, (r.step, r.bytes_written, full)
    for step, want in enumerate(saved):
        got = load(tmp_path, step)
        assert _equal(got["w"], want) and got["bias"][0].item() == step
    assert verify(tmp_path).ok
    m = CheckpointStore(tmp_path).read_manifest(5)
    assert m.stats["delta_chunks"] == 3 and 0 < m.stats["delta_bytes"] <= results[5].bytes_written
    assert 0 < m.stats["elements_changed"] < 0.02 * saved[0].numel()
    assert {r.depth for r in m.deltas.values()} == {1, 2, 3, 4, 5}


def test_max_chain_rebases_chunks_against_their_anchor_and_bounds_reads(tmp_path):
    from solar.checkpoint.reader import Reader

    saved, results = _series(tmp_path, 7, max_chain=2)
    full = results[0].bytes_written
    # depth 1, 2, then a skip-delta against the first save's chunks (depth 1 again), 2, 1 ...:
    # never a whole chunk again while the changes since the anchor stay sparse
    assert all(r.bytes_written < 0.1 * full for r in results[1:])
    store = CheckpointStore(tmp_path)
    depths = [sorted({r.depth for d, r in store.read_manifest(s).deltas.items()
                      if d in {bytes(x) for x in store.read_manifest(s).blob_digests(0)}}) for s in range(1, 7)]
    assert depths == [[1], [2], [1], [2], [1], [2]], depths
    assert results[3].bytes_written > results[2].bytes_written  # the skip-delta holds three saves' changes
    for step in range(7):
        m = store.read_manifest(step)
        assert all(r.depth <= 2 for r in m.deltas.values())
        rd = Reader(tmp_path, step)
        got = rd.state_dict()
        assert _equal(got["w"], saved[step])
        assert rd.bytes_read <= 2 * m.logical_bytes


def test_chunks_are_written_whole_again_once_the_changes_since_the_anchor_are_dense(tmp_path):
    saved, results = _series(tmp_path, 6, frac=0.12, max_chain=1)
    full = results[0].bytes_written
    big = [r.step for r in results if r.bytes_written > 0.5 * full]
    assert big and big[0] == 0 and len(big) >= 2, [r.bytes_written for r in results]
    for step, want in enumerate(saved):
        assert _equal(load(tmp_path, step)["w"], want)
    assert verify(tmp_path).ok


def test_dense_changes_are_written_whole(tmp_path):
    w = torch.randn(1 << 19)
    with CheckpointWriter(tmp_path, deltas=True) as wr:
        first = wr.save({"w": w}, 0).result()
        second = wr.save({"w": w + 1e-3}, 1).result()
    assert second.bytes_written == first.bytes_written
    assert not CheckpointStore(tmp_path).read_manifest(1).deltas
    assert not list(delta_keys(CheckpointStore(tmp_path)))


def test_a_delta_whose_base_is_missing_or_corrupt_names_chunk_base_and_tensors(tmp_path):
    from solar.checkpoint.store import chunk_key
    from solar.errors import CorruptDataError

    _series(tmp_path, 3)
    store = CheckpointStore(tmp_path)
    m = store.read_manifest(2)
    target, ref = next((d, r) for d, r in m.deltas.items() if r.depth == 2)
    base0 = m.deltas[ref.base].base  # the whole chunk under the chain
    path = store.tier.path(chunk_key(base0))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(CorruptDataError) as err:
        load(tmp_path, 2)
    msg = str(err.value)
    assert base0.hex() in msg and "base chunk" in msg and "w" in msg
    import os

    os.unlink(path)
    with pytest.raises(CorruptDataError, match="missing"):
        load(tmp_path, 1)
    rep = verify(tmp_path)
    assert not rep.ok and any(p.get("chunk") == target.hex() for p in rep.problems)
    os.unlink(store.tier.path(delta_key(target, ref.base)))
    with pytest.raises(CorruptDataError, match="delta object is missing|missing"):
        load(tmp_path, 2)


def test_gc_keeps_the_bases_kept_versions_need(tmp_path):
    from solar.checkpoint import gc

    saved, _ = _series(tmp_path, 5)
    rep = gc(tmp_path, keep_last=1)
    assert rep.kept == [4]
    assert _equal(load(tmp_path, 4)["w"], saved[4])
    assert verify(tmp_path).ok
    store = CheckpointStore(tmp_path)
    m = store.read_manifest(4)
    assert {t for t, _b in delta_keys(store)} == set(m.deltas)


def test_keep_last_retention_keeps_chains_and_reopened_writer_continues(tmp_path):
    w = _bf16(1 << 19, seed=5)
    with CheckpointWriter(tmp_path, deltas=True, keep_last=2) as wr:
        for step in range(5):
            w = _touch(w, 0.01, step)
            wr.save({"w": w}, step)
    with CheckpointWriter(tmp_path, deltas=True, keep_last=2) as wr:
        w2 = _touch(w, 0.01, 99)
        first = wr.save({"w": w2}, 5).result()  # no mirror yet: written whole
        w3 = _touch(w2, 0.01, 98)
        second = wr.save({"w": w3}, 6).result()
    assert first.bytes_written > 0.9 * w.numel() * 2 and second.bytes_written < 0.03 * w.numel() * 2
    assert _equal(load(tmp_path, 6)["w"], w3) and _equal(load(tmp_path, 5)["w"], w2)
    assert verify(tmp_path).ok


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_chain"):
        CheckpointWriter(tmp_path / "a", deltas=True, max_chain=0)
    with pytest.raises(ConfigError, match="staging"):
        CheckpointWriter(tmp_path / "b", deltas=True, staging=tmp_path / "s")


def test_manifest_marks_the_feature_and_old_readers_refuse_by_format(tmp_path):
    import json
    import struct

    from solar.checkpoint.manifest import FORMAT, decode, encode as encode_m
    from solar.checkpoint.store import manifest_key
    from solar.errors import CorruptDataError

    _series(tmp_path, 2)
    store = CheckpointStore(tmp_path)
    raw0, raw1 = store.tier.get(manifest_key(0)), store.tier.get(manifest_key(1))
    hlen = struct.unpack_from("<Q", raw1, 16)[0]
    head = json.loads(raw1[24:24 + hlen])
    assert head["format"] == "solar-ckpt/2" and head["features"] == ["deltas"] and head["deltas"]
    assert json.loads(raw0[24:24 + struct.unpack_from("<Q", raw0, 16)[0]])["format"] == FORMAT
    m = decode(raw1)
    # a manifest naming a feature this SOLAR does not know is refused, naming it
    head["features"] = ["deltas", "quantum"]
    body = json.dumps(head, separators=(",", ":")).encode()
    from solar.checkpoint.manifest import MAGIC, seal

    crafted = seal(MAGIC + struct.pack("<Q", len(body)) + body + m.digests.tobytes())
    with pytest.raises(CorruptDataError, match="quantum"):
        decode(crafted)
    # a chain whose depths do not add up (a cycle, or a base missing from the table) is refused
    d, r = next(iter(m.deltas.items()))
    m.deltas[d] = r._replace(depth=r.depth + 1)
    with pytest.raises(CorruptDataError, match="depth"):
        decode(encode_m(m))
    assert np.array_equal(decode(raw1).digests, m.digests)


def test_log_and_diff_report_elements_changed_and_bytes_as_chunks_and_deltas(tmp_path, capsys):
    import json

    from solar.checkpoint.cli import main

    saved, results = _series(tmp_path, 3)
    assert main(["log", str(tmp_path), "--json"]) == 0
    versions = json.loads(capsys.readouterr().out)["versions"]
    first, last = versions[0], versions[2]
    assert first["delta_bytes"] == 0 and first["chunk_bytes"] == results[0].bytes_written
    assert first["elements_changed"] == saved[0].numel() + 7  # every element of a first save is new
    changed = int((saved[2].view(torch.int16) != saved[1].view(torch.int16)).sum()) + 7  # bias: 7 new values
    assert last["elements_changed"] == changed
    assert last["delta_bytes"] > 0 and last["delta_chunks"] == 3
    assert last["delta_bytes"] + last["chunk_bytes"] == results[2].bytes_written
    assert main(["log", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "changed elems" in text and "as deltas" in text and str(changed) in text
    assert main(["diff", f"{tmp_path}@0", f"{tmp_path}@2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [i["step"] for i in rep["increments"]] == [1, 2]
    assert rep["increments"][1]["elements_changed"] == changed
    assert main(["diff", f"{tmp_path}@0", f"{tmp_path}@2"]) == 0
    assert "written by the saves after" in capsys.readouterr().out
