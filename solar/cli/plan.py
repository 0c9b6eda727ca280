"""``solar plan``: compute a SOLAR schedule and report its hit rate against the bound.

The plan is what every rank of a real run computes (``solar/schedule.py``); this command runs it
for any (N, E, P, b, C, seed) without data, prints per-epoch hit rates, misses and coalesced read
calls, optionally dumps every step's assignment so anyone can verify it
(``solar.testing.plans.check_dump``) and plots hit rate per epoch against the bound and the
baselines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch  # noqa: F401  (loaded before any timing: its import is not planning time)

from solar.cli.plan_rank import rank_view, simulated_ranks, simulation_bytes, spill_dir
from solar.errors import ConfigError
from solar.fileio import write_atomic, write_text_atomic
from solar.memory import available_memory
from solar.options import parse_buffer
from solar.ownership import capacity_for_uniform
from solar.schedule import POLICIES, PlanConfig, Planner
from solar.testing.baselines import BaselinePlanner

#: A dump holds one [index, hit] pair per access; above this many accesses it is refused.
MAX_DUMP_ACCESSES = 2_000_000

#: Peak bytes one plan holds, per sample of the dataset and per position of the padded epoch
#: order, by policy (upper estimates, with N equal to the positions; measured peaks:
#: bench/plan/memory.json), and per dumped access (nested lists plus the JSON text).
PLAN_BYTES = {"solar": (40, 80), "lru": (160, 160), "fifo": (160, 160)}
DUMP_BYTES_PER_ACCESS = 200


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, required=True, help="N, samples in the dataset")
    parser.add_argument("--epochs", type=int, default=3, help="E, epochs to plan (default 3)")
    parser.add_argument("--world-size", type=int, default=1, help="P, number of ranks (default 1)")
    parser.add_argument("--batch-size", type=int, required=True, help="b, samples per rank per step")
    parser.add_argument("--buffer", required=True,
                        help="each rank's buffer, in solar.DataLoader's forms: samples per rank (800), a fraction "
                             "of the dataset over all ranks (0.5), or bytes per rank ('40MiB', with --sample-bytes)")
    parser.add_argument("--sample-bytes", type=int, metavar="B",
                        help="bytes of one sample (all fields), to turn a --buffer in bytes into samples")
    parser.add_argument("--seed", type=int, default=0, help="DistributedSampler seed (default 0)")
    parser.add_argument("--policy", choices=POLICIES, default="solar",
                        help="solar (pinned + remap), or the baselines lru (per-rank LRU) and fifo "
                             "(SOLAR's released code)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop_last for both DistributedSampler (truncate) and DataLoader (no partial batch)")
    parser.add_argument("--no-shuffle", action="store_true", help="shuffle=False (same order every epoch)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dump", metavar="FILE", help="write every step's assignment as JSON (small problems)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot hit rate per epoch vs the bound and the baselines")
    parser.add_argument("--order", choices=("torch", "feistel"), default="torch",
                        help="torch (DistributedSampler's order, default) or feistel (not torch's order: one no "
                             "rank materializes, NOTE [ Feistel order ])")
    parser.add_argument("--rank", type=int, metavar="R",
                        help="report rank R's view, planned sharded (NOTE [ Sharded planning ]): under mpirun "
                             "with --world-size ranks each rank plans only its share and rank R prints; without "
                             "mpirun every rank's share is simulated in this process")


def _config(args: argparse.Namespace, policy: str, long_head: bool = False):
    return PlanConfig(args.samples, args.world_size, args.batch_size, args.buffer, args.seed,
                      shuffle=not args.no_shuffle, drop_last=args.drop_last, drop_last_batch=args.drop_last,
                      policy=policy, order=getattr(args, "order", "torch"), long_head=long_head)


def _balanced(plan) -> bool:
    P, G = plan.world_size, plan.global_batch
    if not len(plan.rank):
        return True
    counts = np.bincount((np.arange(len(plan.rank)) // G) * P + plan.rank, minlength=plan.num_steps * P)
    counts = counts.reshape(plan.num_steps, P)
    return bool((counts[:-1] == G // P).all() and (counts[-1] == counts[-1, 0]).all())


def _planner(cfg):
    """The schedule's planner for ``solar``; the baselines are a comparison, simulated outside the
    library (:mod:`solar.testing.baselines`)."""
    if cfg.policy == "solar":
        return Planner(cfg)
    return BaselinePlanner(cfg)


def simulate(args: argparse.Namespace, policy: str, dump: list | None = None) -> dict:
    """Plan ``args.epochs`` epochs with ``policy``; the JSON report (and the dump, if a list is given)."""
    cfg = _config(args, policy)
    planner = _planner(cfg)
    epochs, balanced, seconds = [], True, []
    for e in range(args.epochs):
        t0 = time.perf_counter()
        plan = planner.plan(e)
        seconds.append(time.perf_counter() - t0)
        balanced &= _balanced(plan)
        epochs.append({"epoch": e, "hit_rate": plan.hit_rate, "misses": plan.misses, "read_calls": plan.read_calls()})
        if dump is not None:
            dump.append(plan.to_dump())
    # epochs are numbered from 0 as torch's set_epoch; the hit rate is measured on epochs >= 1 (epoch 0
    # only fills the buffers): none without them
    later = [x["hit_rate"] for x in epochs[1:]]
    return {"hit_rate": sum(later) / len(later) if later else None, "bound": cfg.bound, "balanced": balanced,
            "policy": policy, "samples": cfg.num_samples, "world_size": cfg.world_size, "batch_size": cfg.batch_size,
            "buffer": cfg.capacity, "seed": cfg.seed, "plan_seconds_per_epoch": max(seconds) if seconds else 0.0,
            "epochs": epochs}


def plot(path: str, reports: dict[str, dict]) -> None:
    """Hit rate per epoch of each policy in ``reports``, against the bound (a PNG at ``path``)."""
    import matplotlib  # optional (the plot extra); only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, rep in reports.items():
        xs = [e["epoch"] for e in rep["epochs"]]
        ax.plot(xs, [e["hit_rate"] for e in rep["epochs"]], marker="o", label=name)
    bound = next(iter(reports.values()))["bound"]
    ax.axhline(bound, color="k", ls="--", label=f"bound min(1, PC/N) = {bound:.3f}")
    rep = next(iter(reports.values()))
    ax.set(xlabel="epoch", ylabel="hit rate", ylim=(0, min(1.05, max(bound * 1.3, 0.05))),
           title=f"N={rep['samples']} P={rep['world_size']} b={rep['batch_size']} C={rep['buffer']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".png")
    finally:
        plt.close(fig)


def check_output(option: str, path: str) -> None:
    """Refuse, before planning, an output ``path`` that cannot become a file (ConfigError)."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        name = "plan.json" if option == "--dump" else "hits.png"
        raise ConfigError(f"{option} {path} is a directory; give a file path such as {os.path.join(path, name)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{option} {path}: {parent} {what}; create the directory (mkdir -p {parent}) "
                          f"or choose another {option} path")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{option} {path}: directory {parent} is not writable; fix its permissions "
                          f"or choose another {option} path")


def plan_bytes(cfg, policy: str, accesses: int = 0) -> int:
    """Estimated peak memory of planning with ``policy`` (epochs are planned one at a time)."""
    per_sample, per_position = PLAN_BYTES[policy]
    positions = cfg.per_rank * cfg.world_size  # the padded global order, before DataLoader's drop_last
    return per_sample * cfg.num_samples + per_position * positions + DUMP_BYTES_PER_ACCESS * accesses


def check_disk(args: argparse.Namespace, cfg) -> None:
    """Refuse (ConfigError) a one-rank view whose simulated exchanges would not fit on disk."""
    where = spill_dir(cfg) if args.rank is not None and simulated_ranks(cfg.world_size) > 1 else None
    if where is None:
        return
    need, free = simulation_bytes(cfg)[1], shutil.disk_usage(where).free
    if need > free:
        gib = 2**30
        raise ConfigError(f"--rank without mpirun simulates every rank's share, spilling about {need / gib:.1f} GiB "
                          f"of exchanged records to {where}, which has {free / gib:.1f} GiB free; point TMPDIR at a "
                          f"directory with room, or run it under mpirun -n {cfg.world_size}")


def check_memory(args: argparse.Namespace, cfg) -> None:
    """Refuse (ConfigError) a plan whose estimated memory exceeds what is available, before allocating it."""
    avail = available_memory()
    if avail is None:
        return
    accesses = cfg.epoch_length * args.epochs if args.dump else 0
    policies = POLICIES if args.plot and args.rank is None else (args.policy,)
    need = max(plan_bytes(cfg, p, accesses if p == args.policy else 0) for p in policies)
    if args.rank is not None:  # one rank's view: this process plans every rank's share, or only its own
        need = 0 if simulated_ranks(cfg.world_size) == 1 else simulation_bytes(cfg)[0]
    if need <= avail:
        return
    fixes = [f"use fewer --samples (N={cfg.num_samples})"]
    if cfg.per_rank * cfg.world_size > 2 * cfg.num_samples:
        fixes.append(f"use a smaller --world-size (P={cfg.world_size} pads each epoch to "
                     f"{cfg.per_rank * cfg.world_size} positions)")
    if args.plot and plan_bytes(cfg, args.policy, accesses) <= avail:
        fixes.append("leave out --plot (it also runs the baselines, which need more memory)")
    gib = 2**30
    raise ConfigError(f"planning needs about {need / gib:.1f} GiB of memory but {avail / gib:.1f} GiB is available; "
                      f"{', or '.join(fixes)}")


def buffer_capacity(args: argparse.Namespace) -> int:
    """C, samples per rank, from ``--buffer`` in the loader's forms (``parse_buffer``), counted as
    ``SolarBatchSampler.capacity`` counts them for samples of ``--sample-bytes`` each."""
    text = str(args.buffer).strip()
    try:
        return int(text)  # samples per rank, as given: PlanConfig checks the range
    except ValueError:
        pass
    try:
        value: object = float(text)
    except ValueError:
        value = text
    spec = parse_buffer(value)
    n, P = args.samples, max(1, args.world_size)
    if spec.nbytes is None:
        return spec.per_rank(n, P)
    if not args.sample_bytes or args.sample_bytes < 1:
        raise ConfigError(f"--buffer {text} is bytes per rank; give --sample-bytes B (one sample's bytes over all "
                          "fields) to turn it into samples, or pass samples (800) or a fraction (0.5)")
    return capacity_for_uniform(n, args.sample_bytes, spec.nbytes, P)


def run(args: argparse.Namespace) -> int:
    try:
        args.buffer = buffer_capacity(args)
        if args.epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {args.epochs}")
        if args.dump and args.samples * args.epochs > MAX_DUMP_ACCESSES:
            raise ConfigError(f"--dump writes one entry per access; {args.samples} x {args.epochs} epochs is more "
                              f"than {MAX_DUMP_ACCESSES}; use fewer samples or epochs")
        if args.dump and args.rank is not None:
            raise ConfigError("--dump writes every rank's assignment; leave out --rank (one rank's view)")
        for option, path in (("--dump", args.dump), ("--plot", args.plot)):
            if path:
                check_output(option, path)
        check_memory(args, _config(args, args.policy))
        check_disk(args, _config(args, args.policy))
        dump: list | None = [] if args.dump else None
        if args.rank is not None:
            report = rank_view(args, _config(args, "solar", long_head=True))  # as the loader plans sharded
            if report is None:
                return 0  # another rank of the job prints
        else:
            report = simulate(args, args.policy, dump)
    except ConfigError as exc:
        print(f"solar plan: {exc}", file=sys.stderr)
        return 2
    outputs = []
    if args.dump:
        outputs.append(("--dump", args.dump,
                        lambda p: write_text_atomic(p, json.dumps({"epochs": dump}, separators=(",", ":")))))
    if args.plot:
        reports = {args.policy: report}
        for other in POLICIES if args.rank is None else ():  # (a rank's view: the sharded plan alone)
            if other != args.policy:
                reports[other] = simulate(args, other)
        outputs.append(("--plot", args.plot, lambda p: plot(p, reports)))
    for option, path, write in outputs:
        try:
            write(path)
            print(f"solar plan: wrote {option} {os.path.abspath(path)}", file=sys.stderr)
        except OSError as exc:  # checked above, so: disk full, permissions changed, an I/O error
            print(f"solar plan: cannot write {option} {path} ({exc.strerror or exc}); check free space and "
                  f"permissions there; {path} was not written", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(report))
        return 0
    if args.rank is not None:
        print(json.dumps(report, indent=1))
        return 0
    print(f"policy {report['policy']}: N={args.samples} P={args.world_size} b={args.batch_size} C={args.buffer} "
          f"seed={args.seed}  (planning: {report['plan_seconds_per_epoch']:.3f} s/epoch)")
    print(f"{'epoch':>5} {'hit rate':>9} {'misses':>9} {'read calls':>10}")
    for e in report["epochs"]:
        print(f"{e['epoch']:>5} {e['hit_rate']:>9.4f} {e['misses']:>9} {e['read_calls']:>10}")
    hit = ("n/a (no epoch after the first; plan --epochs 2 or more)" if report["hit_rate"] is None
           else f"{report['hit_rate']:.4f}")
    print(f"hit rate (epochs >= 1): {hit}   bound min(1, PC/N): {report['bound']:.4f}   "
          f"balanced: {report['balanced']}")
    return 0
