"""Fine-grained increments on a job root (``CheckpointWriter(root, comm=..., deltas=True)``).

Each rank keeps its own mirror (:class:`.deltasave.DeltaSaver`) of what it last saved. A new chunk
is written by one of the ranks holding it (the job writer's rule), as a delta against that rank's
previous chunk at the same place when that pays; a replicated tensor's chunks are the same on every
rank, so whichever rank writes the delta, every rank's part reads it. The deltas written are
exchanged with the new chunks' locations, before the parts are written, so each part's delta table
covers the chunks it reads, whoever wrote them.
"""

from __future__ import annotations

from concurrent.futures import Future, wait as wait_futures
from typing import Any, Callable

from .deltasave import DeltaSaver
from .jobstore import JobStore

__all__ = ["open_job_deltas", "write_deltas"]


def open_job_deltas(jobs: JobStore, sync: Any, chunk_size: int, max_chain: int, digest) -> DeltaSaver:
    """The rank's saver, with the chains of every committed version (rank 0 reads them, all ranks get them)."""
    chains: Any = None
    if sync.rank == 0:
        try:
            parts = [jobs.part(jm, r) for jm in jobs.valid() for r in range(jm.world_size)]
            chains = {d: tuple(ref) for p in parts for d, ref in p.deltas.items()}
        except Exception as exc:  # every rank raises it
            chains = f"{type(exc).__name__}: {exc}"
    chains = sync.bcast(chains)
    if isinstance(chains, str):
        from solar.errors import CheckpointError

        raise CheckpointError(f"rank 0 could not read the delta chains of job root {jobs.root}: {chains}")
    saver = DeltaSaver(chunk_size, max_chain, [], digest)
    saver.load_chains(chains)
    return saver


def write_deltas(saver: DeltaSaver, sink: Any, new: dict, owned: set[bytes], spots: dict,
                 submit: Callable[..., Future]) -> set[bytes]:
    """Write the owned new chunks that pay as deltas (in the I/O threads); return their digests (the
    caller writes the rest whole). ``spots``: digest -> (blob name, chunk index) where it was found."""
    futs = {d: submit(saver.try_delta, sink, d, new[d], *spots[d]) for d in owned if d in spots}
    wait_futures(futs.values())
    for f in futs.values():
        if f.exception() is not None:
            raise f.exception()
    return {d for d, f in futs.items() if f.result() is not None}
