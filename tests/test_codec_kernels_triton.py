"""The ``triton`` decoder path gives the reference decoder's bits (solar.codec.kernels_triton).

Without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set here for this module's own import of the kernels only); the ``gpu``-marked tests run the
compiled kernels on CUDA (``make gpu-check``) against the CPU reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solar.codec as sc
from solar.codec import decoders, paths
from solar.codec.predict import Predictor

from test_codec_kernels import _BOUNDS, FIXTURES, fields, same

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the triton decoder needs Triton (it ships with CUDA builds of torch; "
                                       "pip install triton)")

PER_LEVEL = st.fixed_dictionaries({"id": st.just("ebq"), "predictor": st.sampled_from(["fine", "interp", "cubic",
                                                                                         "linear"]),
                                   "lossless": st.sampled_from(["zstd", "lz4", "none", "bitpack"])})


@pytest.fixture(scope="module")
def interpreted():
    """The kernels imported afresh under Triton's interpreter, for this module's tests only."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    sys.modules.pop("solar.codec.kernels_triton", None)
    mp.setattr(paths, "_TRITON", importlib.import_module("solar.codec.kernels_triton"))
    yield
    mp.undo()
    sys.modules.pop("solar.codec.kernels_triton", None)
    paths._TRITON = None


def test_choice_of_the_triton_path(interpreted):
    cpu = torch.device("cpu")
    with decoders.use("triton"):
        assert paths.choose(cpu, 6, Predictor.FINE, 10) == "triton"
        assert paths.choose(cpu, 2, Predictor.INTERP, 10) == "triton"
        assert paths.choose(cpu, 6, Predictor.LORENZO, 10) == "reference"  # prefix sums: torch ops
        assert paths.choose(cpu, 1, Predictor.CUBIC, 10) == "reference"
    assert paths.choose(cpu, 6, Predictor.FINE, 10) != "triton"  # auto: triton only for CUDA decodes


def test_golden_fixtures_decode_to_the_reference_bits(interpreted):
    index = json.loads((FIXTURES / "index.json").read_text())
    blobs = [(FIXTURES / e["blob"]).read_bytes() for e in index]
    for entry, blob in zip(index, blobs):
        got = sc.decode(blob, decoder="triton")
        assert same(got, sc.decode(blob, decoder="reference")), entry["blob"]
        assert got.numpy().tobytes().hex()[:64] == entry["decoded_prefix"]
    assert same(sc.decode_batch(blobs, decoder="triton"), sc.decode_batch(blobs, decoder="reference"))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=fields(), codec=PER_LEVEL, bound=_BOUNDS)
def test_hypothesis_arrays_decode_to_the_reference_bits(interpreted, x, codec, bound):
    blob = sc.encode(x, codec=codec, **bound)
    assert same(sc.decode(blob, decoder="triton"), sc.decode(blob, decoder="reference"))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), shape=st.sampled_from([(1,), (3, 17, 5), (4, 9, 8), (2, 33), (16, 16), (5, 4, 3, 2)]),
       batch=st.integers(2, 6))
def test_mixed_batches_decode_to_the_reference_bits(interpreted, data, shape, batch):
    """Per-row cubic/linear choices, nibble and int8 codes, escapes and folded channels in one
    group: no mask sorting on the triton path, the same rows as the reference's."""
    xs = [data.draw(fields(shape=shape, dtype=np.float32)) for _ in range(batch)]
    blobs = [sc.encode(x, codec=data.draw(PER_LEVEL), **data.draw(_BOUNDS)) for x in xs]
    assert same(sc.decode_batch(blobs, decoder="triton"), sc.decode_batch(blobs, decoder="reference"))


def _cuda_blobs():
    rng = np.random.default_rng(21)
    xs = [np.cumsum(np.cumsum(rng.standard_normal((24, 40, 33)), 0), 2).astype(np.float32) for _ in range(6)]
    xs[2][3, 4, 5] = np.nan
    xs[3] = xs[3] + rng.standard_normal(xs[3].shape).astype(np.float32) * 40  # wide codes, escapes
    codecs = [{"id": "ebq", "predictor": p} for p in ("fine", "interp", "cubic", "linear", "fine", "auto")]
    return [sc.encode(x, codec=c, rel_error=r) for x, c, r in zip(xs, codecs, (1e-2, 1e-3, 1e-4, 1e-5, 1e-3, 1e-3))]


@pytest.mark.gpu
def test_cuda_triton_decode_matches_the_cpu_reference():
    assert paths.choose(torch.device("cuda"), 6, Predictor.FINE, 10) == "triton"  # auto on CUDA
    blobs = _cuda_blobs()
    want = sc.decode_batch(blobs, decoder="reference")
    got = sc.decode_batch(blobs, device="cuda", decoder="triton")
    assert got.device.type == "cuda" and same(got, want)
    assert same(sc.decode_batch(blobs, device="cuda"), want)  # auto
    index = json.loads((FIXTURES / "index.json").read_text())
    for entry in index:
        blob = (Path(FIXTURES) / entry["blob"]).read_bytes()
        assert same(sc.decode(blob, device="cuda", decoder="triton"), sc.decode(blob, decoder="reference")), \
            entry["blob"]


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=fields(), codec=PER_LEVEL, bound=_BOUNDS)
def test_cuda_triton_hypothesis_arrays_match_the_cpu_reference(x, codec, bound):
    blob = sc.encode(x, codec=codec, **bound)
    assert same(sc.decode(blob, device="cuda", decoder="triton"), sc.decode(blob, decoder="reference"))
