"""ebq/7's ``bitpack`` codes (solar.codec.bitpack) and the one-blob fast path (solar.codec.fast).

The section layout is checked byte by byte, every code width (0-64 bits) round-trips through
the numpy packer and every decoder path, damaged sections are CorruptDataError naming the
sample on every path, and the fast path gives the general path's bits and errors.
"""

from __future__ import annotations

import importlib.util
import json
import struct

import numpy as np
import pytest
import torch
import xxhash

import solar.codec as sc
from solar.codec import bitpack, fast, paths
from solar.codec.ebq_meta import BITPACK, EbqMeta
from solar.codec.header import read_header
from solar.errors import ConfigError, CorruptDataError

from test_codec_kernels import FIXTURES, _reseal, same
from test_codec_kernels_triton import interpreted  # noqa: F401  (fixture)

BP = {"id": "ebq", "lossless": "bitpack"}
PATHS = ["reference", pytest.param("cpu-kernel", marks=pytest.mark.skipif(not paths.kernel_available(),
                                                                         reason="needs numba"))]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def test_the_section_layout_byte_by_byte():
    r = np.array([0] * 32 + [1, -1, 2] + [0] * 29 + [0, 0, 0], np.int64)  # blocks: zero, width 3, zero
    s = bitpack.pack(r)
    assert bitpack.blocks(r.size) == 3 and bitpack.head(r.size) == 4
    assert s[:4] == bytes([0, 3, 0, 0])  # widths, then padding to a whole word
    codes = 2 | (1 << 3) | (4 << 6)  # zigzag 1 -> 2, -1 -> 1, 2 -> 4 at bits 0, 3, 6
    assert s[4:] == struct.pack("<III", codes, 0, 0)
    assert bitpack.check(s, r.size, 4, "x").tolist() == [0, 3, 0]


@pytest.mark.parametrize("qint", [4, 8])
def test_every_width_round_trips(qint):
    rng = np.random.default_rng(qint)
    top = 8 * qint
    rows = []
    for w in range(top + 1):  # one block per width: its largest zigzag code has exactly w bits
        lo, hi = (0, 0) if w == 0 else (-(1 << (w - 1)), (1 << (w - 1)) - 1)
        r = rng.integers(lo, hi, 32, endpoint=True, dtype=np.int64)
        r[rng.integers(32)] = lo  # zigzag(lo) = 2**w - 1
        rows.append(r)
    r = np.concatenate(rows)[:-5]  # a partial last block
    s = bitpack.pack(r)
    assert bitpack.check(s, r.size, qint, "x").tolist() == list(range(top + 1))
    itype = torch.int32 if qint == 4 else torch.int64
    got = bitpack.unpack_torch(bitpack.concat([s, s]), r.size, itype, torch.device("cpu"))
    assert got.dtype == itype and np.array_equal(got.numpy().astype(np.int64), np.stack([r, r]))


@pytest.mark.parametrize("decoder", PATHS)
def test_fields_of_every_kind_decode_within_the_bound_and_to_the_reference_bits(decoder):
    rng = np.random.default_rng(1)
    cases = [np.cumsum(rng.standard_normal((9, 17, 5)), 0).astype(np.float32),
             np.cumsum(rng.standard_normal((2, 33)), 1),
             (rng.standard_normal(70) * 1e20).astype(np.float32),
             np.full(1, 3.0, np.float32), np.cumsum(rng.standard_normal((3, 40, 24)), 1)]
    for x in cases:
        for pred in ("auto", "fine", "interp", "lorenzo"):
            for bound in ({"rel_error": 1e-3}, {"rel_error": 1e-9}, {"abs_error": 0.5}):
                blob = sc.encode(x, codec={**BP, "predictor": pred}, **bound)
                want = sc.decode(blob, decoder="reference")
                got = sc.decode(blob, decoder=decoder)
                assert same(got, want)
                eb = read_header(blob).abs_error
                finite = np.isfinite(x)
                assert np.all(np.abs(got.numpy()[finite].astype(np.float64) - x[finite]) <= eb)
                assert same(sc.decode_batch([blob, blob], decoder=decoder)[1], want)


def test_a_blob_says_bitpack_and_keeps_nothing_behind_a_byte_stage():
    x = np.cumsum(np.ones((20, 30), np.float32), 1)
    m = EbqMeta.parse(read_header(blob := sc.encode(x, rel_error=1e-3, codec=BP)), "x")
    assert sc.header_info(blob).descriptor == "ebq/7"
    assert m.width == BITPACK and int(m.lossless) == 0 and m.n_esc == 0 and m.n_side == 0


def test_the_environment_chooses_bitpack_for_callers_without_a_codec_option(monkeypatch):
    """``solar ingest`` encodes with the default codec: SOLAR_CODEC_LOSSLESS=bitpack picks it."""
    x = np.cumsum(np.ones((20, 30), np.float32), 1)
    monkeypatch.setenv("SOLAR_CODEC_LOSSLESS", "bitpack")
    assert EbqMeta.parse(read_header(sc.encode(x, rel_error=1e-3)), "x").width == BITPACK
    monkeypatch.setenv("SOLAR_CODEC_LOSSLESS", "brotli")
    with pytest.raises(ConfigError, match="ebq lossless must be one of.*'brotli' .from SOLAR_CODEC_LOSSLESS"):
        sc.encode(x, rel_error=1e-3)


def _forge(blob: bytes, edit) -> bytes:
    h = read_header(blob)
    p = bytearray(blob[h.payload_offset:])
    edit(p)
    return _reseal(blob, bytes(p))


def _cases():
    x = np.cumsum(np.cumsum(np.random.default_rng(2).standard_normal((16, 16)), 0), 1).astype(np.float32)
    blob = sc.encode(x, rel_error=1e-3, codec={**BP, "predictor": "fine"})

    def wide(p):
        p[0] = 33  # a width int32 codes cannot have

    def short(p):
        p[1] = p[1] + 1 if p[1] < 32 else p[1] - 1  # the widths no longer add up to the length

    yield _forge(blob, wide), "exceeds 32 bits"
    yield _forge(blob, short), "block widths need"
    h = read_header(blob)  # a bitpack blob that claims a byte-oriented lossless stage
    m = EbqMeta.parse(h, "x")._replace(lossless=2)
    meta = bytearray(blob[:h.payload_offset])
    start = h.payload_offset - 24 - len(h.meta)
    meta[start:start + len(h.meta)] = m.pack()
    head = bytes(meta[:-8])
    yield head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + blob[h.payload_offset:], "inconsistent bitpack"


@pytest.mark.parametrize("decoder", PATHS + [pytest.param("triton", marks=needs_triton)])
def test_damaged_sections_are_corrupt_data_naming_the_sample(decoder, request):
    if decoder == "triton":
        request.getfixturevalue("interpreted")
    for forged, why in _cases():
        with pytest.raises(CorruptDataError, match=why):
            sc.decode(forged, decoder=decoder)
        with pytest.raises(CorruptDataError, match=f"sample 'row 7'.*{why}"):
            sc.decode_batch([forged], names=["row 7"], decoder=decoder)


@pytest.mark.skipif(not paths.kernel_available(), reason="needs numba")
def test_the_fast_path_takes_every_covered_fixture_with_the_general_paths_bits(monkeypatch):
    index = json.loads((FIXTURES / "index.json").read_text())
    taken = 0
    for entry in index:
        blob = (FIXTURES / entry["blob"]).read_bytes()
        x = fast.decode_one(blob, None)
        general = sc.decode(bytearray(blob), decoder="cpu-kernel")  # not bytes: the general path
        assert same(sc.decode(blob), general) and same(sc.decode(blob, decoder="reference"), general)
        if x is not None:
            taken += 1
            assert same(x, general), entry["blob"]
            covered, want = blob, general
    assert taken >= 40
    blob = covered
    assert fast.decode_one(blob, "reference") is None
    monkeypatch.setenv("SOLAR_CODEC_DECODER", "reference")
    assert fast.decode_one(blob, None) is None
    monkeypatch.setenv("SOLAR_CODEC_COMPILE", "1")
    monkeypatch.setenv("SOLAR_CODEC_DECODER", "auto")
    assert fast.decode_one(blob, None) is None
    assert fast.decode_one(blob, None, compile=True) is None
    assert same(fast.decode_one(blob, None, compile=False), want)  # compile=False overrides the environment


@pytest.mark.skipif(not paths.kernel_available(), reason="needs numba")
def test_the_fast_path_refuses_what_the_general_path_refuses():
    blob = sc.encode(np.sin(np.linspace(0, 9, 500)).astype(np.float32), abs_error=1e-4)
    bad = blob[:-1] + bytes([blob[-1] ^ 1])
    for b in (bad, blob[:-3], b"SLRX" + blob[4:], blob[:5]):
        with pytest.raises(CorruptDataError):
            sc.decode(b)
    with pytest.raises(ConfigError, match="threads="):
        sc.decode(blob, threads=-1)


@pytest.mark.gpu
def test_cuda_bitpack_blobs_decode_on_the_device_to_the_cpu_bits():
    rng = np.random.default_rng(23)
    xs = [np.cumsum(np.cumsum(rng.standard_normal((24, 40, 33)), 0), 2).astype(np.float32) for _ in range(6)]
    xs[1][3, 4, 5] = np.nan
    codecs = [{**BP, "predictor": p} for p in ("fine", "interp", "lorenzo", "fine", "auto", "interp")]
    blobs = [sc.encode(x, codec=c, rel_error=r) for x, c, r in zip(xs, codecs, (1e-2, 1e-3, 1e-4, 1e-7, 1e-3, 1e-3))]
    want = sc.decode_batch(blobs, decoder="reference")
    for decoder in ("triton", "reference", None):
        got = sc.decode_batch(blobs, device="cuda", decoder=decoder)
        assert got.device.type == "cuda" and same(got, want)
