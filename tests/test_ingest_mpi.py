"""`solar ingest` on 2 real MPI ranks through parallel HDF5: same result as the serial run."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from solar.ingest import ingest, verify_file
from solar.layout import checksum_key

pytestmark = pytest.mark.mpi


def _inputs(comm, d):
    paths = [os.path.join(d, f"p{i}.npy") for i in range(3)]
    if comm.rank == 0:
        rng = np.random.default_rng(7)
        for i, p in enumerate(paths):
            np.save(p, rng.standard_normal((11 + 6 * i, 4, 4)).astype(np.float32))
    comm.Barrier()
    return paths


@pytest.mark.parametrize("bound", [None, 0.01], ids=["raw", "compressed"])
def test_parallel_ingest_matches_serial(comm, shared_tmp, bound):
    paths = _inputs(comm, shared_tmp)
    par, ser = os.path.join(shared_tmp, f"par{bound}.h5"), os.path.join(shared_tmp, f"ser{bound}.h5")
    rep = ingest(paths, par, abs_error=bound, batch_size=5, verify=True, progress=False)  # comm auto: world
    assert rep.world_size == comm.size == 2 and rep.num_samples == 51
    if comm.rank == 0:
        ingest(paths, ser, abs_error=bound, batch_size=5, comm=None, progress=False)
    comm.Barrier()
    with h5py.File(par, "r") as a, h5py.File(ser, "r") as b:
        # identical stored bytes: same blobs, offsets and checksums whatever the world size
        keys = ["x"] if bound is None else ["x/data", "x/offsets"]
        for k in [*keys, checksum_key("x")]:
            np.testing.assert_array_equal(a[k][:], b[k][:])
    assert verify_file(par, comm=comm) > 0
    comm.Barrier()
