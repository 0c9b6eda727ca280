"""Checkpoint benchmark: solar.checkpoint side by side with torch.save and torch.distributed.checkpoint.

Run: ``.venv/bin/python bench/checkpoint/run.py [--gib 1.0] [--dir /tmp] [--out results.json]``

One process, one disk, the three writers interleaved on the same state dict (a model plus its
AdamW moments, ``--gib`` in total). Measured, and printed as ratios against torch.save:

* bytes written by the first (full) save, after a change touching 1% of the chunks, and after a
  dense change (a real AdamW step on every parameter: the "dense fine-tuning step");
* the blocking time of an asynchronous save (``save()`` returning) vs the time of ``torch.save``,
  both for the default save (blocks for the host copy) and for ``lazy=True`` (the copy overlaps
  the forward/backward pass; ``wait_staged()`` before the optimizer step);
* XXH3-128 chunk hashing speed on one core (``torch.set_num_threads(1)``);
* a manifest-only diff of two versions with 10^5 chunks (in process; the CLI's start-up is extra);
* an embedding-table workload (a few random rows change per step, as in recommendation models) at
  1 MiB and 64 KiB chunks, and a partial fine-tuning workload (frozen backbone), to show where
  incremental saving pays and where it does not.

The machine may be shared with other jobs: times are noisy, ratios from one run are what counts.
Writes every figure as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from solar.cache.disk import DiskTier
from solar.checkpoint import CheckpointWriter
from solar.checkpoint.chunking import hash_chunks, hasher
from solar.checkpoint.diff import diff

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
MiB = 1 << 20


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, files in os.walk(path) for f in files)


def make_model(total_bytes: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers whose params + two Adam moments add up to ``total_bytes``."""
    torch.manual_seed(seed)
    width = 2048
    n_params = total_bytes // 4 // 3
    layers = max(1, n_params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dense_step(model, opt)  # materialize the moments
    return model, opt


def dense_step(model, opt) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}


class Baselines:
    """torch.save and dcp.save into fresh paths under ``work``; returns (seconds, bytes)."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.n = 0

    def _path(self, kind: str) -> str:
        self.n += 1
        return os.path.join(self.work, f"{kind}-{self.n}")

    def torch_save(self, state) -> tuple[float, int]:
        path = self._path("pt") + ".pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        dt = time.perf_counter() - t0
        size = dir_bytes(path)
        os.unlink(path)
        return dt, size

    def dcp_save(self, state) -> tuple[float, int]:
        import torch.distributed.checkpoint as dcp

        path = self._path("dcp")
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        dt = time.perf_counter() - t0
        size = dir_bytes(path)
        shutil.rmtree(path)
        return dt, size


def solar_save(writer: CheckpointWriter, state, step: int) -> dict:
    t0 = time.perf_counter()
    fut = writer.save(state, step)
    blocking = time.perf_counter() - t0
    res = fut.result()
    total = time.perf_counter() - t0
    return {"blocking_s": blocking, "total_s": total, "bytes": res.bytes_written + res.manifest_bytes,
            "chunks_written": res.chunks_written, "chunks_total": res.chunks_total}


def touch_fraction_of_chunks(state: dict, chunk: int, fraction: float, rng) -> int:
    """Change one element in ``fraction`` of all chunks (spread over every tensor); return how many."""
    optim = [s for st in state["optim"]["state"].values() for s in st.values()]
    tensors = [t for t in list(state["model"].values()) + optim if t.numel() * t.element_size() >= chunk]
    slots = [(t, c) for t in tensors for c in range(t.numel() * t.element_size() // chunk)]
    pick = rng.choice(len(slots), max(1, int(round(fraction * len(slots)))), replace=False)
    for i in pick:
        t, c = slots[i]
        t.view(-1)[c * chunk // t.element_size()] += 1.0
    return len(pick)


def bench_hash(state, chunk: int) -> float:
    torch.set_num_threads(1)
    digest = hasher("xxh3_128")
    arrays = [t.numpy().reshape(-1).view(np.uint8) for t in state["model"].values()]
    nbytes = sum(a.nbytes for a in arrays)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for a in arrays:
            hash_chunks(a, chunk, digest)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    torch.set_num_threads(os.cpu_count() or 1)
    return best


def bench_diff(work: str, nchunks: int = 100_000) -> dict:
    """Two versions of ``nchunks`` 1 KiB chunks; time a manifest-only diff between them."""
    root = os.path.join(work, "diff-root")
    x = torch.randn(nchunks * 1024 // 4)
    tier = DiskTier(root, fsync=False)
    t0 = time.perf_counter()
    with CheckpointWriter(tier, chunk_size=1024, io_threads=8) as w:
        w.save({"x": x, "y": x[: 1024 // 4].clone()}, 1).result()
        x[:: x.numel() // 50] += 1.0  # 50 changed chunks
        w.save({"x": x, "y": x[: 1024 // 4].clone()}, 2).result()
    write_s = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        rep = diff(f"{root}@1", f"{root}@2")
        times.append(time.perf_counter() - t0)
    shutil.rmtree(root)
    return {"chunks": nchunks + 1, "diff_s": min(times), "diff_s_median": sorted(times)[2],
            "changed_chunks": rep.changed_chunks, "setup_write_s": write_s}


def bench_embedding(work: str, base: Baselines, rows: int, dim: int, per_step: int, steps: int, chunk: int) -> dict:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(rows, dim, generator=g)
    acc = torch.zeros(rows, dim)  # Adagrad accumulator: touched on the same rows
    state = {"emb": emb, "adagrad": acc, "dense": torch.randn(512, 512, generator=g)}
    rng = np.random.default_rng(2)
    root = os.path.join(work, f"emb-{chunk}")
    out = {"rows": rows, "dim": dim, "rows_per_step": per_step, "chunk_size": chunk, "steps": []}
    with CheckpointWriter(root, chunk_size=chunk) as w:
        solar_save(w, state, 0)
        for step in range(1, steps + 1):
            idx = torch.from_numpy(rng.choice(rows, per_step, replace=False))
            grad = torch.randn(per_step, dim, generator=g) * 1e-2
            acc[idx] += grad * grad
            emb[idx] -= 0.1 * grad / acc[idx].sqrt().clamp_min(1e-8)
            state["dense"].add_(1e-3)
            s = solar_save(w, state, step)
            t_pt, b_pt = base.torch_save(state)
            s.update(torch_save_bytes=b_pt, torch_save_s=t_pt, bytes_ratio=s["bytes"] / b_pt)
            out["steps"].append(s)
    shutil.rmtree(root)
    out["mean_bytes_ratio"] = float(np.mean([s["bytes_ratio"] for s in out["steps"]]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=None,
                    help="size of the model + optimizer state dict (default 1.0; 0.125 with --quick)")
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to test (default: a temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    ap.add_argument("--quick", action="store_true", help="small sizes (a 1/8 GiB state), for a smoke run")
    args = ap.parse_args(argv)
    if args.gib is None:
        args.gib = 0.125 if args.quick else 1.0
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="solar-ckpt-bench-", dir=args.dir)
    chunk = int(args.chunk_mib * MiB)
    total = int(args.gib * (1 << 30))
    base = Baselines(work)
    res: dict = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
                             "platform": platform.platform(),
                             "note": "shared 2-core VM; times are noisy, ratios are from one run"},
                 "chunk_size": chunk}
    try:
        model, opt = make_model(total)
        state = state_of(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
            t.numel() * t.element_size()
            for st in opt.state_dict()["state"].values() for t in st.values() if torch.is_tensor(t))
        res["state_bytes"] = nbytes
        print(f"state dict: {nbytes / 2**30:.2f} GiB ({len(state['model'])} model tensors), "
              f"chunk {chunk / MiB:g} MiB, scratch {work}")

        root = os.path.join(work, "solar")
        with CheckpointWriter(root, chunk_size=chunk) as w:
            rows = {}
            t_pt, b_pt = base.torch_save(state)
            t_dcp, b_dcp = base.dcp_save(state)
            full = solar_save(w, state, 0)
            rows["full"] = {"torch_save_s": t_pt, "torch_save_bytes": b_pt, "dcp_s": t_dcp, "dcp_bytes": b_dcp,
                            "solar": full}

            rng = np.random.default_rng(0)
            n_touched = touch_fraction_of_chunks(state, chunk, 0.01, rng)
            t_pt, b_pt = base.torch_save(state)
            t_dcp, b_dcp = base.dcp_save(state)
            sparse = solar_save(w, state, 1)
            rows["sparse_1pct"] = {"touched_chunks": n_touched, "torch_save_s": t_pt, "torch_save_bytes": b_pt,
                                   "dcp_s": t_dcp, "dcp_bytes": b_dcp, "solar": sparse}

            dense_step(model, opt)  # a real AdamW step: every parameter and moment changes
            state = state_of(model, opt)
            t_pt, b_pt = base.torch_save(state)
            t_dcp, b_dcp = base.dcp_save(state)
            dense = solar_save(w, state, 2)
            rows["dense_finetune_step"] = {"torch_save_s": t_pt, "torch_save_bytes": b_pt, "dcp_s": t_dcp,
                                           "dcp_bytes": b_dcp, "solar": dense}

            # asynchronous blocking time, steady state (the staging buffer is reused); default mode
            # blocks for the host copy, lazy mode returns at once and the copy overlaps fwd/bwd
            blocking, pt_times, lazy_blocking, lazy_staged = [], [], [], []
            for k in range(3):
                dense_step(model, opt)
                state = state_of(model, opt)
                pt_times.append(base.torch_save(state)[0])
                blocking.append(solar_save(w, state, 10 + 2 * k)["blocking_s"])
                t0 = time.perf_counter()
                fut = w.save(state, 11 + 2 * k, lazy=True)
                lazy_blocking.append(time.perf_counter() - t0)
                w.wait_staged()
                lazy_staged.append(time.perf_counter() - t0)
                fut.result()
            rows["async"] = {"blocking_s": blocking, "torch_save_s": pt_times,
                             "ratio": float(np.median(blocking) / np.median(pt_times)),
                             "lazy_blocking_s": lazy_blocking, "lazy_staged_after_s": lazy_staged,
                             "lazy_ratio": float(np.median(lazy_blocking) / np.median(pt_times))}
        shutil.rmtree(root)
        res["scenarios"] = rows

        res["hash_gbps_one_core"] = bench_hash(state, chunk)
        del model, opt, state
        res["diff_1e5"] = bench_diff(work, 20_000 if args.quick else 100_000)
        emb_rows = 100_000 if args.quick else 1_000_000
        res["embedding"] = [bench_embedding(work, base, emb_rows, 64, 64, 3, c) for c in (chunk, 64 * 1024)]
        res["partial_finetune"] = bench_partial(work, base, total // 3 if not args.quick else total // 8, chunk)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    s = res["scenarios"]
    targets = {
        "sparse_1pct_bytes_vs_torch_save": (
            s["sparse_1pct"]["solar"]["bytes"] / s["sparse_1pct"]["torch_save_bytes"], "<= 0.015"),
        "dense_bytes_vs_torch_save": (
            s["dense_finetune_step"]["solar"]["bytes"] / s["dense_finetune_step"]["torch_save_bytes"], "<= 1.05"),
        "async_blocking_vs_torch_save_time": (s["async"]["ratio"], "<= 0.10"),
        "lazy_async_blocking_vs_torch_save_time": (s["async"]["lazy_ratio"], "<= 0.10"),
        "hash_gbps_one_core": (res["hash_gbps_one_core"], ">= 5"),
        "manifest_diff_1e5_chunks_s": (res["diff_1e5"]["diff_s"], "<= 0.2"),
    }
    res["targets"] = {k: {"value": v, "target": t} for k, (v, t) in targets.items()}
    print("\nscenario                 torch.save           dcp.save             solar (bytes, blocking / total s)")
    for name, r in s.items():
        if name == "async":
            continue
        print(f"{name:24s} {r['torch_save_bytes'] / MiB:8.1f} MiB {r['torch_save_s']:5.2f}s  "
              f"{r['dcp_bytes'] / MiB:8.1f} MiB {r['dcp_s']:5.2f}s  "
              f"{r['solar']['bytes'] / MiB:8.2f} MiB {r['solar']['blocking_s']:.3f}/{r['solar']['total_s']:.2f}s "
              f"({r['solar']['chunks_written']}/{r['solar']['chunks_total']} chunks)")
    a = s["async"]
    print(f"async: save() blocks {[round(b, 3) for b in a['blocking_s']]} s "
          f"vs torch.save {[round(t, 2) for t in a['torch_save_s']]} s; "
          f"lazy save() returns in {[round(b, 4) for b in a['lazy_blocking_s']]} s, "
          f"state copied after {[round(b, 3) for b in a['lazy_staged_after_s']]} s")
    for e in res["embedding"]:
        print(f"embedding {e['rows']}x{e['dim']}, {e['rows_per_step']} rows/step, chunk {e['chunk_size'] // 1024} KiB: "
              f"solar writes {e['mean_bytes_ratio']:.3%} of torch.save's bytes per step")
    p = res["partial_finetune"]
    print(f"partial fine-tuning (frozen backbone, {p['trained_fraction']:.0%} of params trained): solar writes "
          f"{p['bytes_ratio']:.1%} of torch.save's bytes per step")
    print("\ntargets:")
    for k, (v, t) in targets.items():
        print(f"  {k:36s} {v:10.4f}   target {t}")
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def bench_partial(work: str, base: Baselines, total: int, chunk: int) -> dict:
    """Fine-tuning with a frozen backbone: only the last quarter of the layers (and their moments) change."""
    model, _ = make_model(total, seed=3)
    layers = list(model)
    trained = layers[-max(1, len(layers) // 4):]
    for layer in layers:
        layer.requires_grad_(layer in trained)
    opt = torch.optim.AdamW([p for layer in trained for p in layer.parameters()], lr=1e-4)
    dense_step(torch.nn.Sequential(*trained), opt)
    root = os.path.join(work, "partial")
    with CheckpointWriter(root, chunk_size=chunk) as w:
        solar_save(w, state_of(model, opt), 0)
        dense_step(torch.nn.Sequential(*trained), opt)
        state = state_of(model, opt)
        s = solar_save(w, state, 1)
    t_pt, b_pt = base.torch_save(state)
    shutil.rmtree(root)
    n_all = sum(p.numel() for p in model.parameters())
    n_tr = sum(p.numel() for layer in trained for p in layer.parameters())
    return {"trained_fraction": n_tr / n_all, "solar": s, "torch_save_bytes": b_pt, "torch_save_s": t_pt,
            "bytes_ratio": s["bytes"] / b_pt}


if __name__ == "__main__":
    sys.exit(main())
