"""Checkpoint save and load: round trips (sharing, every dtype, plain values), increments and dedup,
the host copy and its back-pressure, input errors. Also the helpers the other ``test_checkpoint_*``
files import (``KB``, ``bits``, ``assert_same``, ``seeded_state``)."""

from __future__ import annotations

import math
from collections import OrderedDict
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.checkpoint import CheckpointWriter, list_versions, load
from solar.checkpoint.flatten import flatten, materialize, unflatten
from solar.checkpoint.sources import c_order_bytes
from solar.checkpoint.store import CheckpointStore, referenced
from solar.errors import CheckpointError, ConfigError, InputError

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
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
               if hasattr(torch, n)]
    typed = {str(d): (torch.randn(5, 3, generator=g) * 10).to(d) for d in dtypes}
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "model": OrderedDict(
            [("w", w), ("w_tied", w), ("w_t", w.t()), ("rows", w[3:9]), ("col", w[:, 5]),
             ("p", torch.nn.Parameter(torch.ones(4))),
             ("buf_lo", buf[:100]), ("buf_hi", buf[900:]), ("as_int", buf[10:20].view(torch.int32)),
             ("scalar", torch.tensor(3.5)), ("empty", torch.zeros(0, 7)), ("special", special)]
        ),
        "typed": typed,
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(64, 48)}, 1: {}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1],
                                    "foreach": None}]},
        "meta": {"epoch": 3, "name": "run-1", "nan": float("nan"), "inf": float("inf"), "dtype": torch.bfloat16,
                 "size": torch.Size([2, 3]), "device": torch.device("cpu"), "blob": b"\x00\xff", "__weird__": 1,
                 (1, 2): "tuple key", "frac": Fraction(1, 3)},
        "list": [torch.ones(2), [torch.zeros(1), "x"], ()],
    }


def seeded_state(seed: int) -> dict:
    """Two tensors (two blobs) of 2 chunks each; every seed gives other bytes, so a newer version
    shares no chunk with an older one and retention deletes all of the older one's chunks."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(2048, generator=g), "b": torch.randn(2048, generator=g)}


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
    stored_once = (state["model"]["w"], state["optim"]["state"][0]["exp_avg"])
    assert logical < sum(t.numel() * t.element_size() for t in stored_once) + 50 * KB
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
