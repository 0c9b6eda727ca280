"""Time to each epoch's first batch: planning ahead against planning inline, beside torch.

Run: ``.venv/bin/python bench/plan/ahead.py [--samples 2000000] [--world-size 16]
[--batch-size 256] [--epochs 3] [--out bench/plan/ahead.json]``

One rank's loader (``rank=0`` of ``--world-size``) over a file of ``--samples`` small rows, so
the per-epoch plan of the whole job (O(N) on every rank) is what the first batch waits for.
Three sides in one run, each on its own loader:

``torch``
    ``torch.utils.data.DataLoader`` with the same ``DistributedSampler``: ``randperm(N)`` each epoch.
``inline``
    ``solar.DataLoader`` with planning ahead turned off: the plan is made when the epoch starts.
``ahead``
    ``solar.DataLoader`` as shipped: epoch e+1 is planned in the background during epoch e
    (NOTE [ Planning ahead ] in solar/sampler.py).

Each epoch's loop sleeps 0.5 ms every fourth batch (a stand-in for training). Reported per
epoch: seconds to the first batch and for the whole epoch; ratios inline/ahead. Epoch 0 has no
plan made ahead (and its background planning of epoch 1 competes for this machine's 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _epochs(loader, sampler, epochs: int) -> tuple[list[float], list[float]]:
    first, whole = [], []
    for e in range(epochs):
        sampler.set_epoch(e)
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        first.append(time.perf_counter() - t)
        for k, _ in enumerate(it):
            if k % 4 == 0:
                time.sleep(0.0005)
        whole.append(time.perf_counter() - t)
        del it
    return first, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--world-size", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "ahead.json"))
    a = ap.parse_args()

    import h5py
    import numpy as np
    import torch.utils.data as tud

    import solar
    from solar.sampler import SolarBatchSampler

    tmp = tempfile.mkdtemp(prefix="solar-ahead-")
    path = os.path.join(tmp, "rows.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(a.samples * 4, dtype=np.float32).reshape(a.samples, 4)
    results = {}
    real = SolarBatchSampler._plan_ahead
    for side in ("torch", "inline", "ahead"):
        ds = solar.H5Dataset(path)
        sampler = tud.DistributedSampler(ds, num_replicas=a.world_size, rank=0, seed=1)
        if side == "torch":
            loader = tud.DataLoader(ds, batch_size=a.batch_size, sampler=sampler)
        else:
            SolarBatchSampler._plan_ahead = real if side == "ahead" else (lambda self, epoch: None)
            loader = solar.DataLoader(ds, batch_size=a.batch_size, sampler=sampler, buffer=0.5)
        try:
            first, whole = _epochs(loader, sampler, a.epochs)
        finally:
            SolarBatchSampler._plan_ahead = real
        results[side] = {"first_batch_s": first, "epoch_s": whole}
        ds.close()
    os.remove(path)
    os.rmdir(tmp)

    print(f"N = {a.samples}, P = {a.world_size} (rank 0), batch {a.batch_size}, buffer 0.5")
    print(f"{'':24s}" + "".join(f"{'epoch ' + str(e):>10s}" for e in range(a.epochs)))
    for side in results:
        for what in ("first_batch_s", "epoch_s"):
            print(f"{side + ' ' + what:24s}" + "".join(f"{x:10.3f}" for x in results[side][what]))
    ratios = {what: [i / h for i, h in zip(results["inline"][what], results["ahead"][what])]
              for what in ("first_batch_s", "epoch_s")}
    for what, r in ratios.items():
        print(f"{'inline/ahead ' + what:24s}" + "".join(f"{x:9.2f}x" for x in r))
    out = {"config": vars(a) | {"out": None}, "results": results, "inline_over_ahead": ratios}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
