"""`mpirun -n P solar ingest` gathers nothing that grows with the dataset (issue 22): every
object a rank hands to a collective (the blob lengths' totals, the commit decisions, the plan,
the journal's sizes) is as large for 1,000 samples as for 40, so each rank's memory stays
O(rows per rank) however many samples the output gets (blob offsets included: each rank
writes its own, placed after the lower ranks' totals)."""

from __future__ import annotations

import os
import pickle

import h5py
import numpy as np
import pytest
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

    return Recording(comm)


def _largest(comm, d, n, bound):
    src = os.path.join(d, f"in{n}.npy")
    if comm.rank == 0:
        np.save(src, np.random.default_rng(n).standard_normal((n, 8, 8)).astype(np.float32))
    comm.Barrier()
    seen: list = []
    out = os.path.join(d, f"out{n}-{bound}.h5")
    rep = ingest([src], out, abs_error=bound, batch_size=16, comm=_recording(comm, seen), progress=False)
    assert rep.num_samples == n and verify_file(out, comm=comm) > 0
    with h5py.File(out, "r") as f:
        compressed = isinstance(f["x"], h5py.Group)
        assert compressed == (bound is not None)
        assert (f["x/offsets"].shape[0] - 1 if compressed else f["x"].shape[0]) == n
    return {name: max(s for k, s in seen if k == name) for name in {k for k, _ in seen}}


@pytest.mark.parametrize("bound", [None, 0.01], ids=["raw", "compressed"])
def test_no_collective_carries_more_for_more_samples(comm, shared_tmp, bound):
    small, large = _largest(comm, shared_tmp, 40, bound), _largest(comm, shared_tmp, 1000, bound)
    assert set(small) == set(large)
    for name, size in large.items():
        # a few bytes more for longer numbers (sample counts, sizes); O(N) would be kilobytes
        assert size <= small[name] + 64, f"{name} carries {size} bytes for 1000 samples, {small[name]} for 40"
    comm.Barrier()
