"""Fine-grained increments on a job root (``CheckpointWriter(root, comm=..., deltas=True)``), under a
real ``mpirun`` (``-n 2`` and ``-n 3``): a replicated tensor's delta is written once, by one rank,
and every rank's part reads it; rank-own chunks are deltas of that rank's previous save; every
version loads bit-exact on every rank; retention keeps the bases kept versions read. A delta save
killed at each named commit point: tests/test_checkpoint_delta_crash.py (it starts its own mpirun)."""

from __future__ import annotations

import os

import pytest
import torch

from solar.checkpoint import CheckpointWriter, gc, list_versions, load, verify
from solar.checkpoint.deltastore import delta_keys
from solar.checkpoint.jobstore import JobStore
from solar.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.mpi

CHUNK = 16 * 1024


def state(step: int, rank: int) -> dict:
    """A function of (step, rank) alone; consecutive steps differ in about 1% of the elements."""
    rep = (torch.arange(64 * 1024, dtype=torch.float32) / 999).to(torch.bfloat16)
    own = (torch.arange(32 * 1024, dtype=torch.float32) * (rank + 2) / 777).to(torch.bfloat16)
    for t, stride in ((rep, 97), (own, 89 + rank)):
        for s in (step, step // 4):
            t[(s * 31) % stride::stride] += 0.125 * (1 + s % 3)
    return {"model": {"rep": rep, "own": own}, "step": step}


def same(a: dict, b: dict) -> bool:
    return all(a["model"][k].view(torch.int16).numpy().tobytes() == b["model"][k].view(torch.int16).numpy().tobytes()
               for k in ("rep", "own")) and a["step"] == b["step"]


def test_job_delta_saves_load_bit_exact_and_write_each_delta_once(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job-deltas")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, deltas=True) as w:
        results = [w.save(state(s, comm.rank), s).result() for s in range(4)]
    full = comm.allreduce(results[0].bytes_written)
    for r in results[1:]:
        assert comm.allreduce(r.bytes_written) < 0.1 * full, (r.step, full)
    for s in range(4):
        assert same(load(root, s, rank=comm.rank), state(s, comm.rank))
    assert same(load(root, comm=comm), state(3, comm.rank))
    comm.barrier()
    jobs = JobStore(CheckpointStore(root))
    jm = jobs.read_global(3)
    # a version whose parts read deltas names the feature, so a SOLAR without deltas refuses it
    assert jm.features == ["deltas"] and all(p.deltas for p in jm.parts)
    assert jobs.read_global(0).features == [] and not any(p.deltas for p in jobs.read_global(0).parts)
    parts = [jobs.part(jm, r) for r in range(comm.size)]
    rep_chunks = {bytes(d) for d in parts[0].blob_digests(0)}
    # the replicated tensor's chunks are deltas in every rank's part, each stored once
    for p in parts:
        assert {bytes(d) for d in p.blob_digests(0)} == rep_chunks
        assert rep_chunks <= set(p.deltas)
    stored = [t for t, _b in delta_keys(CheckpointStore(root))]
    assert len(stored) == len(set(stored))
    assert verify(root).ok
    comm.barrier()


def test_job_retention_keeps_the_bases_kept_versions_read(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job-deltas-keep")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, deltas=True, keep_last=2, max_chain=3) as w:
        for s in range(7):
            w.save(state(s, comm.rank), s)
    assert list_versions(root) == [5, 6]
    for s in (5, 6):
        assert same(load(root, s, rank=comm.rank), state(s, comm.rank))
    comm.barrier()
    if comm.rank == 0:
        assert verify(root).ok
        gc(root, keep_last=1)
    comm.barrier()
    assert same(load(root, 6, rank=comm.rank), state(6, comm.rank))
    comm.barrier()
