"""Fuzz the decoder with >= 10,000 mutated blobs: CorruptDataError or a correct decode, nothing else.

Two families of mutations:

* plain damage (truncation, bit flips, overwritten ranges, inserted/appended bytes, foreign
  bytes): the checksums are left as they are, so the result must be ``CorruptDataError`` or a
  decode that is still within the bound of the original;
* forgeries: header fields or payload bytes are edited *and both checksums recomputed*, as a
  buggy or hostile writer would; the decoder's own validation must then answer with
  ``CorruptDataError`` or a tensor of the declared shape and dtype -- never another exception,
  a hang, or a huge allocation (the address space is capped while fuzzing).
"""

from __future__ import annotations

import contextlib
import resource
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solar.codec as sc
from solar.codec.header import read_header
from solar.errors import CorruptDataError
from solar.testing.codecs import assert_within_bound


def _corpus():
    rng = np.random.default_rng(7)
    smooth = np.cumsum(np.cumsum(rng.standard_normal((16, 16)), 0), 1).astype(np.float32)
    spiky = np.sin(np.linspace(0, 6, 700)).astype(np.float32)
    spiky[::97] += 40.0
    specials = smooth.copy()
    specials[2, 3], specials[5, 5], specials[7, 1] = np.nan, np.inf, -np.inf
    edge = (np.arange(120, dtype=np.float32) * np.float32(0.1) + np.float32(0.05)).reshape(4, 5, 6)
    cases = [
        (smooth, {"rel_error": 1e-3}, {"id": "ebq", "predictor": "cubic", "lossless": "zstd"}),
        (smooth, {"rel_error": 1e-2}, {"id": "ebq", "predictor": "linear", "lossless": "lz4"}),
        (spiky, {"abs_error": 1e-3}, {"id": "ebq", "predictor": "cubic", "lossless": "none"}),
        (specials.astype(np.float64), {"abs_error": 1e-4}, {"id": "ebq", "predictor": "lorenzo"}),
        (edge, {"abs_error": 0.05}, {"id": "ebq", "predictor": "lorenzo", "lossless": "lz4"}),
        (smooth[:3], {"rel_error": 0.0}, None),
        (rng.standard_normal((2, 3, 4, 5)).astype(np.float32), {"abs_error": 1e-5}, None),
        (np.stack([smooth, smooth.T]), {"rel_error": 1e-3}, {"id": "ebq", "predictor": "cubic"}),
        (specials, {"rel_error": 1e-3}, {"id": "ebq", "predictor": "fine", "lossless": "bitpack"}),
        (spiky.astype(np.float64), {"abs_error": 1e-9}, {"id": "ebq", "predictor": "lorenzo", "lossless": "bitpack"}),
    ]
    return [(x, sc.encode(x, codec=c, **b)) for x, b, c in cases]


CORPUS = _corpus()


def _reseal(head: bytes, payload: bytes) -> bytes:
    """Recompute both checksums of header-without-checksums ``head`` (ends in payload_len, sum)."""
    head = head[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload


@st.composite
def mutated(draw):
    i = draw(st.integers(0, len(CORPUS) - 1))
    x, blob = CORPUS[i]
    h = read_header(blob)
    head, payload = blob[:h.payload_offset - 8], blob[h.payload_offset:]
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "foreign",
                                 "forge_header", "forge_payload", "forge_meta"]))
    b = bytearray(blob)
    if kind == "truncate":
        return i, False, bytes(b[:draw(st.integers(0, len(b) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, len(b) - 1))
            b[pos] ^= 1 << draw(st.integers(0, 7))
        return i, False, bytes(b)
    if kind == "overwrite":
        pos = draw(st.integers(0, len(b) - 1))
        junk = draw(st.binary(min_size=1, max_size=32))
        b[pos:pos + len(junk)] = junk
        return i, False, bytes(b)
    if kind == "insert":
        pos = draw(st.integers(0, len(b)))
        return i, False, bytes(b[:pos] + draw(st.binary(min_size=1, max_size=16)) + b[pos:])
    if kind == "foreign":
        prefix = draw(st.sampled_from([b"", b"SLRC", b"SLRC\x01", b"\x89HDF\r\n\x1a\n", b"\x28\xb5\x2f\xfd"]))
        return i, False, prefix + draw(st.binary(max_size=300))
    # forgeries: edit and re-seal, so only the decoder's own validation stands in the way
    if kind == "forge_payload":
        p = bytearray(payload)
        if p:
            for _ in range(draw(st.integers(1, 6))):
                p[draw(st.integers(0, len(p) - 1))] = draw(st.integers(0, 255))
        return i, True, _reseal(head + bytes(16), bytes(p))
    hb = bytearray(head)
    if kind == "forge_meta":  # codec metadata: predictor, widths, step, section lengths, counts
        meta_end = len(hb) - 16
        lo = meta_end - len(h.meta)
        for _ in range(draw(st.integers(1, 4))):
            if h.meta:
                hb[draw(st.integers(lo, meta_end - 1))] = draw(st.integers(0, 255))
    else:  # forge_header: any header byte after the magic (descriptor, dtype, ndim, shape, bound)
        for _ in range(draw(st.integers(1, 3))):
            hb[draw(st.integers(4, len(hb) - 17))] = draw(st.integers(0, 255))
    return i, True, _reseal(bytes(hb), payload)


@contextlib.contextmanager
def _address_space_cap(extra: int = 3 << 30):
    """Cap this process's address space so a huge allocation fails loudly instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as fh:
        vm = int(fh.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _check(case):
    i, forged, blob = case
    x, original = CORPUS[i]
    try:
        y = sc.decode(blob)
    except CorruptDataError:
        return
    if forged:
        info = sc.header_info(blob)
        assert tuple(y.shape) == info.shape and y.numpy().dtype == info.dtype
    else:
        assert blob == original or len(blob) == len(original), "damaged blob decoded without an error"
        assert_within_bound(x, y.numpy(), sc.header_info(original).abs_error)


@pytest.mark.slow
def test_fuzz_decoder_10k_mutated_blobs():
    @settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated())
    def run(case):
        _check(case)

    with _address_space_cap():
        run()


def test_fuzz_corpus_decodes():
    """The unmutated corpus decodes correctly (so the fuzz test mutates working blobs)."""
    for x, blob in CORPUS:
        assert_within_bound(x, sc.decode(blob).numpy(), sc.header_info(blob).abs_error)


def _fine_corpus():
    """Blobs that take the compiled graph: nibble codes with side values, int8 codes, 16-bit
    byte-plane codes, each with escapes."""
    rng = np.random.default_rng(11)
    smooth = np.cumsum(np.cumsum(rng.standard_normal((24, 20)), 0), 1).astype(np.float32)
    noisy = smooth + rng.standard_normal(smooth.shape).astype(np.float32) * 0.5
    noisy[3, 4] += 500.0  # an escape
    fine = {"id": "ebq", "predictor": "fine"}
    return [(x, sc.encode(x, codec=fine, rel_error=r)) for x, r in ((noisy, 1e-3), (noisy, 1e-4), (noisy, 1e-5))]


@pytest.mark.slow
def test_fuzz_compiled_decoder_forged_payloads():
    """Resealed payload forgeries keep the header (so the compiled graph is reused) and reach
    the graph's unpacking, side values and escapes: the compiled decode must give exactly what
    the eager decode gives, the same tensor or the same CorruptDataError."""
    from solar.codec.ebq_meta import EbqMeta

    corpus = _fine_corpus()
    metas = [EbqMeta.unpack(6, read_header(b).meta) for _, b in corpus]
    assert [m[2] for m in metas] == [0, 1, 2] and all(m[8] for m in metas) and metas[0][12]  # + side, escapes
    for x, blob in corpus:  # compile outside the address-space cap
        assert torch_equal_bits(sc.decode(blob, compile=True), sc.decode(blob, compile=False))

    @settings(max_examples=1_000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(corpus) - 1), st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                                                st.integers(0, 255)), min_size=1, max_size=6))
    def run(i, edits):
        _, blob = corpus[i]
        h = read_header(blob)
        p = bytearray(blob[h.payload_offset:])
        for where, value in edits:
            p[int(where * len(p))] = value
        forged = _reseal(blob[:h.payload_offset - 8], bytes(p))
        outcomes = []
        for compile in (False, True):
            try:
                outcomes.append(sc.decode(forged, compile=compile))
            except CorruptDataError as e:
                outcomes.append(type(e))
        eager, compiled = outcomes
        if isinstance(eager, type):
            assert compiled is eager
        else:
            assert torch_equal_bits(compiled, eager)

    with _address_space_cap():
        run()


def torch_equal_bits(a, b) -> bool:
    import torch

    view = torch.int32 if a.dtype == torch.float32 else torch.int64
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))
