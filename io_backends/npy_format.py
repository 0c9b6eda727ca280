"""Reading ``.npy`` headers without ``ast``: ``(shape, dtype, data_offset)`` from a file's first bytes.

Why not ``numpy.lib.format.read_array_header_*``: they parse the header dict with
``ast.literal_eval``, and on CPython 3.11 (before 3.11.9) the AST constructor keeps its recursion
counter in one per-interpreter slot. When two threads build ASTs at once -- SOLAR's read-ahead
thread opening a ``.npy`` store while the main thread (or torch, or the user's code) parses
anything -- the counters mix and one side fails with ``SystemError: AST constructor recursion
depth mismatch`` (CPython gh-106905; it failed our CI once, in ``solar ingest``). A ``.npy``
header is a small, fixed literal written by numpy (``{'descr': ..., 'fortran_order': ...,
'shape': (...), }``), so a thirty-line recursive-descent reader of Python literals is enough and
has no shared state at all.

The format (numpy NEP 1): magic ``\\x93NUMPY``, major and minor version bytes, header length
(2 bytes little-endian in version 1, 4 bytes in 2 and 3), then the header text (latin-1 in 1
and 2, UTF-8 in 3) padded with spaces and ending in a newline; the data follows.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import numpy as np

from solar.errors import DatasetFormatError

__all__ = ["npy_array", "npy_header", "parse_literal"]

_MAGIC = b"\x93NUMPY"
_MAX_HEADER = 1 << 20
_TOKEN = re.compile(r"""\s*(?:[uU]?(?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
                    r"|(?P<num>[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)L?"
                    r"|(?P<name>True|False|None)\b"
                    r"|(?P<punct>[()\[\]{},:]))", re.S)
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t", "r": "\r", "0": "\0",
            "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
_CLOSE = {"(": ")", "[": "]", "{": "}"}
_MAX_DEPTH = 64  # numpy nests a structured dtype a few levels; deeper is not a header


def _unescape(body: str) -> str:
    """The value of a Python string literal's body (the escapes ``repr(str)`` writes)."""
    if "\\" not in body:
        return body
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            out.append(chr(int(body[i + 2:i + 2 + width], 16)))
            i += 2 + width
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:
            raise ValueError(f"unsupported escape \\{e}")
    return "".join(out)


def parse_literal(text: str) -> Any:
    """A Python literal made of str, int, float, bool, None, tuple, list and dict: the subset a
    ``.npy`` header uses (with Python 2's ``u'...'`` strings and ``3L`` integers, which old
    headers hold). Raises ``ValueError`` on anything else or nested past 64 levels (no code is
    ever evaluated)."""
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"unexpected text at offset {pos}: {text[pos:pos + 20]!r}")
        tokens.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    value, end = _value(tokens, 0, 0)
    if end != len(tokens):
        raise ValueError(f"trailing text after the literal (token {end} of {len(tokens)})")
    return value


def _value(tokens: list, i: int, depth: int) -> tuple[Any, int]:
    if i >= len(tokens):
        raise ValueError("the literal ends early")
    if depth > _MAX_DEPTH:
        raise ValueError(f"the literal nests deeper than {_MAX_DEPTH} levels")
    kind, tok = tokens[i]
    if kind == "str":
        return _unescape(tok[1:-1]), i + 1
    if kind == "num":
        return (float(tok) if any(c in tok for c in ".eE") else int(tok)), i + 1
    if kind == "name":
        return {"True": True, "False": False, "None": None}[tok], i + 1
    if tok not in _CLOSE:
        raise ValueError(f"unexpected {tok!r}")
    close, items, i = _CLOSE[tok], [], i + 1
    trailing_comma = False
    while True:
        if i >= len(tokens):
            raise ValueError(f"missing {close!r}")
        if tokens[i][1] == close and tokens[i][0] == "punct":
            i += 1
            break
        if items and not trailing_comma:
            raise ValueError(f"expected ',' or {close!r}, found {tokens[i][1]!r}")
        item, i = _value(tokens, i, depth + 1)
        if tok == "{":
            if i >= len(tokens) or tokens[i][1] != ":":
                raise ValueError("expected ':' in a dict")
            val, i = _value(tokens, i + 1, depth + 1)
            item = (item, val)
        items.append(item)
        trailing_comma = i < len(tokens) and tokens[i][1] == ","
        if trailing_comma:
            i += 1
    if tok == "[":
        return items, i
    if tok == "{":
        return dict(items), i
    if len(items) == 1 and not trailing_comma:
        return items[0], i  # a parenthesised value, not a tuple
    return tuple(items), i


def _parse(head: bytes, where: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    try:
        if head[:6] != _MAGIC or len(head) < 10:
            raise ValueError(f"the file does not start with the .npy magic string ({bytes(head[:8])!r})")
        major = head[6]
        if major == 1:
            (hlen,), start, encoding = struct.unpack("<H", head[8:10]), 10, "latin1"
        elif major in (2, 3):
            if len(head) < 12:
                raise ValueError("the header ends early")
            (hlen,), start = struct.unpack("<I", head[8:12]), 12
            encoding = "utf8" if major == 3 else "latin1"
        else:
            raise ValueError(f"unknown .npy format version {major}.{head[7]}")
        if hlen > _MAX_HEADER:
            raise ValueError(f"header length {hlen} is over {_MAX_HEADER} bytes")
        if len(head) < start + hlen:
            raise EOFError(f"the header needs {start + hlen} bytes, only {len(head)} read")
        d = parse_literal(bytes(head[start:start + hlen]).decode(encoding))
        if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
            raise ValueError(f"the header is not a dict of descr, fortran_order and shape: {d!r}")
        shape, fortran = d["shape"], d["fortran_order"]
        if not isinstance(shape, tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"shape is not a tuple of sizes: {shape!r}")
        if not isinstance(fortran, bool):
            raise ValueError(f"fortran_order is not a bool: {fortran!r}")
        from numpy.lib import format as npf

        dtype = npf.descr_to_dtype(d["descr"])
    except (ValueError, EOFError, TypeError, UnicodeDecodeError, IndexError) as exc:
        raise DatasetFormatError(f"{where}: not a readable .npy file ({exc})") from exc
    if dtype.hasobject:
        raise DatasetFormatError(f"{where}: object arrays are not supported (they need pickle)")
    return shape, fortran, dtype, start + hlen


def npy_header(head: bytes, where: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """Parse a ``.npy`` header from the first bytes of a file: ``(shape, dtype, data_offset)``.

    ``head`` must hold the whole header (4 KiB covers any header numpy writes for a plain dtype);
    ``where`` names the file in errors. Refuses what cannot be read by row ranges."""
    shape, fortran, dtype, offset = _parse(head, where)
    if fortran and len(shape) > 1:
        raise DatasetFormatError(f"{where}: Fortran-ordered .npy arrays cannot be read by row ranges; "
                                 "save it with np.save(path, np.ascontiguousarray(a))")
    if len(shape) < 1:
        raise DatasetFormatError(f"{where}: a 0-d array has no leading sample axis")
    return shape, dtype, offset


def npy_array(buf: bytes, where: str) -> np.ndarray:
    """The whole array of a ``.npy`` file's bytes (``np.load`` of a buffer, without ``ast``);
    Fortran order allowed. For the members of ``.npz`` archives."""
    shape, fortran, dtype, offset = _parse(buf, where)
    count = int(np.prod(shape, dtype=np.int64))
    if len(buf) - offset < count * dtype.itemsize:
        raise DatasetFormatError(f"{where}: the file is truncated: its header says {shape} of {dtype} "
                                 f"({count * dtype.itemsize} bytes), {len(buf) - offset} bytes follow")
    a = np.frombuffer(buf, dtype, count, offset)
    return a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
