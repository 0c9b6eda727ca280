"""A job saving a step its root already holds (issue 24): every rank warns, refuses or replaces
alike; the replacing parts go under a new generation key, so a replacement that fails before its
global manifest leaves the old version loading bit-exactly. Under ``mpirun -n 2`` and ``-n 3``."""

from __future__ import annotations

import os

import pytest
import torch

from solar.checkpoint import CheckpointWriter, list_versions, load
from solar.checkpoint.jobstore import JobStore
from solar.checkpoint.store import CheckpointStore
from solar.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.mpi


def state(v: int, rank: int) -> dict:
    return {"own": torch.full((3000,), float(v * 10 + rank)), "rep": torch.full((500,), float(v))}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_job_replaces_an_existing_step_and_a_failed_replacement_keeps_the_old(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    fail = {"on": False}

    def hook(point: str, step: int) -> None:
        if fail["on"] and point == "before-global":
            raise OSError("injected: the disk went away before the global manifest")

    with CheckpointWriter(root, comm=comm, chunk_size=4096, on_commit_point=hook) as w:
        w.save(state(1, comm.rank), 7, blocking=True)
        with pytest.warns(UserWarning, match="step 7 already exists"):
            w.save(state(2, comm.rank), 7, blocking=True)
        assert same(load(root, comm=comm), state(2, comm.rank))
        comm.barrier()
        gens = JobStore(CheckpointStore(root)).part_gens(7)
        assert gens == {r: [1] for r in range(comm.size)}  # the replaced parts are gone
        with pytest.raises(ConfigError, match="step 7 already exists .* overwrite=False"):
            w.save(state(3, comm.rank), 7, overwrite=False)
        fail["on"] = True
        with pytest.raises(CheckpointError, match="failed to commit step 7"):
            w.save(state(4, comm.rank), 7, overwrite=True, blocking=True)
        fail["on"] = False
    assert list_versions(root) == [7] and same(load(root, comm=comm), state(2, comm.rank))
    comm.barrier()
    assert JobStore(CheckpointStore(root)).part_gens(7) == {r: [1] for r in range(comm.size)}
    comm.barrier()
