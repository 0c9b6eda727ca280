"""The 10,000-blob fuzz test of tests/test_codec_fuzz.py against every decoder path.

Each damaged or forged blob must give ``CorruptDataError`` or a correct decode (within the bound
for damage, the declared shape and dtype for forgeries) on the reference, on the ``cpu-kernel``
and on the ``triton`` path (under Triton's interpreter here; ``interpreted`` comes from
tests/test_codec_kernels_triton.py).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from test_codec_fuzz import _address_space_cap, _check, mutated
from test_codec_kernels_triton import interpreted  # noqa: F401  (fixture)

from solar.codec import decoders, paths

PATHS = [
    "reference",
    pytest.param("cpu-kernel", marks=pytest.mark.skipif(not paths.kernel_available(),
                                                        reason="the cpu-kernel decoder needs numba")),
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="the triton decoder needs Triton")),
]


@pytest.mark.slow
@pytest.mark.parametrize("decoder", PATHS)
def test_fuzz_every_decoder_path_10k_mutated_blobs(decoder, request):
    if decoder == "triton":
        request.getfixturevalue("interpreted")

    @settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated())
    def run(case):
        with decoders.use(decoder):
            _check(case)

    with _address_space_cap():
        run()
