"""The epoch's order: DistributedSampler's own cost against the one the sharded plan pays.

Run: ``.venv/bin/python bench/plan/randperm.py [--samples 20000000] [--rounds 3]
[--out bench/plan/randperm.json]``

``DistributedSampler.__iter__`` draws ``torch.randperm(N)`` (int64) and turns it into a Python
list, on every rank, every epoch. The sharded plan writes the same permutation as int32 into
the node's shared window (``solar.order.permutation_into``), once per node and epoch (NOTE
[ One order per node ] in solar/nodeshare.py). Both are timed alternately in one process,
``--rounds`` times; the two orders are checked equal. The JSON records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from solar.order import permutation_into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=20_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "randperm.json"))
    a = ap.parse_args()
    rounds = []
    load_before = os.getloadavg()
    for r in range(a.rounds):
        g = torch.Generator()
        g.manual_seed(1 + r)
        t0 = time.perf_counter()
        perm = torch.randperm(a.samples, generator=g)
        t1 = time.perf_counter()
        listed = perm.tolist()
        t2 = time.perf_counter()
        del listed
        window = np.empty(a.samples, np.int32)
        t3 = time.perf_counter()
        permutation_into(window, 1, r)
        t4 = time.perf_counter()
        if not np.array_equal(window, perm.numpy()):
            raise SystemExit("the int32 permutation differs from torch.randperm's")
        rounds.append({"randperm_int64_s": t1 - t0, "tolist_s": t2 - t1, "distributed_sampler_s": t2 - t0,
                       "permutation_into_int32_s": t4 - t3})
        del perm, window
    best = {k: min(x[k] for x in rounds) for k in rounds[0]}
    out = {"config": vars(a), "rounds": rounds, "best": best,
           "sampler_over_window": best["distributed_sampler_s"] / best["permutation_into_int32_s"],
           "load_average_before": load_before, "load_average": os.getloadavg()}
    print(json.dumps(best), f"DistributedSampler / window fill: {out['sampler_over_window']:.2f}x")
    with open(a.out, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
