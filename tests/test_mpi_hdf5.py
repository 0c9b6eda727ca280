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


_THREE_RANK_READS = r'''
import faulthandler, sys
faulthandler.dump_traceback_later(120, exit=True)
import h5py, numpy as np
from mpi4py import MPI
import solar

comm, path = MPI.COMM_WORLD, sys.argv[1]
ds = solar.H5Dataset(path)
assert ds.backend.collective and comm.size == 3
# each rank's rows are its own (as in a global batch), but their spans interleave: read with
# gaps, rank 1's span [57, 195) would cover rank 2's rows
asks = {0: [14, 26], 1: [57, 194], 2: [153, 92]}
bad = 0
for trial in range(3):
    mine = asks[comm.rank] if comm.rank != 1 else [asks[1], asks[0], asks[2]][trial]
    got = ds.fetch_steps([mine])[0].fields
    bad += int(not np.array_equal(np.asarray(got["i"]), mine))
    bad += int(not np.array_equal(np.asarray(got["x"])[:, 0, 0], np.asarray(mine, np.float32)))
# overlapping selections without the disjoint promise (rank 1's span covers rank 2's rows)
spans = {0: [(14, 27)], 1: [(57, 195)], 2: [(92, 154)]}[comm.rank]
got = ds.backend.read_ranges("i", spans)
bad += int(not np.array_equal(got, np.concatenate([np.arange(a, b) for a, b in spans])))
# the loader with 23 samples on 3 ranks: DistributedSampler pads by repeating the epoch's head,
# so a read-ahead pass of two steps held one sample on two ranks (rank 2 got zeros)
import torch.utils.data as tud
sub = solar.H5Dataset(sys.argv[2], fields=["i", "x"])
sampler = tud.DistributedSampler(sub, num_replicas=3, rank=comm.rank, seed=84)
loader = solar.DataLoader(sub, batch_size=5, sampler=sampler, buffer=0, prefetch=2)
for e in range(3):
    sampler.set_epoch(e)
    for i, x in loader:
        bad += int(not np.array_equal(x[:, 0, 0].numpy(), i.numpy().astype(np.float32)))
sub.close()
ds.close()
total = comm.allreduce(bad)
if comm.rank == 0:
    print("BAD", total)
'''


def test_three_ranks_reading_interleaved_rows_get_the_right_rows(tmp_path):
    """NOTE [ Disjoint collective reads ]: Open MPI's default MPI-IO returns zeros for parts of
    overlapping collective reads. They came from sieving (rank 1's read of rows 57 and 194 spanned
    rows other ranks read), from DistributedSampler's padding inside one read-ahead pass, and from
    direct overlapping ``read_ranges`` calls. Needs 3 ranks (2 ranks happened to be fine), so it
    runs its own mpirun."""
    import subprocess
    import sys

    path, small = str(tmp_path / "rows.h5"), str(tmp_path / "small.h5")
    for p, n in ((path, 200), (small, 23)):
        with h5py.File(p, "w") as f:
            x = np.zeros((n, 8, 8), np.float32)
            x[:, 0, 0] = np.arange(n)
            f["x"], f["i"] = x, np.arange(n, dtype=np.int64)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "SOLAR_EXPECT_WORLD"):
        env.pop(var, None)
    out = subprocess.run(["mpirun", "-n", "3", "--bind-to", "none", sys.executable, "-c", _THREE_RANK_READS,
                          path, small], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "BAD 0", out.stdout + out.stderr[-3000:]
