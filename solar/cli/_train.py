"""The training half of ``solar demo``: one small CNN surrogate trained with two loaders, compared."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.data as tud
from tqdm import tqdm

import solar
from solar.io_backends.hdf5 import HDF5Backend
from solar.io_backends.throttled import ThrottledBackend
from solar.testing.baselines import PerSampleH5


class Surrogate(nn.Module):
    """A PtychoNN-like encoder-decoder: diffraction (1xHxW) -> amplitude and phase (2xHxW)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.Upsample(scale_factor=2), nn.Conv2d(width, 2, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass
class Run:
    name: str
    epoch_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    samples: int = 0
    calls: int = 0
    nbytes: int = 0
    hit_rate: float | None = None


def _storage(path: str, args: argparse.Namespace, readers: int):
    inner = HDF5Backend(path)
    if not args.bandwidth:
        return inner
    return ThrottledBackend(inner, bandwidth=args.bandwidth / readers, latency=args.latency)


def train(name: str, loader, args: argparse.Namespace, n: int) -> Run:
    torch.manual_seed(args.seed)
    model = Surrogate()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = Run(name)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        t0, total, count = time.perf_counter(), 0.0, 0
        for x, y in tqdm(loader, desc=f"{name} epoch {epoch}", unit="batch", leave=False, disable=args.no_progress):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(x)
            count += len(x)
        run.epoch_s.append(time.perf_counter() - t0)
        run.loss.append(total / max(1, count))
        run.samples = count
    return run


def compare(path: str, args: argparse.Namespace) -> None:
    """Train with torch's and SOLAR's loaders on ``path`` and print the side-by-side table."""
    torch.set_num_threads(1)
    if args.batch_size > args.samples:
        print(f"batch size {args.batch_size} > {args.samples} samples: using {args.samples}")
        args.batch_size = args.samples
    base_ds = PerSampleH5(_storage(path, args, max(1, args.workers)))
    n = len(base_ds)
    base = tud.DataLoader(base_ds, batch_size=args.batch_size, num_workers=args.workers,
                          persistent_workers=args.workers > 0,
                          sampler=tud.DistributedSampler(base_ds, num_replicas=1, rank=0, seed=args.seed))
    runs = [train("torch", base, args, n)]
    runs[0].calls, runs[0].nbytes = base_ds.calls, base_ds.bytes
    base._iterator = None
    threads = 4
    ds = solar.H5Dataset(path, backend=_storage(path, args, threads), io_threads=threads,
                         sieve_bytes=int(args.latency * args.bandwidth / threads) if args.bandwidth else 64 << 10)
    loader = solar.DataLoader(ds, batch_size=args.batch_size, buffer=args.buffer,
                              sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=args.seed))
    runs.append(train("solar", loader, args, n))
    st = ds.stats
    runs[1].calls, runs[1].nbytes = st.read_calls, st.bytes_in
    later = st.hits + st.misses - n  # accesses after the fill epoch
    runs[1].hit_rate = st.hits / later if later > 0 else 0.0
    print_table(runs, args, n)


def print_table(runs: list[Run], args: argparse.Namespace, n: int) -> None:
    storage = (f"throttled {args.bandwidth / 1e6:.0f} MB/s, {args.latency * 1e3:.1f} ms/request"
               if args.bandwidth else "local file")
    print(f"\ntrained {args.epochs} epochs x {n} samples, batch {args.batch_size}, storage: {storage}, "
          f"SOLAR buffer {args.buffer:.0%} (shared 2-core machine: compare ratios)")
    head = f"{'':<26}" + "".join(f"{r.name:>14}" for r in runs) + f"{'torch/solar':>14}"
    print(head)
    print("-" * len(head))

    def row(label, vals, fmt, ratio=True):
        cells = "".join(f"{fmt(v):>14}" for v in vals)
        extra = f"{vals[0] / vals[1]:>13.2f}x" if ratio and vals[1] else ""
        print(f"{label:<26}{cells}{extra}")

    for e in range(args.epochs):
        row(f"epoch {e} time (s)", [r.epoch_s[e] for r in runs], lambda v: f"{v:.2f}")
    steady = [sum(r.epoch_s[1:]) / max(1, len(r.epoch_s) - 1) if len(r.epoch_s) > 1 else r.epoch_s[0] for r in runs]
    row("steady epoch (s, e>=2)", steady, lambda v: f"{v:.2f}")
    row("samples/s (steady)", [n / s for s in steady], lambda v: f"{v:.0f}", ratio=False)
    row("storage MiB read", [r.nbytes / 2**20 for r in runs], lambda v: f"{v:.1f}")
    row("storage requests", [r.calls for r in runs], lambda v: f"{v}")
    row("final loss", [r.loss[-1] for r in runs], lambda v: f"{v:.4f}", ratio=False)
    bound = min(1.0, args.buffer)
    print(f"{'hit rate after fill':<26}{'-':>14}{runs[1].hit_rate:>14.3f}   bound min(1, PC/N) = {bound:.3f}")
    print(f"speedup of the steady epoch: {steady[0] / steady[1]:.2f}x")
