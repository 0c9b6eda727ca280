""".npy headers are read without ``ast`` (io_backends/npy_format.py): same answers as numpy's own
reader on every header numpy writes, clear errors on bad ones, and no ``SystemError`` when
another thread builds ASTs at the same time (CPython gh-106905, which failed CI once)."""

from __future__ import annotations

import ast
import gc
import io
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numpy.lib import format as npf

from solar.errors import DatasetFormatError
from solar.io_backends.npy_format import npy_array, npy_header, parse_literal

_BASE = ["<f4", ">f8", "<i2", "|u1", "|b1", "<c16", "<M8[ns]", "|S5", "<U3", "<m8[s]"]
_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def _dtypes(draw, depth=0):
    if depth >= 2 or draw(st.booleans()):
        return np.dtype(draw(st.sampled_from(_BASE)))
    names = draw(st.lists(_NAMES, min_size=1, max_size=3, unique=True))
    fields = []
    for name in names:
        sub = draw(_dtypes(depth + 1))
        shape = draw(st.sampled_from([(), (2,), (2, 3)]))
        fields.append((name, sub, shape) if shape else (name, sub))
    return np.dtype(fields)


def _numpy_reads(buf: bytes):
    """numpy's own answer (np.load picks the right reader and text encoding for each version)."""
    a = np.load(io.BytesIO(buf), allow_pickle=False)
    return a.shape, a.dtype, len(buf) - a.nbytes


@settings(max_examples=150, deadline=None)
@given(dtype=_dtypes(), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
       version=st.sampled_from([None, (1, 0), (2, 0), (3, 0)]))
def test_same_header_as_numpy(dtype, shape, version):
    bio = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Stored array in format 3.0"
            npf.write_array(bio, np.zeros(shape, dtype), version=version)
    except ValueError:  # e.g. a non-latin-1 field name in version 1 or 2
        return
    buf = bio.getvalue()
    want_shape, want_dtype, want_off = _numpy_reads(buf)
    got_shape, got_dtype, got_off = npy_header(buf, "a.npy")
    assert (got_shape, got_off) == (want_shape, want_off)
    assert got_dtype == want_dtype and got_dtype.descr == want_dtype.descr


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda kids: st.lists(kids) | st.lists(kids).map(tuple)
                    | st.dictionaries(st.text(), kids), max_leaves=20))
def test_parse_literal_reads_what_repr_writes(value):
    assert parse_literal(repr(value)) == value


@pytest.mark.parametrize("text", ["__import__('os')", "{'a': 1", "(1, 2", "[1 2]", "{'a' 1}", "1 2", "x"])
def test_parse_literal_refuses_anything_else(text):
    with pytest.raises(ValueError):
        parse_literal(text)


def _saved(a, **kw) -> bytes:
    bio = io.BytesIO()
    np.save(bio, a, **kw)
    return bio.getvalue()


@pytest.mark.parametrize("mutate, says", [
    (lambda b: b"GIF89a" + b[6:], "magic"),
    (lambda b: b[:6] + b"\x07\x00" + b[8:], "version 7.0"),
    (lambda b: b[:40], "header needs"),
    (lambda b: b.replace(b"'shape'", b"'shapf'"), "descr, fortran_order and shape"),
    (lambda b: b.replace(b"'<f8'", b"'<q9'"), "a.npy"),
])
def test_bad_headers_name_the_file(mutate, says):
    with pytest.raises(DatasetFormatError, match="a.npy: not a readable .npy file") as e:
        npy_header(mutate(_saved(np.zeros((3, 2)))), "a.npy")
    assert says in str(e.value)


def test_fortran_object_and_scalar_arrays_are_refused():
    with pytest.raises(DatasetFormatError, match="Fortran-ordered"):
        npy_header(_saved(np.asfortranarray(np.zeros((3, 2)))), "f.npy")
    assert npy_header(_saved(np.asfortranarray(np.zeros(3))), "f1.npy")[0] == (3,)  # 1-D: same bytes
    with pytest.raises(DatasetFormatError, match="object arrays"):
        npy_header(_saved(np.array([None, 1], dtype=object), allow_pickle=True), "o.npy")
    with pytest.raises(DatasetFormatError, match="0-d array"):
        npy_header(_saved(np.float64(1.0)), "s.npy")


def test_no_ast_race_with_another_thread():
    """Another thread parsing Python while a .npy header is read: with numpy's reader (ast) about 2%
    of reads failed with 'AST constructor recursion depth mismatch' on CPython 3.11.7. A
    finalizer that sleeps makes the garbage collector hand the GIL over mid-parse."""

    class Yields:
        def __del__(self):
            time.sleep(0)

    head = _saved(np.zeros((4, 4)))
    stop, errors = threading.Event(), []

    def parse_forever():
        while not stop.is_set():
            try:  # the mix-up can hit either side
                ast.parse("x = {'a': (1, 2), 'b': [3, 4]}")
            except SystemError as exc:
                errors.append(exc)

    def deep(n):  # a deep stack, as under pytest, makes the two threads' depths differ
        if n:
            return deep(n - 1)
        for _ in range(2000):
            for _ in range(5):
                y = Yields()
                y.cycle = y
            try:
                assert npy_header(head, "x.npy")[0] == (4, 4)
            except SystemError as exc:
                errors.append(exc)

    other = threading.Thread(target=parse_forever, daemon=True)
    old_interval, old_threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-5)
    gc.set_threshold(50, 1, 1)
    other.start()
    try:
        deep(60)
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(old_interval)
        gc.set_threshold(*old_threshold)
    assert not errors, errors[:1]


@pytest.mark.parametrize("a", [np.arange(12.0).reshape(3, 4), np.asfortranarray(np.arange(24).reshape(2, 3, 4)),
                               np.zeros((0, 3), np.float32), np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", ">f8")])])
def test_npy_array_is_np_load(a):
    got = npy_array(_saved(a), "m.npy")
    np.testing.assert_array_equal(got, a)
    assert got.dtype == a.dtype and got.shape == a.shape


def test_npy_array_says_the_member_is_truncated():
    with pytest.raises(DatasetFormatError, match=r"m.npy: the file is truncated: .*\(3, 4\)"):
        npy_array(_saved(np.zeros((3, 4)))[:-8], "m.npy")


def test_npz_ingest_reads_compressed_and_fortran_members(tmp_path):
    from solar.ingest import ingest

    x = np.asfortranarray(np.arange(60, dtype=np.float32).reshape(5, 3, 4))
    np.savez_compressed(tmp_path / "a.npz", x=x, y=np.arange(5))
    out = ingest([str(tmp_path / "a.npz")], str(tmp_path / "o.h5"), progress=False)
    assert out.num_samples == 5
    import h5py

    with h5py.File(tmp_path / "o.h5") as f:
        np.testing.assert_array_equal(f["x"][:], x)
        np.testing.assert_array_equal(f["y"][:], np.arange(5))


def test_python2_strings_and_deep_nesting():
    """Old (Python 2) headers wrote u'...' names and 3L sizes; a header nested past 64 levels is a
    DatasetFormatError naming the file, not a RecursionError."""
    assert parse_literal("{u'descr': [(u'x', '<f4')], 'shape': (3L,)}") == {"descr": [("x", "<f4")], "shape": (3,)}
    text = "{'descr': " + "[" * 5000 + "]" * 5000 + ", 'fortran_order': False, 'shape': (1,), }"
    head = b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text.encode()
    with pytest.raises(DatasetFormatError, match="deep.npy: not a readable .npy file .*deeper than 64"):
        npy_header(head, "deep.npy")


@pytest.mark.parametrize("content", [b"not a zip at all", None], ids=["garbage", "truncated"])
def test_a_bad_npz_input_is_an_input_error_naming_it(tmp_path, content):
    from solar.errors import InputError
    from solar.ingest import ingest

    path = tmp_path / "a.npz"
    np.savez(path, x=np.arange(4000.0))
    path.write_bytes(content if content is not None else path.read_bytes()[:-200])
    with pytest.raises(InputError, match=r"a\.npz: .*not a readable \.npz archive"):
        ingest([str(path)], str(tmp_path / "o.h5"), progress=False)
