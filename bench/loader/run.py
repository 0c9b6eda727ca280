"""Loader benchmark: ``solar.DataLoader`` vs ``torch.utils.data.DataLoader`` on the same HDF5 file.

Run: ``.venv/bin/python bench/loader/run.py [--samples 2048] [--size 64] [--epochs 3] [--buffer 0.5]
[--bandwidth 200e6] [--latency 1e-3] [--rel-error 1e-3 | --abs-error E | --uncompressed-only]
[--out bench/loader/results.json]``

The baseline is what training scripts do today: a map-style dataset that reads one sample per
``__getitem__`` (one h5py read per field), the file opened lazily in each of ``num_workers=2``
worker processes, ``shuffle`` by ``DistributedSampler`` (world size 1, the same global order
SOLAR uses). SOLAR reads the same file through :class:`solar.H5Dataset` with its buffer
(``--buffer`` of the dataset), the schedule, coalesced and sieved range reads and prefetch.

Two storages: the local disk (the file sits in the page cache: memory speed), and the same file
behind ``io_backends/throttled.py`` (``ThrottledBackend``), modelling one rank's share of a parallel
file system: ``--bandwidth`` bytes/s for the rank and ``--latency`` s per request. The rank's
bandwidth is split evenly among its concurrent readers (torch: its 2 worker processes; SOLAR: its
``io_threads`` request threads), each paying the full latency per request, so neither side gets more
than the rank's share.

Both loaders run in this one process, one after the other per storage, for ``--epochs`` epochs;
the steady-state epoch time is the mean over epochs >= 2 (the first epoch fills SOLAR's buffer).
The machine is shared, so compare ratios, not absolute times. Prints a table and writes JSON.

Compressed mode (``--rel-error R``, default 1e-3, or ``--abs-error E``): the same file is first compressed with
``solar ingest`` (its Python API; cached next to ``--data``), and a third loader joins the
comparison: ``solar.DataLoader`` on the compressed file with the *same buffer byte budget* as on the
uncompressed one (``--buffer`` of the uncompressed dataset's bytes). The buffer keeps compressed
blobs, so it holds about ratio-times more samples (hit-rate bound ``min(1, budget * ratio / bytes)``),
and each mini-batch is decoded at once with ``solar.codec.decode_batch`` (``--device``). The bench
checks every decoded sample of one more (untimed) epoch against the original within the bound and
reports the decode time share. ``--solar-workers`` sets SOLAR's ``num_workers`` (decode runs there).
A fourth loader (``--no-decode-compile`` skips it) is the same compressed run decoding with the
``torch.compile``-d decoder graph (``H5Dataset(decode_compile=True)``); its first epoch includes
the one-time compile, the steady state does not. A fifth (``--no-copies-ab`` skips it) is the
compressed run without decoded copies (``SOLAR_DECODED_COPIES=0``: NOTE [ Decoded copies ] in
solar/decoded.py); the compressed runs report the buffer's decoded copies beside its blobs.

Under ``mpirun -n P`` every rank runs both loaders on its DistributedSampler share (SOLAR through
parallel HDF5 with collective reads and its schedule); epoch times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time

import h5py
import numpy as np
import torch
import torch.utils.data as tud

import solar
from solar.fileio import write_text_atomic
from solar.decoded import usage
from solar.dist import mpi_comm
from solar.io_backends import Backend, open_backend
from solar.io_backends.hdf5 import HDF5Backend
from solar.io_backends.throttled import ThrottledBackend
from solar.synthetic import write_ptycho_h5
from solar.testing.baselines import PerSampleH5


def throttled(inner: Backend, bandwidth: float | None, latency: float) -> Backend:
    """``inner`` behind the throttle model of io_backends/throttled.py (NOTE [ Throttle model ])."""
    return ThrottledBackend(inner, bandwidth=bandwidth, latency=latency)


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


def allsum(v, comm=None):
    """``v`` summed over the ranks of ``comm`` (no MPI: ``v``)."""
    return comm.allreduce(v) if comm is not None else v


def steady(times: list[float]) -> float:
    """Steady-state epoch seconds: the mean over epochs >= 2 (the first fills SOLAR's buffer)."""
    return float(np.mean(times[1:])) if len(times) > 1 else times[0]


def report(title: str, rows: dict[str, dict], ratios: dict[str, float], config: dict, out: str) -> None:
    """Print a side-by-side table of ``rows`` (steady seconds, hit rate against its bound,
    storage calls and bytes) and the ``ratios``, and write them with ``config`` as JSON to ``out``
    (bench/loader/spill.py and split.py)."""
    print(title)
    print(f"{'':10s}{'steady s':>10s}{'hit rate':>10s}{'bound':>8s}{'calls':>8s}{'MiB read':>10s}")
    for side, r in rows.items():
        hr = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        bd = f"{r['bound']:.2f}" if "bound" in r else "-"
        print(f"{side:10s}{r['steady_s']:10.3f}{hr:>10s}{bd:>8s}{r['calls']:8d}{r['bytes'] / 2**20:10.1f}")
    print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_text_atomic(out, json.dumps({"config": config, "results": rows, "ratios": ratios}, indent=1))
    print(f"wrote {out}")


class TimedH5Dataset(solar.H5Dataset):
    """``H5Dataset`` that adds the seconds spent in per-batch :meth:`decode` to a counter shared
    with DataLoader workers (decode runs where the batch is assembled: a worker). Without workers
    the bench reads ``ds.stats.decode_s`` of a plain ``H5Dataset`` instead: an override of
    ``decode`` would turn off decoding straight into a batch's rows (``H5Dataset.decodes_into``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._decode_s = multiprocessing.Value("d", 0.0)

    @property
    def decode_s(self) -> float:
        return self._decode_s.value

    def decode(self, stored):
        t0 = time.perf_counter()
        out = super().decode(stored)
        dt = time.perf_counter() - t0
        with self._decode_s.get_lock():
            self._decode_s.value += dt
        return out


def compressed_copy(data: str, abs_error: float | None, rel_error: float | None, comm, rank: int) -> str:
    """``data`` compressed by ``solar ingest`` (cached beside it while newer than ``data``)."""
    from solar.ingest import ingest

    tag = f"rel{rel_error:g}" if rel_error is not None else f"abs{abs_error:g}"
    path = f"{os.path.splitext(data)[0]}-{tag}.h5"
    if not (os.path.exists(path) and os.path.getmtime(path) >= os.path.getmtime(data)):
        ingest([data], path, abs_error=abs_error, rel_error=rel_error, overwrite=True, comm=comm,
               progress=rank == 0)
    return path


def max_abs_errors(loader, fields, originals: dict[str, np.ndarray], epoch: int, comm, rank: int) -> dict[str, float]:
    """Run one more (untimed) epoch and return each field's max |decoded - original| over all
    ranks' samples; the sample indices of each step come from the loader's schedule."""
    loader.sampler.set_epoch(epoch)
    errs = {f: 0.0 for f in fields}
    steps = None
    for k, batch in enumerate(loader):
        if steps is None:
            steps = loader.solar_sampler.current["plan"].rank_steps(rank)
        for f, t in zip(fields, batch):
            errs[f] = max(errs[f], float(np.abs(t.cpu().numpy().astype(np.float64) - originals[f][steps[k]]).max()))
    if comm is None:
        return errs
    from mpi4py import MPI

    return {f: comm.allreduce(v, op=MPI.MAX) for f, v in errs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--size", type=int, default=64, help="field edge (x: 1xSxS, y: 2xSxS float32)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--buffer", type=float, default=0.5,
                    help="SOLAR buffer byte budget as a fraction of the uncompressed dataset's bytes")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="the rank's bytes/s on throttled storage")
    ap.add_argument("--latency", type=float, default=1e-3, help="seconds per request on throttled storage")
    ap.add_argument("--workers", type=int, default=2, help="torch baseline num_workers")
    ap.add_argument("--solar-workers", type=int, default=0,
                    help="SOLAR's num_workers (per-batch decode, transform and collate run there)")
    ap.add_argument("--io-threads", type=int, default=4, help="SOLAR's concurrent requests (H5Dataset io_threads)")
    ap.add_argument("--sieve", type=float, default=None,
                    help="SOLAR sieve_bytes (default: latency x per-reader bandwidth on throttled storage, "
                         "64 KiB local)")
    ap.add_argument("--storage", nargs="+", default=["local", "throttled"], choices=["local", "throttled"])
    bound = ap.add_mutually_exclusive_group()
    bound.add_argument("--rel-error", type=float, default=None,
                       help="also run SOLAR on a copy compressed by solar ingest with this relative bound")
    bound.add_argument("--abs-error", type=float, default=None, help="... or with this absolute bound")
    bound.add_argument("--uncompressed-only", action="store_true",
                       help="skip the compressed run (default: --rel-error 1e-3)")
    ap.add_argument("--device", default="cpu", help="where SOLAR decodes compressed batches")
    ap.add_argument("--decode-compile", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the compressed loader with the torch.compile-d decoder (H5Dataset decode_compile)")
    ap.add_argument("--copies-ab", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the compressed loader without decoded copies (SOLAR_DECODED_COPIES=0)")
    ap.add_argument("--data", default="out/bench/loader.h5")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
    args = ap.parse_args(argv)
    if args.rel_error is None and args.abs_error is None and not args.uncompressed_only:
        args.rel_error = 1e-3
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
    compress = args.rel_error is not None or args.abs_error is not None
    cdata = compressed_copy(args.data, args.abs_error, args.rel_error, comm, rank) if compress else None
    ds_probe = solar.H5Dataset(args.data, backend="hdf5")
    n, sample_bytes = len(ds_probe), int(ds_probe.sample_nbytes()[0])
    ds_probe.close()
    dataset_bytes = n * sample_bytes
    budget = int(args.buffer * dataset_bytes / P)  # the same byte budget per rank for every SOLAR run
    say(f"{P} rank(s); dataset {args.data}: {n} samples x {sample_bytes / 1024:.0f} KiB "
        f"= {dataset_bytes / 2**20:.0f} MiB; "
        f"SOLAR buffer {args.buffer:.0%} of it ({budget / 2**20:.0f} MiB per rank); batch {args.batch_size}; "
        f"{args.epochs} epochs; shared 2-core machine")
    results = {"config": vars(args), "machine": platform.platform(), "samples": n, "sample_bytes": sample_bytes,
               "world_size": P, "buffer_bytes_per_rank": budget, "runs": {}}
    if compress:
        cprobe = solar.H5Dataset(cdata, backend="hdf5")
        stored = int(cprobe.sample_nbytes().sum())
        bounds = {s.name: float(s.abs_error) for s in cprobe.specs if s.kind == "codec"}
        cprobe.close()
        ratio = dataset_bytes / stored
        results["compression"] = {"file": cdata, "stored_bytes": stored, "ratio": ratio, "abs_error_bound": bounds,
                                  "rel_error": args.rel_error, "hit_rate_bound": min(1.0, args.buffer * ratio)}
        say(f"compressed copy {cdata} (solar ingest): {stored / 2**20:.1f} MiB, ratio {ratio:.1f}x, "
            f"abs bounds {', '.join(f'{k} {v:.3g}' for k, v in bounds.items())}")
        with h5py.File(args.data, "r") as f:  # the originals the decoded samples are checked against
            originals = {name: f[name][...].astype(np.float64) for name in bounds}

    for storage in args.storage:
        def backend(path: str, readers: int, solar_side: bool = False) -> Backend:
            # under mpirun SOLAR reads through parallel HDF5 (collective, one reader per rank)
            # the torch side reads as a torch user's h5py does (under h5py's lock, NOTE [ Reads outside
            # h5py's lock ] in io_backends/hdf5.py); each worker process has its own lock
            inner = open_backend(path, "auto") if solar_side else HDF5Backend(path, direct_reads=False)
            if storage == "local":
                return inner
            return throttled(inner, args.bandwidth / readers, args.latency)

        base_ds = PerSampleH5(backend(args.data, args.workers))
        base = tud.DataLoader(base_ds, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True,
                              sampler=tud.DistributedSampler(base_ds, num_replicas=P, rank=rank, seed=0))
        t_torch = run_epochs(base, args.epochs, comm)
        base._iterator = None  # stop the persistent workers before SOLAR runs

        sieve = args.sieve if args.sieve is not None else (
            64 << 10 if storage == "local" else args.latency * args.bandwidth / args.io_threads)
        readers = 1 if P > 1 else args.io_threads  # collective parallel HDF5 does not use request threads

        def solar_run(path: str, check: bool = False, compile: bool = False, copies: bool = True) -> dict:
            os.environ["SOLAR_DECODED_COPIES"] = "1" if copies else "0"  # (read at each pass)
            cls = TimedH5Dataset if args.solar_workers else solar.H5Dataset
            ds = cls(path, backend=backend(path, readers, solar_side=True), io_threads=args.io_threads,
                     sieve_bytes=int(sieve), device=args.device, decode_compile=compile)
            loader = solar.DataLoader(ds, batch_size=args.batch_size, buffer=str(budget),
                                      num_workers=args.solar_workers, persistent_workers=args.solar_workers > 0,
                                      sampler=tud.DistributedSampler(ds, num_replicas=P, rank=rank, seed=0))
            times = run_epochs(loader, args.epochs, comm)
            st, sampler = ds.stats, loader.solar_sampler
            used = usage(sampler.buffer)
            hits, misses, calls, nbytes, resident, decode_s = (allsum(v, comm) for v in (
                st.hits, st.misses, st.read_calls, st.bytes_in, len(sampler.buffer) // len(ds.fields),
                ds.decode_s if args.solar_workers else st.decode_s))
            out = {"epoch_s": times, "steady_s": steady(times), "hits": hits, "misses": misses,
                   "hit_rate_after_fill": hits / max(1, hits + misses - n), "read_calls": calls, "bytes_read": nbytes,
                   "capacity_samples": sampler.plan_config().capacity, "resident_samples": resident,
                   "plan_bound": sampler.plan_config().bound,
                   "buffer_bytes_used": allsum(sampler.buffer.nbytes, comm),
                   "decoded_copies": {"bytes": allsum(used.decoded_bytes, comm),
                                      "samples": allsum(used.decoded_samples, comm),
                                      "rows": allsum(used.decoded_rows, comm),
                                      "hits": allsum(used.decoded_hits, comm)},
                   "decode_s": decode_s / P,  # per rank, summed over its decoding processes
                   "decode_share": decode_s / P / max(1, args.solar_workers) / sum(times)}
            if check:
                out["max_abs_error"] = max_abs_errors(loader, ds.fields, originals, args.epochs, comm, rank)
            loader._iterator = None
            ds.close()
            return out

        raw = solar_run(args.data)
        t_solar = raw["epoch_s"]
        run = {
            "torch_epoch_s": t_torch, "solar_epoch_s": t_solar,
            "torch_steady_s": steady(t_torch), "solar_steady_s": raw["steady_s"],
            "speedup_steady": steady(t_torch) / raw["steady_s"], "speedup_total": sum(t_torch) / sum(t_solar),
            "solar_hit_rate_after_fill": raw["hit_rate_after_fill"],
            "hit_rate_bound": min(1.0, args.buffer),
            "solar_read_calls": raw["read_calls"], "solar_bytes_read": raw["bytes_read"],
            "torch_read_calls": base_ds.calls if comm is None else comm.allreduce(base_ds.calls),
            "torch_bytes_read": base_ds.bytes if comm is None else comm.allreduce(base_ds.bytes),
            "solar_resident_samples": raw["resident_samples"],
        }
        if compress:
            c = solar_run(cdata, check=True)
            c.update(speedup_steady_vs_torch=steady(t_torch) / c["steady_s"],
                     speedup_total_vs_torch=sum(t_torch) / sum(c["epoch_s"]),
                     speedup_steady_vs_solar_raw=raw["steady_s"] / c["steady_s"],
                     hit_rate_bound=results["compression"]["hit_rate_bound"],
                     within_bound=all(c["max_abs_error"][f] <= b
                                      for f, b in results["compression"]["abs_error_bound"].items()))
            run["compressed"] = c
            if args.copies_ab:
                nc = solar_run(cdata, copies=False)
                nc.update(speedup_steady_vs_torch=steady(t_torch) / nc["steady_s"],
                          speedup_steady_vs_solar_raw=raw["steady_s"] / nc["steady_s"],
                          copies_speedup=nc["steady_s"] / c["steady_s"])
                run["compressed_no_copies"] = nc
            if args.decode_compile:
                cc = solar_run(cdata, check=True, compile=True)
                cc.update(speedup_steady_vs_torch=steady(t_torch) / cc["steady_s"],
                          speedup_total_vs_torch=sum(t_torch) / sum(cc["epoch_s"]),
                          speedup_steady_vs_solar_raw=raw["steady_s"] / cc["steady_s"],
                          speedup_steady_vs_eager_decode=c["steady_s"] / cc["steady_s"],
                          within_bound=all(cc["max_abs_error"][f] <= b
                                           for f, b in results["compression"]["abs_error_bound"].items()))
                run["compressed_compiled"] = cc
        results["runs"][storage] = run
        say(f"\n[{storage}]" + ("" if storage == "local" else
            f" {args.bandwidth / 1e6:.0f} MB/s per rank, {args.latency * 1e3:.1f} ms per request"))
        cols = [("torch", t_torch), ("solar", t_solar)]
        cols += [("solar+codec", run["compressed"]["epoch_s"])] if compress else []
        if "compressed_no_copies" in run:
            cols.append(("codec-nocopy", run["compressed_no_copies"]["epoch_s"]))
        if "compressed_compiled" in run:
            cols.append(("+compiled", run["compressed_compiled"]["epoch_s"]))
        say("  epoch " + "".join(f"{name + ' s':>13}" for name, _ in cols) + "".join(
            f"{'torch/' + name:>18}" for name, _ in cols[1:]))
        for e in range(args.epochs):
            say(f"  {e:>5} " + "".join(f"{ts[e]:>13.3f}" for _, ts in cols) + "".join(
                f"{t_torch[e] / ts[e]:>17.2f}x" for _, ts in cols[1:]))
        say(f"  steady-state speedup (epochs >= 2): {run['speedup_steady']:.2f}x   "
            f"whole run: {run['speedup_total']:.2f}x")
        say(f"  storage calls: torch {run['torch_read_calls']}, solar {run['solar_read_calls']}; "
            f"bytes: torch {run['torch_bytes_read'] / 2**20:.0f} MiB, solar {run['solar_bytes_read'] / 2**20:.0f} MiB; "
            f"SOLAR hit rate after the fill epoch {run['solar_hit_rate_after_fill']:.3f} "
            f"(bound {run['hit_rate_bound']:.3f})")
        if compress:
            c = run["compressed"]
            say(f"  solar+codec: steady {c['speedup_steady_vs_torch']:.2f}x torch, "
                f"{c['speedup_steady_vs_solar_raw']:.2f}x solar (uncompressed); "
                f"whole run {c['speedup_total_vs_torch']:.2f}x torch; storage calls {c['read_calls']}, "
                f"bytes {c['bytes_read'] / 2**20:.1f} MiB; resident samples {c['resident_samples']} (uncompressed "
                f"{raw['resident_samples']}); hit rate after fill {c['hit_rate_after_fill']:.3f} (bound "
                f"{c['hit_rate_bound']:.3f}); decode {c['decode_s']:.2f} s = {c['decode_share']:.0%} of the epochs; "
                f"max abs error " + ", ".join(f"{f} {v:.3g}" for f, v in c["max_abs_error"].items())
                + f" ({'within' if c['within_bound'] else 'EXCEEDS'} the bound)")
            dc = c["decoded_copies"]
            say(f"  decoded copies: {dc['rows']} rows of {dc['samples']} samples, {dc['bytes'] / 2**20:.1f} MiB beside "
                f"{c['buffer_bytes_used'] / 2**20:.1f} MiB of blobs (budget {budget / 2**20:.0f} MiB); "
                f"{dc['hits']} rows served from them")
            if "compressed_no_copies" in run:
                nc = run["compressed_no_copies"]
                say(f"  solar+codec without decoded copies: steady {nc['speedup_steady_vs_torch']:.2f}x torch, "
                    f"{nc['speedup_steady_vs_solar_raw']:.2f}x solar (uncompressed); copies make the steady "
                    f"epoch {nc['copies_speedup']:.2f}x faster")
            if "compressed_compiled" in run:
                cc = run["compressed_compiled"]
                say(f"  solar+codec, compiled decoder (decode_compile=True; epoch 0 includes the compile): steady "
                    f"{cc['speedup_steady_vs_torch']:.2f}x torch, {cc['speedup_steady_vs_solar_raw']:.2f}x solar "
                    f"(uncompressed), {cc['speedup_steady_vs_eager_decode']:.2f}x the eager decoder; decode "
                    f"{cc['decode_s']:.2f} s = {cc['decode_share']:.0%} of the epochs; "
                    f"{'within' if cc['within_bound'] else 'EXCEEDS'} the bound")
    if "throttled" in results["runs"]:
        r = results["runs"]["throttled"]["speedup_steady"]
        applies = abs(args.buffer - 0.5) < 1e-9
        results["target"] = {"what": "steady-state speedup on throttled storage at buffer 50%", "target": 2.0,
                             "measured": r, "applies": applies, "met": bool(r >= 2.0 and applies)}
        verdict = (("MET" if r >= 2.0 else "NOT MET") if applies
                   else f"not checked (this run's buffer is {args.buffer:.0%})")
        say(f"\ntarget >= 2x on throttled storage at buffer 50%: measured {r:.2f}x -> {verdict}")
        if compress:
            c = results["runs"]["throttled"]["compressed"]
            results["target_compressed"] = {
                "what": "steady-state speedup of solar.DataLoader on the compressed file over torch on the "
                        "uncompressed file, throttled storage, same buffer bytes (50% of the uncompressed data)",
                "measured": c["speedup_steady_vs_torch"], "uncompressed_solar": r,
                "factor_over_uncompressed": c["speedup_steady_vs_torch"] / r}
            say(f"compressed: {c['speedup_steady_vs_torch']:.2f}x torch vs {r:.2f}x uncompressed: compression "
                f"multiplies SOLAR's speedup by {c['speedup_steady_vs_torch'] / r:.2f}")
    if rank == 0:
        write_text_atomic(args.out, json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
