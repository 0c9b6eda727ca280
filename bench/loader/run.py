"""Loader benchmark: ``solar.DataLoader`` vs ``torch.utils.data.DataLoader`` on the same HDF5 file.

Run: ``.venv/bin/python bench/loader/run.py [--samples 2048] [--size 64] [--epochs 3] [--buffer 0.5]
[--bandwidth 200e6] [--latency 1e-3] [--out bench/loader/results.json]``

The baseline is what training scripts do today: a map-style dataset that reads one sample per
``__getitem__`` (one h5py read per field), the file opened lazily in each of ``num_workers=2``
worker processes, ``shuffle`` by ``DistributedSampler`` (world size 1, the same global order
SOLAR uses). SOLAR reads the same file through :class:`solar.H5Dataset` with its buffer
(``--buffer`` of the dataset), the schedule, coalesced and sieved range reads and prefetch.

Two storages: the local disk (the file sits in the page cache: memory speed), and the same file
behind ``io_backends/throttled.py`` (``ThrottledBackend``; a small local fallback is used if that
module is missing), modelling one rank's share of a parallel file system: ``--bandwidth`` bytes/s
for the rank and ``--latency`` s per request. The rank's bandwidth is split evenly among its
concurrent readers (torch: its 2 worker processes; SOLAR: its ``io_threads`` request threads),
each paying the full latency per request, so neither side gets more than the rank's share.

Both loaders run in this one process, one after the other per storage, for ``--epochs`` epochs;
the steady-state epoch time is the mean over epochs >= 2 (the first epoch fills SOLAR's buffer).
The machine is shared, so compare ratios, not absolute times. Prints a table and writes JSON.

Under ``mpirun -n P`` every rank runs both loaders on its DistributedSampler share (SOLAR through
parallel HDF5 with collective reads and its schedule); epoch times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.utils.data as tud

import solar
from solar.cli.plan import write_text_atomic
from solar.dist import mpi_comm
from solar.io_backends import Backend, open_backend
from solar.io_backends.hdf5 import HDF5Backend
from solar.synthetic import write_ptycho_h5
from solar.testing.baselines import PerSampleH5


def throttled(inner: Backend, bandwidth: float | None, latency: float) -> Backend:
    try:
        from solar.io_backends.throttled import ThrottledBackend
    except ImportError:  # pragma: no cover - the backends issue ships it
        ThrottledBackend = _LocalThrottle
    return ThrottledBackend(inner, bandwidth=bandwidth, latency=latency)


class _LocalThrottle(Backend):
    """Fallback throttle (same model as io_backends/throttled.py): calls*latency + bytes/bandwidth."""

    name = "bench-throttle"

    def __init__(self, inner: Backend, bandwidth: float | None, latency: float) -> None:
        super().__init__(inner.url)
        self.inner, self.bandwidth, self.latency = inner, bandwidth, latency

    def _open(self):
        self.inner.ensure_open()

    def _close(self):
        self.inner.close()

    def keys(self):
        return self.inner.keys()

    def info(self, key):
        return self.inner.info(key)

    def attrs(self, key="/"):
        return self.inner.attrs(key)

    def _read_ranges(self, key, ranges, out):
        c0, b0, t0 = self.inner.stats.read_calls, self.inner.stats.bytes_read, time.perf_counter()
        self.inner.read_ranges(key, ranges, out=out)
        calls = self.inner.stats.read_calls - c0
        need = calls * self.latency + (self.inner.stats.bytes_read - b0) / (self.bandwidth or float("inf"))
        time.sleep(max(0.0, need - (time.perf_counter() - t0)))
        self.stats.read_calls += calls


def run_epochs(loader, epochs: int, comm=None) -> list[float]:
    """Seconds per epoch; under MPI the slowest rank's (a step waits for every rank)."""
    times = []
    for e in range(epochs):
        loader.sampler.set_epoch(e)
        t0 = time.perf_counter()
        n = 0
        for x, _y in loader:
            n += len(x)
        dt = time.perf_counter() - t0
        if comm is not None:
            from mpi4py import MPI

            dt = comm.allreduce(dt, op=MPI.MAX)
        times.append(dt)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--size", type=int, default=64, help="field edge (x: 1xSxS, y: 2xSxS float32)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--buffer", type=float, default=0.5, help="SOLAR buffer as a fraction of the dataset")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="the rank's bytes/s on throttled storage")
    ap.add_argument("--latency", type=float, default=1e-3, help="seconds per request on throttled storage")
    ap.add_argument("--workers", type=int, default=2, help="torch baseline num_workers")
    ap.add_argument("--io-threads", type=int, default=4, help="SOLAR's concurrent requests (H5Dataset io_threads)")
    ap.add_argument("--sieve", type=float, default=None,
                    help="SOLAR sieve_bytes (default: latency x per-reader bandwidth on throttled storage, 64 KiB local)")
    ap.add_argument("--storage", nargs="+", default=["local", "throttled"], choices=["local", "throttled"])
    ap.add_argument("--data", default="out/bench/loader.h5")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    comm = mpi_comm()
    P, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    say = print if rank == 0 else (lambda *a, **k: None)

    if not os.path.exists(args.data):
        if rank == 0:
            os.makedirs(os.path.dirname(args.data) or ".", exist_ok=True)
        if comm is not None:
            comm.Barrier()
        write_ptycho_h5(args.data, args.samples, args.size, seed=0, comm=comm, progress=rank == 0)
    ds_probe = solar.H5Dataset(args.data, backend="hdf5")
    n, sample_bytes = len(ds_probe), int(ds_probe.sample_nbytes()[0])
    say(f"{P} rank(s); dataset {args.data}: {n} samples x {sample_bytes / 1024:.0f} KiB = {n * sample_bytes / 2**20:.0f} MiB; "
          f"SOLAR buffer {args.buffer:.0%} of it; batch {args.batch_size}; {args.epochs} epochs; shared 2-core machine")
    results = {"config": vars(args), "machine": platform.platform(), "samples": n, "sample_bytes": sample_bytes,
               "world_size": P, "runs": {}}
    for storage in args.storage:
        def backend(readers: int, solar_side: bool = False) -> Backend:
            # under mpirun SOLAR reads through parallel HDF5 (collective, one reader per rank)
            inner = open_backend(args.data, "auto") if solar_side else HDF5Backend(args.data)
            if storage == "local":
                return inner
            return throttled(inner, args.bandwidth / readers, args.latency)

        base_ds = PerSampleH5(backend(args.workers))
        base = tud.DataLoader(base_ds, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True,
                              sampler=tud.DistributedSampler(base_ds, num_replicas=P, rank=rank, seed=0))
        t_torch = run_epochs(base, args.epochs, comm)
        base._iterator = None  # stop the persistent workers before SOLAR runs

        sieve = args.sieve if args.sieve is not None else (
            64 << 10 if storage == "local" else args.latency * args.bandwidth / args.io_threads)
        readers = 1 if P > 1 else args.io_threads  # collective parallel HDF5 does not use request threads
        ds = solar.H5Dataset(args.data, backend=backend(readers, solar_side=True), io_threads=args.io_threads,
                             sieve_bytes=int(sieve))
        loader = solar.DataLoader(ds, batch_size=args.batch_size, buffer=args.buffer,
                                  sampler=tud.DistributedSampler(ds, num_replicas=P, rank=rank, seed=0))
        t_solar = run_epochs(loader, args.epochs, comm)
        st = ds.stats
        hits, misses, s_calls, s_bytes, t_calls, t_bytes = (
            comm.allreduce(v) if comm is not None else v
            for v in (st.hits, st.misses, st.read_calls, st.bytes_in, base_ds.calls, base_ds.bytes))
        ds.close()
        steady = lambda ts: float(np.mean(ts[1:])) if len(ts) > 1 else ts[0]  # noqa: E731
        run = {
            "torch_epoch_s": t_torch, "solar_epoch_s": t_solar,
            "torch_steady_s": steady(t_torch), "solar_steady_s": steady(t_solar),
            "speedup_steady": steady(t_torch) / steady(t_solar), "speedup_total": sum(t_torch) / sum(t_solar),
            "solar_hit_rate_after_fill": hits / max(1, hits + misses - n),
            "hit_rate_bound": min(1.0, args.buffer),
            "solar_read_calls": s_calls, "solar_bytes_read": s_bytes,
            "torch_read_calls": t_calls, "torch_bytes_read": t_bytes,
        }
        results["runs"][storage] = run
        say(f"\n[{storage}]" + ("" if storage == "local" else
              f" {args.bandwidth / 1e6:.0f} MB/s per rank, {args.latency * 1e3:.1f} ms per request"))
        say(f"  {'epoch':>5} {'torch s':>9} {'solar s':>9} {'ratio':>7}")
        for e, (a, b) in enumerate(zip(t_torch, t_solar)):
            say(f"  {e:>5} {a:>9.3f} {b:>9.3f} {a / b:>6.2f}x")
        say(f"  steady-state speedup (epochs >= 2): {run['speedup_steady']:.2f}x   whole run: {run['speedup_total']:.2f}x")
        say(f"  storage calls: torch {run['torch_read_calls']}, solar {run['solar_read_calls']}; "
              f"bytes: torch {run['torch_bytes_read'] / 2**20:.0f} MiB, solar {run['solar_bytes_read'] / 2**20:.0f} MiB; "
              f"SOLAR hit rate after the fill epoch {run['solar_hit_rate_after_fill']:.3f} (bound {run['hit_rate_bound']:.3f})")
    if "throttled" in results["runs"]:
        r = results["runs"]["throttled"]["speedup_steady"]
        results["target"] = {"what": "steady-state speedup on throttled storage at buffer 50%", "target": 2.0,
                             "measured": r, "met": bool(r >= 2.0 and abs(args.buffer - 0.5) < 1e-9)}
        say(f"\ntarget >= 2x on throttled storage at buffer 50%: measured {r:.2f}x -> "
              f"{'MET' if results['target']['met'] else 'NOT MET'}")
    if rank == 0:
        write_text_atomic(args.out, json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
