"""Sharded state saved on one world size, loaded on another; run by
tests/test_checkpoint_job_shard.py as ``mpirun -n P python tests/ckpt_shard.py save|load ROOT``.

The state: ``w`` as plain per-rank :class:`solar.checkpoint.Shard` rows of an 8 x 600 tensor, ``d``
a DTensor sharded by rows over a 1-D CPU mesh (gloo), ``r`` a replicated DTensor, ``b`` a plain
tensor every rank holds. ``save`` writes step 1 with ``CheckpointWriter(root, comm=...)``, then
loads it back on the same ranks; ``load`` fills a template of this world size's layout with
``load_into(root, template, comm=...)``. Each rank checks its values against the global tensors
and prints ``ok RANK BYTES_READ OWN_BYTES``.
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard as RowShard, distribute_tensor

from solar.checkpoint import CheckpointWriter, Shard, load_into


def globals_() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(8 * 600, dtype=torch.float32).reshape(8, 600) / 7,
            "d": torch.arange(6 * 700, dtype=torch.float64).reshape(6, 700) * 3,
            "r": torch.arange(25, dtype=torch.float32).reshape(5, 5), "b": torch.ones(10)}


def rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """The rows ``torch.tensor_split`` gives ``rank`` of ``size``."""
    bounds = [0]
    for part in torch.tensor_split(torch.arange(n), size):
        bounds.append(bounds[-1] + len(part))
    return bounds[rank], bounds[rank + 1]


def state(mesh, comm, fill: bool) -> dict:
    g = globals_()
    a, e = rows(8, comm.size, comm.rank)
    w = g["w"][a:e].clone() if fill else torch.zeros(e - a, 600)
    d = distribute_tensor(g["d"] if fill else torch.zeros(6, 700, dtype=torch.float64), mesh, [RowShard(0)])
    r = distribute_tensor(g["r"] if fill else torch.zeros(5, 5), mesh, [Replicate()])
    return {"w": Shard(w, (8, 600), (a, 0)), "d": d, "r": r, "b": g["b"].clone() if fill else torch.zeros(10)}


def check(t: dict, comm) -> None:
    g = globals_()
    a, e = rows(8, comm.size, comm.rank)
    assert t["w"].local.equal(g["w"][a:e]), comm.rank
    assert t["d"].full_tensor().equal(g["d"]) and t["r"].full_tensor().equal(g["r"]) and t["b"].equal(g["b"])


def init_gloo(comm) -> None:
    """torch.distributed over gloo on 127.0.0.1, rank and size taken from the MPI communicator."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def main() -> None:
    # imported here: tests/test_checkpoint_job_shard.py imports globals_ from this file, and
    # importing mpi4py.MPI would initialize MPI in the pytest process (test_cli checks it is not)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode, root = sys.argv[1], sys.argv[2]
    init_gloo(comm)
    mesh = init_device_mesh("cpu", (comm.size,))
    if mode == "save":
        with CheckpointWriter(root, comm=comm, chunk_size=1024) as w:
            w.save(state(mesh, comm, True), 1)
    template = state(mesh, comm, False)
    got = load_into(root, template, comm=comm)
    check(template, comm)
    own = sum(x.to_local().numel() * x.to_local().element_size() if hasattr(x, "to_local")
              else (x.local if isinstance(x, Shard) else x).nbytes for x in template.values())
    print(f"ok {comm.rank} {got.bytes_read} {own}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
