"""The four steps of ``solar demo`` in order, each announced on one line (the package docstring
says what each does)."""

from __future__ import annotations

import argparse
import os
import time

from solar.demo import data as demo_data
from solar.demo import report
from solar.demo import runs


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
    titles = report.plot(png, results, ckpt, spread, vrows, data.mean_val_loss, {
        "loaders": [r._asdict() for r in rows], "launcher": launch.why,
        "resume": {k: v for k, v in check._asdict().items() if k != "resumed"}})
    report.print_loader_table(rows, args.epochs, args.samples, results["solar raw"]["world"], storage)
    print("\nthe raw SOLAR run's own statistics, rank 0 (loader.report(); epochs numbered from 0, as set_epoch):")
    print(results["solar raw"]["loader_report"])
    report.print_validation_table(spread, vrows, args.val_samples, data.mean_val_loss)
    print(f"\nwrote {png} ({len(titles)} panels: {'; '.join(titles)}) and {png[:-4]}.json")


def run(args: argparse.Namespace) -> int:
    """Every step with the options of ``solar demo`` (``solar/cli/demo.py``); the exit code."""
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
                     args.workers, args.seeds, args.ckpt_every, args.decoder or "", args.lr)
    print(f"[2/4] training runs ({launch.why} each; {args.epochs} epochs, batch {plan.batch_size} per rank, "
          f"SOLAR buffer {args.buffer:.0%}, checkpoint every {args.ckpt_every} steps)")
    results = runs.run_all(launch, data, plan, args.out)
    check = _resume(launch, data, plan, args, results)
    _report(args, data, results, check, launch)
    print(f"demo done in {time.perf_counter() - t0:.0f} s")
    return 0
