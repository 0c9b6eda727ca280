"""The staging copy's hash-first path (solar/checkpoint/host.py): a slot's buffer remembers the
digests of what it holds, and the next save copies only the chunks that changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solar.checkpoint import CheckpointWriter, load
from solar.checkpoint.chunking import hash_chunks, hasher
from solar.checkpoint.flatten import flatten
from solar.checkpoint.host import HASH_FIRST_MIN_CHUNK, SKIP_BELOW, HostPool

CS = 1024  # the smallest chunk size a writer takes: many chunks from small tensors (the pool's tests)
WCS = HASH_FIRST_MIN_CHUNK  # a writer stages hash-first from this chunk size on


def _pool() -> HostPool:
    return HostPool(1, CS, hasher("xxh3_128"))


def _stage(pool: HostPool, state: dict) -> tuple[int, list[np.ndarray]]:
    slot = pool.acquire(pool.ticket())
    return slot, pool.stage(slot, flatten(state).blobs)


def _digests(views: list[np.ndarray]) -> list[np.ndarray]:
    return [hash_chunks(v, CS, hasher("xxh3_128")) for v in views]


def test_only_changed_chunks_are_copied_again():
    t = torch.arange(16 * CS // 4, dtype=torch.float32)
    pool = _pool()
    slot, views = _stage(pool, {"t": t})
    assert pool.staged(slot).hashed == [None]  # nothing held yet: a plain copy
    pool.release(slot, _digests(views))
    # A witness that chunk 0 is not copied again: its staged bytes are overwritten here, which no
    # save does (the buffer must keep what its record says it holds). A copy would restore them.
    pool._bufs[slot][:CS] = 0xAB
    t[3 * CS // 4] = -1.0  # chunk 3 changes
    slot, views = _stage(pool, {"t": t})
    raw = t.view(torch.uint8).numpy()
    assert (views[0][:CS] == 0xAB).all()
    assert np.array_equal(views[0][CS:], raw[CS:])  # chunk 3 copied, the rest still what it was
    expect = hash_chunks(raw, CS, hasher("xxh3_128"))
    assert np.array_equal(pool.staged(slot).hashed[0], expect)  # the live bytes' digests, for the save to reuse
    pool.release(slot, [expect])


def test_a_blob_that_changed_throughout_is_copied_outright_next_time():
    t = torch.zeros(8 * CS // 4)
    pool = _pool()
    for _ in range(2):  # the first save copies, the second hashes first (nothing known changed)
        slot, views = _stage(pool, {"t": t})
        first_hashed = pool.staged(slot).hashed[0]
        pool.release(slot, _digests(views))
        t.add_(1.0)  # every chunk changes
    assert first_hashed is not None and pool._held[0].changed == [1.0] > [SKIP_BELOW]
    slot, views = _stage(pool, {"t": t})
    assert pool.staged(slot).hashed == [None]  # copied outright
    assert np.array_equal(views[0], t.view(torch.uint8).numpy())
    pool.release(slot, _digests(views))
    t[0] = 5.0  # one chunk of eight changes: below SKIP_BELOW, so the next save hashes first
    assert pool._held[0].changed == [1.0]
    slot, views = _stage(pool, {"t": t})
    assert pool.staged(slot).hashed == [None]  # the record says it changed throughout last time
    pool.release(slot, _digests(views))
    assert pool._held[0].changed == [1 / 8]
    slot, _views = _stage(pool, {"t": t})
    assert pool.staged(slot).hashed[0] is not None


def test_a_save_that_did_not_hash_its_copy_leaves_no_record():
    t = torch.arange(4 * CS // 4, dtype=torch.float32)
    pool = _pool()
    slot, views = _stage(pool, {"t": t})
    pool.release(slot, _digests(views))
    slot, views = _stage(pool, {"t": t})
    pool._bufs[slot][:CS] = 0xAB  # as a staging copy that failed halfway could leave it
    pool.release(slot)  # the save failed before hashing: no digests
    slot, views = _stage(pool, {"t": t})
    assert pool.staged(slot).hashed == [None]
    assert np.array_equal(views[0], t.view(torch.uint8).numpy())


def test_a_new_layout_is_copied_outright():
    pool = _pool()
    state = {"a": torch.ones(4 * CS // 4), "b": torch.zeros(2 * CS // 4)}
    slot, views = _stage(pool, state)
    pool.release(slot, _digests(views))
    pool._bufs[slot][:] = 0xAB  # nothing of it may be reused for another layout
    state["c"] = torch.full((CS // 4,), 2.0)
    slot, views = _stage(pool, state)
    assert pool.staged(slot).hashed == [None, None, None]
    for v, t in zip(views, (state["a"], state["b"], state["c"])):
        assert np.array_equal(v, t.view(torch.uint8).numpy())


def test_without_a_fast_hash_every_save_copies():
    pool = HostPool(1)
    t = torch.ones(4 * CS // 4)
    for _ in range(2):
        slot, views = _stage(pool, {"t": t})
        assert pool.staged(slot).hashed == [None]
        pool.release(slot, _digests(views))


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_every_version_of_randomly_changing_state_loads_exactly(tmp_path, max_in_flight):
    """Sparse, dense, frozen and resized tensors over 30 saves: each version loads bit-exactly
    (a chunk wrongly skipped would load its older bytes)."""
    rng = np.random.default_rng(7)
    state = {"w": torch.randn(37 * WCS // 4 + 3), "frozen": torch.randn(9 * WCS // 4),
             "b": torch.randn(5), "half": torch.randn(6 * WCS // 2).to(torch.bfloat16)}
    saved, staged = {}, []
    with CheckpointWriter(tmp_path / "ck", chunk_size=WCS, max_in_flight=max_in_flight) as w:
        for step in range(30):
            kind = rng.integers(4)
            flat = state["w"].view(-1)
            if kind == 0:  # a few elements anywhere, the last chunk's tail included
                idx = torch.from_numpy(rng.integers(0, flat.numel(), size=int(rng.integers(1, 6))))
                flat[idx] += 1.0
                flat[-1] += 1.0
            elif kind == 1:  # every chunk
                flat.neg_()
            elif kind == 2:  # a run of consecutive chunks of the bf16 tensor
                a = int(rng.integers(0, 5)) * WCS // 2
                state["half"][a:a + WCS].add_(1.0)
            if step == 20:  # another layout: a tensor grows
                state["b"] = torch.randn(700)
            state["b"][0] = float(step)
            staged.append(w.save(state, step))
            saved[step] = {k: v.clone() for k, v in state.items()}
        w.wait()
    logical = staged[0].result().logical_bytes
    assert min(f.result().bytes_staged for f in staged) < logical / 4  # some saves copied little
    for step, want in saved.items():
        got = load(tmp_path / "ck", step=step)
        for k, v in want.items():
            assert torch.equal(got[k], v), (step, k)


def test_save_result_counts_the_bytes_the_host_copy_copied(tmp_path):
    state = {"w": torch.zeros(64 * WCS // 4), "frozen": torch.ones(16 * WCS // 4)}
    total = 80 * WCS
    with CheckpointWriter(tmp_path / "ck", chunk_size=WCS) as w:
        first = w.save(state, 0).result()
        state["w"][10 * WCS // 4] = 1.0  # one chunk of w
        second = w.save(state, 1).result()
        state["w"].add_(2.0)  # all of w: hashed first until a sixteenth of it was seen changed ...
        third = w.save(state, 2).result()
        state["w"].add_(2.0)
        fourth = w.save(state, 3).result()  # ... then copied outright; frozen is never copied again
    assert (first.bytes_staged, second.bytes_staged) == (total, WCS)
    assert (third.bytes_staged, fourth.bytes_staged) == (64 * WCS, 64 * WCS)
    assert second.logical_bytes == total


def test_small_chunks_stage_by_copying(tmp_path):
    state = {"w": torch.zeros(64 * CS // 4)}
    with CheckpointWriter(tmp_path / "ck", chunk_size=CS) as w:
        w.save(state, 0).result()
        assert w.save(state, 1).result().bytes_staged == 64 * CS


def test_a_blob_found_changing_throughout_is_copied_after_a_sixteenth_of_its_hash():
    n = 64  # chunks; the pool hashes 4 MiB groups, so with 1 MiB chunks it looks at 4 at a time
    pool = HostPool(1, 1 << 20, hasher("xxh3_128"))
    t = torch.zeros(n * (1 << 20) // 4)
    slot, views = _stage(pool, {"t": t})
    pool.release(slot, [hash_chunks(views[0], 1 << 20, hasher("xxh3_128"))])
    t.add_(1.0)
    slot, views = _stage(pool, {"t": t})
    assert pool.staged(slot) == ([None], n * (1 << 20))  # gave up hashing after its first 4 chunks
    assert np.array_equal(views[0], t.view(torch.uint8).numpy())
    pool.release(slot, [hash_chunks(views[0], 1 << 20, hasher("xxh3_128"))])
    assert pool._held[0].changed == [1.0]


def _check_records(pool: HostPool, cs: int) -> None:
    """host.py's invariant: a slot's record is absent or the digests of what its buffer holds."""
    for slot, held in enumerate(pool._held):
        if held is None:
            continue
        buf = pool._bufs[slot].numpy()
        for (off, n), d in zip(held.layout, held.digests):
            assert d is None or np.array_equal(d, hash_chunks(buf[off:off + n], cs, hasher("xxh3_128"))), slot


def test_every_record_is_what_its_buffer_holds_across_saves_and_reserve(tmp_path):
    small = {"t": torch.randn(4 * WCS // 4)}
    with CheckpointWriter(tmp_path / "ck", chunk_size=WCS, max_in_flight=2) as w:
        for step in range(4):
            small["t"][step] += 1
            w.save(small, step, lazy=step % 2 == 1).result()
            _check_records(w._pool, WCS)
        w.reserve({"t": torch.randn(8 * WCS // 4)}).result()  # new, larger buffers
        _check_records(w._pool, WCS)
        for step in range(4, 8):
            small["t"][step] += 1
            w.save(small, step).result()
            _check_records(w._pool, WCS)
    for step in range(8):
        load(tmp_path / "ck", step=step)  # every version verifies


def test_a_source_changed_between_hash_and_copy_stores_what_was_copied(tmp_path):
    """A lazy save racing the training step (simulated deterministically: the source changes
    right after its changed chunk was hashed) may save a mixed version, as documented, but each
    chunk is stored under the digest of its bytes: the version verifies, and a later save of the
    first bytes is not de-duplicated onto the racing ones."""
    t = torch.zeros(8 * WCS // 4)
    with CheckpointWriter(tmp_path / "ck", chunk_size=WCS) as w:
        w.save({"t": t}, 0).result()
        w.save({"t": t}, 1).result()  # the slot's record is held from here on
        t[0] = 1.0
        real, calls = w._pool._digest, []

        def racing(view):
            d = real(view)
            calls.append(1)
            if len(calls) == 1:
                t[1] = 2.0  # the training step writes chunk 0 again, after its hash
            return d

        w._pool._digest = racing
        w.save({"t": t}, 2, lazy=True).result()
        w._pool._digest = real
        t[1] = 0.0  # back to the bytes hashed first; saved properly
        w.save({"t": t}, 3).result()
    mixed = load(tmp_path / "ck", step=2)["t"]  # verifies: what was copied, under its own digest
    assert mixed[:2].tolist() == [1.0, 2.0]
    assert torch.equal(load(tmp_path / "ck", step=3)["t"], t)
