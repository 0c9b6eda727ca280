"""Fine-grained increments (issue 23): SOLAR's ``deltas=True`` writer beside torch.save, DCP and safetensors.

Run: ``.venv/bin/python bench/checkpoint/delta.py [--gib 1] [--rounds 3] [--dir /tmp]
[--out bench/checkpoint/delta.json]``

One process, one run, contenders alternated (the machine may be shared: ratios from one run are what
counts, and the load average is recorded before and after each phase):

* **full saves** of a bf16 state of ``--gib`` GiB (8 tensors): ``torch.save``, ``dcp.save``
  (single process), ``safetensors.torch.save_file`` and SOLAR (``CheckpointWriter(deltas=True)``,
  durable: every chunk fsynced, the others are not), each into a fresh directory: seconds and bytes;
* **sparse increments**: 1% and 0.1% of the bf16 elements changed at random positions (each changed
  by 1-7 units in the last place, as visible fine-tuning updates are): SOLAR's increment in bytes
  against its full save (the others rewrite everything: their increment is a full save);
* **dense increments**: an fp32 state of the same size with Adam-like changes (every element moves by
  ~1e-3 relative) and the bf16 state with every element changed. Each of ``--rounds`` rounds saves
  the state into a fresh root (the full save: a new writer's first save), changes every element
  and saves again (the increment), once with ``deltas=True`` and once without (``plain``), so full
  saves and increments alternate. Reported: each save's seconds and bytes, and the medians' ratios
  ``time_ratio_vs_full_median`` (the bar: increment <= 1.2x a full save) and
  ``time_ratio_vs_plain_increment_median``, with the ratios within each round, and the same medians
  ratios of the process's CPU seconds (``cpu_ratio_*``: every thread; less inflated by other load). (Before, the
  ``time_ratio_vs_full`` and ``time_ratio_vs_plain_increment`` keys divided the slower of two
  increments by one first save: single samples of fsync-bound saves, whose spread on one calm run
  was 0.99-2.19 s.) ``bytes_ratio_vs_full`` is the largest increment's bytes over its round's full save;
* **restore** of the 10th version after 9 sparse (1%) increments against restoring the full first
  version, alternated ``--rounds`` times: with the default ``max_chain`` (the writer re-bases
  chains longer than it as skip-deltas against their anchor), and the worst case, ``max_chain=9``
  (every chunk read through 9 deltas). Wall seconds (``ratio``: of the medians) and the process's
  CPU seconds (``cpu_ratio``), with the reader's threads (``READ_THREADS``; the bar) and on one
  thread (``one_thread``: the delta work's share alone, as several threads shorten both loads). These
  loads run with the compiled sparse apply loaded (``delta.warm_kernel(wait=True)``: a process that
  restores repeatedly); ``numpy``: the same loads with numpy's apply; ``fresh_process``: each load the
  first restore of a new process (its imports not timed; numpy's apply, as ``want_kernel`` decides
  for a single restore of a small version);
* **hashing**: XXH3-128 chunk hashing of the state on one thread, GB/s per wall second and per CPU
  second of the thread (per core);
* **blocking**: the time a second ``save`` blocks the caller (the host copy into the reused staging
  buffer) against ``torch.save``'s time.

Peak memory (ru_maxrss) is recorded; the state, SOLAR's staging copy and its mirror are three copies.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

from solar.checkpoint import CheckpointWriter, delta, load, reader
from solar.checkpoint.chunking import hash_chunks, hasher

GiB = 1 << 30
NTENSORS = 8


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


def make_state(gib: float, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(gib * GiB) // torch.tensor([], dtype=dtype).element_size() // NTENSORS
    return {f"layer{i}.weight": (torch.randn(n, generator=g) * 0.02).to(dtype) for i in range(NTENSORS)}


def touch_sparse(state: dict, frac: float, seed: int) -> int:
    """Change about ``frac`` of each bf16 tensor's elements (1-7 ulps) at random positions, in place."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    for t in state.values():
        words = t.view(torch.int16)
        k = max(1, int(frac * t.numel()))
        pos = torch.randint(0, t.numel(), (k,), generator=g)
        words[pos] ^= torch.randint(1, 8, (k,), generator=g, dtype=torch.int16)
        total += k
    return total


def touch_dense(state: dict, seed: int) -> None:
    """Every element moves, as an Adam step moves fp32 master weights: ~1e-3 relative."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        step = torch.randn(t.shape, generator=g).mul_(1e-3)
        t.add_((t.float() * step).to(t.dtype))
        del step


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def fresh(base: str, name: str) -> str:
    path = os.path.join(base, name)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.isfile(path):
        os.unlink(path)
    return path


def full_saves(state: dict, base: str, rounds: int) -> dict:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    contenders = {
        "torch_save": lambda p: torch.save(state, p),
        "dcp_save": lambda p: dcp.save(state, checkpoint_id=p, no_dist=True),
        "safetensors": lambda p: safetensors.torch.save_file(state, p),
        "solar": lambda p: _solar_full(state, p),
    }
    out: dict = {k: {"seconds": [], "bytes": 0} for k in contenders}
    for _r in range(rounds):
        for name, fn in contenders.items():
            path = fresh(base, name)
            gc.collect()
            s, _ = timed(lambda: fn(path))
            out[name]["seconds"].append(round(s, 3))
            out[name]["bytes"] = dir_bytes(path)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    for v in out.values():
        v["median_s"] = statistics.median(v["seconds"])
    return out


def _solar_full(state: dict, path: str) -> None:
    with CheckpointWriter(path, deltas=True) as w:
        w.save(state, 0, blocking=True)


def solar_series(state: dict, base: str, name: str, touches: list, **kw) -> list[dict]:
    """Save the state, then after each ``touch(state)``; one record per save."""
    path = fresh(base, name)
    recs = []
    with CheckpointWriter(path, **kw) as w:
        for step, touch in enumerate([None, *touches]):
            changed = touch(state) if touch is not None else None
            c0 = time.process_time()
            t0 = time.perf_counter()
            fut = w.save(state, step)
            blocking = time.perf_counter() - t0
            res = fut.result()
            recs.append({"step": step, "seconds": round(time.perf_counter() - t0, 3), "blocking_s": round(blocking, 4),
                         "cpu_s": round(time.process_time() - c0, 3), "bytes_written": res.bytes_written,
                         "touched_elements": changed})
    return recs


def sparse_phase(args, base: str) -> dict:
    state = make_state(args.gib, torch.bfloat16)
    numel = sum(t.numel() for t in state.values())
    out: dict = {"numel": numel, "load_before": load_average()}
    for frac in (0.01, 0.001):
        touches = [lambda s, f=frac, i=i: touch_sparse(s, f, 10 + i) for i in range(2)]
        recs = solar_series(state, base, "sparse", touches, deltas=True)
        full = recs[0]["bytes_written"]
        out[f"{frac:g}"] = {"saves": recs, "increment_ratio": [r["bytes_written"] / full for r in recs[1:]]}
        print(f"bf16 {frac:.1%} changed: increments {[f'{r:.4%}' for r in out[f'{frac:g}']['increment_ratio']]} "
              f"of a full save ({full} B)", flush=True)
    shutil.rmtree(os.path.join(base, "sparse"), ignore_errors=True)
    out["load_after"] = load_average()
    return out


def dense_phase(args, base: str, dtype: torch.dtype) -> dict:
    """Full saves (a fresh root each) and dense increments, alternated over ``--rounds`` rounds."""
    out: dict = {"load_before": load_average(), "deltas": [], "plain": []}
    state = make_state(args.gib, dtype, seed=1)
    for r in range(args.rounds):
        touch = (lambda s, r=r: touch_dense(s, 5 + r)) if dtype == torch.float32 else \
            (lambda s, r=r: touch_sparse(s, 1.0, 5 + r))
        for deltas in (True, False):
            gc.collect()
            out["deltas" if deltas else "plain"].append(solar_series(state, base, "dense", [touch], deltas=deltas))
    del state
    gc.collect()
    d, p = out["deltas"], out["plain"]
    full, inc = [rr[0]["seconds"] for rr in d], [rr[1]["seconds"] for rr in d]
    plain_inc = [rr[1]["seconds"] for rr in p]
    cpu = {k: [rr[i]["cpu_s"] for rr in runs] for k, runs, i in (("full", d, 0), ("inc", d, 1), ("plain_inc", p, 1))}
    out.update({
        "cpu_ratio_vs_full_median": statistics.median(cpu["inc"]) / statistics.median(cpu["full"]),
        "cpu_ratio_vs_plain_increment_median": statistics.median(cpu["inc"]) / statistics.median(cpu["plain_inc"]),
        "full_s": full, "increment_s": inc, "plain_full_s": [rr[0]["seconds"] for rr in p],
        "plain_increment_s": plain_inc,
        "bytes_ratio_vs_full": max(rr[1]["bytes_written"] / rr[0]["bytes_written"] for rr in d),
        "time_ratio_vs_full_median": statistics.median(inc) / statistics.median(full),
        "time_ratio_vs_full_per_round": [round(i / f, 3) for i, f in zip(inc, full)],
        "time_ratio_vs_plain_increment_median": statistics.median(inc) / statistics.median(plain_inc),
        "time_ratio_vs_plain_increment_per_round": [round(i / q, 3) for i, q in zip(inc, plain_inc)],
        "load_after": load_average()})
    shutil.rmtree(os.path.join(base, "dense"), ignore_errors=True)
    print(f"{dtype} dense: increment {out['bytes_ratio_vs_full']:.4f}x a full save in bytes, "
          f"{out['time_ratio_vs_full_median']:.2f}x in time, medians (rounds {out['time_ratio_vs_full_per_round']}; "
          f"{out['time_ratio_vs_plain_increment_median']:.2f}x a writer without deltas; CPU seconds "
          f"{out['cpu_ratio_vs_full_median']:.2f}x and {out['cpu_ratio_vs_plain_increment_median']:.2f}x)", flush=True)
    return out


def _restores(path: str, rounds: int, threads: int, kernel: bool = True) -> dict:
    """Loads of the full first version and the 10th, alternated, with the reader on ``threads`` threads;
    ``kernel=False``: deltas applied with numpy only (as before the compiled kernel is loaded)."""
    reader.READ_THREADS = threads
    full, tenth, full_cpu, tenth_cpu = [], [], [], []
    with mock.patch.object(delta, "_READY", delta._READY if kernel else {}):
        for _r in range(rounds):
            for step, sink, cpu in ((0, full, full_cpu), (9, tenth, tenth_cpu)):
                gc.collect()
                c0 = time.process_time()
                s, st = timed(lambda: load(path, step))
                cpu.append(round(time.process_time() - c0, 3))
                sink.append(round(s, 3))
                del st
    return {"threads": threads, "kernel": sorted(delta._READY) != [] and kernel, "full_s": full, "tenth_s": tenth,
            "ratio": statistics.median(tenth) / statistics.median(full),
            "ratio_per_round": [round(t / f, 3) for t, f in zip(tenth, full)], "full_cpu_s": full_cpu,
            "tenth_cpu_s": tenth_cpu, "cpu_ratio": statistics.median(tenth_cpu) / statistics.median(full_cpu)}


_FRESH = ("import sys, time, torch\nfrom solar.checkpoint import load, reader\nreader.READ_THREADS = int(sys.argv[2])\n"
          "t0 = time.perf_counter()\nload(sys.argv[1], int(sys.argv[3]))\nprint(time.perf_counter() - t0)")


def _fresh_restores(path: str, rounds: int, threads: int) -> dict:
    """The same loads, each the first restore of a new process (imports not timed): deltas applied
    with numpy, as a single restore of a small version does (:func:`solar.checkpoint.delta.want_kernel`)."""
    full, tenth = [], []
    for _r in range(rounds):
        for step, sink in ((0, full), (9, tenth)):
            got = subprocess.run([sys.executable, "-c", _FRESH, path, str(threads), str(step)], check=True,
                                 capture_output=True, text=True)
            sink.append(round(float(got.stdout.split()[-1]), 3))
    return {"threads": threads, "full_s": full, "tenth_s": tenth,
            "ratio": statistics.median(tenth) / statistics.median(full),
            "ratio_per_round": [round(t / f, 3) for t, f in zip(tenth, full)]}


def restore_phase(args, base: str) -> dict:
    """The 10th version against the first, with the reader's threads and on one thread (its ratio
    is the delta work's share alone; several threads also shorten the full version's read), in a
    process that restores repeatedly (the compiled kernel loaded: ``ratio``, the bar), with numpy
    only (``numpy``), and as the first restore of a fresh process (``fresh_process``)."""
    out: dict = {}
    default_threads = reader.READ_THREADS
    delta.warm_kernel(wait=True)
    for label, kw in (("default", {}), ("chain9", {"max_chain": 9})):
        state = make_state(args.gib, torch.bfloat16, seed=2)
        recs = solar_series(state, base, "chain", [lambda s, i=i: touch_sparse(s, 0.01, 30 + i) for i in range(9)],
                            deltas=True, **kw)
        del state
        gc.collect()
        path = os.path.join(base, "chain")
        try:
            runs = [_restores(path, args.rounds, th) for th in sorted({default_threads, 1}, reverse=True)]
            extra = {"numpy": _restores(path, args.rounds, default_threads, kernel=False)}
            if label == "default":
                extra["fresh_process"] = _fresh_restores(path, args.rounds, default_threads)
        finally:
            reader.READ_THREADS = default_threads
        full_bytes = recs[0]["bytes_written"]
        out[label] = {"saves": recs, "increment_ratio": [r["bytes_written"] / full_bytes for r in recs[1:]],
                      **runs[0], "one_thread": runs[-1], **extra, "load": load_average()}
        shutil.rmtree(path, ignore_errors=True)
        for what, o in [("", r) for r in runs] + [(f", {k}", v) for k, v in extra.items()]:
            print(f"restore of the 10th version ({label}{what}, {o['threads']} threads): {o['ratio']:.2f}x a full "
                  f"version ({statistics.median(o['tenth_s']):.2f} s vs {statistics.median(o['full_s']):.2f} s; "
                  f"rounds {o['ratio_per_round']}; CPU {o.get('cpu_ratio', float('nan')):.2f}x)", flush=True)
        print(f"  increments {[f'{r:.2%}' for r in out[label]['increment_ratio']]}", flush=True)
    return out


def hashing_phase(args) -> dict:
    """XXH3-128 chunk hashing on one thread: GB per wall second and per CPU second of that thread (on a
    shared machine the thread waits for a core; per core is bytes over its own CPU time)."""
    torch.set_num_threads(1)
    state = make_state(min(args.gib, 1.0), torch.bfloat16, seed=3)
    digest = hasher("xxh3_128")
    nbytes = sum(t.numel() * 2 for t in state.values())
    best, best_cpu = float("inf"), float("inf")
    for _r in range(args.rounds):
        c0 = time.thread_time()
        s, _ = timed(lambda: [hash_chunks(t.view(torch.uint8).numpy(), 1 << 20, digest) for t in state.values()])
        best, best_cpu = min(best, s), min(best_cpu, time.thread_time() - c0)
    out = {"bytes": nbytes, "best_s": best, "best_cpu_s": best_cpu, "gb_per_s": nbytes / best / 1e9,
           "gb_per_cpu_s": nbytes / best_cpu / 1e9, "load": load_average()}
    print(f"hashing: {out['gb_per_s']:.1f} GB/s on one thread, {out['gb_per_cpu_s']:.1f} GB per CPU second",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "delta.json"))
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="solar-delta-bench-", dir=args.dir)
    result: dict = {"gib": args.gib, "rounds": args.rounds, "cpus": os.cpu_count(), "load_start": load_average()}
    try:
        state = make_state(args.gib, torch.bfloat16)
        result["full"] = full_saves(state, base, args.rounds)
        f = result["full"]
        print("full saves (median s, bytes): " + ", ".join(f"{k} {v['median_s']:.2f} s {v['bytes']}"
                                                           for k, v in f.items()), flush=True)
        # the second save's: the first one also allocates the staging buffer it reuses afterwards
        blocking = solar_series(state, base, "blocking", [lambda s: touch_sparse(s, 0.01, 1)], deltas=True)[1][
            "blocking_s"]
        result["blocking"] = {"solar_s": blocking, "torch_save_s": f["torch_save"]["median_s"],
                              "ratio": blocking / f["torch_save"]["median_s"]}
        del state
        gc.collect()
        result["sparse_bf16"] = sparse_phase(args, base)
        result["dense_fp32"] = dense_phase(args, base, torch.float32)
        result["dense_bf16"] = dense_phase(args, base, torch.bfloat16)
        result["restore"] = restore_phase(args, base)
        result["hashing"] = hashing_phase(args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    result["load_end"] = load_average()
    s = result["sparse_bf16"]
    result["bars"] = {
        "sparse_1pct_increment_le_3pct": max(s["0.01"]["increment_ratio"]) <= 0.03,
        "sparse_0.1pct_increment_le_0.5pct": max(s["0.001"]["increment_ratio"]) <= 0.005,
        "dense_fp32_bytes_le_1.02x": result["dense_fp32"]["bytes_ratio_vs_full"] <= 1.02,
        "dense_fp32_time_le_1.2x": result["dense_fp32"]["time_ratio_vs_full_median"] <= 1.2,
        "dense_bf16_bytes_le_1.02x": result["dense_bf16"]["bytes_ratio_vs_full"] <= 1.02,
        "dense_bf16_time_le_1.2x": result["dense_bf16"]["time_ratio_vs_full_median"] <= 1.2,
        "restore_10th_le_1.5x": result["restore"]["default"]["ratio"] <= 1.5,
        "restore_10th_numpy_only_le_1.5x": result["restore"]["default"]["numpy"]["ratio"] <= 1.5,
        "restore_10th_fresh_process_le_1.5x": result["restore"]["default"]["fresh_process"]["ratio"] <= 1.5,
        "restore_10th_through_9_deltas_le_1.5x": result["restore"]["chain9"]["ratio"] <= 1.5,
        "hashing_ge_5_gb_per_core_s": result["hashing"]["gb_per_cpu_s"] >= 5,
        "blocking_le_10pct_torch_save": result["blocking"]["ratio"] <= 0.10,
    }
    print(json.dumps(result["bars"], indent=1))
    print(f"peak RSS {result['peak_rss_gib']:.2f} GiB; load average {result['load_end']}")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
