"""The on-disk format and the pure parts: manifest checksums, the Merkle diff, chunk hashing,
C-order bytes, and the diff of two versions."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.checkpoint import CheckpointWriter
from solar.checkpoint import merkle
from solar.checkpoint.chunking import hash_chunks, hasher
from solar.checkpoint.compare import diff
from solar.checkpoint.manifest import decode, encode
from solar.checkpoint.sources import c_order_bytes
from solar.checkpoint.store import CheckpointStore, manifest_key
from solar.errors import CorruptDataError
from test_checkpoint import KB


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_manifest_rejects_any_truncation_or_flip(data):
    m = decode(encode_example())
    raw = encode(m)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CorruptDataError):
        decode(raw[:cut])
    pos = data.draw(st.integers(0, len(raw) - 1))
    flipped = bytearray(raw)
    flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptDataError):
        decode(bytes(flipped))


_EXAMPLE: list = []


def encode_example() -> bytes:
    if not _EXAMPLE:
        root = tempfile.mkdtemp()
        with CheckpointWriter(root, chunk_size=1 * KB) as w:
            w.save({"a": torch.arange(3000), "b": {"c": 1.5}}, 1)
        _EXAMPLE.append(CheckpointStore(root).tier.get(manifest_key(1)))
    return _EXAMPLE[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.lists(st.integers(0, 299), max_size=10))
def test_merkle_diff_finds_exactly_the_changed_leaves(n, changes):
    d = hasher("xxh3_128")
    leaves = np.random.default_rng(n).integers(0, 256, (n, 16), dtype=np.uint8)
    new = leaves.copy()
    changed = sorted({c for c in changes if c < n})
    new[changed, 0] ^= 0xFF
    got = merkle.diff(merkle.build(leaves, d), merkle.build(new, d))
    assert got.tolist() == changed
    assert merkle.diff(None, merkle.build(new, d)).tolist() == list(range(n))


def test_hash_chunks_matches_reference():
    buf = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    got = hash_chunks(buf, 4096, hasher("xxh3_128"))
    want = [xxhash.xxh3_128_digest(buf[a:a + 4096].tobytes()) for a in range(0, 10_000, 4096)]
    assert [r.tobytes() for r in got] == want


def test_c_order_bytes_of_a_single_element_with_a_non_unit_stride():
    # found by Hypothesis: torch calls this tensor contiguous, yet it cannot be viewed as bytes
    t = torch.arange(4, dtype=torch.float32)[::2][1:2]
    assert t.stride() == (2,) and t.is_contiguous()
    assert c_order_bytes(t).tobytes() == torch.tensor([2.0]).numpy().tobytes()
    assert c_order_bytes(torch.zeros(0)).nbytes == 0


def test_diff_sees_nan_inf_and_large_ints_and_only_the_view_that_changed(tmp_path):
    t = torch.ones(8)
    t[3], t[5] = float("nan"), float("inf")
    big = torch.tensor([2**53, 7], dtype=torch.int64)
    buf = torch.zeros(2, 4096)
    with CheckpointWriter(tmp_path, chunk_size=4096) as w:
        w.save({"w": torch.ones(8), "ids": big, "a": buf[0], "b": buf[1]}, 1, blocking=True)
        buf[0] += 1
        w.save({"w": t, "ids": big + torch.tensor([1, 0]), "a": buf[0], "b": buf[1]}, 2, blocking=True)
    rep = diff(f"{tmp_path}@1", f"{tmp_path}@2", values=True)
    changed = {e["name"]: e for e in rep.changed}
    assert set(changed) == {"w", "ids", "a"}  # b shares a's storage but did not change
    assert changed["w"]["changed_elements"] == 2 and changed["w"]["max_rel"] == math.inf
    assert changed["ids"]["changed_elements"] == 1 and changed["ids"]["max_abs"] == 1.0
    assert [e["name"] for e in diff(f"{tmp_path}@1", f"{tmp_path}@2").changed] == ["w", "ids", "a"]
