"""A 2-rank training run with job-wide checkpoints; run by tests/test_checkpoint_job_resume.py as
``mpirun -n P python tests/ckpt_train.py MODE ROOT OUT [KILL_AT]``.

A tiny CNN trained with Adam on a fixed in-memory data set through ``solar.DataLoader`` and
``DistributedSampler`` (batch 4 per rank); every rank computes the loss of the whole global batch
(gathered, sorted by sample index) so the run is bit-exact whichever rank a sample went to.
Every third step is saved with ``writer.save(state, step, loader=loader)``.

* ``full``: two epochs uninterrupted.
* ``crash``: the same, and the last rank SIGKILLs itself after step KILL_AT (the job dies).
* ``resume``: ``load(ROOT, comm=..., loader=loader)`` restores model, optimizer and loader
  from the newest version, then trains to the end of the two epochs.
* ``resume-rank0``: every rank restores rank 0's state (the model and optimizer are replicated
  and the loader's position is global), so the run may have another world size than the saver.

Rank 0 writes ``OUT``: JSON ``{"losses": [[step, loss.hex()], ...], "samples": [[step, epoch, [idx...]], ...]}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.utils.data as tud
from mpi4py import MPI

import solar
from solar.checkpoint import CheckpointWriter, load

EPOCHS = 2


class Squares(tud.Dataset):
    """96 samples of 1x8x8 images with 4 classes, a function of the index alone."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return i, torch.randn(1, 8, 8, generator=g), i % 4


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    ds = Squares()
    sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=0)
    loader = solar.DataLoader(ds, batch_size=4, sampler=sampler)
    model, opt = model_and_optimizer()
    epoch, step = 0, 0
    if mode.startswith("resume"):
        if mode == "resume":
            state = load(root, comm=comm, loader=loader)
        else:
            state = load(root, rank=0, loader=loader)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        epoch, step = state["epoch"], state["step"]
    writer = CheckpointWriter(root, comm=comm, chunk_size=4096, keep_last=3)
    losses, samples = [], []
    for epoch in range(epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for idx, x, y in loader:
            parts = comm.allgather((idx, x, y))
            idx = torch.cat([p[0] for p in parts])
            order = torch.argsort(idx)
            x, y = torch.cat([p[1] for p in parts])[order], torch.cat([p[2] for p in parts])[order]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            losses.append([step, loss.item().hex()])
            samples.append([step, epoch, idx[order].tolist()])
            if step % 3 == 0:
                writer.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch, "step": step},
                            step, loader=loader)
            if step == kill_at:
                writer.wait()
                if comm.rank == 0:
                    _write(out, losses, samples)
                comm.barrier()
                if comm.rank == comm.size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
    writer.close()
    if comm.rank == 0:
        _write(out, losses, samples)


def _write(out: str, losses: list, samples: list) -> None:
    with open(out, "w") as fh:
        json.dump({"losses": losses, "samples": samples}, fh)


if __name__ == "__main__":
    main()
