"""Per-rank memory of the schedule, beside torch's ``DistributedSampler`` on the same N.

Run: ``.venv/bin/python bench/plan/memory.py [--samples 4000000] [--world-size 64]
[--batch-size 32] [--out bench/plan/memory.json]``

Every rank of a SOLAR job plans the whole epoch (ranks agree on the plan without talking), so the
planner's per-sample arrays are O(N) on each rank, as torch's ``DistributedSampler`` is (it turns
``randperm(N)`` into a Python list every epoch). Each side runs in a fresh process:

``solar``
    ``Planner`` at buffer 0.5 (``C = N / 2P``) plans three epochs, taking one rank's steps and
    buffer actions as the sampler does.
``torch``
    ``iter(DistributedSampler(...))`` of three epochs (``set_epoch``), as torch's DataLoader does.

Reported: the peak resident set over the process's state after imports (``ru_maxrss``) and the
resident set kept afterwards, in bytes per sample, and planning seconds per epoch. The resident
set includes memory the allocator keeps for reuse, so "kept" is an upper bound. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(side: str, n: int, P: int, b: int) -> dict:
    import gc

    import torch

    torch.randperm(10)  # torch's lazy set-up is not the sampler's
    gc.collect()
    base = max(_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    times = []
    if side == "solar":
        from solar.schedule import PlanConfig, Planner

        planner = Planner(PlanConfig(n, P, b, n // 2 // P, seed=1))
        for e in range(3):
            t = time.perf_counter()
            plan = planner.plan(e)
            plan.rank_steps(P // 2), plan.rank_actions(P // 2), plan.twin_steps()
            times.append(time.perf_counter() - t)
            del plan
            gc.collect()
    else:
        import torch.utils.data as tud

        class _Len(tud.Dataset):
            def __len__(self):
                return n

            def __getitem__(self, i):
                return i

        sampler = tud.DistributedSampler(_Len(), num_replicas=P, rank=P // 2, seed=1)
        for e in range(3):
            sampler.set_epoch(e)
            t = time.perf_counter()
            it = iter(sampler)
            next(it)
            times.append(time.perf_counter() - t)
            del it
            gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_B_per_sample": (peak - base) / n, "kept_B_per_sample": (_rss() - base) / n,
            "seconds_per_epoch": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4_000_000)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory.json"))
    ap.add_argument("--side", choices=["solar", "torch"], help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    n, P, b = args.samples, args.world_size, args.batch_size
    if args.side:
        print(json.dumps(_measure(args.side, n, P, b)))
        return
    res = {}
    for side in ("solar", "torch"):
        out = subprocess.run([sys.executable, __file__, "--side", side, "--samples", str(n), "--world-size", str(P),
                              "--batch-size", str(b)], check=True, capture_output=True, text=True).stdout
        res[side] = json.loads(out.strip().splitlines()[-1])
        r = res[side]
        print(f"{side:6} peak {r['peak_B_per_sample']:6.1f} B/sample  kept {r['kept_B_per_sample']:6.1f} B/sample  "
              f"s/epoch {' '.join('%.2f' % t for t in r['seconds_per_epoch'])}")
    ratio = res["solar"]["peak_B_per_sample"] / res["torch"]["peak_B_per_sample"]
    print(f"solar/torch peak memory: {ratio:.2f}x (N={n}, P={P}, b={b})")
    from solar.fileio import write_text_atomic

    write_text_atomic(args.out, json.dumps({"config": {"samples": n, "world_size": P, "batch_size": b},
                                            "machine": os.uname().machine, "runs": res,
                                            "peak_ratio_solar_over_torch": ratio}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
