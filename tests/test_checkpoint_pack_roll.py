"""Rolling packs (``pack=N``): every new chunk, full ones too, goes into packs of at most N bytes,
so a save makes a few files whatever its tensor and chunk count; de-duplication, gc, verify and
loads work through them. And ``reserve``: the host buffers a save copies into, prepared ahead."""

from __future__ import annotations

import math
import os

import torch

from solar.checkpoint import CheckpointWriter, gc, load, verify

CHUNK = 4096
PACK = 64 * 1024


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {f"layer{i}.bias": torch.randn(16, generator=g) for i in range(100)}
    big = torch.randn(64 * CHUNK // 4, generator=g)  # 64 full chunks
    big[step * 1024] += step  # one chunk of it changes per step
    return {**out, "big": big, "step": torch.tensor(step)}


def count(root, sub: str) -> int:
    return sum(len(fs) for _d, _s, fs in os.walk(os.path.join(root, sub)))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_every_chunk_goes_into_packs_of_at_most_n_bytes(tmp_path):
    root = tmp_path / "ck"
    with CheckpointWriter(root, chunk_size=CHUNK, pack=PACK) as w:
        first = w.save(state(0), 0).result()
        assert count(root, "chunks") == 0
        assert count(root, "packs") == math.ceil(first.bytes_written / PACK)  # full packs but the last
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root / "packs") for f in fs]
        assert max(sizes) <= PACK and first.bytes_written == sum(sizes)
        second = w.save(state(1), 1).result()
    assert second.chunks_written == 2 and count(root, "packs") == math.ceil(first.bytes_written / PACK) + 1
    assert same(load(root, 0), state(0)) and same(load(root, 1), state(1)) and verify(root).ok
    rep = gc(root, keep_last=1)
    assert rep.removed_versions == [0] and same(load(root), state(1)) and verify(root).ok


def test_reserve_prepares_the_buffer_the_first_save_copies_into(tmp_path):
    with CheckpointWriter(tmp_path / "ck", chunk_size=CHUNK) as w:
        w.reserve(state(0)).result()
        buf = w._pool._bufs[0]
        assert buf is not None and buf.numel() >= sum(t.nbytes for t in state(0).values())
        w.save(state(0), 0).result()
        assert w._pool._bufs[0] is buf  # the save used it instead of allocating its own
        w.save(state(1), 1)
    assert same(load(tmp_path / "ck", 1), state(1))


def test_a_save_whose_last_pack_is_refused_leaves_no_pack_and_no_version(tmp_path):
    import pytest

    from solar.cache.disk import DiskTier
    from solar.errors import CheckpointError

    tier = DiskTier(str(tmp_path / "ck"), capacity_bytes=3 * PACK)  # room for three packs of the five
    with pytest.raises(CheckpointError, match="over its byte budget writing pack"):
        with CheckpointWriter(tier, chunk_size=CHUNK, pack=PACK) as w:
            w.save(state(0), 0).result()
    assert count(tmp_path / "ck", "packs") == 0 and count(tmp_path / "ck", "manifests") == 0


def test_keep_last_retention_repacks_so_no_pack_stays_a_quarter_dead(tmp_path):
    from solar.checkpoint.repack import repack_store
    from solar.checkpoint.store import CheckpointStore

    root = tmp_path / "ck"
    with CheckpointWriter(root, chunk_size=CHUNK, pack=PACK, keep_last=1) as w:
        for s in range(40):  # one chunk of `big` (of 64) and one small tensor change per save
            st = state(s % 16)
            st["layer3.bias"] = st["layer3.bias"] + s
            w.save(st, s)
    left = repack_store(CheckpointStore(root), dry_run=True)
    assert left.packs_rewritten == []  # retention compacted every pack that reached a quarter dead
    assert same(load(root), {**state(39 % 16), "layer3.bias": state(0)["layer3.bias"] + 39})
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root / "packs") for f in fs)
    assert on_disk < 1.34 * sum(t.nbytes for t in state(0).values()) + 40 * PACK // 64  # live + under a third dead
    assert verify(root).ok


def test_a_save_smaller_than_a_pack_per_stream_is_split_over_the_streams_and_packs_keep_their_bytes(tmp_path):
    """stream_limit: 100 MiB over 4 streams makes packs of 32 MiB (not one 100 MiB pack written by one
    thread); the policy's limit still caps large saves, and pack=True stays one pack. Packs whose
    chunks lie back to back in the staging copy, and packs assembled from scattered chunks, both
    hold exactly their chunks' bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from solar.checkpoint.pack import MIN_STREAM_PACK, Packer, pack_policy, read_packed, stream_limit
    from solar.checkpoint.store import CheckpointStore

    MiB = 1 << 20
    views = [(bytes([i]) * 16, memoryview(bytearray(MiB))) for i in range(100)]
    assert stream_limit(pack_policy(256 * MiB, MiB), views, 4) == MIN_STREAM_PACK == 32 * MiB
    assert stream_limit(pack_policy(256 * MiB, MiB), views * 20, 4) == 256 * MiB
    assert stream_limit(pack_policy(True, MiB), views, 4) == float("inf")
    store = CheckpointStore(tmp_path / "ck", create=True)
    staging = np.random.default_rng(0).integers(0, 255, 64 * CHUNK, dtype=np.uint8)
    view = memoryview(staging)
    chunks = [(bytes([j]) * 16, view[j * CHUNK:(j + 1) * CHUNK]) for j in range(0, 64, 1)]
    scattered = chunks[:16] + chunks[20::3]  # a run back to back, then every third chunk
    with ThreadPoolExecutor(4) as io:
        packer = Packer(store, io.submit, 8 * CHUNK, in_flight=4)
        for d, v in scattered:
            packer.add(d, v)
        out = packer.finish()
    assert len(out.names) == -(-len(scattered) // 8)
    for d, v in scattered:
        got = bytearray(CHUNK)
        assert read_packed(store, d, out.locations[d], memoryview(got)) == CHUNK and bytes(got) == bytes(v)
