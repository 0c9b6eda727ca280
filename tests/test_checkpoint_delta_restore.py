"""Restoring delta versions (issue 23): one hash per chunk, the culprit named when the rebuilt chunk
is wrong, chunks read by several threads in order, and the writer's mirror of what it last saved."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zstandard

from solar.checkpoint import CheckpointWriter, load
from solar.checkpoint.delta import _COUNT, _GAP, _HEAD, _sampled_fraction, changed_positions, header
from solar.checkpoint.deltastore import delta_key
from solar.checkpoint.reader import Reader
from solar.checkpoint.store import CheckpointStore, chunk_key
from solar.errors import CorruptDataError
from test_checkpoint_delta import _equal, _series

KB = 1024


def test_a_delta_chunk_is_hashed_once_when_it_is_restored(tmp_path):
    saved, _ = _series(tmp_path, 4, max_chain=8)
    r = Reader(tmp_path, 3)
    m = r.manifest
    assert sum(d.tobytes() in m.deltas for d in m.digests) == 3  # every chunk of "w" through 3 deltas
    digest, calls = r._digest, []
    r._digest = lambda b: calls.append(b.nbytes) or digest(b)
    got = r.state_dict()
    assert _equal(got["w"], saved[3])
    assert len(calls) == m.nchunks  # the base and the chunks between are covered by the last check


def _rewrite_one_value(obj: bytes) -> bytes:
    """``obj`` (a sparse delta) with one changed value altered, compressed to the same length."""
    h = header(obj)
    (k,) = _COUNT.unpack_from(obj, _HEAD.size)
    width = _GAP[h.kind][0]
    raw = bytearray(zstandard.ZstdDecompressor().decompress(obj[_HEAD.size + _COUNT.size:]))
    for i in range(width * k, len(raw)):
        for bit in (1, 2, 4):
            trial = bytearray(raw)
            trial[i] ^= bit
            body = zstandard.ZstdCompressor(level=1).compress(bytes(trial))
            if trial[i] and len(body) == len(obj) - _HEAD.size - _COUNT.size:
                return obj[:_HEAD.size + _COUNT.size] + body
    raise AssertionError("no same-length rewrite found")


def test_a_delta_that_decodes_to_wrong_bytes_is_named_by_its_chunk(tmp_path):
    _series(tmp_path, 3, max_chain=8)
    store = CheckpointStore(tmp_path)
    m = store.read_manifest(2)
    target, ref = next((d, r) for d, r in m.deltas.items() if r.depth == 2)
    middle = ref.base  # stored as a delta (depth 1) against the whole chunk of step 0
    base0 = m.deltas[middle].base
    path = store.tier.path(delta_key(middle, base0))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(_rewrite_one_value(data))
    with pytest.raises(CorruptDataError) as err:
        load(tmp_path, 2)
    msg = str(err.value)
    assert target.hex() in msg and f"on its chain, the delta of chunk {middle.hex()}" in msg
    assert f"the delta object against {base0.hex()} changed" in msg and "w" in msg
    with pytest.raises(CorruptDataError, match=f"chunk {middle.hex()} of step 1 .* rebuilt from its delta against "
                                               f"base chunk {base0.hex()} fails its hash"):
        load(tmp_path, 1)


def test_the_first_bad_chunk_of_a_blob_in_order_is_reported_whichever_thread_reads_it(tmp_path):
    w = torch.randn(64 * KB // 4, generator=torch.Generator().manual_seed(1))  # 16 chunks of 4 KiB
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as wr:
        wr.save({"w": w}, 0, blocking=True)
    store = CheckpointStore(tmp_path)
    digests = [d.tobytes() for d in store.read_manifest(0).blob_digests(0)]
    for j in (13, 5, 9):
        path = store.tier.path(chunk_key(digests[j]))
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(bytes([data[0] ^ 1]) + data[1:])
    for _ in range(3):
        with pytest.raises(CorruptDataError, match=f"chunk {digests[5].hex()} of step 0 .* fails its hash"):
            load(tmp_path, 0)
    os.unlink(store.tier.path(chunk_key(digests[0])))
    with pytest.raises(CorruptDataError, match=f"chunk {digests[0].hex()} of step 0 .* missing"):
        load(tmp_path, 0)


def test_the_mirror_keeps_repeated_and_packed_chunks_as_their_next_deltas_need(tmp_path):
    g = torch.Generator().manual_seed(5)
    one = torch.randn(1 << 19, generator=g).to(torch.bfloat16)  # 1 MiB: one chunk
    w = torch.cat([one, torch.randn(1 << 19, generator=g).to(torch.bfloat16), one])  # chunks 0 and 2 equal
    small = torch.arange(100, dtype=torch.float32)  # packed (below the packing threshold)
    saved = []
    with CheckpointWriter(tmp_path, deltas=True) as wr:
        for step in range(4):
            if step == 1:  # chunks 0 and 2 changed alike: one new chunk, stored once (for position 0)
                w[:1 << 19][::97] += 1
                w[2 << 19:][::97] += 1
            elif step == 2:  # only chunk 2 changes: its delta's base is step 1's chunk at position 2
                w[2 << 19:][5::89] += 1
            elif step == 3:
                small = small + 1
                w[1 << 19:2 << 19][::101] += 1
            saved.append((w.clone(), small.clone()))
            wr.save({"w": w, "small": small}, step).result()
    store = CheckpointStore(tmp_path)
    rows = [[d.tobytes() for d in store.read_manifest(s).blob_digests(0)] for s in range(4)]
    assert rows[1][0] == rows[1][2] and rows[1][0] in store.read_manifest(1).deltas
    m2 = store.read_manifest(2)
    assert rows[2][2] in m2.deltas and m2.deltas[rows[2][2]].base == rows[1][2]
    assert rows[3][1] in store.read_manifest(3).deltas
    for step, (want_w, want_small) in enumerate(saved):
        got = load(tmp_path, step)
        assert _equal(got["w"], want_w) and torch.equal(got["small"], want_small)


def test_clearly_dense_chunks_are_found_from_a_random_sample_that_no_regular_pattern_fools():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, 1 << 19, dtype=np.uint16)
    assert _sampled_fraction(a, a) == 0.0
    assert _sampled_fraction(a, a ^ 1) == 1.0
    for stride in (2, 4, 64, 4096):  # changes at every stride-th word: the sample sees about 1/stride
        b = a.copy()
        b[::stride] ^= 1
        assert abs(_sampled_fraction(a, b) - 1 / stride) < 0.03, stride
        pos = changed_positions(memoryview(b).cast("B"), memoryview(a).cast("B"), 2, 0.25)
        if stride >= 4:
            assert np.array_equal(pos, np.arange(0, a.size, stride))
        else:
            assert pos is None
    assert _sampled_fraction(a[:100], a[:100] ^ 1) == 0.0  # short buffers are compared whole


def test_a_densely_changed_chunk_leaves_only_a_sample_in_the_mirror_until_its_changes_are_sparse(tmp_path):
    w = torch.randn(1 << 18, generator=torch.Generator().manual_seed(7))  # fp32, 1 MiB: one chunk
    saved, results = [], []
    with CheckpointWriter(tmp_path, deltas=True) as wr:
        for step in range(6):
            if step in (1, 2):  # dense: every element moves
                w = w * 1.001 + 1e-4
            elif step >= 3:
                w = w.clone()
                w[step::997] += 1.0
            saved.append(w.clone())
            results.append(wr.save({"w": w}, step).result())
    store = CheckpointStore(tmp_path)
    full = results[0].bytes_written
    # 1, 2: dense, whole; 3: sparse against step 2, whose bytes were not kept: whole, and kept;
    # 4, 5: deltas again, against the previous save's chunk
    assert [r.bytes_written == full for r in results] == [True, True, True, True, False, False]
    rows = [store.read_manifest(s).blob_digests(0)[0].tobytes() for s in range(6)]
    assert store.read_manifest(4).deltas[rows[4]].base == rows[3]
    assert store.read_manifest(5).deltas[rows[5]].base == rows[4]
    for step, want in enumerate(saved):
        assert torch.equal(load(tmp_path, step)["w"], want)
