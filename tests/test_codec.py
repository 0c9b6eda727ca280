"""solar.codec: API contract, the strict bound, golden fixtures, errors (conformance suite included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import solar
import solar.codec as sc
from solar.errors import ConfigError, CorruptDataError
from solar.testing.codecs import CodecTests, assert_within_bound

FIXTURES = Path(__file__).parent / "fixtures" / "codec"

# every registered codec runs the shipped conformance suite, with each of its main configurations
CONFIGS = [{"id": "ebq", "predictor": p, "lossless": ls}
           for p, ls in [("auto", "zstd"), ("fine", "lz4"), ("interp", "zstd"), ("cubic", "lz4"),
                        ("linear", "zstd"), ("lorenzo", "none"), ("auto", "bitpack"), ("lorenzo", "bitpack")]]
CONFIGS += [{"id": name} for name in sc.registry.names() if name != "ebq"]


@pytest.fixture(params=CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def codec_config(request):
    return request.param


class TestConformance(CodecTests):
    @pytest.fixture(autouse=True)
    def _codec(self, codec_config):
        self.codec = codec_config


def test_public_api_contract():
    assert solar.codec is sc
    x = np.random.default_rng(0).standard_normal((4, 5, 6)).astype(np.float32)
    blob = sc.encode(x, rel_error=1e-2)
    assert isinstance(blob, bytes)
    info = sc.header_info(blob)
    v = sc.registry.get("ebq").version
    assert (info.descriptor, info.codec, info.version) == (f"ebq/{v}", "ebq", v)
    assert info.shape == (4, 5, 6) and info.dtype == np.float32 and info.torch_dtype == torch.float32
    assert info.abs_error == pytest.approx(1e-2 * float(x.max() - x.min()))
    assert info.blob_len == len(blob) and info.nbytes == x.nbytes
    y = sc.decode(blob, device="cpu")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (4, 5, 6)
    # torch tensors are accepted as input too
    assert sc.header_info(sc.encode(torch.from_numpy(x), abs_error=0.5)).abs_error == 0.5


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"abs_error": 1e-3, "rel_error": 1e-3}, "exactly one"),
    ({"abs_error": -1.0}, ">= 0"),
    ({"rel_error": float("nan")}, ">= 0"),
    ({"abs_error": float("inf")}, ">= 0"),
    ({"abs_error": "big"}, "number"),
    ({"abs_error": 10**400}, "finite number"),  # an int beyond float range
])
def test_bad_bounds_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        sc.encode(np.zeros(4, np.float32), **kwargs)


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="float32 or float64"):
        sc.encode(np.zeros(4, np.int32), abs_error=1)
    with pytest.raises(ConfigError, match="4-D"):
        sc.encode(np.zeros((1,) * 5, np.float32), abs_error=1)
    with pytest.raises(ConfigError, match="predictor"):
        sc.encode(np.zeros(4, np.float32), abs_error=1, codec={"id": "ebq", "predictor": "magic"})
    with pytest.raises(ConfigError, match="lossless"):
        sc.get_codec({"id": "ebq", "lossless": "gzip"})
    with pytest.raises(LookupError, match="no codec named"):
        sc.get_codec("nope")
    with pytest.raises(ConfigError, match="no codec named"):  # a bad argument too: except ValueError catches it
        sc.encode(np.zeros(4, np.float32), abs_error=1, codec={"id": "nope"})
    with pytest.raises(ConfigError, match="out="):
        sc.decode(sc.encode(np.zeros(4, np.float32), abs_error=1), out=torch.empty(5))
    with pytest.raises(ConfigError, match="bytes-like"):
        sc.decode_batch([123])
    blob = sc.encode(np.zeros(4, np.float32), abs_error=1)
    with pytest.raises(ConfigError, match="float32 or float64 data, got a torch.bfloat16 tensor"):
        sc.encode(torch.zeros(4, dtype=torch.bfloat16), abs_error=1)
    with pytest.raises(ConfigError, match="torch.Tensor"):
        sc.decode(blob, out=np.empty(4, np.float32))
    with pytest.raises(ConfigError, match="must not require grad"):
        sc.decode(blob, out=torch.empty(4, requires_grad=True))
    with pytest.raises(ConfigError, match="bytes-like"):
        sc.header_info("abc")
    with pytest.raises(ConfigError, match="Python objects"):
        sc.header_info(np.array([b"x"], dtype=object))


def test_blob_forms_and_out_identity():
    x = np.linspace(0, 1, 24, dtype=np.float32).reshape(2, 12)
    blob = sc.encode(x, abs_error=1e-3)
    spaced = np.zeros(2 * len(blob), np.uint8)
    spaced[::2] = np.frombuffer(blob, np.uint8)
    strided = memoryview(spaced)[::2]  # a non-contiguous memoryview of the blob's bytes
    assert sc.header_info(strided).shape == (2, 12)
    assert torch.equal(sc.decode(strided), sc.decode(blob))
    out = torch.empty(2, 12)
    assert sc.decode(blob, out=out) is out  # out= is returned itself, not a view of it


def test_a_huge_dimension_beside_a_zero_is_corrupt_data():
    """shape (0, 2**63) has 0 elements, so the size check alone let it through."""
    from solar.codec.header import pack_header, read_header

    b0 = sc.encode(np.zeros((0, 3), np.float32), abs_error=1e-3)
    h = read_header(b0)
    payload = bytes(b0[h.payload_offset:])
    forged = pack_header(h.descriptor, h.dtype, (0, 2**63), h.abs_error, h.meta, payload) + payload
    for fn in (sc.header_info, sc.decode, lambda b: sc.decode_batch([b])):
        with pytest.raises(CorruptDataError, match="larger than any blob"):
            fn(forged)


def test_metadata_ids_and_layouts_are_the_on_disk_format():
    """Predictor and lossless ids are never renumbered, and every ebq version's metadata reads
    into the newest layout's named fields (ebq/1's predictor id implies ``cubic_levels``)."""
    import struct

    from solar.codec.ebq_meta import _METAS, EbqMeta
    from solar.codec.lossless import Lossless
    from solar.codec.predict import Predictor

    assert {p.name: int(p) for p in Predictor} == {"RAW": 0, "LINEAR": 1, "CUBIC": 2, "LORENZO": 3, "INTERP": 4,
                                                  "FINE": 5}
    assert {s.name: int(s) for s in Lossless} == {"NONE": 0, "LZ4": 1, "ZSTD": 2}
    v1 = EbqMeta.unpack(1, struct.pack("<BBBBddQQQQQ", 2, 1, 1, 4, 0.5, 0.0, 10, 0, 0, 0, 0))
    assert v1.predictor is Predictor.CUBIC and v1.lossless is Lossless.LZ4 and v1.cubic_levels == 2**64 - 1
    assert (v1.codes_len, v1.n_side, v1.fold, v1.kshift) == (10, 0, 0, 0)
    m = EbqMeta(Predictor.FINE, Lossless.ZSTD, 0, 4, 0.25, -1.0, 5, 7, 1, 3, 2, 4, 6, 1, 4)
    assert EbqMeta.unpack(6, m.pack()) == m and len(m.pack()) == _METAS[6].size


def test_device_argument_forms():
    blob = sc.encode(np.linspace(0, 1, 50, dtype=np.float32), abs_error=1e-3)
    a = sc.decode(blob, device=torch.device("cpu"))
    out = torch.empty(50)
    assert torch.equal(sc.decode(blob, device="cpu", out=out), a)
    assert torch.equal(sc.decode_batch([blob, blob], device=torch.device("cpu"))[1], a)


def test_mixed_batch_decodes_like_single_blobs():
    """A batch mixing nibble/int8 codes and per-level cubic/linear choices decodes in one group."""
    from solar.codec.ebq_meta import EbqMeta
    from solar.codec.header import read_header
    from solar.synthetic import ptycho_block

    _, xs = ptycho_block(0, 24, size=64)  # amplitude/phase pairs: encoders disagree per sample
    eb = 1e-2 * float(xs.max() - xs.min())
    blobs = [sc.encode(x, abs_error=eb, codec={"id": "ebq", "predictor": "fine"}) for x in xs]
    metas = [EbqMeta.unpack(6, read_header(b).meta) for b in blobs]
    assert len({m[2] for m in metas}) > 1 and len({m[6] for m in metas}) > 1  # the mix is really there
    batch = sc.decode_batch(blobs)
    for b, x, y in zip(blobs, xs, batch):
        assert torch.equal(sc.decode(b), y)
        assert_within_bound(x, y.numpy(), eb)


@pytest.mark.parametrize("max_runs", [0, 64])
def test_mixed_batch_row_slices_match_per_row_selection(monkeypatch, max_runs):
    """Decoding a mixed batch by sorted row slices and by per-row selection gives identical integers."""
    from solar.codec import predict as pr
    from solar.synthetic import ptycho_block

    _, xs = ptycho_block(1, 16, size=32)
    eb = 1e-2 * float(xs.max() - xs.min())
    xs = xs.copy()
    for i in range(0, len(xs), 3):  # exact outliers in some rows: they must land in the right row
        xs[i].reshape(-1)[7 * i + 1] = np.nan
    blobs = [sc.encode(x, abs_error=eb, codec={"id": "ebq", "predictor": "fine"}) for x in xs]
    want = torch.stack([sc.decode(b) for b in blobs])
    monkeypatch.setattr(pr, "_MAX_RUNS", max_runs)
    got = sc.decode_batch(blobs)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert int(got.isnan().sum()) == len(range(0, len(xs), 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=40))
def test_mask_order_makes_fine_levels_contiguous(masks):
    """mask_order is a permutation; level l's choices form at most 2**(l+1) runs (level 0: two)."""
    from solar.codec.predict import _runs, mask_order

    order = mask_order(masks)
    assert sorted(order.tolist()) == list(range(len(masks)))
    m = np.asarray(masks, np.uint64)[order]
    for level in range(3):
        assert len(_runs(m, level)) <= 2 ** (level + 1)


def test_concurrent_threads_decode_identically():
    """Scratch buffers and zstd contexts are per thread: concurrent decodes must not interfere."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    xs = [np.cumsum(rng.standard_normal((40, 30)), 1).astype(np.float32) for _ in range(6)]
    blobs = [sc.encode(x, rel_error=1e-3) for x in xs]
    want = [sc.decode(b) for b in blobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(sc.decode, blobs))
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            enc = list(pool.map(lambda x: sc.encode(x, rel_error=1e-3), xs))
            assert enc == blobs


def test_big_endian_and_non_contiguous_inputs():
    x = np.arange(24, dtype=">f8").reshape(4, 6)[:, ::2]
    y = sc.decode(sc.encode(x, abs_error=1e-9)).numpy()
    assert_within_bound(x.astype("<f8"), y, 1e-9)


def test_unknown_codec_in_blob_is_corrupt_data():
    from solar.codec.header import pack_header

    payload = b"xyz"
    blob = pack_header("zzz/1", np.dtype("<f4"), (3,), 0.0, b"", payload) + payload
    assert sc.header_info(blob).codec == "zzz"
    with pytest.raises(CorruptDataError, match="does not know"):
        sc.decode(blob)
    future = pack_header("ebq/99", np.dtype("<f4"), (3,), 0.0, b"", payload) + payload
    with pytest.raises(CorruptDataError, match="version 99"):
        sc.decode(future)


def test_bin_edges_exact_outliers_float32():
    """Integer data with a 'round' bound puts values exactly on bin edges (research 4.1)."""
    x = (np.arange(-500, 500, dtype=np.float32) * 0.5 + 0.25).reshape(10, 100)
    for eb in (0.25, 0.125, 0.5):
        blob = sc.encode(x, abs_error=eb)
        assert_within_bound(x, sc.decode(blob).numpy(), eb)


def test_golden_fixtures_still_decode():
    """Every blob ever committed under tests/fixtures/codec must decode to its recorded values."""
    index = json.loads((FIXTURES / "index.json").read_text())
    assert len(index) >= 8
    for entry in index:
        blob = (FIXTURES / entry["blob"]).read_bytes()
        info = sc.header_info(blob)
        assert info.descriptor == entry["descriptor"]
        original = np.load(FIXTURES / entry["original"])
        y = sc.decode(blob).numpy()
        assert_within_bound(original, y, entry["abs_error"])
        assert y.tobytes().hex()[:64] == entry["decoded_prefix"]
        assert len(y.tobytes()) == entry["decoded_nbytes"]


@pytest.mark.gpu
def test_cuda_decode_matches_cpu():
    rng = np.random.default_rng(3)
    xs = [np.cumsum(rng.standard_normal((16, 16, 16)), 0).astype(np.float32) for _ in range(4)]
    blobs = [sc.encode(x, rel_error=1e-3) for x in xs]
    cpu = sc.decode_batch(blobs)
    gpu = sc.decode_batch(blobs, device="cuda")
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    out = torch.empty((16, 16, 16), dtype=torch.float32, device="cuda")
    assert sc.decode(blobs[0], device="cuda", out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), cpu[0])


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.sampled_from([1, 2, 3, 16, 31, 64, 128]), min_size=1, max_size=4),
       itemsize=st.sampled_from([4, 8]))
def test_scan_layout_pads_every_aliasing_stride(shape, itemsize):
    """Outer-axis strides of the prefix-sum buffer are never multiples of 256 bytes (cache-set
    aliasing), extents only grow, and the innermost-but-one extent grows by at most 64 bytes."""
    from solar.codec.predict import scan_layout

    ext = scan_layout(tuple(shape), itemsize)
    assert len(ext) == len(shape) and all(e >= s for e, s in zip(ext, shape))
    assert ext[0] == shape[0]  # the outermost axis' extent never matters
    stride = itemsize
    for k in range(len(ext) - 1, 0, -1):
        stride *= ext[k]
        assert stride % 256, (shape, ext, k)
    if len(shape) > 1:
        assert (ext[-1] - shape[-1]) * itemsize <= 64


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.sampled_from([1, 2, 5, 16, 64]), min_size=1, max_size=3),
       batch=st.integers(1, 3), wide=st.booleans(), seed=st.integers(0, 2**16))
def test_lorenzo_reconstruct_matches_plain_cumsums(shape, batch, wide, seed):
    """The padded, in-place prefix sums give the plain per-axis cumsums, with and without padding."""
    from solar.codec.predict import lorenzo_reconstruct

    dtype = torch.int64 if wide else torch.int32
    r = torch.randint(-1000, 1000, (batch, *shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)
    want = r
    for ax in range(1, r.ndim):
        want = torch.cumsum(want, ax, dtype=dtype)
    for pad in (True, False):
        got = lorenzo_reconstruct(r.clone(), pad=pad)
        assert got.dtype == dtype and torch.equal(got, want)


def _section(pos, vals) -> bytes:
    return np.diff(np.asarray(pos, np.int64), prepend=0).tobytes() + np.asarray(vals, np.int64).tobytes()


def test_sparse_sections_of_a_group_are_placed_and_checked_together():
    """Escapes/outliers of many blobs are decoded with a few array ops; a bad section names its blob."""
    from solar.codec.ebq import _sparse_group

    items = [(_section([0, 5, 9], [1, 2, 3]), "none", 3, "sample 0", 0),
             (_section([2], [7]), "none", 1, "sample 1", 2),
             (_section([1, 3], [4, 5]), "none", 2, "sample 2", 1)]
    pos, val = _sparse_group(items, np.dtype("<i8"), 10)
    assert pos.tolist() == [0, 5, 9, 22, 11, 13] and val.tolist() == [1, 2, 3, 7, 4, 5]
    pos, val = _sparse_group(items[1:2], np.dtype("<i8"), 10)  # one section alone
    assert pos.tolist() == [22] and val.tolist() == [7]
    with pytest.raises(CorruptDataError, match="^sample 1: escape value out of range"):
        _sparse_group(items, np.dtype("<i8"), 10, limit=7)  # values must lie in [-7, 7): sample 1's 7
    for deltas, n, why in (([0, 0], 10, "not strictly increasing"), ([3, -1], 10, "not strictly increasing"),
                           ([4, 6], 10, "out of range"), ([1, 2**63 - 1], 2**40, "out of range"),
                           ([2**39, 2**39 + 7, 2**40 - 1] + [2**40 - 1] * 2**23, 2**40, "out of range")):
        # the last two: sums that wrap around int64 (one huge delta; many deltas just below n)
        forged = np.asarray(deltas, np.int64).tobytes() + bytes(8 * len(deltas))
        for group in ([items[0]], []):
            with pytest.raises(CorruptDataError, match=f"^sample 7: .*{why}"):
                _sparse_group(group + [(forged, "none", len(deltas), "sample 7", 1)], np.dtype("<i8"), n)


def test_a_signalling_nan_encodes_without_warnings_and_comes_back_exact():
    import warnings

    x = np.ones(8, np.float32)
    x.view(np.uint32)[3] = 0x7FA00000  # a signalling NaN: casting it to float64 raises "invalid"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = sc.decode(sc.encode(x, abs_error=1e-3)).numpy()
    assert y.view(np.uint32)[3] == 0x7FA00000


def test_decode_batch_of_one_blob_not_in_a_list():
    """decode_batch(blob) iterated the bytes and said "got int"; it now says to use decode()."""
    blob = sc.encode(np.zeros((3, 4), np.float32), abs_error=1e-2)
    for one in (blob, bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8)):
        with pytest.raises(ConfigError, match=r"sequence of blobs.*decode\(blob\)"):
            sc.decode_batch(one)
    # sequences still work: a list, a tuple, an object array of blobs, a generator
    for many in ([blob, blob], (blob, blob), np.array([blob, blob], dtype=object), (b for b in (blob, blob))):
        assert tuple(sc.decode_batch(many).shape) == (2, 3, 4)


def test_a_header_format_version_no_solar_wrote_is_damage_and_a_newer_one_asks_for_an_upgrade():
    blob = bytearray(sc.encode(np.arange(64, dtype=np.float32), abs_error=0.1))
    blob[4] = 0  # the header format version
    with pytest.raises(CorruptDataError, match="invalid header format version 0; the blob is corrupted"):
        sc.decode(bytes(blob))
    blob[4] = 9
    with pytest.raises(CorruptDataError, match="format version 9 is newer than this solar reads .*upgrade solar"):
        sc.decode(bytes(blob))
