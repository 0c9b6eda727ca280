"""The plan of one ingest: the inputs, the fields with their shapes, dtypes and bounds, and the
job's fingerprint; the checks before anything is written (rank 0) and the bound pass (all ranks).

See NOTE [ Ingest phases ] in :mod:`solar.ingest`, phases 1 and 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from solar import codec
from solar.dist import share
from solar.errors import ConfigError, InputError
from solar.ingest.journal import finished_fingerprint
from solar.ingest.sources import Source, open_sources

__all__ = ["FieldPlan", "Plan", "FINGERPRINT_PREFIX", "validate", "bound_pass", "where", "scatter_plan"]

FINGERPRINT_PREFIX = "v2-"  # fingerprints that include a content digest of each input


@dataclass
class FieldPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    compress: bool
    abs_error: float | None = None  # resolved absolute bound (compressed fields)
    descriptor: str | None = None  # the codec's versioned descriptor, known after the first blob


@dataclass
class Plan:
    output: str
    sources: list[Source]
    fields: list[FieldPlan]
    num_samples: int
    batch_size: int
    rel_error: float | None
    abs_error: float | None
    starts: list[int] = field(default_factory=list)  # first global sample of each source
    notes: list[str] = field(default_factory=list)  # decisions rank 0 prints (fields kept raw)
    _released: int = 0  # sources below this index are closed (reads move forward)

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def row_bytes(self) -> int:
        """Raw bytes of one sample over every field."""
        return sum(int(np.prod(f.shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize for f in self.fields)

    def input_identities(self) -> list[list]:
        """``[url, size, modification stamp, content digest]`` of every input
        (:meth:`Source.identity`). Stats every input and reads a sample of its bytes: call it on
        one rank. The journal keeps them, so a refused resume can name the input that changed."""
        return [[s.url, *s.identity()] for s in self.sources]

    def fingerprint(self, ids: list[list]) -> str:
        """The job's identity for ``--resume``: inputs (with their size, modification stamp and
        content digest, ``ids`` from :meth:`input_identities`), fields, bounds and batch size.
        Prefixed ``v2-``: a fingerprint without the prefix is a :meth:`legacy_fingerprint`."""
        return FINGERPRINT_PREFIX + self._digest([i[1:] for i in ids])

    def legacy_fingerprint(self, ids: list[list]) -> str:
        """The fingerprint of a solar ingest that did not sample input contents (size and
        modification stamp only), to recognise a journal or an output written by that version:
        see :func:`solar.ingest.journal.resume_point`."""
        return self._digest([i[1:3] for i in ids])

    def _digest(self, stamps: list[list]) -> str:
        desc = {"inputs": [(s.url, s.n, s.per_file, s.keys, st) for s, st in zip(self.sources, stamps)],
                "fields": [self._fingerprinted(f) for f in self.fields], "batch_size": self.batch_size}
        return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _fingerprinted(self, f: FieldPlan) -> dict:
        """``f`` as the fingerprint records it: a field stored raw for its dtype (ints, complex,
        float16) carries ``--abs-error`` as well, as in the fingerprints of solar ingest versions
        that gave raw fields the bound. The fields are part of the fingerprint, and a journal or
        an output of those versions must still be recognised by ``--resume`` as this job's."""
        d = asdict(f)
        if not f.compress and self.abs_error is not None and not _compressible(np.dtype(f.dtype)):
            d["abs_error"] = self.abs_error
        return d

    def _release_before(self, i: int) -> None:
        """Close the inputs a forward pass has left behind: thousands of inputs must not hold
        thousands of open files. A later pass (verification) reopens them lazily."""
        for k in range(self._released, i):
            self.sources[k].close()
        self._released = i

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Global samples ``[lo, hi)`` of field ``name``, across input boundaries."""
        f = next(f for f in self.fields if f.name == name)
        parts = []
        i = max(0, int(np.searchsorted(self.starts, lo, side="right")) - 1)
        self._release_before(i)
        while lo < hi and i < len(self.sources):
            s0 = self.starts[i]
            if s0 > lo:  # (a rank's plan holds the inputs of its rows only: scatter_plan)
                raise RuntimeError(f"samples {lo}..{min(hi, s0)} lie in no input of this rank's plan")
            stop = min(hi, s0 + self.sources[i].n)
            if stop > lo:
                parts.append(self.sources[i].read(name, lo - s0, stop - s0))
            lo, i = max(lo, stop), i + 1
        if not parts:
            return np.empty((0, *f.shape), np.dtype(f.dtype))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# -- which fields a bound compresses ---------------------------------------------------------------
def _codec_keeps_nan() -> bool:
    x = np.array([np.nan, 1.0, 2.0, 3.0], np.float32)
    return bool(np.isnan(codec.decode(codec.encode(x, abs_error=0.1)).numpy()[0]))


def _compressible(dtype: np.dtype) -> bool:
    """Whether a bound compresses a field of ``dtype``: float32 and float64 (the codec's types);
    the others (ints, bools, complex, float16) are stored raw, exactly."""
    return dtype.kind == "f" and dtype.itemsize in (4, 8)


#: Raw samples above this size are compressed without asking the codec: its fixed overhead per blob
#: (header, codec metadata: ~150 B, at most a few KiB) is far smaller.
_PROBE_BYTES = 1 << 16


def _smallest_blob(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of the smallest blob the codec writes for one sample of ``shape`` and ``dtype``.

    Why: every blob carries a fixed header (magic, descriptor, shape, bound, checksums) and codec
    metadata, ~150 B; a float per sample (4 B) would be stored as a 140 B blob. An all-zero
    sample compresses to that overhead alone, so a raw sample no larger than its blob can only
    grow when compressed. Depends on shape, dtype and the codec only (not on values, timing or
    rank): the decision is the same for every world size and on ``--resume``."""
    return len(codec.encode(np.zeros(shape, np.dtype(dtype)), abs_error=1.0))


def _keep_tiny_fields_raw(plans: list[FieldPlan]) -> list[str]:
    """Store raw the float fields whose samples are too small to gain from compression (see
    :func:`_smallest_blob`); returns one note per such field, for rank 0 to print."""
    notes = []
    for p in plans:
        if not p.compress:
            continue
        raw = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
        if raw > _PROBE_BYTES:
            continue
        blob = _smallest_blob(p.shape, p.dtype)
        if raw <= blob:
            p.compress, p.abs_error = False, None
            notes.append(f"field {p.name!r} is stored raw, not compressed: one sample (shape {p.shape}, "
                         f"{np.dtype(p.dtype).name}) is {raw} B, and the codec's smallest blob for it is {blob} B "
                         "(its fixed header), so compressing would only make it larger")
    return notes


def _samples_auto_note(sources: list[Source]) -> list[str]:
    """The note rank 0 prints when ``samples="auto"`` took each ``.npy``/``.npz`` file as one
    sample: runs of equal length look the same as equal-shape samples, so say which was chosen."""
    whole = [s for s in sources if s.per_file]
    if not whole:
        return []
    shapes = {n: f.shape for n, f in whole[0].fields.items()}
    shape = str(next(iter(shapes.values()))) if len(shapes) == 1 else str(shapes)
    return [f"{len(whole)} inputs of equal shape {shape}: each file is one sample (--samples file); pass "
            "--samples axis0 to take their leading axis as samples"]


# -- phase 1: validate (rank 0) --------------------------------------------------------------------
def _check_options(abs_error, rel_error, batch_size) -> None:
    if abs_error is not None and rel_error is not None:
        raise ConfigError("give --abs-error or --rel-error, not both")
    for name, v in (("abs-error", abs_error), ("rel-error", rel_error)):
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"--{name} must be a finite number >= 0, got {v}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")


def _check_output(output: str, resume: bool, overwrite: bool) -> str:
    """``output`` as a local path, after checking that this run may write it."""
    if "://" in output and not output.startswith("file://"):
        raise ConfigError(f"{output}: the output must be a local (or parallel file system) path, not a URL")
    output = output[len("file://"):] if output.startswith("file://") else output
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise InputError(f"{output}: the output directory {parent} does not exist; create it first")
    if os.path.isdir(output):  # else the whole job would run, then the rename fail (and every --resume)
        raise InputError(f"{output} is a directory: -o must name a file, not a directory (e.g. "
                         f"{os.path.join(output, 'train.h5')})")
    if os.path.exists(output) and not overwrite:
        if not resume:
            raise InputError(f"{output} already exists; pass --overwrite to replace it or --resume to finish a run")
        if finished_fingerprint(output) is None:
            # --resume continues *this* job's OUT.tmp; it never replaces a file it did not write
            # (the fingerprint check against this job follows in ingest(), once bounds are known)
            raise InputError(f"{output} already exists and is not a finished `solar ingest` output, so --resume "
                             "has nothing to continue into it; pass --overwrite to replace it, or choose another -o")
    return output


def validate(inputs, output, fields, abs_error, rel_error, resume, overwrite, batch_size, samples,
             storage_options) -> Plan:
    """Check the options and the output, open and describe every input: the :class:`Plan`, or
    :class:`ConfigError`/:class:`InputError` before anything is written (rank 0 only)."""
    _check_options(abs_error, rel_error, batch_size)
    output = _check_output(output, resume, overwrite)
    sources, infos = open_sources(list(inputs), fields=fields, samples=samples, storage_options=storage_options)
    bound = abs_error is not None or rel_error is not None
    plans = []
    for n, fi in infos.items():
        # only a compressed field has a bound: --verify compares every other field exactly
        compress = bound and _compressible(fi.dtype)
        plans.append(FieldPlan(n, tuple(fi.shape), fi.dtype.str, compress, abs_error if compress else None))
    deep = [p for p in plans if p.compress and len(p.shape) > 4]  # every field, before anything is written
    if deep:
        raise ConfigError(f"field {deep[0].name!r} has {len(deep[0].shape)}-D samples {deep[0].shape}; the codec "
                          "handles samples of up to 4 dimensions: reshape them, or ingest this field without "
                          "--abs-error/--rel-error")
    notes = _samples_auto_note(sources) if samples == "auto" else []
    notes += _keep_tiny_fields_raw(plans)
    starts = np.concatenate([[0], np.cumsum([s.n for s in sources])]).astype(int).tolist()
    return Plan(output, sources, plans, starts[-1], batch_size, rel_error, abs_error, starts[:-1], notes)


# -- phase 2: the bound pass (all ranks) -----------------------------------------------------------
def bound_pass(plan: Plan, comm) -> None:
    """Resolve relative bounds over each field's global range; reject NaN the codec cannot keep."""
    todo = [f for f in plan.fields if f.compress]
    need_range = plan.rel_error is not None
    check_nan = todo and not _codec_keeps_nan()
    if not todo or not (need_range or check_nan):
        return
    lo, hi = share(0, plan.num_samples, comm.rank, comm.size)
    local: dict[str, list[float]] = {f.name: [np.inf, -np.inf, 0.0] for f in todo}
    bad: str | None = None
    for s in range(lo, hi, plan.batch_size):
        e = min(hi, s + plan.batch_size)
        for f in todo:
            a = plan.read(f.name, s, e)
            finite = a[np.isfinite(a)]
            if finite.size:
                local[f.name][0] = min(local[f.name][0], float(finite.min()))
                local[f.name][1] = max(local[f.name][1], float(finite.max()))
            if check_nan and bad is None and np.isnan(a).any():
                i = s + int(np.argwhere(np.isnan(a.reshape(len(a), -1)).any(1))[0, 0])
                bad = f"sample {i} of field {f.name!r} ({where(plan, i)}) contains NaN, which the codec cannot keep"
    bads = [b for b in comm.allgather(bad) if b]
    if bads:
        raise InputError(bads[0] + "; clean the input or store the field raw (no --abs-error/--rel-error)")
    gathered = comm.allgather(local)
    for f in todo:
        mn = min(g[f.name][0] for g in gathered)
        mx = max(g[f.name][1] for g in gathered)
        if need_range:
            f.abs_error = _rel_bound(f.name, plan.rel_error, mn, mx)


def _rel_bound(name: str, rel: float, mn: float, mx: float) -> float:
    """``rel * (mx - mn)``; ``rel*mx - rel*mn`` when ``mx - mn`` overflows (float64 values
    beyond +-9e307; the first form otherwise, so that bounds stay bit-identical between
    versions). Every rank calls it with the same all-reduced range, so a bound that is still
    not finite raises the same :class:`InputError` everywhere, before ``OUT.tmp`` is made, naming
    the field and ``--rel-error`` (the codec would refuse it mid-run, naming neither)."""
    if mx < mn:  # no finite value
        return 0.0
    bound = rel * (mx - mn) if math.isfinite(mx - mn) else rel * mx - rel * mn
    if not math.isfinite(bound):
        raise InputError(f"field {name!r}: --rel-error {rel:g} of its value range [{mn:g}, {mx:g}] is not a finite "
                         "number (the range is beyond float64); give an absolute bound with --abs-error, or store "
                         "the field raw (no --abs-error/--rel-error)")
    return bound


def where(plan: Plan, i: int) -> str:
    """``input URL, sample K`` for global sample ``i``: where a message points the user."""
    k = max(0, int(np.searchsorted(plan.starts, i, side="right")) - 1)
    return f"input {plan.sources[k].url}, sample {i - plan.starts[k]}"


# -- each rank's inputs ------------------------------------------------------------------------------
def scatter_plan(plan: Plan | None, comm) -> Plan:
    """This rank's plan: rank 0's ``plan`` (collective), each other rank getting only the inputs
    its rows lie in (:func:`sources_by_rank`), so that a rank holds O(rows per rank) inputs,
    not one per sample of the job (inputs of one sample per file). Rank 0 keeps every input: it
    validated them, and it fingerprints, journals and re-checks them."""
    if comm.size == 1:
        return plan
    parts = None
    if comm.rank == 0:
        per_rank = sources_by_rank(plan.starts, plan.num_samples, plan.batch_size, comm.size)
        parts = [None] + [replace(plan, sources=[plan.sources[i] for i in idx], starts=[plan.starts[i] for i in idx],
                                  notes=[], _released=0) for idx in per_rank[1:]]
    mine = comm.scatter(parts, root=0)
    return plan if comm.rank == 0 else mine


def sources_by_rank(starts: list[int], n: int, batch_size: int, size: int) -> list[np.ndarray]:
    """For each rank, the indices of the inputs (first global samples ``starts``, ``n`` samples in
    all) that hold a row it reads: its share of every batch (``solar.dist.share``: the writes)
    and its contiguous share of all samples (the bound pass, ``--verify``). An input spanning
    a whole batch goes to every rank, and one in a batch of fewer rows than ranks to each rank
    between its first and last reader (a few more than read it). Vectorized: no loop over
    batches or ranks."""
    P, bs = size, batch_size
    s0 = np.asarray(starts, np.int64)
    s1 = np.append(s0[1:], n).astype(np.int64)
    src = np.flatnonzero(s1 > s0)
    s0, s1 = s0[src], s1[src]
    b0, b1 = s0 // bs, (s1 - 1) // bs
    whole = b1 - b0 >= 2
    near = ~whole  # in one batch or two: the ranks of each piece, from the share formula

    def batch_ranks(a, b):  # first and last rank reading rows [a, b) of one batch
        g0 = a // bs * bs
        m = np.minimum(n, g0 + bs) - g0
        return ((a - g0 + 1) * P - 1) // m, ((b - g0) * P - 1) // m

    two = near & (b1 > b0)
    pieces = [(src[near], *batch_ranks(s0[near], np.minimum(s1[near], (b0[near] + 1) * bs))),
              (src[two], *batch_ranks(b1[two] * bs, s1[two])),
              (src[whole], np.zeros(whole.sum(), np.int64), np.full(whole.sum(), P - 1, np.int64)),
              (src, ((s0 + 1) * P - 1) // n, (s1 * P - 1) // n)]  # the contiguous shares
    which = np.concatenate([p[0] for p in pieces])
    first = np.concatenate([p[1] for p in pieces])
    count = np.concatenate([p[2] for p in pieces]) - first + 1
    rank = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    key = np.unique(rank * max(1, len(starts)) + np.repeat(which, count))
    cuts = np.searchsorted(key, np.arange(P + 1) * max(1, len(starts)))
    return [key[cuts[r]:cuts[r + 1]] - r * max(1, len(starts)) for r in range(P)]
