"""Verification of a SOLAR file written by ``solar ingest``: checksums, and values against inputs.

Each rank checks a contiguous share of the samples with serial h5py (the file is closed for
writing by then), so ``--verify`` costs one parallel read of the output and, with a plan, one of
the inputs. Raw fields must match the inputs exactly (NaN matches NaN); compressed fields must
decode to within the field's bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from solar import codec
from solar.dist import comm_or_serial, share
from solar.errors import CorruptDataError
from solar.io_backends.hdf5 import HDF5Backend
from solar.layout import checksum_key, describe_fields, sample_checksum

__all__ = ["verify_file"]


def verify_file(path: str, *, plan: Any = None, comm: Any = "auto", batch_size: int = 256) -> int:
    """Re-read ``path``: every sample's checksum, and (with ``plan``) its values against the inputs.

    Each rank checks a contiguous share with serial h5py. Returns the number of samples checked
    on this rank; raises :class:`CorruptDataError` naming the field and sample of the first
    mismatch found on any rank.
    """
    if comm is None or isinstance(comm, str):
        comm, _ = comm_or_serial(comm)
    problem: str | None = None
    with HDF5Backend(path) as be:
        n, specs = describe_fields(be, None)
        if plan is None and not bool(be.attrs("/").get("complete", False)):
            problem = f"{path}: root attribute complete is not True; the file was not finished"
        lo, hi = share(0, n, comm.rank, comm.size)
        for spec in specs if problem is None else ():
            problem = _verify_field(path, be, spec, lo, hi, plan, batch_size)
            if problem:
                break
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise CorruptDataError(problems[0] + "; do not use this file (run the ingest again)")
    return hi - lo


def _verify_field(path, be, spec, lo: int, hi: int, plan: Any, batch_size: int) -> str | None:
    if hi <= lo:
        return None
    sums = be.read_ranges(checksum_key(spec.name), [(lo, hi)])
    offsets = be.read_ranges(spec.offsets_key, [(lo, hi + 1)]) if spec.kind == "codec" else None
    # The bound only for codec fields: a raw field (ints, complex, float16, tiny floats) is stored
    # as it came, so it must come back exactly, whatever bound the plan gives its field.
    codec = plan is not None and spec.kind == "codec"
    bound = next(x for x in plan.fields if x.name == spec.name).abs_error if codec else None
    for s in range(lo, hi, batch_size):
        e = min(hi, s + batch_size)
        stored = _stored_samples(be, spec, s, e, offsets, lo)
        for i, buf in enumerate(stored):
            if sample_checksum(buf) != int(sums[s - lo + i]):
                return f"{path}: field {spec.name!r} sample {s + i}: checksum mismatch (stored bytes damaged)"
        if plan is not None:
            got = _decode_all(stored, spec, s) if spec.kind == "codec" else np.stack(stored)
            problem = _compare(path, spec.name, s, got, plan.read(spec.name, s, e), bound)
            if problem:
                return problem
    return None


def _stored_samples(be, spec, s: int, e: int, offsets, lo: int) -> list:
    if spec.kind == "raw":
        return list(be.read_ranges(spec.data_key, [(s, e)]))
    o = offsets[s - lo:e - lo + 1]
    data = be.read_ranges(spec.data_key, [(int(o[0]), int(o[-1]))]) if o[-1] > o[0] else np.empty(0, np.uint8)
    base = int(o[0])
    return [data[int(o[i]) - base:int(o[i + 1]) - base] for i in range(e - s)]


def _decode_all(blobs, spec, first: int) -> np.ndarray:
    out = codec.decode_batch([np.asarray(b) for b in blobs], names=list(range(first, first + len(blobs))))
    if isinstance(out, list):
        import torch  # the codec returned tensors, so torch is loaded; ingest imports this module without it

        out = torch.stack(out)
    return out.numpy().reshape(len(blobs), *spec.sample_shape)


def _compare(path, name, s, got, want, bound) -> str | None:
    if got.shape != want.shape:
        return f"{path}: field {name!r} samples {s}+: shape {got.shape[1:]} != input {want.shape[1:]}"
    if bound is None:
        bad = ~_equal(got, want)
    else:
        g64, w64 = got.astype(np.float64), want.astype(np.float64)
        same = (np.isnan(g64) & np.isnan(w64)) | (g64 == w64)  # NaN and +-Inf must come back exactly
        # The distance only where both are finite: inf - inf would be NaN with a RuntimeWarning
        # printed to the user, and those pairs are judged by `same` alone. Two finite float64 far
        # apart may overflow to inf, which is (rightly) beyond any bound: no warning for that either.
        both = np.isfinite(g64) & np.isfinite(w64)
        with np.errstate(over="ignore"):
            dist = np.subtract(g64, w64, out=np.full_like(g64, np.inf), where=both)
        bad = ~(same | (np.abs(dist) <= bound))
    if bad.any():
        i = int(np.argwhere(bad.reshape(len(bad), -1).any(1))[0, 0])
        what = "differs from the input" if bound is None else f"is off by more than the bound {bound:g}"
        return f"{path}: field {name!r} sample {s + i} {what}"
    return None


def _equal(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise exact equality, NaN equal to NaN; a complex value compares both parts (each
    with that rule: a NaN part must be NaN in both)."""
    if got.dtype.kind == "c":
        return _equal(got.real, want.real) & _equal(got.imag, want.imag)
    if got.dtype.kind == "f":
        return (got == want) | (np.isnan(got) & np.isnan(want))
    return got == want
