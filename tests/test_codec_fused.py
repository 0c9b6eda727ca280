"""solar.codec.fused: the torch.compile-d decoder graph gives the eager decoder's values, bit for bit.

Each new decode signature compiles (seconds to tens of seconds), so the cases below are chosen
to cover every branch of the graph (1-D to 4-D, odd and even lengths, cubic/linear per row and
level, escapes, exact outliers, NaN/Inf, folded channels, float64/int64) with few signatures.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import solar.codec as sc
from solar.codec import fused
from solar.codec.ebq_meta import EbqMeta
from solar.codec.header import read_header
from solar.testing.codecs import assert_within_bound

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "codec"
FINE = {"id": "ebq", "predictor": "fine"}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The IEEE bit patterns (NaN payloads included), so equality means bit-identical."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def meta(blob: bytes) -> tuple:
    h = read_header(blob)
    return EbqMeta.unpack(h.version, h.meta)


def test_compiled_matches_eager_on_golden_fixtures():
    """Every committed ebq/6 blob that takes the graph decodes identically with and without it."""
    index = json.loads((FIXTURES / "index.json").read_text())
    compiled = 0
    for entry in index:
        if entry["descriptor"] != "ebq/6":
            continue
        blob = (FIXTURES / entry["blob"]).read_bytes()
        eager = sc.decode(blob, compile=False)
        got = sc.decode(blob, compile=True)
        assert torch.equal(bits(got), bits(eager)), entry["blob"]
        assert_within_bound(np.load(FIXTURES / entry["original"]), got.numpy(), entry["abs_error"])
        compiled += meta(blob)[0] in (4, 5) and read_header(blob).size > 0
    assert compiled >= 4  # the fine fixtures really went through the graph


@pytest.mark.parametrize("shape,dtype", [((37,), np.float32), ((6, 11), np.float32), ((5, 4, 9), np.float64),
                                         ((2, 3, 5, 8), np.float32)], ids=["1d", "2d", "3d-f64", "4d-folded"])
def test_compiled_matches_eager_on_odd_shapes(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = np.cumsum(rng.standard_normal(shape), axis=-1).astype(dtype)
    x.reshape(-1)[3] = np.inf
    x.reshape(-1)[-2] = np.nan
    blobs = [sc.encode(x * (1 + k), rel_error=10.0 ** -(2 + k % 3), codec=FINE) for k in range(3)]
    eager = sc.decode_batch(blobs, compile=False)
    got = sc.decode_batch(blobs, compile=True)
    assert torch.equal(bits(got), bits(eager))
    for k, y in enumerate(got):
        assert_within_bound(x * (1 + k), y.numpy(), sc.header_info(blobs[k]).abs_error)


def test_compiled_mixed_batch_with_escapes_and_outliers():
    """Per-row cubic/linear choices, nibble and int8 rows, escapes and NaN outliers in one batch."""
    from solar.synthetic import ptycho_block

    _, xs = ptycho_block(0, 24, size=64)  # amplitude/phase pairs: encoders disagree per sample
    eb = 1e-2 * float(xs.max() - xs.min())
    xs = xs.copy()
    rng = np.random.default_rng(5)
    for i in (0, 9, 17):  # spikes well beyond int8 residuals (escapes), and NaN (exact outliers)
        xs[i].reshape(-1)[rng.integers(0, xs[i].size, 6)] += 300 * eb
        xs[i + 1].reshape(-1)[11] = np.nan
    blobs = [sc.encode(x, abs_error=eb, codec=FINE) for x in xs]
    ms = [meta(b) for b in blobs]
    assert len({m[2] for m in ms}) > 1 and len({m[6] for m in ms}) > 1  # nibble+int8, mixed levels
    assert any(m[8] for m in ms) and any(m[10] for m in ms)  # escapes and exact outliers present
    eager = sc.decode_batch(blobs, compile=False)
    got = sc.decode_batch(blobs, compile=True)
    assert torch.equal(bits(got), bits(eager))
    assert torch.equal(bits(sc.decode(blobs[1], compile=True)), bits(eager[1]))


@pytest.mark.parametrize("dtype,rel,spike,width", [(np.float32, 1e-5, 1e6, 2), (np.float64, 1e-9, 1e11, 4)],
                         ids=["w2-int32", "w4-int64"])
def test_compiled_wide_codes_with_escapes(dtype, rel, spike, width, monkeypatch):
    """Byte-plane codes (tight bounds) are joined and unzigzagged inside the graph; their escapes
    (all-ones codes) become corrections, and the values match the eager decoder's bits."""
    rng = np.random.default_rng(7)
    x = np.cumsum(rng.standard_normal((3, 20, 33)), axis=2)
    blobs = []
    for k in range(4):
        y = (x * (k + 1)).astype(dtype)
        eb = rel * float(y.max() - y.min())
        y.reshape(-1)[rng.integers(0, y.size, 3)] += spike * eb  # beyond the code width: escapes
        blobs.append(sc.encode(y, abs_error=eb, codec=FINE))
    wide = [b for b in blobs if meta(b)[0] == 5 and meta(b)[2] == width]
    assert len(wide) >= 2 and all(meta(b)[8] for b in wide)  # the case under test: wide codes, escapes
    eager = sc.decode_batch(wide, compile=False)
    widths = []
    run = fused.run
    monkeypatch.setattr(fused, "run", lambda *a: widths.append(a[-1]) or run(*a))
    got = sc.decode_batch(wide, compile=True)
    assert widths == [width]  # one graph call, on the byte planes
    assert torch.equal(bits(got), bits(eager))


def _escaping_blobs(rng, x):
    blobs = []
    for k in range(8):
        y = (x * (k + 1)).astype(np.float32)
        eb = 1e-5 * float(y.max() - y.min())
        y.reshape(-1)[rng.integers(0, y.size, 2)] += 1e6 * eb  # escapes in every chunk
        blobs.append(sc.encode(y, abs_error=eb, codec=FINE))
    assert all(meta(b)[0] == 5 and meta(b)[8] for b in blobs)
    return blobs


def test_batch_size_seen_first_takes_the_static_graph(monkeypatch):
    """A batch that fits one call runs whole: through the static graph when its size is the first
    this signature saw (a training loop's batch size) or 1, through the dynamic graph otherwise
    (the epoch's last batch), with the eager decoder's values either way."""
    rng = np.random.default_rng(11)
    blobs = _escaping_blobs(rng, np.cumsum(rng.standard_normal((3, 20, 33)), axis=2))
    monkeypatch.setattr(fused, "_static_batch", {})
    calls = []
    get = fused._get
    monkeypatch.setattr(fused, "_get", lambda static: calls.append(static) or get(static))
    for count, want in ((5, True), (3, False), (5, True), (1, True), (8, False)):
        calls.clear()
        eager = sc.decode_batch(blobs[:count], compile=False)
        got = sc.decode_batch(blobs[:count], compile=True)
        assert calls == [want], count  # one call for the whole batch
        assert torch.equal(bits(got), bits(eager)), count


def test_batches_run_in_fixed_size_chunks(monkeypatch):
    """A batch larger than a chunk runs as fixed-size chunks through the static graph and the
    remainder through the dynamic one (or the static one for a single blob); every chunk gets its
    own rows' corrections, and the values are the eager decoder's."""
    rng = np.random.default_rng(7)
    x = np.cumsum(rng.standard_normal((3, 20, 33)), axis=2)
    blobs = _escaping_blobs(rng, x)
    monkeypatch.setattr(fused, "CHUNK_VALUES", 3 * x.size)  # 3 blobs per chunk
    monkeypatch.setattr(fused, "_static_batch", {})
    calls = []
    get = fused._get
    monkeypatch.setattr(fused, "_get", lambda static: calls.append(static) or get(static))
    for count, want_calls in ((8, [True, True, False]), (7, [True, True, True]), (2, [True]), (3, [False])):
        calls.clear()
        eager = sc.decode_batch(blobs[:count], compile=False)
        got = sc.decode_batch(blobs[:count], compile=True)
        # chunks of 3 (static), then 2 rows (dynamic) or 1 (static); whole batches of at most 3:
        # 2 is the first such size (static), 3 another (dynamic)
        assert calls == want_calls, count
        assert torch.equal(bits(got), bits(eager)), count


def test_environment_switch_and_eager_fallback(monkeypatch):
    """SOLAR_CODEC_COMPILE turns the graph on; a compiler failure warns once and decodes eagerly."""
    x = np.linspace(0, 1, 1024, dtype=np.float32).reshape(32, 32) ** 2
    blob = sc.encode(x, rel_error=1e-3, codec=FINE)
    assert meta(blob)[0] == 5 and meta(blob)[2] in (0, 1)  # a blob that takes the graph
    want = sc.decode(blob, compile=False)
    calls = []

    def broken(*_):
        calls.append(1)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "_get", broken)
    monkeypatch.setattr(fused, "_failed", None)
    monkeypatch.setenv("SOLAR_CODEC_COMPILE", "1")
    monkeypatch.setenv("SOLAR_STRICT", "1")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):  # strict: a failure is a failure
        sc.decode(blob)
    monkeypatch.delenv("SOLAR_STRICT")
    with pytest.warns(RuntimeWarning, match="compiled decoding is unavailable"):
        got = sc.decode(blob)
    assert torch.equal(got, want)
    assert torch.equal(sc.decode(blob), want) and len(calls) == 2  # after a failure: eager, no retry
    assert sc.decode(blob, compile=False) is not None and len(calls) == 2
    monkeypatch.setenv("SOLAR_CODEC_COMPILE", "0")
    assert not fused.enabled()
    with fused.use(True):
        assert fused.enabled()


def test_threads_decode_with_the_graph_concurrently():
    """Loader prefetch threads share the compiled graph (dynamo config is per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.cumsum(np.random.default_rng(2).standard_normal((3, 40, 24)), axis=1).astype(np.float32)
    blobs = [sc.encode(x * (k + 1), rel_error=1e-3, codec=FINE) for k in range(6)]
    want = sc.decode_batch(blobs, compile=False)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: sc.decode_batch(blobs[k:] + blobs[:k], compile=True), range(6)))
    for k, g in enumerate(got):
        assert torch.equal(g, torch.cat([want[k:], want[:k]]))


@pytest.mark.gpu
def test_compiled_cuda_decode_matches_cpu_eager():
    """On CUDA the graph compiles to Triton; it must give the CPU eager decoder's bits."""
    x = np.cumsum(np.random.default_rng(4).standard_normal((2, 33, 40)), axis=2).astype(np.float32)
    blobs = [sc.encode(x * (k + 1), rel_error=1e-3, codec=FINE) for k in range(5)]
    want = sc.decode_batch(blobs, compile=False)
    got = sc.decode_batch(blobs, device="cuda", compile=True)
    assert got.device.type == "cuda" and torch.equal(bits(got.cpu()), bits(want))
