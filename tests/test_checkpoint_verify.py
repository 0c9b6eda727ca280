"""Damage: ``verify`` and ``verify --repair``, a flipped byte, a missing chunk, a torn manifest, and
the save counters after a repair."""

from __future__ import annotations

import json
import os

import pytest
import torch

from solar.checkpoint import CheckpointWriter, gc, list_versions, load, verify
from solar.checkpoint.cli import main
from solar.checkpoint.store import CheckpointStore, chunk_key, manifest_key
from solar.errors import CheckpointLockedError, CorruptDataError
from test_checkpoint import KB, assert_same


def _one_version(tmp_path, chunk=4 * KB):
    state = {"weight": torch.randn(16 * KB), "bias": torch.randn(100)}
    with CheckpointWriter(tmp_path, chunk_size=chunk) as w:
        w.save(state, 7)
    return state, CheckpointStore(tmp_path)


def test_flipped_byte_is_found_by_verify_and_refused_by_load(tmp_path):
    _state, store = _one_version(tmp_path)
    m = store.read_manifest(7)
    digest = m.blob_digests(0)[2].tobytes()
    path = store.tier.path(chunk_key(digest))
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    rep = verify(tmp_path)
    assert not rep.ok and rep.problems[0]["chunk"] == digest.hex()
    assert rep.problems[0]["tensors"] == ["weight"]
    with pytest.raises(CorruptDataError, match=f"{digest.hex()}.*weight"):
        load(tmp_path)
    assert load(tmp_path, verify=False)["weight"].numel() == 16 * KB  # explicitly unchecked read still works


def test_verify_repair_lets_the_next_save_heal_a_damaged_chunk(tmp_path):
    """A writer trusts the chunks it finds, so saving the same bytes again would leave the
    damaged copy (and every version using it) broken; after ``verify(repair=True)`` the next
    save rewrites it, which heals the old version too."""
    state, store = _one_version(tmp_path)
    digest = store.read_manifest(7).blob_digests(0)[2].tobytes()
    path = store.tier.path(chunk_key(digest))
    data = bytearray(open(path, "rb").read())
    data[5] ^= 0x10
    open(path, "wb").write(bytes(data))
    lost = store.read_manifest(7).blob_digests(1)[0].tobytes()  # and one chunk deleted by hand
    store.delete_chunk(lost)
    with CheckpointWriter(tmp_path) as w:
        with pytest.raises(CheckpointLockedError):  # repair deletes chunks: not under a running writer
            verify(tmp_path, repair=True)
    rep = verify(tmp_path, repair=True)
    assert rep.removed_chunks == [digest.hex()] and sorted(rep.marked_chunks) == sorted([digest.hex(), lost.hex()])
    assert {p["detail"] for p in verify(tmp_path).problems} == {"missing"}
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        assert w.save(state, 8).result().chunks_written == 2
    assert verify(tmp_path).ok and not store.damaged_digests()  # markers go once rewritten
    assert_same(load(tmp_path, 7), state)


def test_repair_markers_survive_a_writer_gc_until_rewritten(tmp_path):
    """With keep_last the writer rebuilds its known-chunk set after every commit; the damaged
    markers must stay subtracted, or a later save of the same bytes references a missing chunk."""
    state, store = _one_version(tmp_path)
    lost = store.read_manifest(7).blob_digests(0)[1].tobytes()
    store.delete_chunk(lost)
    verify(tmp_path, repair=True)
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=5) as w:
        w.save({"other": torch.ones(10)}, 8).result()  # a commit (and its gc) before the rewrite
        assert w.save(state, 9).result().chunks_written == 1
    assert verify(tmp_path).ok and not store.damaged_digests()
    assert_same(load(tmp_path, 9), state)


def test_save_counters_after_repair_do_not_overlap(tmp_path, capsys):
    """The healing save after ``verify --repair`` counts a chunk it rewrites as written and
    rewritten, never also as unchanged (though the Merkle diff calls it unchanged), so written +
    unchanged never exceeds chunks_total."""
    state, store = _one_version(tmp_path)  # 16 chunks of weight + 1 of bias
    damaged = store.read_manifest(7).blob_digests(0)[2].tobytes()
    path = store.tier.path(chunk_key(damaged))
    data = bytearray(open(path, "rb").read())
    data[5] ^= 0x10
    open(path, "wb").write(bytes(data))
    store.delete_chunk(store.read_manifest(7).blob_digests(1)[0].tobytes())  # bias's only chunk
    assert main(["verify", str(tmp_path), "--repair"]) == 1  # as a user would: found, deleted, marked
    state["weight"][10 * KB] += 1.0  # and one chunk really changes
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        res = w.save(state, 8).result()
        same = w.save(state, 9).result()
    assert res.chunks_written + res.chunks_unchanged <= res.chunks_total
    assert (res.chunks_total, res.chunks_written, res.chunks_rewritten, res.chunks_unchanged) == (17, 3, 2, 14)
    assert res.bytes_written == 2 * 4 * KB + 100 * 4  # rewritten: a weight chunk, the bias; new: a weight chunk
    st8 = store.read_manifest(8).stats
    assert (st8["chunks_written"], st8["chunks_rewritten"], st8["chunks_unchanged"]) == (3, 2, 14)
    # an ordinary save rewrites nothing, and its manifest keeps the exact old set of stats
    assert (same.chunks_written, same.chunks_rewritten, same.chunks_unchanged) == (0, 0, 17)
    assert "chunks_rewritten" not in store.read_manifest(9).stats
    capsys.readouterr()
    assert main(["log", str(tmp_path), "--json"]) == 0
    log = {v["step"]: v for v in json.loads(capsys.readouterr().out)["versions"]}
    assert (log[8]["chunks_written"], log[8]["chunks_rewritten"], log[9]["chunks_rewritten"]) == (3, 2, 0)
    assert verify(tmp_path).ok
    assert_same(load(tmp_path, 7)["bias"], state["bias"])


def test_missing_chunk_is_an_error(tmp_path):
    _state, store = _one_version(tmp_path)
    digest = store.read_manifest(7).blob_digests(1)[0].tobytes()
    store.delete_chunk(digest)
    with pytest.raises(CorruptDataError, match="bias"):
        load(tmp_path)
    assert verify(tmp_path).problems[0]["detail"] == "missing"


def test_torn_manifest_is_ignored(tmp_path):
    state, store = _one_version(tmp_path)
    good = store.tier.get(manifest_key(7))
    for cut in (0, 10, len(good) // 2, len(good) - 1):
        with open(os.path.join(tmp_path, "manifests", f"{8:020d}"), "wb") as f:
            f.write(good[:cut])
        assert list_versions(tmp_path) == [7]
        with pytest.warns(UserWarning, match="skipping checkpoint step 8"):
            assert_same(load(tmp_path), state)
        rep = verify(tmp_path)  # committed atomically, so failing the checksum is a problem
        assert not rep.ok and [p["step"] for p in rep.problems] == [p["step"] for p in rep.incomplete] == [8]
    with pytest.raises(CorruptDataError):
        load(tmp_path, 8)
    assert gc(tmp_path).removed_torn == [8]
