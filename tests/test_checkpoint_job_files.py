"""Few files on a parallel file system (issue 26): a small CNN (convolutions, batch norm, linear
layers) trained with Adam, saved six times by a job, creates at most a pack and a part per rank
per save, and one global manifest, whatever its tensor count; the same saves with a file per chunk
(``pack=False``) make a file per changed tensor, most of them under 1 KiB. Run under
``mpirun -n 2`` and ``-n 3``."""

from __future__ import annotations

import os

import pytest
import torch

from solar.checkpoint import CheckpointWriter, load

pytestmark = pytest.mark.mpi


def cnn_and_adam(rank: int):
    torch.manual_seed(rank)  # each rank trains its own replica on its own data: its own state
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    x, y = torch.randn(8, 1, 12, 12, generator=g), torch.randint(0, 10, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def files(root: str) -> dict[str, int]:
    """Every file under ``root`` with its size."""
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs}


def six_saves(comm, root: str, **kw) -> list[dict[str, int]]:
    """Train and save six times; the files each save created (on rank 0; every rank gets them)."""
    model, opt = cnn_and_adam(comm.rank)
    made = []
    with CheckpointWriter(root, comm=comm, **kw) as w:
        for step in range(6):
            train_step(model, opt, comm.rank, step)
            comm.barrier()
            before = files(root) if comm.rank == 0 else {}
            w.save({"model": model.state_dict(), "optim": opt.state_dict()}, step, blocking=True)
            comm.barrier()
            made.append({k: v for k, v in files(root).items() if k not in before} if comm.rank == 0 else {})
    got = load(root, comm=comm)
    want = model.state_dict()
    assert all(got["model"][k].equal(v) for k, v in want.items())
    return comm.bcast(made)


def test_a_cnn_with_adam_saved_six_times_makes_a_pack_and_a_part_per_rank_per_save(comm, shared_tmp):
    model, opt = cnn_and_adam(0)
    train_step(model, opt, 0, 0)
    tensors = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    assert tensors >= 40  # weights, biases, batch-norm buffers; Adam's step, exp_avg, exp_avg_sq per parameter
    packed = six_saves(comm, os.path.join(shared_tmp, "packed"))  # the job writer's default: rolling packs
    loose = six_saves(comm, os.path.join(shared_tmp, "loose"), pack=False)
    for s, made in enumerate(packed):
        kinds = [os.path.relpath(p, os.path.join(shared_tmp, "packed")).split(os.sep)[0] for p in made]
        assert kinds.count("packs") <= comm.size and kinds.count("chunks") == 0, (s, kinds)
        assert kinds.count("parts") == comm.size and kinds.count("versions") == 1, (s, kinds)
    chunk_files = [size for made in loose for p, size in made.items() if f"{os.sep}chunks{os.sep}" in p]
    pack_files = [size for made in packed for p, size in made.items() if f"{os.sep}packs{os.sep}" in p]
    # the same saves with a file per chunk: a file per tensor changed, most under 1 KiB
    assert len(chunk_files) >= 6 * comm.size * tensors // 2
    assert sum(size < 1024 for size in chunk_files) >= len(chunk_files) // 2
    assert len(pack_files) <= 6 * comm.size and len(chunk_files) >= 10 * len(pack_files)


def test_keep_last_retention_of_a_job_repacks_and_every_rank_reads_the_new_packs(comm, shared_tmp):
    from solar.checkpoint import verify
    from solar.checkpoint.repack import repack_store
    from solar.checkpoint.store import CheckpointStore

    root = os.path.join(shared_tmp, "job")
    big = torch.randn(64 * 1024, generator=torch.Generator().manual_seed(comm.rank))  # 64 chunks of 4 KiB
    with CheckpointWriter(root, comm=comm, chunk_size=4096, pack=64 * 1024, keep_last=1) as w:
        for s in range(6):
            if s == 1:  # a quarter of the first pack's chunks change once: that pack is a quarter dead
                big[:4 * 1024] += 1
            w.save({"big": big, "step": torch.tensor(s)}, s, blocking=True)
        w.save({"big": big, "step": torch.tensor(29)}, 29, blocking=True)  # saves go on over the new packs
    got = load(root, comm=comm)
    assert got["big"].equal(big) and int(got["step"]) == 29
    comm.barrier()
    if comm.rank == 0:
        assert repack_store(CheckpointStore(root), dry_run=True).packs_rewritten == []
        assert verify(root).ok
    comm.barrier()
