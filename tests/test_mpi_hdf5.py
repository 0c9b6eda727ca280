"""The pattern for every MPI test: real ranks, real parallel HDF5, collective I/O."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest


@pytest.mark.mpi
def test_collective_write_then_collective_read(comm, shared_tmp):
    assert h5py.get_config().mpi, "h5py must be built with MPI"
    path = os.path.join(shared_tmp, "par.h5")
    rows = 257  # not a multiple of anything convenient
    with h5py.File(path, "w", driver="mpio", comm=comm) as f:
        dset = f.create_dataset("x", shape=(comm.size * rows, 3), dtype="f8")  # collective
        mine = np.arange(rows * 3, dtype="f8").reshape(rows, 3) + 1000 * comm.rank
        with dset.collective:
            dset[comm.rank * rows:(comm.rank + 1) * rows] = mine
    comm.Barrier()
    with h5py.File(path, "r", driver="mpio", comm=comm) as f:
        assert f.driver == "mpio"
        dset = f["x"]
        other = (comm.rank + 1) % comm.size  # read a slice another rank wrote
        with dset.collective:
            got = dset[other * rows:(other + 1) * rows]
    expect = np.arange(rows * 3, dtype="f8").reshape(rows, 3) + 1000 * other
    np.testing.assert_array_equal(got, expect)
    assert comm.allreduce(1) == comm.size


def test_serial_hdf5_without_mpirun(tmp_path):
    path = tmp_path / "serial.h5"
    data = np.random.default_rng(0).standard_normal((50, 4, 4)).astype("f4")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data)
    with h5py.File(path, "r") as f:
        assert f.driver != "mpio"
        np.testing.assert_array_equal(f["x"][10:20], data[10:20])


def test_world_is_single_outside_mpirun(monkeypatch):
    from solar.dist import get_dist_info, under_mpirun

    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not under_mpirun()
    info = get_dist_info()
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert get_dist_info() == type(info)(3, 4, "env")
