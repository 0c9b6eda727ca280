"""``solar.H5Dataset`` over a glob of parallel-HDF5 files under a real ``mpirun -n 2`` (and 3): every
rank opens the same files in the same order, and solar.DataLoader plans them as one dataset."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch.utils.data as tud

import solar
from solar.schedule import PlanConfig, Planner, global_order
from solar.synthetic import ptycho_sample, write_ptycho_h5


@pytest.mark.mpi
def test_a_glob_of_parallel_hdf5_files_is_one_schedule_on_every_rank(comm, shared_tmp):
    sizes = (40, 27, 33)
    paths = [os.path.join(shared_tmp, f"run{i}.h5") for i in range(3)]
    for i, (p, n) in enumerate(zip(paths, sizes)):
        write_ptycho_h5(p, n, 8, seed=30 + i, comm=comm, progress=False)
    comm.Barrier()
    data = solar.H5Dataset(os.path.join(shared_tmp, "run*.h5"), ("x", "y"))
    assert type(data) is tud.ConcatDataset and [d.path for d in data.datasets] == paths
    assert all(d.backend.collective for d in data.datasets)  # backend "auto" under mpirun
    y_all = np.concatenate([np.stack([ptycho_sample(i, 8, 30 + k)[1] for i in range(n)]) for k, n in enumerate(sizes)])
    P, b, n = comm.size, 5, sum(sizes)
    sampler = tud.DistributedSampler(data, num_replicas=P, rank=comm.rank, seed=3)
    loader = solar.DataLoader(data, batch_size=b, sampler=sampler, buffer=0.5)
    assert isinstance(loader.dataset, solar.StoredConcat) and loader.solar_sampler.mode == "schedule"
    for e in range(2):
        sampler.set_epoch(e)
        everyone = comm.allgather([y.numpy() for _, y in loader])
        order = global_order(n, P, 3, e)
        for k in range(min(len(m) for m in everyone)):
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(-1, 128)
            want = y_all[order[k * P * b:(k + 1) * P * b]].reshape(-1, 128)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
    hits = comm.allreduce(sum(d.stats.hits for d in data.datasets))
    planned = Planner(PlanConfig(n, P, b, n // 2 // P, seed=3))
    assert hits == sum(int(planned.plan(e).hit.sum()) for e in range(2)) > 0
    del loader
    for d in data.datasets:
        d.close()


@pytest.mark.mpi
def test_files_that_cannot_be_one_dataset_are_refused_on_every_rank(comm, shared_tmp):
    """Another field name in one file: every rank raises the same ConfigError (none waits in a
    collective open or close), naming both files."""
    good, other = os.path.join(shared_tmp, "good.h5"), os.path.join(shared_tmp, "other.h5")
    write_ptycho_h5(good, 12, 8, seed=1, comm=comm, progress=False)
    if comm.rank == 0:
        with h5py.File(other, "w") as f:
            f["z"] = np.zeros((6, 2), np.float32)
    comm.Barrier()
    with pytest.raises(solar.ConfigError, match=r"other\.h5 has the fields \['z'\], .*good\.h5 has \['x', 'y'\]"):
        solar.H5Dataset([good, other])
    comm.Barrier()
    ds = solar.H5Dataset([good])  # the files are still usable: nothing was left open half-way
    assert len(ds) == 12
    ds.datasets[0].close()
