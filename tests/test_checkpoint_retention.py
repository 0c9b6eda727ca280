"""A reader racing a ``keep_last`` writer: a version removed mid-read is reported as removed, not
as damage (``load``, ``Reader``, the listing commands and ``verify``)."""

from __future__ import annotations

import json

import pytest
import torch

from solar.cache.disk import DiskTier
from solar.checkpoint import CheckpointVersionRemovedError, CheckpointWriter, Reader, list_versions, load, verify
from solar.checkpoint.cli import main
from solar.checkpoint.reader import LATEST_RETRIES
from solar.checkpoint.store import CheckpointStore
from solar.errors import CheckpointError, CorruptDataError
from test_checkpoint import KB, assert_same, seeded_state


def _commit_during_reads(monkeypatch, writer, steps, at_reads):
    """Before the loader's chunk reads number ``at_reads`` (1-based), let ``writer`` commit the next
    step of ``steps``; its keep_last=1 retention then deletes the version being read (manifest,
    then chunks) exactly between the loader reading the manifest and reading those chunks. This is
    the race of a reader and a writer, made deterministic (no threads, no sleeps)."""
    original = CheckpointStore.read_chunk_into
    pending = list(steps)
    reads = {"n": 0}

    def read_chunk_into(self, digest, out):
        reads["n"] += 1
        if pending and (at_reads == "all" or reads["n"] in at_reads):
            step = pending.pop(0)
            writer.save(seeded_state(step), step, blocking=True)
        return original(self, digest, out)

    monkeypatch.setattr(CheckpointStore, "read_chunk_into", read_chunk_into)
    return reads


def _first_read_of_last_blob(root, step) -> int:
    """The chunk read at which the loader has fully read (and cached) every blob but the last."""
    m = CheckpointStore(root).read_manifest(step)
    assert len(m.blobs) == 2
    return m.blobs[0].nchunks + 1


def test_load_of_the_newest_version_starts_over_when_retention_removes_it_mid_read(tmp_path, monkeypatch):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
        at = _first_read_of_last_blob(tmp_path, 1)
        reads = _commit_during_reads(monkeypatch, w, [2], {at})
        out = load(tmp_path)  # starts over on step 2, not CorruptDataError "chunk ... is missing"
        assert reads["n"] > at and list_versions(tmp_path) == [2]
        # all of step 2: blob "a" read (and cached) from the removed step 1 is not reused
        assert_same(out, seeded_state(2))
        r = Reader(tmp_path)  # a Reader (what `solar-ckpt restore` uses) follows the newest version too
        assert r.manifest.step == 2
        _commit_during_reads(monkeypatch, w, [3], {at})
        assert_same(r.state_dict(), seeded_state(3))
        assert r.manifest.step == 3


def test_an_explicit_version_removed_mid_read_says_so_and_is_not_corruption(tmp_path, monkeypatch):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
        _commit_during_reads(monkeypatch, w, [2], {_first_read_of_last_blob(tmp_path, 1)})
        with pytest.raises(CheckpointVersionRemovedError) as info:
            load(tmp_path, 1)
    err = info.value
    assert isinstance(err, CheckpointError) and isinstance(err, FileNotFoundError)
    assert not isinstance(err, CorruptDataError)
    msg = str(err)
    assert f"step 1 of {tmp_path} was removed while it was being read" in msg
    assert "keep_last" in msg and "Nothing is corrupt" in msg and "[2]" in msg and "restore from" not in msg
    assert verify(tmp_path).ok and list_versions(tmp_path) == [2]


def test_a_version_removed_on_every_read_gives_up_after_a_few_retries(tmp_path, monkeypatch):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
        steps = list(range(2, LATEST_RETRIES + 10))
        _commit_during_reads(monkeypatch, w, steps, "all")  # a new version before every chunk read
        with pytest.raises(CheckpointVersionRemovedError, match=f"{LATEST_RETRIES + 1} times in a row") as info:
            load(tmp_path)
        assert "keep_last" in str(info.value) and str(tmp_path) in str(info.value)
        assert list_versions(tmp_path) == [LATEST_RETRIES + 2]  # one commit per attempt, then it stopped


def test_a_chunk_missing_from_a_version_still_stored_is_corruption_even_for_the_newest(tmp_path):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
    store = CheckpointStore(tmp_path)
    store.delete_chunk(store.read_manifest(1).blob_digests(1)[0].tobytes())
    with pytest.raises(CorruptDataError, match="chunk .* of step 1 .* tensor\\(s\\) b. Run `solar-ckpt verify"):
        load(tmp_path)


def _commit_after_first_listing(monkeypatch, writer, state, step) -> list:
    """Right after the first listing of manifests, let ``writer`` commit ``state`` as ``step``; its
    keep_last retention then removes listed versions before they are read (the race of a reader
    and a writer, made deterministic). Returns the listings seen."""
    original = CheckpointStore.steps
    listed = []

    def steps(self):
        out = original(self)
        if not listed:
            listed.append(out)
            writer.save(state, step, blocking=True)
        return out

    monkeypatch.setattr(CheckpointStore, "steps", steps)
    return listed


def test_opening_the_newest_version_lists_again_when_retention_removes_it_first(tmp_path, monkeypatch):
    """The manifest listed as the newest can be removed before it is read: list again, do not
    report "no checkpoint step N" or fall back to an older listed step (removed as well)."""
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
        listed = _commit_after_first_listing(monkeypatch, w, seeded_state(2), 2)  # removes step 1 after we listed it
        out = load(tmp_path)
    assert listed == [[1]]
    assert_same(out, seeded_state(2))


@pytest.mark.parametrize("reader", ["list_versions", "verify", "log"])
def test_listing_readers_skip_a_version_removed_after_the_listing(tmp_path, monkeypatch, capsys, reader):
    """``list_versions``, ``verify`` and ``solar-ckpt log`` next to a keep_last writer: a listed
    version removed before its manifest is read is skipped (and the store listed again for the
    newer one), not reported as "no checkpoint step N" (exit 2) or as damage."""
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(seeded_state(1), 1, blocking=True)
        listed = _commit_after_first_listing(monkeypatch, w, seeded_state(2), 2)
        if reader == "list_versions":
            assert list_versions(tmp_path) == [2]
        elif reader == "verify":
            rep = verify(tmp_path)
            assert rep.ok and rep.steps == [2] and rep.skipped == [1] and rep.problems == []
        else:
            assert main(["log", str(tmp_path), "--json"]) == 0
            assert [v["step"] for v in json.loads(capsys.readouterr().out)["versions"]] == [2]
    assert listed == [[1]]


def _commit_at_first_chunk_check(monkeypatch, writer, state, step) -> list:
    """Before ``verify`` reads its first chunk (its manifests are read by then), let ``writer``
    commit ``state`` as ``step``; its keep_last retention removes a version being verified,
    manifest first, then the chunks no kept version uses."""
    original = DiskTier.read_into
    reads = []

    def read_into(self, key, out):
        if str(key).startswith("chunks/"):
            if not reads:
                writer.save(state, step, blocking=True)
            reads.append(key)
        return original(self, key, out)

    monkeypatch.setattr(DiskTier, "read_into", read_into)
    return reads


def test_verify_skips_a_version_retention_removes_while_its_chunks_are_checked(tmp_path, monkeypatch, capsys):
    """A chunk missing because a keep_last writer removed its version during ``verify`` is not
    corruption (it was reported as "CORRUPT chunk ...: missing", exit 1); a chunk that is missing
    from a version still stored is, and names only that version."""
    shared = torch.randn(2048, generator=torch.Generator().manual_seed(1000))  # no seeded_state(seed) has it
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=2) as w:
        w.save({"a": shared, "b": seeded_state(1)["b"]}, 1, blocking=True)
        w.save({"a": shared, "b": seeded_state(2)["b"]}, 2, blocking=True)
        reads = _commit_at_first_chunk_check(monkeypatch, w, seeded_state(3), 3)  # removes step 1
        rep = verify(tmp_path)
        assert reads and list_versions(tmp_path) == [2, 3]
        assert rep.ok and rep.steps == [2] and rep.skipped == [1], rep.problems
        monkeypatch.undo()

        # real damage, in a chunk of "a" that step 2 (kept) shares with step 3 (removed meanwhile)
        w.save({"a": shared, "b": seeded_state(4)["b"]}, 4, blocking=True)  # steps 3, 4
        lost = CheckpointStore(tmp_path).read_manifest(4).blob_digests(0)[0].tobytes()
        w.save({"a": shared, "b": seeded_state(5)["b"]}, 5, blocking=True)  # steps 4, 5: "a" still shared
        CheckpointStore(tmp_path).delete_chunk(lost)
        _commit_at_first_chunk_check(monkeypatch, w, {"a": shared, "b": seeded_state(6)["b"]}, 6)  # removes 4
        rep = verify(tmp_path)
        (problem,) = rep.problems
        assert problem["chunk"] == lost.hex() and problem["detail"] == "missing"
        assert problem["steps"] == [5] and problem["tensors"] == ["a"] and rep.skipped == [4]
        monkeypatch.undo()

        # an explicit step removed while being verified: removed, not corrupt
        _commit_at_first_chunk_check(monkeypatch, w, seeded_state(7), 7)  # removes 5 (and "a" goes too)
        with pytest.raises(CheckpointVersionRemovedError, match="step 5 of .* was removed while it was being "
                                                                  "verified.*Nothing is corrupt"):
            verify(tmp_path, 5)
        monkeypatch.undo()
        _commit_at_first_chunk_check(monkeypatch, w, seeded_state(8), 8)  # removes 6: the CLI says so, exit 0
        assert main(["verify", str(tmp_path)]) == 0
        assert "skipped step 6: removed while being verified" in capsys.readouterr().out
