"""Checkpoint writer and loader: round trips, increments, dedup, commit protocol, locks, gc, corruption."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.cache.disk import DiskTier
from solar.checkpoint import CheckpointWriter, Reader, gc, list_versions, load, verify
from solar.checkpoint import merkle
from solar.checkpoint.chunking import hash_chunks, hasher
from solar.checkpoint.diff import c_order_bytes
from solar.checkpoint.manifest import decode, encode
from solar.checkpoint.store import CheckpointStore, chunk_key, manifest_key, referenced
from solar.errors import CheckpointError, CheckpointLockedError, ConfigError, CorruptDataError, InputError
from test_tiers import s3_bucket  # noqa: F401  (fixture: moto S3 on 127.0.0.1)
from servers import http_root  # noqa: F401  (fixture: nginx on 127.0.0.1)

KB = 1024


def bits(t: torch.Tensor) -> bytes:
    """Bit pattern of a tensor (NaN payloads and -0.0 included)."""
    return c_order_bytes(t).tobytes()


def assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert bits(a) == bits(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def rich_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    buf = torch.arange(1000, dtype=torch.float32)
    dtypes = [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.uint8,
              torch.bool, torch.complex64, torch.complex128]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)]
    typed = {str(d): (torch.randn(5, 3, generator=g) * 10).to(d) for d in dtypes}
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "model": OrderedDict(
            [("w", w), ("w_tied", w), ("w_t", w.t()), ("rows", w[3:9]), ("col", w[:, 5]), ("p", torch.nn.Parameter(torch.ones(4))),
             ("buf_lo", buf[:100]), ("buf_hi", buf[900:]), ("as_int", buf[10:20].view(torch.int32)),
             ("scalar", torch.tensor(3.5)), ("empty", torch.zeros(0, 7)), ("special", special)]
        ),
        "typed": typed,
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(64, 48)}, 1: {}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1], "foreach": None}]},
        "meta": {"epoch": 3, "name": "run-1", "nan": float("nan"), "inf": float("inf"), "dtype": torch.bfloat16,
                 "size": torch.Size([2, 3]), "device": torch.device("cpu"), "blob": b"\x00\xff", "__weird__": 1,
                 (1, 2): "tuple key", "frac": Fraction(1, 3)},
        "list": [torch.ones(2), [torch.zeros(1), "x"], ()],
    }


def test_roundtrip_bit_exact_with_sharing(tmp_path):
    state = rich_state()
    with CheckpointWriter(tmp_path / "ck", chunk_size=4 * KB) as w:
        res = w.save(state, 1).result()
    out = load(tmp_path / "ck")
    assert_same(state, out)
    m = out["model"]
    # one storage for the tied weight, its transpose and its slices; another for buf and its int32 view
    ptr = m["w"].untyped_storage().data_ptr()
    assert all(m[k].untyped_storage().data_ptr() == ptr for k in ("w_tied", "w_t", "rows", "col"))
    assert m["buf_lo"].untyped_storage().data_ptr() == m["as_int"].untyped_storage().data_ptr()
    m["w"][0, 0] = 42.0
    assert m["w_tied"][0, 0] == 42.0 and m["w_t"][0, 0] == 42.0
    assert isinstance(m["p"], torch.nn.Parameter)
    # the tied weight is stored once; buf[100:900] is never touched by any view and is not stored
    logical = sum(b.nbytes for b in CheckpointStore(tmp_path / "ck").read_manifest(1).blobs)
    assert logical < sum(t.numel() * t.element_size() for t in (state["model"]["w"], state["optim"]["state"][0]["exp_avg"])) + 50 * KB
    assert res.chunks_written < res.chunks_total  # exp_avg is zeros: one chunk for all of it


def test_increments_write_only_changed_chunks(tmp_path):
    t = torch.randn(256 * KB)  # 1 MiB of float32 = 64 chunks of 16 KiB
    state = {"t": t, "frozen": torch.randn(64 * KB)}
    with CheckpointWriter(tmp_path, chunk_size=16 * KB) as w:
        first = w.save(state, 0).result()
        assert first.bytes_written == 1024 * KB + 256 * KB
        same = w.save(state, 1).result()
        assert same.bytes_written == 0 and same.chunks_unchanged == same.chunks_total
        t[5] += 1.0
        t[200_000] += 1.0
        sparse = w.save(state, 2).result()
        assert sparse.bytes_written == 2 * 16 * KB and sparse.chunks_written == 2
        step2 = t.clone()
        t.add_(1.0)
        dense = w.save(state, 3).result()
        assert dense.bytes_written == 1024 * KB
        t.copy_(step2)  # back to step 2's bytes: every chunk is already stored
        back = w.save(state, 4).result()
        assert back.bytes_written == 0 and back.chunks_unchanged == 16  # only "frozen" is in place
    for step in range(5):
        assert load(tmp_path, step)["frozen"].equal(state["frozen"])
    assert bits(load(tmp_path, 4)["t"]) == bits(t)


def test_identical_chunks_across_tensors_are_stored_once(tmp_path):
    a = torch.randn(8 * KB)
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        res = w.save({"a": a, "b": a.clone(), "c": torch.cat([a, a])}, 0).result()
    assert res.bytes_written == a.numel() * 4
    assert len(list(CheckpointStore(tmp_path).chunk_digests())) == 8


def test_state_is_copied_before_save_returns(tmp_path):
    t = torch.randn(512 * KB)
    before = t.clone()
    with CheckpointWriter(tmp_path, chunk_size=64 * KB) as w:
        fut = w.save({"t": t}, 0)
        t.zero_()  # the training step goes on while hashing and writing run in the background
        fut.result()
    assert bits(load(tmp_path)["t"]) == bits(before)


def test_lazy_save_copies_in_the_background(tmp_path):
    t = torch.randn(512 * KB)
    before = t.clone()
    with CheckpointWriter(tmp_path, chunk_size=64 * KB) as w:
        fut = w.save({"t": t}, 0, lazy=True)
        w.wait_staged()  # what a training loop calls right before optimizer.step()
        assert fut.staged.done()
        t.zero_()
        assert fut.result().chunks_written == 32
        fut2 = w.save({"t": t}, 1, lazy=True, blocking=True)
        assert fut2.staged.done() and fut2.result().chunks_written == 1  # all-zero chunks dedup to one
    assert bits(load(tmp_path, 0)["t"]) == bits(before)
    assert not load(tmp_path, 1)["t"].any()


def test_one_staging_buffer_and_back_pressure(tmp_path):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=2) as w:
        futures = [w.save({"x": torch.full((4 * KB,), float(i))}, i) for i in range(6)]
        assert [f.result().step for f in futures] == list(range(6))
        assert sum(b is not None for b in w._pool._bufs) == 1
    assert list_versions(tmp_path) == [4, 5]
    assert load(tmp_path, 4)["x"][0] == 4.0
    store = CheckpointStore(tmp_path)  # keep_last's collection left exactly the chunks of the kept versions
    assert set(store.chunk_digests()) == referenced(store.valid_manifests())


def test_blocking_save_and_wait(tmp_path):
    w = CheckpointWriter(tmp_path, chunk_size=4 * KB)
    fut = w.save({"x": torch.ones(10)}, 3, blocking=True)
    assert fut.done()
    w.save({"x": torch.ones(10) * 2}, 4)
    assert [r.step for r in w.wait()] == [4]
    w.close()
    with pytest.raises(CheckpointError, match="closed"):
        w.save({}, 5)


def test_any_version_loads_directly(tmp_path):
    x = torch.zeros(64 * KB)
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, durable=False) as w:
        assert w._main.store.tier.fsync is False
        for step in range(6):
            x[step * 1000] = step + 1
            w.save({"x": x}, step * 10)
    store = CheckpointStore(tmp_path)
    for step in range(6):
        m = store.read_manifest(step * 10)
        assert m.parent == (None if step == 0 else (step - 1) * 10)
        got = load(tmp_path, step * 10)["x"]
        assert [float(got[i * 1000]) for i in range(6)] == [i + 1.0 if i <= step else 0.0 for i in range(6)]


def test_writers_on_one_root_are_locked_out(tmp_path):
    with CheckpointWriter(tmp_path):
        with pytest.raises(CheckpointLockedError, match="locked by another writer"):
            CheckpointWriter(tmp_path)
        with pytest.raises(CheckpointLockedError):
            gc(tmp_path, keep_last=1)
        # also from another process (flock is per open file description)
        code = f"from solar.checkpoint import CheckpointWriter\ntry:\n CheckpointWriter({str(tmp_path)!r})\nexcept Exception as e:\n print(type(e).__name__)"
        out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "CheckpointLockedError", out.stderr
    CheckpointWriter(tmp_path).close()  # released on close


def test_fsspec_root_lock_and_roundtrip():
    root = "memory://solar-ckpt-test/root"
    state = {"a": torch.randn(10 * KB), "b": [1, 2]}
    with CheckpointWriter(root, chunk_size=4 * KB) as w:
        # messages name the URL as given, so the recovery they suggest points at the right object
        with pytest.raises(CheckpointLockedError, match=f"delete {root}/LOCK"):
            CheckpointWriter(root)
        assert w.save(state, 1).result().root == root
        state["a"][0] = 1.0
        assert w.save(state, 2).result().chunks_written == 1
    assert list_versions(root) == [1, 2]
    assert_same(load(root, 2), state)
    assert verify(root).ok


def test_memory_tier_root_does_not_alias_the_staging_buffer():
    from solar.cache import MemoryTier

    tier = MemoryTier()
    with CheckpointWriter(tier, chunk_size=4 * KB) as w:
        w.save({"x": torch.ones(4 * KB)}, 1)
        w.save({"x": torch.full((4 * KB,), 2.0)}, 2)  # reuses the staging buffer
    assert list_versions(tier) == [1, 2]
    assert load(tier, 1)["x"].eq(1).all() and load(tier, 2)["x"].eq(2).all()


def test_staging_root_drains_to_main_root(tmp_path):
    x = torch.randn(32 * KB)
    with CheckpointWriter(tmp_path / "shared", staging=tmp_path / "local", chunk_size=4 * KB, keep_last=2) as w:
        r1 = w.save({"x": x}, 1).result()
        x[0] += 1
        r2 = w.save({"x": x}, 2).result()
        w.save({"x": x}, 3)
    assert r1.root == r2.root == str(tmp_path / "shared")
    assert r2.bytes_written == 4 * KB
    assert list_versions(tmp_path / "shared") == [2, 3] == list_versions(tmp_path / "local")
    assert bits(load(tmp_path / "shared", 3)["x"]) == bits(x)
    assert verify(tmp_path / "shared").ok


def test_staging_never_drops_a_version_before_it_is_drained(tmp_path):
    """The staging root runs ahead of a slow drain; keep_last=1 there must not lose versions."""
    x = torch.randn(16 * KB)
    with CheckpointWriter(tmp_path / "shared", staging=tmp_path / "local", chunk_size=4 * KB, keep_last=1) as w:
        release = __import__("threading").Event()
        w._drain.submit(release.wait)  # hold the drain thread while five versions are staged
        futures = []
        for step in range(5):
            x[step] = 100.0 + step
            futures.append(w.save({"x": x}, step))
            futures[-1].staged.result()
        release.set()
        results = [f.result() for f in futures]
    assert [r.step for r in results] == list(range(5))
    assert list_versions(tmp_path / "shared") == [4] and list_versions(tmp_path / "local") == [4]
    assert bits(load(tmp_path / "shared")["x"]) == bits(x)
    assert verify(tmp_path / "shared").ok and verify(tmp_path / "local").ok


def test_gc_keeps_every_referenced_chunk(tmp_path):
    x = torch.randn(16 * KB)
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        for step in range(5):
            x[step * 4000] += 1
            w.save({"x": x, "const": torch.ones(4 * KB)}, step)
    before = len(list(CheckpointStore(tmp_path).chunk_digests()))
    rep = gc(tmp_path, keep_last=2)
    assert rep.kept == [3, 4] and rep.removed_versions == [0, 1, 2]
    assert rep.removed_chunks == before - rep.kept_chunks > 0
    assert verify(tmp_path).ok and list_versions(tmp_path) == [3, 4]
    assert load(tmp_path, 3)["x"][3 * 4000] == x[3 * 4000]
    with pytest.raises(ConfigError):
        gc(tmp_path, keep_last=0)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=6), st.integers(1, 3))
def test_gc_never_removes_a_referenced_chunk(tmp_path_factory, edits, keep):
    root = tmp_path_factory.mktemp("gc")
    x = torch.zeros(8 * KB // 4 * 4)
    expected = {}
    with CheckpointWriter(root, chunk_size=1 * KB) as w:
        for step, (pos, val) in enumerate(edits):
            x[pos * 256] = val
            expected[step] = x.clone()
            w.save({"x": x}, step)
    gc(root, keep_last=keep)
    kept = list_versions(root)
    assert kept == sorted(expected)[-keep:]
    for step in kept:
        assert bits(load(root, step)["x"]) == bits(expected[step])


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
    """A writer trusts the chunks it finds, so saving the same bytes again used to leave the
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
    """The healing save after ``verify --repair`` reported chunks_unchanged from the Merkle diff (the
    repaired chunks too) and chunks_written from what it wrote (the same chunks again), so written +
    unchanged exceeded chunks_total. A rewritten chunk now counts as written and rewritten, not as
    unchanged; what is written is the same."""
    state, store = _one_version(tmp_path)  # 16 chunks of weight + 1 of bias
    damaged = store.read_manifest(7).blob_digests(0)[2].tobytes()
    path = store.tier.path(chunk_key(damaged))
    data = bytearray(open(path, "rb").read())
    data[5] ^= 0x10
    open(path, "wb").write(bytes(data))
    store.delete_chunk(store.read_manifest(7).blob_digests(1)[0].tobytes())  # bias's only chunk
    from solar.checkpoint.cli import main

    assert main(["verify", str(tmp_path), "--repair"]) == 1  # as a user would: found, deleted, marked
    state["weight"][10 * KB] += 1.0  # and one chunk really changes
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        res = w.save(state, 8).result()
        same = w.save(state, 9).result()
    assert res.chunks_written + res.chunks_unchanged <= res.chunks_total
    assert (res.chunks_total, res.chunks_written, res.chunks_rewritten, res.chunks_unchanged) == (17, 3, 2, 14)
    assert res.bytes_written == 2 * 4 * KB + 100 * 4  # the same chunks are written as before the fix
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
        import tempfile

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
    import xxhash

    buf = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    got = hash_chunks(buf, 4096, hasher("xxh3_128"))
    want = [xxhash.xxh3_128_digest(buf[a:a + 4096].tobytes()) for a in range(0, 10_000, 4096)]
    assert [r.tobytes() for r in got] == want


def test_bad_inputs_get_clear_errors(tmp_path):
    with CheckpointWriter(tmp_path) as w:
        with pytest.raises(InputError, match="'s'.*to_dense"):
            w.save({"s": torch.eye(3).to_sparse()}, 1)
        with pytest.raises(InputError, match="meta"):
            w.save({"m": torch.empty(3, device="meta")}, 1)
        with pytest.raises(ConfigError, match="step"):
            w.save({}, -1)
    with pytest.raises(ConfigError, match="chunk_size"):
        CheckpointWriter(tmp_path / "x", chunk_size=10)
    with pytest.raises(ConfigError, match="hash"):
        CheckpointWriter(tmp_path / "y", hash="md5")
    with pytest.raises(CheckpointError, match="no checkpoint step 5"):
        load(tmp_path, 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint root"):
        load(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()  # readers never create a root


def test_budget_exceeded_is_a_clear_error_and_keeps_earlier_versions(tmp_path):
    tier = DiskTier(tmp_path / "small", capacity_bytes=300 * KB)
    x = torch.randn(32 * KB)  # 128 KiB
    with CheckpointWriter(tier, chunk_size=16 * KB) as w:
        w.save({"x": x}, 1).result()
        with pytest.raises(CheckpointError, match="byte budget"):
            w.save({"x": torch.randn(64 * KB)}, 2).result()
    assert list_versions(tier) == [1]
    assert bits(load(tier)["x"]) == bits(x)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.decode().strip()}); the byte-budget test covers ENOSPC")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_a_clear_error_and_keeps_earlier_versions(tiny_tmpfs):
    x = torch.randn(64 * KB)  # 256 KiB
    with CheckpointWriter(tiny_tmpfs / "ck", chunk_size=64 * KB) as w:
        w.save({"x": x}, 1).result()
        with pytest.raises(CheckpointError, match="no space left"):
            w.save({"x": torch.randn(512 * KB)}, 2).result()
    assert list_versions(tiny_tmpfs / "ck") == [1]
    assert bits(load(tiny_tmpfs / "ck")["x"]) == bits(x)
    assert verify(tiny_tmpfs / "ck").ok


def test_map_location(tmp_path):
    with CheckpointWriter(tmp_path) as w:
        w.save({"x": torch.ones(3)}, 1)
    assert load(tmp_path, map_location={"cpu": "cpu"})["x"].device.type == "cpu"
    assert load(tmp_path, map_location=lambda saved: "cpu")["x"].device.type == "cpu"


@pytest.mark.gpu
def test_cuda_state_roundtrip_through_pinned_pool(tmp_path):
    x = torch.randn(1000, device="cuda")
    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        w.save({"x": x}, 1).result()
        assert w._pool._bufs[0].is_pinned()
    out = load(tmp_path)["x"]
    assert out.device == x.device and torch.equal(out, x)
    assert load(tmp_path, map_location="cpu")["x"].device.type == "cpu"


@st.composite
def shared_states(draw):
    """Random nested containers of tensors, some of them views of shared bases, plus plain leaves."""
    dtypes = [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool, torch.bfloat16, torch.complex64]
    bases = [torch.arange(draw(st.integers(1, 300)), dtype=torch.float64).to(draw(st.sampled_from(dtypes)))
             for _ in range(draw(st.integers(1, 3)))]

    def tensor():
        base = draw(st.sampled_from(bases))
        n = base.numel()
        kind = draw(st.sampled_from(["whole", "slice", "strided", "clone", "reshape"]))
        if kind == "slice":
            a = draw(st.integers(0, n - 1))
            return base[a:draw(st.integers(a, n))]
        if kind == "strided":
            return base[::draw(st.integers(1, 4))]
        if kind == "clone":
            return base.clone()
        if kind == "reshape" and n % 2 == 0:
            return base.view(2, n // 2).t()
        return base

    leaves = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=5), st.none(),
                       st.builds(lambda _: tensor(), st.just(0)))
    return draw(st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.tuples(kids, kids),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), kids, max_size=3)), max_leaves=10))


@settings(max_examples=60, deadline=None)
@given(shared_states())
def test_flatten_roundtrip_preserves_values_and_sharing(state):
    """flatten -> copy the blobs' bytes -> materialize -> unflatten is the identity, sharing included."""
    from solar.checkpoint.flatten import flatten, materialize, unflatten

    flat = flatten(state)
    buffers = [b.byte_view().clone() for b in flat.blobs]
    tensors = materialize(flat.tensors, buffers)
    out = unflatten(flat.skeleton, tensors)
    assert_same(state, out)
    originals = []

    def collect(obj):
        if isinstance(obj, torch.Tensor):
            originals.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                collect(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                collect(v)

    collect(state)  # the same traversal order as flatten's tensor table
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    pairs = [(a, ta) for a, ta in zip(originals, tensors) if a.numel()]
    for a, ta in pairs:
        for b, tb in pairs:
            assert (ptr(a) == ptr(b)) == (ptr(ta) == ptr(tb))


def test_s3_root_on_a_real_moto_server(s3_bucket):
    """An object-store root: direct PUTs (atomic), a LOCK object, increments, verify and gc."""
    bucket, opts = s3_bucket
    root = f"{bucket}/ckpt-{os.getpid()}"
    x = torch.randn(16 * KB)
    with CheckpointWriter(root, chunk_size=4 * KB, keep_last=2, storage_options=opts) as w:
        with pytest.raises(CheckpointLockedError, match="LOCK"):
            CheckpointWriter(root, storage_options=opts)
        assert w.save({"x": x}, 1).result().chunks_written == 16
        x[0] = 7.0
        assert w.save({"x": x}, 2).result().chunks_written == 1
        w.save({"x": x, "y": torch.ones(3)}, 3)
    assert list_versions(root, storage_options=opts) == [2, 3]
    assert bits(load(root, storage_options=opts)["x"]) == bits(x)
    assert verify(root, storage_options=opts).ok
    assert gc(root, keep_last=1, storage_options=opts).removed_versions == [2]


def test_lock_released_between_create_and_read_is_taken_not_reported_as_full(tmp_path):
    """put_new fails because another writer holds LOCK, which it releases before we read the
    holder: the lock is free, so acquiring retries instead of blaming a full storage."""
    from solar.cache import MemoryTier
    from solar.checkpoint.store import CheckpointStore

    class ReleasedMeanwhile(MemoryTier):
        first = True

        def get(self, key):
            if key == "LOCK" and self.first:  # the other writer's close lands right here
                self.first = False
                self.delete("LOCK")
            return super().get(key)

    tier = ReleasedMeanwhile()
    tier.put("LOCK", b'{"pid": 1}')
    lock = CheckpointStore(tier, create=True).lock()
    assert tier.get("LOCK") == lock.token
    lock.release()


def test_read_only_http_root_cannot_be_locked(http_root):
    from solar.errors import CheckpointError

    root, base = http_root
    local = os.path.join(root, f"ro-{os.getpid()}")
    with CheckpointWriter(local) as w:
        w.save({"x": torch.ones(3)}, 1).result()
    url = f"{base}/ro-{os.getpid()}"
    assert verify(url).ok
    with pytest.raises(CheckpointError, match="read-only"):
        verify(url, repair=True)


def test_s3_lock_is_an_exclusive_create(s3_bucket, monkeypatch):
    """Two writers that both saw no LOCK (forced here: every existence check says "absent"):
    S3's conditional PUT lets only the first create it; the second is refused and the first
    keeps its lock (a check-then-put let the second overwrite it and both write)."""
    from solar.cache.fsspec_tier import FsspecTier

    bucket, opts = s3_bucket
    root = f"{bucket}/lockrace-{os.getpid()}"
    with CheckpointWriter(root, storage_options=opts) as w:
        tier = FsspecTier(root, storage_options=opts)
        mine = tier.get("LOCK")
        assert mine is not None
        monkeypatch.setattr(FsspecTier, "_exists_path", lambda self, path: False)
        with pytest.raises(CheckpointLockedError, match="locked by another writer"):
            CheckpointWriter(root, storage_options=opts)
        monkeypatch.undo()
        assert tier.get("LOCK") == mine
        w.save({"x": torch.ones(4)}, 1).result()
    assert not FsspecTier(root, storage_options=opts).exists("LOCK")  # released on close


def test_c_order_bytes_of_a_single_element_with_a_non_unit_stride():
    # found by Hypothesis: torch calls this tensor contiguous, yet it cannot be viewed as bytes
    t = torch.arange(4, dtype=torch.float32)[::2][1:2]
    assert t.stride() == (2,) and t.is_contiguous()
    assert c_order_bytes(t).tobytes() == torch.tensor([2.0]).numpy().tobytes()
    assert c_order_bytes(torch.zeros(0)).nbytes == 0


def test_relaunch_below_the_newest_step_with_keep_last_loses_nothing(tmp_path):
    """A job relaunched into a root holding a later step: its save survives its own commit, and
    the next save rewrites chunks gc removed instead of trusting the Merkle diff."""
    def state(step, seed):
        g = torch.Generator().manual_seed(seed)
        return {"backbone": torch.randn(8192, generator=g), "head": torch.full((1024,), float(step))}

    with CheckpointWriter(tmp_path, keep_last=1, chunk_size=4096) as w:
        w.save(state(1000, 1), 1000).result()
    with CheckpointWriter(tmp_path, keep_last=1, chunk_size=4096) as w:
        w.save(state(500, 2), 500).result()
        assert 500 in list_versions(tmp_path)
        w.save(state(1500, 2), 1500).result()
    assert list_versions(tmp_path) == [1500]
    assert verify(tmp_path).ok
    assert_same(load(tmp_path), state(1500, 2))


def test_lazy_then_normal_saves_behind_a_running_commit_do_not_deadlock(tmp_path):
    import threading

    state = {"w": torch.randn(1 << 20)}
    w = CheckpointWriter(tmp_path, chunk_size=1 << 16)

    def run():
        w.save(state, 1)
        w.save(state, 2, lazy=True)  # takes its staging slot on the persist thread, behind save 1
        w.save(state, 3)  # must not take the slot before the lazy save did
        w.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "saves deadlocked"
    w.close()
    assert list_versions(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("later", ["normal", "lazy"])
def test_a_save_interrupted_while_waiting_for_the_buffer_does_not_hang_later_saves(tmp_path, monkeypatch, later):
    """Ctrl-C in a save waiting for the staging buffer (max_in_flight=1) left its turn unserved,
    and every later save of the writer waited forever for it."""
    import threading

    from solar.checkpoint import writer as W

    gate = threading.Event()
    original = W.CheckpointWriter._write_chunks

    def write_chunks(self, *args):
        gate.wait()  # save 1's commit holds the only staging buffer until the test lets it go
        return original(self, *args)

    monkeypatch.setattr(W.CheckpointWriter, "_write_chunks", write_chunks)
    w = CheckpointWriter(tmp_path, chunk_size=4 * KB)
    try:
        f1 = w.save(_state(1), 1)
        cond = w._pool._cond
        real_wait = cond.wait

        def interrupted_wait(*args, **kwargs):  # the user presses Ctrl-C while save 2 waits
            cond.wait = real_wait
            raise KeyboardInterrupt

        cond.wait = interrupted_wait
        with pytest.raises(KeyboardInterrupt):
            w.save(_state(2), 2)
        assert cond.wait is real_wait  # save 2 did wait for the buffer
    finally:
        gate.set()
    results = []

    def run():
        results.append(w.save(_state(3), 3, lazy=later == "lazy").result())
        results.append(w.save(_state(4), 4).result())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)  # a hang guard, not a timing: these saves take well under a second
    assert not t.is_alive(), "saves after the interrupted one never got the staging buffer"
    assert f1.result().step == 1 and [r.step for r in results] == [3, 4]
    w.close()
    assert list_versions(tmp_path) == [1, 3, 4]
    assert_same(load(tmp_path, 4), _state(4))


def test_a_failed_background_save_is_raised_by_wait_and_by_close(tmp_path):
    import concurrent.futures
    import errno

    class Flaky(DiskTier):
        fail = True

        def put(self, key, value):
            if self.fail and str(key).startswith("chunks/"):
                raise OSError(errno.EIO, "simulated I/O error")
            return super().put(key, value)

    tier = Flaky(str(tmp_path / "a"))
    w = CheckpointWriter(tier, chunk_size=4096)
    f1 = w.save({"w": torch.randn(1000)}, 1)
    concurrent.futures.wait([f1])  # done, its failure not looked at
    tier.fail = False
    w.save({"w": torch.randn(1000)}, 2)  # a later save must not drop the failed one
    with pytest.raises(OSError, match="simulated"):
        w.wait()
    assert w.wait() == []  # raised once
    w.close()
    with pytest.raises(OSError, match="simulated"):
        with CheckpointWriter(Flaky(str(tmp_path / "b")), chunk_size=4096) as w2:
            w2.save({"w": torch.randn(1000)}, 1)
    with CheckpointWriter(Flaky(str(tmp_path / "d")), chunk_size=4096) as w4:
        with pytest.raises(OSError, match="simulated"):
            w4.save({"w": torch.randn(1000)}, 1).result()  # seen here: close() does not raise it again
    with pytest.raises(KeyError):  # the block's own error wins over a failed save's
        with CheckpointWriter(Flaky(str(tmp_path / "c")), chunk_size=4096) as w3:
            w3.save({"w": torch.randn(1000)}, 1)
            raise KeyError("mine")


def test_diff_sees_nan_inf_and_large_ints_and_only_the_view_that_changed(tmp_path):
    from solar.checkpoint.diff import diff

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


def test_a_restarted_writer_drains_what_a_dead_one_left_in_staging(tmp_path, monkeypatch):
    from solar.checkpoint import writer as W

    main, stage = tmp_path / "main", tmp_path / "stage"
    w = CheckpointWriter(main, staging=stage)
    w.save({"w": torch.full((10,), 1.0)}, 1, blocking=True)
    monkeypatch.setattr(W.CheckpointWriter, "_drain_version", lambda self, step: (_ for _ in ()).throw(
        OSError("killed before the drain")))
    f2 = w.save({"w": torch.full((10,), 2.0)}, 2)
    with pytest.raises(OSError, match="killed"):
        f2.result()
    w.close()
    monkeypatch.undo()
    assert list_versions(main) == [1] and list_versions(stage) == [1, 2]
    with CheckpointWriter(main, staging=stage) as w:
        w.save({"w": torch.full((10,), 3.0)}, 3, blocking=True)
        assert [(type(r).__name__, r.step) for r in w.wait()] == [("SaveResult", 2), ("SaveResult", 3)]  # 2: drained
    assert list_versions(main) == [1, 2, 3]
    assert torch.equal(load(main, 2)["w"], torch.full((10,), 2.0))


def test_an_over_budget_save_leaves_no_chunks_behind(tmp_path):
    w = CheckpointWriter(DiskTier(str(tmp_path), capacity_bytes=300_000), chunk_size=4096, keep_last=1)
    w.save({"w": torch.randn(25_000)}, 1).result()
    with pytest.raises(CheckpointError, match="budget"):
        w.save({"w": torch.randn(100_000)}, 2).result()
    w.save({"w": torch.randn(10)}, 3).result()  # fits once the failed save's chunks are gone
    w.close()
    assert list_versions(tmp_path) == [3] and verify(tmp_path).ok


# -- a reader racing a keep_last writer: a version removed mid-read is not damage --

def _state(seed: int) -> dict:
    """Two tensors (two blobs) of 2 chunks each; every seed gives other bytes, so a newer version
    shares no chunk with an older one and retention deletes all of the older one's chunks."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(2048, generator=g), "b": torch.randn(2048, generator=g)}


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
            writer.save(_state(step), step, blocking=True)
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
        w.save(_state(1), 1, blocking=True)
        at = _first_read_of_last_blob(tmp_path, 1)
        reads = _commit_during_reads(monkeypatch, w, [2], {at})
        out = load(tmp_path)  # used to raise CorruptDataError "chunk ... is missing ... restore from an older version"
        assert reads["n"] > at and list_versions(tmp_path) == [2]
        # all of step 2: blob "a" read (and cached) from the removed step 1 is not reused
        assert_same(out, _state(2))
        r = Reader(tmp_path)  # a Reader (what `solar-ckpt restore` uses) follows the newest version too
        assert r.manifest.step == 2
        _commit_during_reads(monkeypatch, w, [3], {at})
        assert_same(r.state_dict(), _state(3))
        assert r.manifest.step == 3


def test_an_explicit_version_removed_mid_read_says_so_and_is_not_corruption(tmp_path, monkeypatch):
    from solar.checkpoint import CheckpointVersionRemovedError

    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(_state(1), 1, blocking=True)
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
    from solar.checkpoint import CheckpointVersionRemovedError
    from solar.checkpoint.loader import LATEST_RETRIES

    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(_state(1), 1, blocking=True)
        steps = list(range(2, LATEST_RETRIES + 10))
        _commit_during_reads(monkeypatch, w, steps, "all")  # a new version before every chunk read
        with pytest.raises(CheckpointVersionRemovedError, match=f"{LATEST_RETRIES + 1} times in a row") as info:
            load(tmp_path)
        assert "keep_last" in str(info.value) and str(tmp_path) in str(info.value)
        assert list_versions(tmp_path) == [LATEST_RETRIES + 2]  # one commit per attempt, then it stopped


def test_a_chunk_missing_from_a_version_still_stored_is_corruption_even_for_the_newest(tmp_path):
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(_state(1), 1, blocking=True)
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
        w.save(_state(1), 1, blocking=True)
        listed = _commit_after_first_listing(monkeypatch, w, _state(2), 2)  # removes step 1 after we listed it
        out = load(tmp_path)
    assert listed == [[1]]
    assert_same(out, _state(2))


@pytest.mark.parametrize("reader", ["list_versions", "verify", "log"])
def test_listing_readers_skip_a_version_removed_after_the_listing(tmp_path, monkeypatch, capsys, reader):
    """``list_versions``, ``verify`` and ``solar-ckpt log`` next to a keep_last writer: a listed
    version removed before its manifest is read is skipped (and the store listed again for the
    newer one), not reported as "no checkpoint step N" (exit 2) or as damage."""
    from solar.checkpoint.cli import main

    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=1) as w:
        w.save(_state(1), 1, blocking=True)
        listed = _commit_after_first_listing(monkeypatch, w, _state(2), 2)
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
    from solar.checkpoint import CheckpointVersionRemovedError
    from solar.checkpoint.cli import main

    shared = torch.randn(2048, generator=torch.Generator().manual_seed(1000))  # no _state(seed) has it
    with CheckpointWriter(tmp_path, chunk_size=4 * KB, keep_last=2) as w:
        w.save({"a": shared, "b": _state(1)["b"]}, 1, blocking=True)
        w.save({"a": shared, "b": _state(2)["b"]}, 2, blocking=True)
        reads = _commit_at_first_chunk_check(monkeypatch, w, _state(3), 3)  # removes step 1
        rep = verify(tmp_path)
        assert reads and list_versions(tmp_path) == [2, 3]
        assert rep.ok and rep.steps == [2] and rep.skipped == [1], rep.problems
        monkeypatch.undo()

        # real damage, in a chunk of "a" that step 2 (kept) shares with step 3 (removed meanwhile)
        w.save({"a": shared, "b": _state(4)["b"]}, 4, blocking=True)  # steps 3, 4
        lost = CheckpointStore(tmp_path).read_manifest(4).blob_digests(0)[0].tobytes()
        w.save({"a": shared, "b": _state(5)["b"]}, 5, blocking=True)  # steps 4, 5: "a" still shared
        CheckpointStore(tmp_path).delete_chunk(lost)
        _commit_at_first_chunk_check(monkeypatch, w, {"a": shared, "b": _state(6)["b"]}, 6)  # removes 4
        rep = verify(tmp_path)
        (problem,) = rep.problems
        assert problem["chunk"] == lost.hex() and problem["detail"] == "missing"
        assert problem["steps"] == [5] and problem["tensors"] == ["a"] and rep.skipped == [4]
        monkeypatch.undo()

        # an explicit step removed while being verified: removed, not corrupt
        _commit_at_first_chunk_check(monkeypatch, w, _state(7), 7)  # removes 5 (and "a" goes too)
        with pytest.raises(CheckpointVersionRemovedError, match="step 5 of .* was removed while it was being "
                                                                  "verified.*Nothing is corrupt"):
            verify(tmp_path, 5)
        monkeypatch.undo()
        _commit_at_first_chunk_check(monkeypatch, w, _state(8), 8)  # removes 6: the CLI says so, exit 0
        assert main(["verify", str(tmp_path)]) == 0
        assert "skipped step 6: removed while being verified" in capsys.readouterr().out


# -- a read-only root: one clear error naming it, not a bare OSError on .lock --

def _read_only_lock(monkeypatch, err: int) -> None:
    """Make opening any ``.lock`` for writing fail as on a read-only mount (EROFS) or without
    permission (EACCES): tests run as root, which chmod cannot stop."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == ".lock" and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_a_read_only_root_is_a_clear_error_for_writers_and_gc_and_still_loads(tmp_path, monkeypatch, err):
    from solar.checkpoint import CheckpointReadOnlyError

    with CheckpointWriter(tmp_path, chunk_size=4 * KB) as w:
        w.save(_state(1), 1, blocking=True)
    _read_only_lock(monkeypatch, err)
    for attempt in (lambda: CheckpointWriter(tmp_path), lambda: gc(tmp_path, keep_last=1),
                    lambda: verify(tmp_path, repair=True)):
        with pytest.raises(CheckpointReadOnlyError) as info:
            attempt()
        e = info.value
        assert isinstance(e, CheckpointError) and isinstance(e, PermissionError)
        msg = str(e)
        assert f"checkpoint root {tmp_path} is not writable here" in msg and os.strerror(err) in msg
        assert "need write access" in msg and "load" in msg and "\n" not in msg
    assert_same(load(tmp_path), _state(1))  # reading needs no lock
    assert verify(tmp_path).ok


def test_a_new_root_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch):
    from solar.checkpoint import CheckpointReadOnlyError

    real_mkdir = os.mkdir
    ro = str(tmp_path / "ro")

    def fake_mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(ro):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    with pytest.raises(CheckpointReadOnlyError, match=f"checkpoint root {ro}/ck is not writable here"):
        CheckpointWriter(f"{ro}/ck")
