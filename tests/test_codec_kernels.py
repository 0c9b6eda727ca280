"""Every fast decoder path gives the reference decoder's bits (solar.codec.paths, kernels_cpu).

Compared as IEEE bit patterns (NaN payloads and signed zeros included): golden fixtures of every
format version, Hypothesis arrays (adversarial values, odd shapes, sizes 0 and 1, every
predictor, lossless stage and code width), mixed mini-batches, folded channels, threads, and
resealed payload forgeries (the same tensor or the same error as the reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import solar.codec as sc
from solar.codec import decoders, paths
from solar.codec.ebq_meta import EbqMeta
from solar.codec.header import read_header
from solar.codec.predict import Predictor
from solar.errors import ConfigError, CorruptDataError

FIXTURES = Path(__file__).parent / "fixtures" / "codec"
FAST = [d for d in decoders.DECODERS if d not in ("auto", "reference")]

needs_kernel = pytest.mark.skipif(not paths.kernel_available(),
                                  reason="the cpu-kernel decoder needs numba: pip install 'solar-loader[fast]'")


def bits(t: torch.Tensor) -> np.ndarray:
    a = t.contiguous().cpu().numpy()
    return a.view(np.int32 if a.dtype == np.float32 else np.int64)


def decode_all(blobs, decoder, threads=1):
    return sc.decode_batch(blobs, decoder=decoder, threads=threads)


def same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


@needs_kernel
def test_auto_takes_the_kernel_for_every_covered_blob_and_the_reference_otherwise():
    cpu = torch.device("cpu")
    for pred in (Predictor.INTERP, Predictor.FINE, Predictor.LORENZO):
        assert paths.choose(cpu, 6, pred, 10) == "cpu-kernel"
        assert paths.choose(cpu, 2, pred, 10) == "cpu-kernel"
    assert paths.choose(cpu, 1, Predictor.CUBIC, 10) == "reference"  # ebq/1: natural order
    assert paths.choose(cpu, 6, Predictor.RAW, 10) == "reference"
    assert paths.choose(cpu, 6, Predictor.FINE, 0) == "reference"
    with decoders.use("reference"):
        assert paths.choose(cpu, 6, Predictor.FINE, 10) == "reference"
    with sc.fused.use(True):  # compiling asked for: auto leaves it to the compiled graph
        assert paths.choose(cpu, 6, Predictor.FINE, 10) == "reference"


def test_bad_decoder_options_are_config_errors(monkeypatch):
    blob = sc.encode(np.arange(10, dtype=np.float32), abs_error=0.1)
    with pytest.raises(ConfigError, match="decoder= must be one of"):
        sc.decode(blob, decoder="fastest")
    with pytest.raises(ConfigError, match="threads= must be an int >= 0"):
        sc.decode_batch([blob], threads=-1)
    monkeypatch.setenv("SOLAR_CODEC_DECODER", "gpu")
    with pytest.raises(ConfigError, match="SOLAR_CODEC_DECODER must be one of"):
        sc.decode(blob)
    monkeypatch.setenv("SOLAR_CODEC_DECODER", "reference")
    monkeypatch.setenv("SOLAR_CODEC_THREADS", "many")
    with pytest.raises(ConfigError, match="SOLAR_CODEC_THREADS"):
        sc.decode(blob)


def test_without_numba_a_named_kernel_falls_back_to_the_reference(monkeypatch):
    x = np.cumsum(np.ones((9, 7), np.float32), 0)
    blob = sc.encode(x, abs_error=1e-3)
    want = sc.decode(blob, decoder="reference")
    monkeypatch.setattr(paths, "_KERNELS", False)
    assert not paths.kernel_available()
    assert paths.choose(torch.device("cpu"), 6, Predictor.FINE, 10) == "reference"
    assert same(sc.decode(blob, decoder="cpu-kernel"), want)


@needs_kernel
@pytest.mark.parametrize("decoder", FAST)
def test_golden_fixtures_decode_to_the_reference_bits(decoder):
    index = json.loads((FIXTURES / "index.json").read_text())
    versions = set()
    for entry in index:
        blob = (FIXTURES / entry["blob"]).read_bytes()
        versions.add(sc.header_info(blob).version)
        want = sc.decode(blob, decoder="reference")
        got = sc.decode(blob, decoder=decoder)
        assert same(got, want), entry["blob"]
        assert got.numpy().tobytes().hex()[:64] == entry["decoded_prefix"]
    assert versions >= {1, 2, 3, 4, 5, 6, 7}
    blobs = [(FIXTURES / e["blob"]).read_bytes() for e in index]  # one mixed batch, every group kind
    assert same(decode_all(blobs, decoder, threads=3), decode_all(blobs, "reference"))


_SPECIAL = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-45, 3.4e38, -3.4e38, 1e30, 0.5, 0.25]


@st.composite
def fields(draw, shape=None, dtype=None):
    dtype = dtype or draw(st.sampled_from([np.float32, np.float64]))
    shape = shape or tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33]),
                                         min_size=0, max_size=4)))
    n = int(np.prod(shape)) if shape else 1
    if n > 3000:
        shape, n = (n % 61 + 1,), n % 61 + 1
    kind = draw(st.sampled_from(["smooth", "noise", "steps", "special", "hypothesis"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "smooth":
        x = np.cumsum(rng.standard_normal(n)) * draw(st.sampled_from([1e-3, 1.0, 1e6]))
    elif kind == "noise":
        x = rng.standard_normal(n) * draw(st.sampled_from([1.0, 1e20, 1e-20]))
    elif kind == "steps":
        x = np.round(rng.standard_normal(n) * 4) * 0.5 + 0.25
    elif kind == "special":
        x = rng.choice(np.array(_SPECIAL), n) + rng.standard_normal(n) * rng.integers(0, 2, n)
    else:
        elems = st.floats(width=32 if dtype == np.float32 else 64, allow_nan=True, allow_infinity=True,
                          allow_subnormal=True)
        x = draw(hnp.arrays(dtype, n, elements=elems))
    with np.errstate(all="ignore"):
        return np.asarray(x, dtype=dtype).reshape(shape)


_CODECS = st.fixed_dictionaries({
    "id": st.just("ebq"),
    "predictor": st.sampled_from(["auto", "fine", "interp", "cubic", "linear", "lorenzo"]),
    "lossless": st.sampled_from(["zstd", "lz4", "none", "bitpack"]),
})
_BOUNDS = st.one_of(st.fixed_dictionaries({"rel_error": st.sampled_from([0.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-6])}),
                    st.fixed_dictionaries({"abs_error": st.sampled_from([1e-3, 0.25, 0.5, 1e-30, 1e30])}))


@needs_kernel
@pytest.mark.parametrize("decoder", FAST)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=fields(), codec=_CODECS, bound=_BOUNDS)
def test_hypothesis_arrays_decode_to_the_reference_bits(decoder, x, codec, bound):
    blob = sc.encode(x, codec=codec, **bound)
    assert same(sc.decode(blob, decoder=decoder), sc.decode(blob, decoder="reference"))


@needs_kernel
@pytest.mark.parametrize("decoder", FAST)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), shape=st.sampled_from([(1,), (2, 1), (3, 17, 5), (4, 9, 8), (2, 33), (16, 16), (5, 4, 3, 2)]),
       batch=st.integers(1, 7), threads=st.sampled_from([1, 2, 4]))
def test_mixed_batches_decode_to_the_reference_bits(decoder, data, shape, batch, threads):
    """Blobs of one shape with different predictors, code widths, per-level choices and bounds
    (several groups, mask-sorted by the reference) decode into the same rows on every path."""
    xs = [data.draw(fields(shape=shape, dtype=np.float32)) for _ in range(batch)]
    blobs = [sc.encode(x, codec=data.draw(_CODECS), **data.draw(_BOUNDS)) for x in xs]
    assert same(decode_all(blobs, decoder, threads), decode_all(blobs, "reference"))


@needs_kernel
def test_threads_split_a_batch_and_write_each_row_once():
    rng = np.random.default_rng(5)
    xs = [np.cumsum(rng.standard_normal((3, 40, 24)), 1).astype(np.float32) for _ in range(13)]
    blobs = [sc.encode(x, rel_error=1e-3) for x in xs]
    want = decode_all(blobs, "reference")
    for threads in (0, 1, 2, 5, 13, 40):
        assert same(decode_all(blobs, "cpu-kernel", threads), want)
    out = torch.empty((3, 40, 24), dtype=torch.float32)
    assert sc.decode(blobs[4], out=out, decoder="cpu-kernel").data_ptr() == out.data_ptr()
    assert same(out, want[4])


def _reseal(blob: bytes, payload: bytes) -> bytes:
    import struct

    import xxhash

    h = read_header(blob)
    head = blob[:h.payload_offset - 16] + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload


def _outcome(blob, decoder):
    try:
        return sc.decode(blob, decoder=decoder)
    except CorruptDataError as e:
        return type(e)


@needs_kernel
@pytest.mark.parametrize("decoder", FAST)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=fields(shape=(11, 13), dtype=np.float32), codec=_CODECS, bound=_BOUNDS,
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6))
def test_forged_payloads_give_the_reference_outcome(decoder, x, codec, bound, edits):
    """Resealed payload edits reach the codes, escapes, side values and outliers: a fast path
    answers with the reference's tensor (overflowing sums included) or its CorruptDataError."""
    blob = sc.encode(x, codec=codec, **bound)
    h = read_header(blob)
    p = bytearray(blob[h.payload_offset:])
    if not p:
        return
    for where, value in edits:
        p[int(where * len(p))] = value
    forged = _reseal(blob, bytes(p))
    want, got = _outcome(forged, "reference"), _outcome(forged, decoder)
    if isinstance(want, type):
        assert got is want
    else:
        assert not isinstance(got, type) and same(got, want)


@needs_kernel
def test_warm_compiles_the_kernel_for_both_dtypes():
    assert paths.warm()
    outs = {str(sig[-1]) for sig in paths._kernels().decode_rows.signatures}
    assert {"array(float32, 2d, C)", "array(float64, 2d, C)"} <= outs


def test_warm_without_numba_compiles_nothing(monkeypatch):
    monkeypatch.setattr(paths, "_KERNELS", False)
    assert paths.warm() is False


@needs_kernel
def test_a_forked_child_decodes_with_threads_after_its_parent_did():
    """A DataLoader worker forked after the parent decoded on a thread pool decodes on threads
    too (an inherited pool has no threads: it would hang)."""
    import multiprocessing as mp

    blobs = [sc.encode(np.cumsum(np.ones((8, 9, 10), np.float32), 1) * k, rel_error=1e-3) for k in range(1, 5)]
    want = decode_all(blobs, "cpu-kernel", threads=2)
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_decode_in_child, (blobs,)).get(timeout=120)
    assert np.array_equal(got.view(np.int32), bits(want))


def _decode_in_child(blobs):
    return decode_all(blobs, "cpu-kernel", threads=2).numpy()


@needs_kernel
def test_a_cold_compile_of_the_decoder_says_it_is_compiling(caplog):
    """numba compiling a kernel of the decoder (its cache cold) logs one line; a kernel that is
    already compiled (or cached) says nothing, and neither does numba compiling other code."""
    import logging

    import numba

    paths.kernel_available()  # the notice is installed with the kernels

    def fresh(x):
        return x * 2 + 1

    fresh.__module__ = paths._kernels().__name__  # one more kernel of the decoder's module, never compiled
    kernel = numba.njit(fresh)
    blob = sc.encode(np.linspace(0, 1, 100, dtype=np.float32), rel_error=1e-3)
    sc.decode(blob, decoder="cpu-kernel")  # compiled (or loaded from the cache) before listening
    with caplog.at_level(logging.WARNING, logger="solar.codec"):
        assert kernel(3) == 7
        assert kernel(4) == 9  # compiled now: quiet
        numba.njit(lambda x: x - 1)(5)  # not the decoder's
        sc.decode(blob, decoder="cpu-kernel")  # already compiled: quiet
    notices = [r.getMessage() for r in caplog.records if r.name == "solar.codec"]
    assert len(notices) == 1 and "compiling the cpu-kernel decoder fresh" in notices[0], notices
    assert "cache is cold" in notices[0]


def _forgeries():
    """Resealed blobs whose sections the one-blob kernel checks itself (kernels_cpu.decode_blob):
    side markers without side values, escape and outlier positions out of order or range, an
    escape value past int32."""
    rng = np.random.default_rng(3)
    y = np.cumsum(rng.standard_normal(2000)).astype(np.float32)
    y[::211] += 500
    y[7] = np.nan  # one exact outlier
    out = []
    for eb in (1.0, 0.1):  # nibble codes with side values; int8 codes
        blob = sc.encode(y, abs_error=eb, codec={"id": "ebq", "predictor": "lorenzo", "lossless": "none"})
        h = read_header(blob)
        m = EbqMeta.parse(h, "blob")
        p = np.frombuffer(blob[h.payload_offset:], np.uint8).copy()
        assert m.n_esc >= 2 and m.n_out == 1 and (m.n_side > 0) == (eb == 1.0)
        edits = [lambda e: e.__setitem__(1, 0), lambda e: e.__setitem__(m.n_esc - 1, h.size - 1),
                 lambda e: e.__setitem__(m.n_esc, 2**31)]
        for edit in edits:  # the escape section: n_esc position deltas, then n_esc values
            q = p.copy()
            edit(q[m.codes_len:m.codes_len + m.esc_len].view("<i8"))
            out.append(_reseal(blob, q.tobytes()))
        q = p.copy()
        q[m.codes_len + m.esc_len:][:8].view("<i8")[0] = -1  # the outlier's position delta
        out.append(_reseal(blob, q.tobytes()))
        if m.n_side:
            q = p.copy()
            codes = q[:m.codes_len - m.n_side]
            codes[np.flatnonzero(((codes & 0x0F) != 8) & ((codes >> 4) != 8))[0]] = 0x88  # 2 markers more
            out.append(_reseal(blob, q.tobytes()))
    return out


@needs_kernel
def test_the_one_blob_kernel_refuses_forged_sections_in_the_group_paths_words():
    for forged in _forgeries():
        with pytest.raises(CorruptDataError) as ref:
            sc.decode(forged, decoder="reference")
        with pytest.raises(CorruptDataError) as fast:
            sc.decode(forged, decoder="cpu-kernel")
        assert str(fast.value) == str(ref.value)
        assert "corrupted payload" in str(ref.value)


@needs_kernel
def test_the_kernel_scratch_is_kept_per_thread_and_stale_values_never_leak(monkeypatch):
    """paths.work: one scratch per thread, grown when a decode needs more, not kept past
    WORK_KEEP; a decode after a larger one (the scratch full of its integers) is still exact."""
    import threading

    rng = np.random.default_rng(5)
    big, small = rng.standard_normal((40, 50)).astype(np.float32), rng.standard_normal((3, 7)).astype(np.float32)
    blobs = [sc.encode(a, rel_error=1e-3, codec={"id": "ebq", "predictor": p})
             for a in (big, small) for p in ("lorenzo", "fine")]
    want = [sc.decode(b, decoder="reference") for b in blobs]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3, 0, 2]):
        assert all(same(sc.decode(blobs[i], decoder="cpu-kernel"), want[i]) for i in order)
    a = paths.work(4, 100)
    assert paths.work(4, 50) is a and paths.work(4, 100) is a
    grown = paths.work(4, 101)
    assert grown.size >= 101 and paths.work(4, 10) is grown
    seen = []
    t = threading.Thread(target=lambda: seen.append(paths.work(4, 10)))
    t.start()
    t.join()
    assert seen[0] is not grown  # another thread's own
    monkeypatch.setattr(paths, "WORK_KEEP", 400)
    huge = paths.work(4, 1000)  # 4000 bytes: past WORK_KEEP, used once
    assert huge.size >= 1000 and paths.work(4, 10) is grown


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_goes_blob_by_blob_through_the_one_blob_path_into_its_rows(monkeypatch, threads):
    """A CPU batch of one shape decodes each blob through solar.codec.fast (its plan cached per
    header), not through the group driver, from every kind of byte buffer a caller passes."""
    from solar.codec import fast

    rng = np.random.default_rng(11)
    xs = [np.cumsum(rng.standard_normal((1, 32, 24)), 2).astype(np.float32) for _ in range(7)]
    blobs = [sc.encode(x, rel_error=1e-3) for x in xs]
    flat = np.frombuffer(b"".join(blobs), np.uint8)
    cuts = np.cumsum([0] + [len(b) for b in blobs])
    want = decode_all(blobs, "reference")
    group = []
    monkeypatch.setattr(paths, "_share", lambda *a: group.append(a))  # the group driver: must not run
    for kind in (list, lambda bs: [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])],
                 lambda bs: [bytearray(b) for b in bs], lambda bs: [memoryview(b) for b in bs]):
        got = sc.decode_batch(kind(blobs), threads=threads)
        assert same(got, want) and got.shape == (7, 1, 32, 24)
    assert not group
    assert fast._key(blobs[3])[0] in fast._PLANS


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_batch_with_a_forged_blob_is_refused_in_the_group_paths_words(threads):
    """A forged blob among clean ones: a CorruptDataError naming that blob's sample in the
    reference's words, whatever the thread count."""
    clean = sc.encode(np.cumsum(np.ones(2000, np.float32)), abs_error=1.0,
                      codec={"id": "ebq", "predictor": "lorenzo", "lossless": "none"})
    names = [f"s{i}" for i in range(12)]
    for forged in _forgeries():
        batch = [clean] * 12
        batch[9] = forged
        with pytest.raises(CorruptDataError) as ref:
            sc.decode_batch(batch, names=names, decoder="reference")
        with pytest.raises(CorruptDataError) as fast:
            sc.decode_batch(batch, names=names, threads=threads)
        assert str(fast.value) == str(ref.value)
        assert str(fast.value).startswith("sample 's9'") and "corrupted payload" in str(fast.value)
