"""Roots with partly dead packs, and a repack killed at a named point; run by
tests/test_checkpoint_repack.py in subprocesses.

``python tests/ckpt_repack.py make ROOT single|job``
    saves steps 0..3 (each changes a few of 120 small tensors and one chunk of a large one) into
    packs, then keeps the newest two (so the first save's packs are partly dead). ``job`` makes a
    job root, written by a one-rank job (``comm=MPI.COMM_SELF``).
``python tests/ckpt_repack.py repack ROOT POINT``
    repacks ROOT and SIGKILLs itself at the named point (``none``: runs to the end).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

CHUNK = 4096


def state(step: int) -> dict:
    """The state saved at ``step``: a function of it alone, so any version can be checked."""
    g = torch.Generator().manual_seed(0)
    small = {f"layer{i}.bias": torch.randn(16, generator=g) for i in range(120)}
    for i in range(0, 120, 4):  # a quarter of the small tensors change per step
        small[f"layer{i}.bias"][0] = float(step)
    big = torch.randn(16 * CHUNK // 4, generator=g)
    big[(step % 16) * 1024] = float(step)
    return {"small": small, "big": big, "step": torch.tensor(step)}


def main() -> None:
    from solar.checkpoint import CheckpointWriter, gc
    from solar.checkpoint.repack import repack

    mode, root = sys.argv[1], sys.argv[2]
    if mode == "make":
        comm = None
        if sys.argv[3] == "job":
            from mpi4py import MPI  # imported here: the test module imports state() from this file

            comm = MPI.COMM_SELF
        with CheckpointWriter(root, chunk_size=CHUNK, pack=1 << 20, comm=comm) as w:
            for s in range(4):
                w.save(state(s), s)
        gc(root, keep_last=2)
        return

    def point(name: str) -> None:
        if name == sys.argv[3]:
            os.kill(os.getpid(), signal.SIGKILL)

    rep = repack(root, on_point=point)
    print(f"repacked {rep.packs_rewritten}", flush=True)


if __name__ == "__main__":
    main()
