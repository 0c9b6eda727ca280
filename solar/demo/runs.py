"""The demo's training runs, each a separate launch of ``python -m solar.demo.train`` (under
``mpirun -n P`` when MPI is here): torch's loader on the raw file, SOLAR on the raw file (seed 0
with job-wide checkpoints, more seeds for the yardstick), SOLAR on each compressed file, and one
run killed mid-epoch and resumed from its last checkpoint version. Then the resume check and
``solar-ckpt log`` / ``diff`` of two versions."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import NamedTuple

from solar.checkpoint import list_versions
from solar.demo.data import DemoData, Launcher
from solar.demo.train import RunConfig


class Plan(NamedTuple):
    """The demo's training settings (from ``solar demo``'s options)."""

    epochs: int
    batch_size: int
    buffer: float
    bandwidth: float
    latency: float
    workers: int
    seeds: int
    ckpt_every: int
    decoder: str  # "" : the codec's own choice (SOLAR_CODEC_DECODER, else auto)
    lr: float  # the surrogate's Adam learning rate


def steps_per_epoch(samples: int, ranks: int, batch_size: int) -> int:
    """DistributedSampler pads every rank to ceil(N/P) samples; the last batch may be partial."""
    return math.ceil(math.ceil(samples / ranks) / batch_size)


def kill_step(plan: Plan, per_epoch: int) -> int:
    """A step in the middle of the second epoch (the first if there is one), not a checkpoint step."""
    at = min(1, plan.epochs - 1) * per_epoch + max(1, per_epoch // 2)
    if at % plan.ckpt_every == 0:
        at += 1
    return max(at, plan.ckpt_every + 1)


def train(run: Launcher, cfg: RunConfig) -> tuple[dict | None, subprocess.CompletedProcess, float]:
    """One launch; its figures (None when it failed), the process and its wall time."""
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    path = cfg.out[:-len(".json")] + ".config.json"
    with open(path, "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    if os.path.exists(cfg.out):
        os.remove(cfg.out)
    t0 = time.perf_counter()
    done = run.run("-m", "solar.demo.train", path, quiet=True)
    wall = time.perf_counter() - t0
    figures = json.load(open(cfg.out)) if done.returncode == 0 and os.path.exists(cfg.out) else None
    return figures, done, wall


def _must(name: str, result: tuple[dict | None, subprocess.CompletedProcess, float]) -> dict:
    figures, done, wall = result
    if figures is None:
        err = done.stderr
        first = err.find("Traceback")  # the failing rank's own error, before the launcher's abort banner
        raise RuntimeError(f"demo run {name!r} failed (exit {done.returncode}):\n"
                           f"{err[first:first + 6000] if first >= 0 else err[-6000:]}")
    print(f"  {name:<22} {len(figures['epochs'])} epochs, {wall:5.1f} s wall, val loss {figures['val_loss']:.5f}")
    return figures


def configs(data: DemoData, plan: Plan, out: str) -> dict[str, RunConfig]:
    """Every uninterrupted run, by name (seed 0 unless the name says otherwise)."""
    base = RunConfig(name="", loader="solar", data=data.raw, val=data.val, out="", norm=data.norm,
                     epochs=plan.epochs, batch_size=plan.batch_size, buffer=plan.buffer, seed=0,
                     bandwidth=plan.bandwidth, latency=plan.latency, lr=plan.lr, workers=plan.workers,
                     ckpt_every=plan.ckpt_every, decoder=plan.decoder)
    runs = {"torch raw": replace(base, loader="torch"),
            "solar raw": replace(base, ckpt=os.path.join(out, "ckpt", "uninterrupted"))}
    for seed in range(1, plan.seeds):
        runs[f"solar raw seed {seed}"] = replace(base, seed=seed)
    for bound, path in data.compressed.items():
        runs[f"solar rel {bound:.0e}"] = replace(base, data=path)
    return {name: replace(cfg, name=name, out=os.path.join(out, "runs", name.replace(" ", "_") + ".json"))
            for name, cfg in runs.items()}


def run_all(run: Launcher, data: DemoData, plan: Plan, out: str) -> dict[str, dict]:
    """Every uninterrupted run; their figures by name. A rerun starts from empty checkpoint roots, so
    the bytes each version writes are this run's, not de-duplicated against the last run's."""
    shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)
    return {name: _must(name, train(run, cfg)) for name, cfg in configs(data, plan, out).items()}


class ResumeCheck(NamedTuple):
    killed_at: int
    exit_code: int
    resumed_from: int
    steps: int  # steps compared
    max_diff: float  # largest |loss difference| over those steps
    val_diff: float
    resumed: dict  # the resumed run's figures
    root: str


def kill_and_resume(run: Launcher, reference: RunConfig, samples: int, plan: Plan, out: str,
                    uninterrupted: dict) -> ResumeCheck:
    """The reference run again, its last rank SIGKILLed mid-epoch; then resumed from the newest version."""
    root = os.path.join(out, "ckpt", "killed")
    at = kill_step(plan, steps_per_epoch(samples, run.ranks, plan.batch_size))
    cfg = replace(reference, name="solar raw killed", ckpt=root, kill_at=at,
                  out=os.path.join(out, "runs", "solar_raw_killed.json"))
    if os.path.isdir(root):
        shutil.rmtree(root)
    figures, done, wall = train(run, cfg)
    if figures is not None:
        raise RuntimeError(f"the run killed at step {at} finished instead (kill_at={at} beyond the last step?)")
    print(f"  solar raw killed       rank {run.ranks - 1} SIGKILLed itself at step {at}: the launcher ended the "
          f"job (exit {done.returncode}) after {wall:.1f} s; versions on disk: {list_versions(root)}")
    resumed = _must("solar raw resumed", train(run, replace(cfg, name="solar raw resumed", kill_at=-1, resume=True,
                                                             out=os.path.join(out, "runs", "solar_raw_resumed.json"))))
    start = resumed["first_step"]
    want = uninterrupted["losses"][start:]
    got = resumed["losses"]
    if len(got) != len(want):
        raise RuntimeError(f"the resumed run trained {len(got)} steps after step {start}, the uninterrupted "
                           f"one {len(want)}")
    diff = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    return ResumeCheck(at, done.returncode, start, len(got), diff, abs(resumed["val_loss"] - uninterrupted["val_loss"]),
                       resumed, root)


def _cli(*args: str, head: int = 0) -> subprocess.CompletedProcess:
    """Run ``solar-ckpt ARGS`` and print its output (with ``head``: that many rows, then its summary)."""
    cmd = [sys.executable, "-m", "solar.checkpoint.cli", *args]
    print(f"$ solar-ckpt {' '.join(args)}")
    done = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    lines = done.stdout.rstrip().splitlines()
    end = next((i for i, line in enumerate(lines) if " added, " in line), len(lines))  # the tensors' table
    rows = [i for i, line in enumerate(lines[:end]) if line.startswith(("changed", "added", "removed", "unchanged"))]
    if head and len(rows) > head:
        cut = set(rows[head:])
        kept = [line for i, line in enumerate(lines) if i not in cut]
        kept.insert(rows[head], f"... ({len(cut)} more rows)")
        lines = kept
    print("\n".join(lines))
    return done


def show_checkpoints(root: str) -> None:
    """``solar-ckpt log`` of the job root and ``diff`` of its last two versions."""
    steps = list_versions(root)
    _cli("log", root)
    if len(steps) < 2:
        print(f"(only {len(steps)} checkpoint version(s) in {root}: nothing to diff)")
        return
    _cli("diff", f"{root}@{steps[-2]}", f"{root}@{steps[-1]}", head=6)
