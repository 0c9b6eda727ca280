"""A job that saves job-wide checkpoints; run by tests/test_checkpoint_job_crash.py under mpirun.

``mpirun -n N python tests/ckpt_job.py ROOT point POINT RANK STEP LAST``
    saves steps (after the newest committed one) up to LAST, blocking; rank RANK SIGKILLs itself
    at the commit point POINT of step STEP (``none``: nobody dies). The point is reached through
    the writer's ``on_commit_point`` hook, which this script passes: the library has no other
    way in.
``mpirun -n N python tests/ckpt_job.py ROOT loop SEED``
    saves one step after another until killed (the test SIGKILLs one rank or all of them); half
    the saves are asynchronous, and the writer's ``keep_last`` is drawn from SEED.

Each rank first prints ``pid RANK PID``; rank 0 prints ``saved STEP`` after each commit.
"""

from __future__ import annotations

import os
import random
import signal
import sys

import torch

from solar.checkpoint import CheckpointWriter, list_versions

CHUNK = 16 * 1024


def make_state(step: int, rank: int) -> dict:
    """The state rank ``rank`` saves at ``step``: a function of both alone, so any version can be
    checked; a replicated part (the same on every rank) and a part of the rank's own."""
    g = torch.Generator().manual_seed(0)
    rep = torch.randn(64 * 1024, generator=g)
    i = (step * 7919) % (rep.numel() - 64)
    rep[i:i + 64] = float(step)
    own = torch.randn(24 * 1024, generator=torch.Generator().manual_seed(rank + 1))
    own[(step * 131) % own.numel()] = float(step * 10 + rank)
    return {"model": {"rep": rep, "rep_tied": rep, "own": own}, "optim": {"step": torch.tensor(step), "m": rep * 0.5},
            "note": f"s{step}r{rank}"}


def _next_step(comm, root: str) -> int:
    versions = list_versions(root) if comm.rank == 0 and os.path.isdir(root) else []
    return comm.bcast(versions[-1] + 1 if versions else 0)


def main() -> None:
    # imported here: tests/test_checkpoint_job_crash.py imports make_state from this file, and
    # importing mpi4py.MPI would initialize MPI in the pytest process (test_cli checks it is not)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    root, mode = sys.argv[1], sys.argv[2]
    print(f"pid {comm.rank} {os.getpid()}", flush=True)
    if mode == "point":
        point, rank, at, last = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])

        def hook(name: str, step: int) -> None:
            if name == point and step == at and comm.rank == rank:
                os.kill(os.getpid(), signal.SIGKILL)

        writer = CheckpointWriter(root, comm=comm, chunk_size=CHUNK, on_commit_point=hook)
        for step in range(_next_step(comm, root), last + 1):
            writer.save(make_state(step, comm.rank), step, blocking=True)
            if comm.rank == 0:
                print(f"saved {step}", flush=True)
        writer.close()
        return
    rng = random.Random(int(sys.argv[3]))
    writer = CheckpointWriter(root, comm=comm, chunk_size=CHUNK, keep_last=rng.choice([None, 2, 3]))
    step = _next_step(comm, root)
    while True:
        fut = writer.save(make_state(step, comm.rank), step, blocking=rng.random() < 0.5)
        if comm.rank == 0:
            fut.add_done_callback(lambda f, s=step: f.exception() is None and print(f"saved {s}", flush=True))
        step += 1


if __name__ == "__main__":
    main()
