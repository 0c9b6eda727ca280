"""Job-wide checkpoints under mpirun: SOLAR's ``CheckpointWriter(root, comm=...)`` beside
torch.distributed.checkpoint's ``save`` and ``async_save`` on the same sharded state.

Run: ``mpirun -n 2 .venv/bin/python bench/checkpoint/job.py [--mib 64] [--rounds 2] [--dir /tmp]
[--out bench/checkpoint/job.json]``

Each rank holds a row-sharded DTensor (``--mib`` per rank, its own bytes), a replicated plain
tensor (``--mib / 4``, the same on every rank) and a few hundred small tensors (biases, like a
model's). The contenders run alternated, ``--rounds`` times, each into a fresh directory:

* ``solar``: a full save by a fresh writer (``save()`` returns after the host copy: the blocking
  time of a first save, which allocates its host buffer; the total time ends when the global
  manifest is committed on every rank), then an incremental save after 1% of the sharded
  tensor's chunks changed (its blocking time is a steady save's: the host buffer is reused), then
  two saves after every chunk changed (``dense_first``: the save that finds a blob changed
  throughout, hashing before copying; ``dense_steady``: the saves after it, which copy outright);
* ``solar_reserved``: the same after ``writer.reserve(state)`` prepared the host buffer (as a
  training job does once, at start);
* ``dcp_save``: ``dcp.save`` (blocking for all of it);
* ``dcp_async``: ``dcp.async_save`` (blocking until it returns; total when its future is done);
* ``torch_save``: each rank ``torch.save``s its own state to its own file (the blocking baseline).

Times are the slowest rank's; bytes are what each directory holds after the save. The machine
may be shared: ratios from one run are what counts, and the load average is recorded. The blocking
ratios are also given in CPU seconds (user + system of all a rank's threads: what the blocking
call used, which a loaded machine inflates far less than the wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from solar.checkpoint import CheckpointWriter

MiB = 1 << 20
CHUNK = 1 << 20


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


def dir_files(path: str) -> int:
    return sum(len(fs) for _d, _s, fs in os.walk(path))


def make_state(mesh, comm, mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    small = {f"layer{i}.bias": torch.randn(64, generator=g) for i in range(300)}
    rep = torch.randn(mib * MiB // 16, generator=g)  # mib / 4 MiB, replicated
    local = torch.randn(mib * MiB // (4 * 1024), 1024, generator=torch.Generator().manual_seed(1 + comm.rank))
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)  # this rank's rows of the global
    return {"sharded": sharded, "replicated": rep, **small}


def touch_one_percent(state: dict, step: int) -> None:
    """Change one element in 1% of the sharded tensor's local chunks (at least one), spread evenly."""
    local = state["sharded"].to_local().view(-1)
    per_chunk = CHUNK // 4
    chunks = local.numel() // per_chunk
    n = max(1, round(chunks / 100))
    for c in range(n):
        local[(c * chunks // n) * per_chunk] += step


def quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits (Open MPI's spins, taking a core from ranks still working)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def timed(comm, fn, cpu: dict | None = None, key: str = "") -> float:
    """``fn``'s time on the slowest rank (each rank's own time, taken before any rank waits).
    With ``cpu``: ``cpu[key]`` is the most CPU seconds (user + system, all the process's threads)
    a rank spent in ``fn``, which a loaded machine inflates far less than the wall time."""
    quiet_barrier(comm)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    took, used = time.perf_counter() - t0, time.process_time() - c0
    quiet_barrier(comm)
    if cpu is not None:
        cpu[key] = comm.allreduce(used, op=MPI.MAX)
    return comm.allreduce(took, op=MPI.MAX)


def bench_solar(comm, state: dict, d: str, reserve: bool = False) -> dict:
    w = CheckpointWriter(d, comm=comm, chunk_size=CHUNK)
    if reserve:
        w.reserve(state).result()
    box: dict = {}
    cpu: dict = {}
    block = timed(comm, lambda: box.update(f=w.save(state, 1)), cpu, "blocking_cpu_s")
    total = block + timed(comm, lambda: box["f"].result())
    first = dir_bytes(d) if comm.rank == 0 else 0
    files = dir_files(d) if comm.rank == 0 else 0
    touch_one_percent(state, 1)
    steady = timed(comm, lambda: box.update(f=w.save(state, 2)), cpu, "steady_blocking_cpu_s")
    incr_s = steady + timed(comm, lambda: box["f"].result())
    comm.Barrier()
    second = dir_bytes(d) - first if comm.rank == 0 else 0
    dense = []  # every chunk changed (negated: exact, and the replicated tensor stays the same on every rank)
    for step in (3, 4):
        for v in state.values():
            (v.to_local() if isinstance(v, DTensor) else v).neg_()
        dense.append(timed(comm, lambda: box.update(f=w.save(state, step)), cpu, f"dense{step}_blocking_cpu_s"))
        box["f"].result()
    w.close()
    touch_one_percent(state, -1)
    comm.Barrier()
    return {"blocking_s": block, "total_s": total, "bytes": first, "files": files, "incremental_s": incr_s,
            "incremental_bytes": second, "steady_blocking_s": steady, "dense_first_blocking_s": dense[0],
            "dense_steady_blocking_s": dense[1], **cpu}


def bench_dcp(comm, state: dict, d: str, asynchronous: bool) -> dict:
    if not asynchronous:
        total = timed(comm, lambda: dcp.save(state, checkpoint_id=d))
        block = total
    else:
        box: dict = {}
        block = timed(comm, lambda: box.update(f=dcp.async_save(state, checkpoint_id=d)))
        total = block + timed(comm, lambda: box["f"].result())
    comm.Barrier()
    return {"blocking_s": block, "total_s": total, "bytes": dir_bytes(d) if comm.rank == 0 else 0,
            "files": dir_files(d) if comm.rank == 0 else 0}


def bench_torch_save(comm, state: dict, d: str) -> dict:
    """Each rank ``torch.save``s its own state (the sharded tensor's local rows) to its own file."""
    plain = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    os.makedirs(d, exist_ok=True)
    cpu: dict = {}
    total = timed(comm, lambda: torch.save(plain, os.path.join(d, f"rank{comm.rank}.pt")), cpu, "cpu_s")
    return {"blocking_s": total, "total_s": total, "bytes": comm.allreduce(dir_bytes(d) if comm.rank == 0 else 0),
            **cpu}


def summarize(comm, args, runs: dict[str, list], load_start, peak_rss) -> dict:
    """The JSON of a run: best and median of each contender, and SOLAR's ratios round by round."""
    best = {k: {m: min(run[m] for run in v) for m in v[0]} for k, v in runs.items()}
    median = {k: {m: statistics.median(run[m] for run in v) for m in v[0]} for k, v in runs.items()}
    torch_s = [run["total_s"] for run in runs["torch_save"]]
    # each round's SOLAR blocking over the same round's torch.save (the contenders alternate)
    by_round = {"first": [r["blocking_s"] / t for r, t in zip(runs["solar"], torch_s)],
                "first_reserved": [r["blocking_s"] / t for r, t in zip(runs["solar_reserved"], torch_s)],
                "steady": [r["steady_blocking_s"] / t for r, t in zip(runs["solar"] + runs["solar_reserved"],
                                                                        torch_s + torch_s)],
                "dense_first": [r["dense_first_blocking_s"] / t
                                for r, t in zip(runs["solar"] + runs["solar_reserved"], torch_s + torch_s)],
                "dense_steady": [r["dense_steady_blocking_s"] / t
                                 for r, t in zip(runs["solar"] + runs["solar_reserved"], torch_s + torch_s)]}
    torch_cpu = [run["cpu_s"] for run in runs["torch_save"]]
    by_round_cpu = {  # the same ratios in CPU seconds (see timed)
        "first": [r["blocking_cpu_s"] / t for r, t in zip(runs["solar"], torch_cpu)],
        "first_reserved": [r["blocking_cpu_s"] / t for r, t in zip(runs["solar_reserved"], torch_cpu)],
        "steady": [r["steady_blocking_cpu_s"] / t for r, t in zip(runs["solar"] + runs["solar_reserved"],
                                                                   torch_cpu + torch_cpu)]}
    own = comm.size * args.mib * MiB
    rep = args.mib * MiB // 4
    s = best["solar"]
    out = {"world_size": comm.size, "mib_per_rank": args.mib, "rounds": args.rounds,
           "load_average": os.getloadavg(), "logical_bytes_unique": own + rep + comm.size * 0,
           "load_average_at_start": load_start, "peak_rss_bytes_per_rank": peak_rss, "best": best, "median": median,
           "solar_blocking_vs_torch_save_by_round": by_round,
           "solar_blocking_cpu_vs_torch_save_cpu_by_round": by_round_cpu,
           "solar_incremental_vs_first": s["incremental_bytes"] / s["bytes"],
           "solar_bytes_vs_unique_state": s["bytes"] / (own + rep),
           "solar_blocking_vs_dcp_save": s["blocking_s"] / best["dcp_save"]["total_s"],
           "solar_blocking_vs_dcp_async_blocking": s["blocking_s"] / best["dcp_async"]["blocking_s"],
           "solar_total_vs_dcp_save": s["total_s"] / best["dcp_save"]["total_s"],
           "solar_blocking_vs_torch_save": s["blocking_s"] / best["torch_save"]["total_s"],
           "solar_reserved_first_blocking_vs_torch_save": best["solar_reserved"]["blocking_s"]
           / best["torch_save"]["total_s"],
           "solar_steady_blocking_vs_torch_save": s["steady_blocking_s"] / best["torch_save"]["total_s"],
           "solar_dense_steady_blocking_vs_torch_save": s["dense_steady_blocking_s"]
           / best["torch_save"]["total_s"],
           "solar_files_per_rank_first_save": s["files"] / comm.size,
           "dcp_async_blocking_vs_torch_save": best["dcp_async"]["blocking_s"] / best["torch_save"]["total_s"],
           "runs": runs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="MiB of sharded state per rank")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not os.path.isdir(args.dir):  # every rank refuses alike, before any collective can wait on rank 0
        ap.error(f"--dir {args.dir} is not a directory; create it or pass an existing one")
    comm = MPI.COMM_WORLD
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{comm.bcast(port)}", rank=comm.rank,
                            world_size=comm.size)
    mesh = init_device_mesh("cpu", (comm.size,))
    state = make_state(mesh, comm, args.mib)
    load_start = os.getloadavg()
    base = comm.bcast(tempfile.mkdtemp(prefix="solar-job-bench-", dir=args.dir) if comm.rank == 0 else None)
    runs: dict[str, list] = {"solar": [], "solar_reserved": [], "dcp_save": [], "dcp_async": [], "torch_save": []}
    for r in range(args.rounds):
        for name in runs:
            d = os.path.join(base, f"{name}-{r}")
            if name.startswith("solar"):
                runs[name].append(bench_solar(comm, state, d, reserve=name == "solar_reserved"))
            elif name == "torch_save":
                runs[name].append(bench_torch_save(comm, state, d))
            else:
                runs[name].append(bench_dcp(comm, state, d, asynchronous=name == "dcp_async"))
            comm.Barrier()
            if comm.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
    peak_rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # bytes (Linux: KiB)
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        out = summarize(comm, args, runs, load_start, peak_rss)
        print(json.dumps(out, indent=2))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
