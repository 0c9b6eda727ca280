"""SOLAR's loader on local storage beside the one-copy limit and torch, alternated in one run.

Run: ``.venv/bin/python bench/loader/local.py [--rounds 3] [--epochs 4] [--out bench/loader/local.json]``

The data is bench/compete's (PtychoNN-shaped: ``--samples`` 2,048 samples, x ``1 x 128 x 128``
and y ``2 x 128 x 128`` float32, 403 MB, written once to ``--data``), batch 32, shuffled, a loop
that sums both tensors. Contenders, each in a fresh process, alternated round by round:

* ``solar-w0`` / ``solar-w2``: ``solar.DataLoader(H5Dataset, distributed=True, shuffle=True,
  buffer="192MiB", num_workers=0 / 2)`` (bench/compete's setting);
* ``torch-w0``: ``torch.utils.data.DataLoader`` over h5py, one read per sample.

Per contender: the steady epoch (mean of epochs 2..E), the process's CPU seconds in it (all its
threads; not a worker process's), the first epoch, and the time to the first batch (``iter`` and
the first ``next``) of the first epoch and of later epochs. On a loaded machine the CPU seconds
show the work an epoch costs where the wall time shows how long it waited for a core. Measured
in the same run: ``one_copy_s``, the epoch's bytes over this machine's memcpy bandwidth (best of
5 ``numpy.copyto`` of 256 MiB), and ``loop_s``, the loop over the same batches already in
memory. The issue's bar is ``steady <= 1.5 x (one_copy_s + loop_s)``. The machine is shared:
compare ratios within one file, next to its load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import torch
import torch.utils.data as tud

import solar
from solar.fileio import write_text_atomic
from solar.synthetic import write_ptycho_h5

CONTENDERS = ("solar-w0", "solar-w2", "torch-w0")


def _compete_run():
    """bench/compete/run.py as a module: the one-copy limit is measured as it measures it."""
    here = os.path.dirname(os.path.abspath(__file__))
    compete = os.path.join(here, "..", "compete")
    sys.path.insert(0, compete)  # (its own imports: contenders.py)
    spec = importlib.util.spec_from_file_location("compete_run", os.path.join(compete, "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class PerSample(tud.Dataset):
    """The usual HDF5 dataset: opened lazily per process, one h5py read per field and sample."""

    def __init__(self, path: str) -> None:
        self.path, self._f, self._pid = path, None, None
        with h5py.File(path, "r") as f:
            self.n = f["x"].shape[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self._pid != os.getpid():
            self._f, self._pid = h5py.File(self.path, "r"), os.getpid()
        return torch.from_numpy(self._f["x"][i]), torch.from_numpy(self._f["y"][i])

    def __getstate__(self):
        return {**self.__dict__, "_f": None, "_pid": None}


def make_loader(name: str, path: str, batch: int, buffer: str):
    if name.startswith("solar"):
        ds = solar.H5Dataset(path, ("x", "y"))
        return solar.DataLoader(ds, batch_size=batch, shuffle=True, distributed=True, buffer=buffer,
                                num_workers=int(name[-1]))
    return tud.DataLoader(PerSample(path), batch_size=batch, shuffle=True, num_workers=int(name[-1]),
                          generator=torch.Generator().manual_seed(0))


def run_one(name: str, path: str, epochs: int, batch: int, buffer: str) -> dict:
    """One contender's epochs in this process: seconds per epoch and to each epoch's first batch."""
    t0 = time.perf_counter()
    loader = make_loader(name, path, batch, buffer)
    build = time.perf_counter() - t0
    times, firsts, cpus = [], [], []
    for e in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        c0 = time.process_time()
        t0 = time.perf_counter()
        it = iter(loader)
        x, y = next(it)
        firsts.append(time.perf_counter() - t0)
        n = len(x)
        float(x.sum()) + float(y.sum())
        for x, y in it:
            float(x.sum()) + float(y.sum())
            n += len(x)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)  # (this process's threads; workers' CPU is not counted)
        assert n == len(loader.dataset), (name, e, n)
    return {"epochs_s": times, "first_batch_s": firsts, "cpu_s": cpus, "build_s": build}


def loop_floor(samples: int, size: int, batch: int) -> float:
    batches = [(torch.rand(min(batch, samples - a), 1, size, size), torch.rand(min(batch, samples - a), 2, size, size))
               for a in range(0, samples, batch)]
    t0 = time.perf_counter()
    for x, y in batches:
        float(x.sum()) + float(y.sum())
    return time.perf_counter() - t0


def summarize(runs: dict, limit: float) -> dict:
    out = {}
    for name, got in runs.items():
        steady = float(np.mean([np.mean(g["epochs_s"][1:]) for g in got]))
        cpu = float(np.mean([np.mean(g["cpu_s"][1:]) for g in got]))
        out[name] = {"runs": got, "steady_s": steady, "steady_cpu_s": cpu,
                     "first_epoch_s": float(np.mean([g["epochs_s"][0] for g in got])),
                     "first_batch_epoch0_s": float(np.median([g["first_batch_s"][0] for g in got])),
                     "first_batch_later_s": float(np.median([t for g in got for t in g["first_batch_s"][1:]])),
                     "vs_limit": steady / limit, "cpu_vs_limit": cpu / limit}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    options = {"data": "/tmp/solar-compete/ptycho.h5", "samples": 2048, "size": 128, "batch": 32,
               "buffer": "192MiB", "epochs": 4, "rounds": 3, "contenders": ",".join(CONTENDERS), "out": None}
    for name, default in options.items():  # (bench/compete's data and loop; --samples/--size: a new file)
        ap.add_argument(f"--{name}", default=default, type=type(default) if isinstance(default, int) else None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a steady one-thread consumer, as bench/compete
    if args.one:
        print(json.dumps(run_one(args.one, args.data, args.epochs, args.batch, args.buffer)))
        return
    if not os.path.exists(args.data):
        os.makedirs(os.path.dirname(args.data), exist_ok=True)
        write_ptycho_h5(args.data, args.samples, size=args.size, progress=False)
    with h5py.File(args.data, "r") as f:
        samples, size = f["x"].shape[0], f["x"].shape[-1]
    load_start = os.getloadavg()
    bw = _compete_run().memcpy_bandwidth()
    floor = loop_floor(samples, size, args.batch)
    names = [n for n in args.contenders.split(",") if n]
    runs: dict[str, list] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--data", args.data, "--epochs",
                   str(args.epochs), "--batch", str(args.batch), "--buffer", args.buffer]
            got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            runs[name].append(got)
            print(f"round {r} {name:9s} epochs " + " ".join(f"{t:.3f}" for t in got["epochs_s"])
                  + "  first batch " + " ".join(f"{t:.4f}" for t in got["first_batch_s"]), flush=True)
    epoch_bytes = samples * 3 * size * size * 4
    one_copy = epoch_bytes / bw
    limit = one_copy + floor
    results = summarize(runs, limit)
    print(f"\nmemcpy {bw / 1e9:.2f} GB/s; one-copy limit {one_copy:.3f} s + loop {floor:.3f} s = {limit:.3f} s")
    print(f"{'':10s}{'steady s':>9s}{'/ limit':>8s}{'cpu s':>7s}{'/ limit':>8s}{'1st epoch':>10s}{'1st batch e0':>13s}"
          f"{'1st batch e>0':>14s}")
    for name, r in results.items():
        print(f"{name:10s}{r['steady_s']:9.3f}{r['vs_limit']:8.2f}{r['steady_cpu_s']:7.3f}{r['cpu_vs_limit']:8.2f}"
              f"{r['first_epoch_s']:10.3f}"
              f"{r['first_batch_epoch0_s']:13.4f}{r['first_batch_later_s']:14.4f}")
    ratios = {}
    if "solar-w0" in results and "solar-w2" in results:
        ratios["solar_w2_over_w0"] = results["solar-w2"]["steady_s"] / results["solar-w0"]["steady_s"]
    if "solar-w0" in results and "torch-w0" in results:
        ratios["solar_first_batch_over_torch_epoch0"] = (results["solar-w0"]["first_batch_epoch0_s"]
                                                         / results["torch-w0"]["first_batch_epoch0_s"])
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    load = os.getloadavg()
    print(f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    config = {**vars(args), "samples": samples, "size": size, "epoch_bytes": epoch_bytes, "memcpy_Bps": bw,
              "one_copy_s": one_copy, "loop_s": floor, "limit_s": limit, "loadavg_start": load_start,
              "loadavg_end": load, "cpus": os.cpu_count(), "torch": torch.__version__}
    if args.out:
        write_text_atomic(args.out, json.dumps({"config": config, "results": results, "ratios": ratios}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
