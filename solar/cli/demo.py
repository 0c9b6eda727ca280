"""``solar demo``: the whole product in a few minutes (``make demo``).

1. Data: a PtychoNN-like training set (``--samples`` of 1xSxS diffraction -> 2xSxS amplitude and
   phase) and a held-out validation set, written as .npy and ingested with ``mpirun -n 2 solar
   ingest x=X.npy y=Y.npy`` into a raw SOLAR file and one compressed file per ``--bounds``.
2. Training (``solar/cli/_demo_train.py``), each run a separate ``mpirun -n 2``, on storage throttled to
   a parallel-file-system share (``--bandwidth`` per rank, ``--latency`` per request): torch's
   DataLoader and SOLAR on the raw file, SOLAR on every compressed file, more seeds of the raw run.
3. Checkpoints: the raw SOLAR run saves a job-wide checkpoint (model, optimizer, loader) every
   ``--ckpt-every`` steps; the same run is killed mid-epoch (SIGKILL of a rank) and resumed from its
   last version, and its losses are compared with the uninterrupted run's; ``solar-ckpt log`` and
   ``diff`` of two versions.
4. The report: the loader table, the validation loss per bound against the raw run's seed-to-seed
   spread, and ``OUT/report.png`` (five panels; ``OUT/report.json`` beside it).

Without mpirun or MPI-enabled h5py every step runs in one process, and the demo says so.
"""

from __future__ import annotations

import argparse
import os
import time

from solar.cli import _demo_data as demo_data
from solar.cli import _demo_report as report
from solar.cli import _demo_runs as runs


def _at_least(lo: float, kind=int):
    """An argparse type: ``kind`` values >= ``lo``, else a one-line usage error (exit 2) while the
    arguments are parsed, before anything is written."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v >= lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo:g}, got {text}")
        return v
    return parse


def _fraction(text: str) -> float:
    v = _at_least(0.0, float)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"is a fraction of the dataset, 0..1, got {text}")
    return v


def _bound(text: str) -> float:
    v = _at_least(0.0, float)(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"is a relative error bound, between 0 and 1, got {text}")
    return v


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=_at_least(1), default=1024, help="training samples (default 1024)")
    parser.add_argument("--val-samples", type=_at_least(1), default=256,
                        help="held-out validation samples (default 256)")
    parser.add_argument("--size", type=_at_least(1), default=64, help="field edge length in pixels (default 64)")
    parser.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    parser.add_argument("--ranks", type=_at_least(1), default=2, help="MPI ranks of every step (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default 0)")
    parser.add_argument("--epochs", type=_at_least(0), default=3,
                        help="training epochs per run (default 3; 0 only builds the data)")
    parser.add_argument("--batch-size", type=_at_least(1), default=32, help="per-rank batch (default 32)")
    parser.add_argument("--buffer", type=_fraction, default=0.5,
                        help="SOLAR buffer, fraction of the dataset (default 0.5)")
    parser.add_argument("--bounds", type=_bound, nargs="+", default=[1e-2, 1e-3, 1e-4],
                        help="relative error bounds of the compressed copies (default 1e-2 1e-3 1e-4)")
    parser.add_argument("--seeds", type=_at_least(2), default=3,
                        help="seeds of the raw run, the yardstick of the validation loss (default 3)")
    parser.add_argument("--ckpt-every", type=_at_least(1), default=4, help="steps between checkpoints (default 4)")
    parser.add_argument("--bandwidth", type=_at_least(0.0, float), default=200e6,
                        help="storage bytes/s of one rank (default 200e6; 0: unthrottled)")
    parser.add_argument("--latency", type=_at_least(0.0, float), default=1e-3,
                        help="seconds per storage request (default 1e-3)")
    parser.add_argument("--workers", type=_at_least(0), default=1, help="num_workers of torch's loader (default 1)")
    parser.add_argument("--decoder", choices=["auto", "reference", "cpu-kernel"], default=None,
                        help="codec decoder of the compressed runs (SOLAR_CODEC_DECODER; default: the "
                        "environment's, else auto: the numba cpu-kernel, compiled once per code kind and cached)")
    parser.add_argument("--no-progress", action="store_true", help="accepted for compatibility: the steps print "
                        "one line each")


def _data(args: argparse.Namespace, launch: demo_data.Launcher) -> demo_data.DemoData | None:
    print(f"[1/4] data: {args.samples} training + {args.val_samples} validation PtychoNN-like samples "
          f"(x 1x{args.size}x{args.size}, y 2x{args.size}x{args.size}), `solar ingest x=X.npy y=Y.npy` with "
          f"{launch.why}")
    t0 = time.perf_counter()
    data = demo_data.build(launch, args.out, args.samples, args.val_samples, args.size, args.seed,
                           args.bounds)
    probe, ok = demo_data.check_raw(data.raw, args.size, args.seed)
    print(f"  read back samples {probe} of {data.raw}: {'match' if ok else 'MISMATCH'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return data if ok else None


def _resume(launch, data, plan, args, results) -> runs.ResumeCheck:
    print(f"[3/4] checkpoints: kill a rank mid-epoch, resume from the last version, compare ({launch.why})")
    ref = runs.configs(data, plan, args.out)["solar raw"]
    check = runs.kill_and_resume(launch, ref, args.samples, plan, args.out, results["solar raw"])
    same = "bit-identical" if check.max_diff == 0 else f"max |difference| {check.max_diff:.3g}"
    print(f"  resume check: resumed from version {check.resumed_from} (killed at step {check.killed_at}); its "
          f"{check.steps} later losses against the uninterrupted run's: {same}; validation loss "
          f"{'equal' if check.val_diff == 0 else f'differs by {check.val_diff:.3g}'}")
    runs.show_checkpoints(os.path.join(args.out, "ckpt", "uninterrupted"))
    return check


def _report(args, data, results, check, launch) -> None:
    print("[4/4] report")
    names = report.loader_names(results)
    rows = [report.loader_row(n, results[n]) for n in names]
    storage = (f"throttled to {args.bandwidth / 1e6:.0f} MB/s and {args.latency * 1e3:.1f} ms per request per rank"
               if args.bandwidth else "the local disk, unthrottled")
    spread, vrows = report.validation_rows(results, data.ratios)
    ckpt = results["solar raw"]["ckpt"]
    png = os.path.join(args.out, "report.png")
    titles = report.plot(png, results, ckpt, spread, vrows, {
        "loaders": [r._asdict() for r in rows], "launcher": launch.why,
        "resume": {k: v for k, v in check._asdict().items() if k != "resumed"}})
    report.print_loader_table(rows, args.epochs, args.samples, results["solar raw"]["world"], storage)
    report.print_validation_table(spread, vrows, args.val_samples)
    print(f"\nwrote {png} ({len(titles)} panels: {'; '.join(titles)}) and {png[:-4]}.json")


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    launch = demo_data.launcher(args.ranks)
    if launch.ranks == 1 and args.ranks > 1:
        print(f"note: {launch.why}")
    data = _data(args, launch)
    if data is None:
        return 1
    if args.epochs == 0:
        return 0
    plan = runs.Plan(args.epochs, min(args.batch_size, args.samples), args.buffer, args.bandwidth, args.latency,
                     args.workers, args.seeds, args.ckpt_every, args.decoder or "")
    print(f"[2/4] training runs ({launch.why} each; {args.epochs} epochs, batch {plan.batch_size} per rank, "
          f"SOLAR buffer {args.buffer:.0%}, checkpoint every {args.ckpt_every} steps)")
    results = runs.run_all(launch, data, plan, args.out)
    check = _resume(launch, data, plan, args, results)
    _report(args, data, results, check, launch)
    print(f"demo done in {time.perf_counter() - t0:.0f} s")
    return 0
