"""A conformance suite every registered codec runs (zarr's shipped ``StoreTests`` is the model).

Use it from a test module::

    from solar.testing.codecs import CodecTests

    class TestMyCodec(CodecTests):
        codec = {"id": "mycodec", "some_option": 1}

Each test checks one promise of the :mod:`solar.codec` API: the strict bound (Hypothesis on
adversarial arrays), bit-exact NaN/Inf, header round trip, batch decode equal to single decode,
``out=``, and that damaged, truncated or foreign blobs raise :class:`solar.CorruptDataError`.
"""

from __future__ import annotations

import json
import math

import numpy as np

import solar.codec as sc
from solar.codec import get_codec
from solar.codec.quantize import within_bound
from solar.errors import CorruptDataError

__all__ = ["CodecTests", "adversarial_arrays", "assert_within_bound"]


def assert_within_bound(x: np.ndarray, y: np.ndarray, eb: float) -> None:
    """Decoded ``y`` matches ``x``: same shape, NaN/Inf bit-exact, finite values within ``eb``."""
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    fin = np.isfinite(x)
    nonfin = ~fin
    assert np.array_equal(x[nonfin].view(_uint(x)), y[nonfin].view(_uint(x))), "NaN/Inf not bit-exact"
    ok = within_bound(x[fin], y[fin], eb)
    if not ok.all():
        i = np.flatnonzero(~ok)[0]
        raise AssertionError(
            f"bound violated at {i}: x={x[fin][i]!r} y={y[fin][i]!r} |d|={abs(float(x[fin][i]) - float(y[fin][i]))!r} "
            f"eb={eb!r}")


def _uint(x: np.ndarray):
    return np.uint32 if x.dtype.itemsize == 4 else np.uint64


def adversarial_arrays():
    """Hypothesis strategy: (array, kind, bound) covering the cases that break naive quantizers.

    Constant arrays, huge ranges, denormals, values exactly on bin edges, NaN/Inf, size 0 and 1,
    odd shapes, 0-D to 4-D, float32 and float64, absolute and relative bounds.
    """
    from hypothesis import strategies as st  # the test extra: importing the suite does not need it
    from hypothesis.extra import numpy as hnp

    @st.composite
    def build(draw):
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        ndim = draw(st.integers(0, 4))
        max_side = {0: 1, 1: 300, 2: 24, 3: 9, 4: 5}[ndim]
        shape = tuple(draw(st.lists(st.integers(0 if ndim else 1, max_side), min_size=ndim, max_size=ndim)))
        size = math.prod(shape)
        kind = draw(st.sampled_from(["smooth", "noise", "constant", "huge", "denormal", "binedge", "elements"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if kind == "smooth":
            x = np.cumsum(rng.standard_normal(size)).reshape(shape) * draw(st.sampled_from([1e-3, 1.0, 1e4]))
        elif kind == "noise":
            x = rng.standard_normal(shape) * 10.0 ** draw(st.integers(-30, 30))
        elif kind == "constant":
            x = np.full(shape, draw(st.floats(-1e30, 1e30, width=64)))
        elif kind == "huge":
            fmax = float(np.finfo(dtype).max)
            x = rng.uniform(-1, 1, shape) * fmax * draw(st.sampled_from([1.0, 0.5, 1e-3]))
        elif kind == "denormal":
            tiny = float(np.finfo(dtype).smallest_subnormal)
            x = rng.integers(-1000, 1000, shape) * tiny
        elif kind == "binedge":
            eb = draw(st.sampled_from([0.5, 0.25, 1.0, 0.1, 1e-3]))
            x = (rng.integers(-1000, 1000, shape) + 0.5) * (2 * eb) + draw(st.sampled_from([0.0, 1e-7, 3.0]))
        else:
            x = np.asarray(draw(hnp.arrays(dtype, shape, elements=st.floats(width=np.dtype(dtype).itemsize * 8))))
        x = np.asarray(x).astype(dtype)
        if size and draw(st.booleans()):  # sprinkle NaN / Inf / -0.0
            flat = x.reshape(-1)
            for v in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, -0.0]), max_size=3)):
                flat[rng.integers(0, size)] = v
        if kind == "binedge":
            bound = ("abs", eb)
        else:
            bound = draw(st.sampled_from([("rel", 1e-3), ("rel", 1e-2), ("rel", 1e-5), ("rel", 0.0),
                                          ("abs", 1e-3), ("abs", 1.0), ("abs", 1e-40), ("abs", 1e300)]))
        return x, bound

    return build()


class CodecTests:
    """Mixin of conformance tests; subclasses set ``codec`` (a name or config dict)."""

    codec: object = None

    def _enc(self, x, **kw):
        return sc.encode(x, codec=self.codec, **kw)

    def test_bound_adversarial(self):
        from hypothesis import HealthCheck, given, settings  # the test extra, as above

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(adversarial_arrays())
        def run(case):
            x, (mode, val) = case
            blob = self._enc(x, **({"abs_error": val} if mode == "abs" else {"rel_error": val}))
            info = sc.header_info(blob)
            assert info.shape == x.shape and info.dtype == x.dtype
            y = sc.decode(blob).numpy()
            assert_within_bound(x, y, info.abs_error)
            if mode == "abs":
                assert info.abs_error == val
            if mode == "rel" and val == 0.0 or mode == "abs" and val == 0.0:
                assert np.array_equal(x.view(_uint(x)), y.view(_uint(x)))

        run()

    def test_nan_inf_exact(self):
        x = np.linspace(-5, 5, 1000, dtype=np.float32).reshape(10, 100)
        x[1, 2], x[3, 4], x[5, 6] = np.nan, np.inf, -np.inf
        x.reshape(-1)[7] = np.float32(np.frombuffer(np.uint32(0x7FC12345).tobytes(), np.float32)[0])  # NaN payload
        blob = self._enc(x, rel_error=1e-3)
        assert_within_bound(x, sc.decode(blob).numpy(), sc.header_info(blob).abs_error)

    def test_batch_equals_single(self):
        import torch  # heavy; the rest of the suite is numpy-only

        rng = np.random.default_rng(1)
        xs = [np.cumsum(rng.standard_normal((12, 17)), 1).astype(np.float32) for _ in range(5)]
        xs[2][3, 3] = np.nan
        blobs = [self._enc(x, rel_error=1e-3) for x in xs]
        batch = sc.decode_batch(blobs)
        assert isinstance(batch, torch.Tensor) and batch.shape == (5, 12, 17)
        for b, y in zip(blobs, batch):
            assert torch.equal(sc.decode(b).nan_to_num(7.0), y.nan_to_num(7.0))
        mixed = sc.decode_batch([blobs[0], self._enc(xs[1][:5], abs_error=0.1), blobs[1]])
        assert isinstance(mixed, list) and [tuple(m.shape) for m in mixed] == [(12, 17), (5, 17), (12, 17)]
        assert torch.equal(mixed[2], batch[1])
        assert sc.decode_batch([]) == []

    def test_out_parameter(self):
        import torch  # heavy; the rest of the suite is numpy-only

        x = np.arange(60, dtype=np.float64).reshape(3, 4, 5) / 7
        blob = self._enc(x, abs_error=1e-6)
        out = torch.empty((3, 4, 5), dtype=torch.float64)
        res = sc.decode(blob, out=out)
        assert res.data_ptr() == out.data_ptr()
        assert_within_bound(x, out.numpy(), 1e-6)

    def test_corruption_is_detected(self):
        import pytest  # the test extra: importing the suite does not need it

        x = np.sin(np.linspace(0, 20, 4096)).astype(np.float32).reshape(64, 64)
        blob = self._enc(x, rel_error=1e-3)
        for cut in (0, 3, 10, len(blob) // 2, len(blob) - 1):
            with pytest.raises(CorruptDataError):
                sc.decode(blob[:cut])
        for pos in (0, 6, 20, len(blob) // 2, len(blob) - 1):
            bad = bytearray(blob)
            bad[pos] ^= 0x10
            with pytest.raises(CorruptDataError):
                sc.decode(bytes(bad))
        with pytest.raises(CorruptDataError):
            sc.decode(blob + b"\0")
        with pytest.raises(CorruptDataError, match="not a SOLAR codec blob"):
            sc.decode(b"\x89HDF\r\n\x1a\n" + bytes(100))
        with pytest.raises(CorruptDataError, match="sample 17"):
            sc.decode_batch([blob, blob[:-5]], names=[3, 17])

    def test_config_round_trip(self):
        c = get_codec(self.codec)
        cfg = c.get_config()
        assert get_codec(json.loads(json.dumps(cfg))).get_config() == cfg
