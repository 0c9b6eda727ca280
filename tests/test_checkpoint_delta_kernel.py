"""The compiled sparse apply (issue 23): bit-exact with numpy's for every element and gap width,
bounds checked, loaded only when it pays."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import zstandard

import solar.checkpoint
from solar.checkpoint import delta, load
from solar.checkpoint.delta import SPARSE, SPARSE16, apply, encode, header
from solar.checkpoint.store import CheckpointStore
from test_checkpoint_delta import BASE, _equal, _series


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("numba")
    delta.warm_kernel(wait=True)
    assert set(delta._READY) == set(delta._SIGNATURES)  # every (gap width, element size) is loaded
    return dict(delta._READY)


def _pair(elem: int, wide: bool, seed: int) -> tuple[bytes, bytes]:
    """Two 1 MiB chunks of ``elem``-byte words differing at random positions (and, ``wide``,
    with a gap of more than 2**16 elements, so the positions need the 4-byte form)."""
    rng = np.random.default_rng(seed)
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[elem]
    old = rng.integers(0, np.iinfo(dt).max, (1 << 20) // elem, dtype=dt, endpoint=True)
    new = old.copy()
    pos = rng.choice(old.size, old.size // 100, replace=False)
    if wide:
        pos = pos[(pos < 100) | (pos > 70_000 + 100)]
    new[pos] ^= rng.integers(1, np.iinfo(dt).max, pos.size, dtype=dt, endpoint=True)
    new[-1] ^= 1  # the last element: a position at the chunk's end is applied
    return new.tobytes(), old.tobytes()


@pytest.mark.parametrize("elem", [1, 2, 4, 8])
@pytest.mark.parametrize("wide", [False, True])
def test_the_kernel_applies_exactly_what_numpy_applies(kernel, monkeypatch, elem, wide):
    new, old = _pair(elem, wide, seed=elem)
    enc = encode(memoryview(new), memoryview(old), BASE, elem)
    kind = header(enc.data).kind
    assert kind == (SPARSE if wide else SPARSE16)
    got = {}
    for path, ready in (("kernel", kernel), ("numpy", {})):
        monkeypatch.setattr(delta, "_READY", ready)
        out = bytearray(old)
        apply(enc.data, memoryview(out), BASE)
        got[path] = bytes(out)
    assert got["kernel"] == got["numpy"] == new


def _past_the_end(obj: bytes) -> bytes:
    """``obj`` (a SPARSE16 delta) with its last gap raised so that its last position lies past the chunk."""
    h = header(obj)
    body = memoryview(obj)[delta._HEAD.size:]
    (k,) = delta._COUNT.unpack_from(body)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(body[delta._COUNT.size:], max_output_size=4 * k))
    assert h.kind == SPARSE16
    raw[2 * k - 1] = 0xFF  # the last gap's high byte
    return bytes(obj[:delta._HEAD.size + delta._COUNT.size]) + zstandard.ZstdCompressor().compress(bytes(raw))


def test_a_position_past_the_chunk_is_refused_and_nothing_outside_it_is_written(kernel, monkeypatch):
    new, old = _pair(2, False, seed=7)
    new = new[:4096]  # 2048 elements: a gap of 0xFF00 runs past them
    old = old[:4096]
    bad = _past_the_end(encode(memoryview(new), memoryview(old), BASE, 2).data)
    for ready in (kernel, {}):
        monkeypatch.setattr(delta, "_READY", ready)
        room = bytearray(old) + bytes(1 << 18)  # the chunk, then bytes a stray write would change
        with pytest.raises(delta.DeltaFormatError, match="it changes element .* of a chunk of 2048"):
            apply(bad, memoryview(room)[:4096], BASE)
        assert not any(room[4096:])


def test_versions_restore_bit_exact_through_the_kernel(kernel, tmp_path):
    saved, _ = _series(tmp_path, 5, max_chain=8)
    for step, want in enumerate(saved):
        assert _equal(load(tmp_path, step)["w"], want)


def test_the_kernel_is_loaded_for_a_large_restore_a_second_one_or_once_numba_is_imported(monkeypatch):
    started = []
    monkeypatch.setattr(delta, "warm_kernel", lambda wait=False: started.append(True))
    monkeypatch.setattr(delta, "_numba_imported", lambda: False)
    monkeypatch.setattr(delta, "_restores", 0)
    delta.want_kernel(1 << 20)
    assert not started  # one small restore: numpy applies, numba is not imported for it
    delta.want_kernel(1 << 20)
    assert started == [True]  # a process that restores repeatedly
    monkeypatch.setattr(delta, "_restores", 0)
    delta.want_kernel(delta.WARM_BYTES)
    assert started == [True, True]  # one restore applying enough deltas to pay for the import
    monkeypatch.setattr(delta, "_restores", 0)
    monkeypatch.setattr(delta, "_numba_imported", lambda: True)
    delta.want_kernel(1)
    assert len(started) == 3


def test_a_restore_tells_want_kernel_its_delta_bytes_once_per_version(tmp_path, monkeypatch):
    _series(tmp_path, 3, max_chain=8)
    asked = []
    monkeypatch.setattr("solar.checkpoint.reader.want_kernel", asked.append)
    load(tmp_path, 0)
    assert asked == []  # a version without deltas
    load(tmp_path, 2)
    m = CheckpointStore(tmp_path).read_manifest(2)
    assert asked == [sum(r.nbytes for r in m.deltas.values())] and asked[0] > 0


def test_clearly_dense_changes_are_decided_from_the_first_quarter_of_the_sample():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint32)  # 1 MiB of fp32 words
    idx = delta._sample(a.size)
    head = idx[:delta._FIRST * delta._BLOCK]
    read = []

    class Words(np.ndarray):
        def take(self, i, *args, **kw):
            read.append(len(i))
            return np.asarray(self).take(i, *args, **kw)

    def dense(new):
        read.clear()
        return delta._clearly_dense(new.view(Words), a.view(Words), 2 * delta.DENSE)

    assert dense(a ^ 1) and read == [head.size] * 2  # every word changed: the first runs decided alone
    half = a.copy()
    half[::2] ^= 1
    assert not dense(half) and sorted(read) == [head.size] * 2 + [idx.size - head.size] * 2  # each run read once
    two_thirds = a.copy()
    two_thirds[np.arange(a.size) % 3 > 0] ^= 1
    assert dense(two_thirds) and len(read) == 4  # the whole sample: 2/3 > 1/2
    assert delta.changed_positions(memoryview(half).cast("B"), memoryview(a).cast("B"), 4, delta.DENSE) is None
    assert head.min() < a.size // 4 and head.max() > 3 * a.size // 4  # the first runs span the chunk
    assert np.array_equal(delta.sample_words(memoryview(a).cast("B"), 4), a[head])


def test_without_numba_the_kernel_is_not_loaded_and_numpy_applies(monkeypatch):
    monkeypatch.setitem(sys.modules, "solar.checkpoint.deltakernel", None)  # its import fails
    monkeypatch.delattr(solar.checkpoint, "deltakernel", raising=False)
    monkeypatch.setattr(delta, "_READY", {})
    monkeypatch.setattr(delta, "_warming", None)
    delta.warm_kernel(wait=True)
    assert delta._READY == {}
    new, old = _pair(2, False, seed=9)
    out = bytearray(old)
    apply(encode(memoryview(new), memoryview(old), BASE, 2).data, memoryview(out), BASE)
    assert bytes(out) == new


def test_a_fork_waits_for_the_warm_up(monkeypatch):
    done = []

    def slow_warm():
        time.sleep(0.3)
        done.append(True)

    monkeypatch.setattr(delta, "_warm", slow_warm)
    monkeypatch.setattr(delta, "_warming", None)
    delta.warm_kernel()
    pid = os.fork()
    if pid == 0:  # the child: the warm-up had finished before the fork (its import locks released)
        os._exit(0 if done else 1)
    assert os.waitpid(pid, 0)[1] == 0 and done
