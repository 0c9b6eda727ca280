"""PtychoNN's training script unchanged: shards joined with ConcatDataset, a random_split into
training and validation, a shuffled training loader and a validation pass every epoch.

Run: ``.venv/bin/python bench/loader/split.py [--samples 2048] [--shards 4] [--size 64] [--epochs 3]
[--buffer 0.5] [--bandwidth 200e6] [--latency 1e-3] [--out bench/loader/split.json]``

The data are ``--shards`` PtychoNN-like files of ``--samples / --shards`` samples each, behind the
throttle of ``bench/loader/run.py`` (one rank's share of a parallel file system: ``--bandwidth``
bytes/s and ``--latency`` s per request, split evenly among the side's concurrent readers).
``random_split(ConcatDataset(shards), [0.9, 0.1])``, then per epoch one shuffled pass over the
training part (batch 32) and one in-order pass over the validation part. Three sides, world
size 1, in this one process:

``torch``
    ``torch.utils.data.DataLoader`` over per-sample h5py datasets, ``num_workers=2``.
``wrapped``
    ``torch.utils.data.DataLoader`` over the same split of ``solar.H5Dataset`` s: each batch one
    coalesced read per field and shard, no buffer, no read-ahead. This is what ``solar.DataLoader``
    did with a Subset or ConcatDataset before it could drive them (it warned and ran as torch's).
``solar``
    ``solar.DataLoader`` for both loaders, ``buffer=`` ``--buffer`` of the training part's bytes
    (NOTE [ Subsets ] in solar/subset.py, NOTE [ Several files ] in solar/concat.py).

Reported: steady epoch seconds (training + validation, epochs >= 2), the training loader's hit
rate after its fill epoch against the bound ``min(1, buffer)``, storage calls and bytes, and the
ratios torch/solar and wrapped/solar. Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from run import report, steady, throttled  # noqa: E402  (bench/loader/run.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer", type=float, default=0.5, help="training buffer, fraction of the training part's bytes")
    ap.add_argument("--bandwidth", type=float, default=200e6)
    ap.add_argument("--latency", type=float, default=1e-3)
    ap.add_argument("--data", default="out/bench/shards")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "split.json"))
    a = ap.parse_args()

    import torch
    import torch.utils.data as tud

    import solar
    from solar.io_backends.hdf5 import HDF5Backend
    from solar.synthetic import write_ptycho_h5
    from solar.testing.baselines import PerSampleH5

    os.makedirs(a.data, exist_ok=True)
    per = a.samples // a.shards
    paths = [os.path.join(a.data, f"shard{k}-of-{a.shards}-{per}x{a.size}.h5") for k in range(a.shards)]
    for k, p in enumerate(paths):
        if not os.path.exists(p):
            write_ptycho_h5(p, per, a.size, seed=k, progress=False)

    def split(members):
        return tud.random_split(tud.ConcatDataset(members), [0.9, 0.1], generator=torch.Generator().manual_seed(0))

    rows = {}
    for side in ("torch", "wrapped", "solar"):
        if side == "torch":
            members = [PerSampleH5(throttled(HDF5Backend(p, direct_reads=False), a.bandwidth / 2, a.latency))
                       for p in paths]  # a torch user's h5py reads
        else:
            members = [solar.H5Dataset(p, backend=throttled(HDF5Backend(p), a.bandwidth / 4, a.latency),
                                       io_threads=4, sieve_bytes=int(a.latency * a.bandwidth / 4)) for p in paths]
        train, val = split(members)
        g = torch.Generator().manual_seed(1)
        if side == "solar":
            budget = int(a.buffer * sum(int(m.sample_nbytes().sum()) for m in members) * 0.9)
            tl = solar.DataLoader(train, batch_size=32, shuffle=True, generator=g, buffer=f"{budget}B")
            vl = solar.DataLoader(val, batch_size=32, buffer=0)
        else:
            workers = {"num_workers": 2, "persistent_workers": True} if side == "torch" else {}
            tl = tud.DataLoader(train, batch_size=32, shuffle=True, generator=g, **workers)
            vl = tud.DataLoader(val, batch_size=32, **workers)
        times, seen = [], 0
        for _ in range(a.epochs):
            t0 = time.perf_counter()
            for x, _y in tl:
                seen += len(x)
            for x, _y in vl:
                seen += len(x)
            times.append(time.perf_counter() - t0)
        row = {"epoch_s": times, "steady_s": steady(times), "samples": seen}
        if side == "torch":
            row.update(calls=sum(m.calls for m in members), bytes=sum(m.bytes for m in members))
        else:
            row.update(calls=sum(m.stats.read_calls for m in members), bytes=sum(m.stats.bytes_in for m in members))
        if side == "solar":
            hits = sum(m.stats.hits for m in members)
            later = (a.epochs - 1) * len(train)
            row.update(hit_rate=hits / later if later else 0.0, bound=min(1.0, a.buffer))
        rows[side] = row
        del tl, vl

    if len({r["samples"] for r in rows.values()}) != 1:
        raise SystemExit(f"the sides saw different numbers of samples: { {k: r['samples'] for k, r in rows.items()} }")
    ratios = {"torch/solar": rows["torch"]["steady_s"] / rows["solar"]["steady_s"],
              "wrapped/solar": rows["wrapped"]["steady_s"] / rows["solar"]["steady_s"]}
    report(f"{a.shards} shards x {per} samples ({a.size}x{a.size}); random_split 0.9/0.1; throttled "
           f"{a.bandwidth / 1e6:.0f} MB/s, {a.latency * 1e3:.1f} ms/request; solar buffer {a.buffer:.0%} of the "
           "training part", rows, ratios, vars(a), a.out)


if __name__ == "__main__":
    main()
