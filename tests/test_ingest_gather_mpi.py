"""`mpirun -n P solar ingest` gathers nothing that grows with the dataset (issue 22): every
object a rank hands to a collective (the blob lengths' totals, the commit decisions, the
verdict, the journal's sizes) is as large for 1,000 samples as for 40, so each rank's memory
stays O(rows per rank) however many samples the output gets (blob offsets included: each rank
writes its own, placed after the lower ranks' totals, an exscan). The plan's inputs are
scattered: with one sample per file, a rank receives the inputs of the rows it writes and
verifies, not one per sample of the job."""

from __future__ import annotations

import os
import json
import pickle

import h5py
import numpy as np
import pytest
from solar.dist import share
from solar.ingest import ingest, verify_file

pytestmark = pytest.mark.mpi


def _recording(comm, seen):
    """``comm`` itself (h5py's mpio driver takes it), noting the pickled size of every object
    passed to a collective of mpi4py's object interface. (mpi4py is imported here: importing
    it with this module would initialize MPI in a unit-test run, which test_cli checks never
    happens.)"""
    from mpi4py import MPI

    class Recording(MPI.Intracomm):
        def _note(self, name, obj):
            seen.append((name, len(pickle.dumps(obj))))

        def allgather(self, obj):
            self._note("allgather", obj)
            return super().allgather(obj)

        def gather(self, obj, root=0):
            self._note("gather", obj)
            return super().gather(obj, root)

        def bcast(self, obj, root=0):
            self._note("bcast", obj)
            return super().bcast(obj, root)

        def allreduce(self, obj, op=MPI.SUM):
            self._note("allreduce", obj)
            return super().allreduce(obj, op)

        def scatter(self, objs, root=0):
            got = super().scatter(objs, root)
            seen.append(("scatter", got))  # what this rank receives: its part of the plan
            return got

    return Recording(comm)


def _inputs(comm, d, n, per_file):
    """``n`` samples of 8 x 8: one .npy of them all, or one file per sample."""
    x = np.random.default_rng(n).standard_normal((n, 8, 8)).astype(np.float32)
    if not per_file:
        src = os.path.join(d, f"in{n}.npy")
        if comm.rank == 0:
            np.save(src, x)
        return [src], x
    where = os.path.join(d, f"files{n}")
    srcs = [os.path.join(where, f"s{i:05d}.npy") for i in range(n)]
    if comm.rank == 0:
        os.makedirs(where, exist_ok=True)
        for i, path in enumerate(srcs):
            np.save(path, x[i])
    return srcs, x


def _largest(comm, d, n, bound, per_file=False):
    srcs, x = _inputs(comm, d, n, per_file)
    comm.Barrier()
    seen: list = []
    out = os.path.join(d, f"out{n}-{bound}-{per_file}.h5")
    # per file: a relative bound (the bound pass reads each rank's contiguous share) and --verify
    # (so does the verification), besides the writes (each rank's share of every batch)
    bounds = {"rel_error": bound, "verify": True} if per_file else {"abs_error": bound}
    rep = ingest(srcs, out, batch_size=16, comm=_recording(comm, seen), progress=False,
                 samples="file" if per_file else "auto", **bounds)
    assert rep.num_samples == n and verify_file(out, comm=comm) > 0
    with h5py.File(out, "r") as f:
        compressed = isinstance(f["x"], h5py.Group)
        assert compressed == (bound is not None)
        assert (f["x/offsets"].shape[0] - 1 if compressed else f["x"].shape[0]) == n
        if not compressed:
            assert np.array_equal(f["x"][:], x)
        assert len(json.loads(f.attrs["provenance"])["inputs"]) == len(srcs)  # (rank 0 wrote every input)
    parts = [got for k, got in seen if k == "scatter"]
    sizes = {name: max(s for k, s in seen if k == name) for name in {k for k, _ in seen} - {"scatter"}}
    return sizes, parts


def _rows_of(rank, size, n, batch):
    """The rows a rank writes (its share of every batch) and verifies (its contiguous share)."""
    rows = set(range(*share(0, n, rank, size)))
    for g0 in range(0, n, batch):
        rows |= set(range(*share(g0, min(n, g0 + batch), rank, size)))
    return rows


@pytest.mark.parametrize("bound", [None, 0.01], ids=["raw", "compressed"])
def test_no_collective_carries_more_for_more_samples(comm, shared_tmp, bound):
    (small, _), (large, _) = _largest(comm, shared_tmp, 40, bound), _largest(comm, shared_tmp, 1000, bound)
    assert set(small) == set(large)
    for name, size in large.items():
        # a few bytes more for longer numbers (sample counts, sizes); O(N) would be kilobytes
        assert size <= small[name] + 64, f"{name} carries {size} bytes for 1000 samples, {small[name]} for 40"
    comm.Barrier()


@pytest.mark.parametrize("bound", [None, 0.01], ids=["raw", "compressed"])
def test_inputs_of_one_sample_per_file_are_scattered_not_broadcast(comm, shared_tmp, bound):
    """1,000 inputs of one sample each: no collective carries more than for 40, and each rank
    other than 0 (which validated every input, and writes the provenance) receives exactly the
    inputs of the rows it writes and verifies, a part of the job's."""
    (small, _), (large, parts) = (_largest(comm, shared_tmp, 40, bound, per_file=True),
                                  _largest(comm, shared_tmp, 1000, bound, per_file=True))
    assert set(small) == set(large)
    for name, size in large.items():
        assert size <= small[name] + 64, f"{name} carries {size} bytes for 1000 inputs, {small[name]} for 40"
    assert len(parts) == 1
    if comm.rank:
        rows = _rows_of(comm.rank, comm.size, 1000, 16)
        assert parts[0].starts == sorted(rows) and len(parts[0].sources) == len(rows) < 1000
    comm.Barrier()
