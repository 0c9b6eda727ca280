"""The demo's closing figures: the loader table, the validation-loss table against the raw run's
seed-to-seed spread and the mean predictor's loss, and ``report.png`` (five panels) with
``report.json`` beside it (the panels' titles as drawn, the tables' rows)."""

from __future__ import annotations

import json
import statistics
from typing import NamedTuple

LOADERS = ("torch raw", "solar raw")  # then "solar rel <bound>" for each bound


class LoaderRow(NamedTuple):
    name: str
    first_s: float  # epoch 0 (SOLAR fills its buffer)
    steady_s: float  # mean epoch time from epoch 1 on (epoch 0 alone when there is one epoch)
    wait_s: float  # mean time per steady epoch the loop waited for batches
    step_s: float  # mean time per steady epoch in training steps
    hit_rate: float | None  # steady epochs' hits / accesses
    bound: float | None
    mib_read: float  # every epoch, every rank
    requests: int
    val_loss: float


class ValRow(NamedTuple):
    data: str
    ratio: float
    val_loss: float
    vs_mean: float  # relative to the raw seeds' mean
    in_std: float  # |val - raw mean| in raw seed standard deviations
    vs_seed0: float  # relative to the raw run of the same seed (same init, same order)


class RawSpread(NamedTuple):
    seeds: int
    mean: float
    std: float
    lo: float
    hi: float


def _steady(epochs: list[dict]) -> list[dict]:
    return epochs[1:] or epochs


def loader_row(name: str, fig: dict) -> LoaderRow:
    ep = fig["epochs"]
    steady = _steady(ep)
    hits, total = sum(e["hits"] for e in steady), sum(e["hits"] + e["misses"] for e in steady)
    solar = fig["loader"] == "solar"
    return LoaderRow(name, ep[0]["seconds"], statistics.fmean(e["seconds"] for e in steady),
                     statistics.fmean(e["wait_s"] for e in steady), statistics.fmean(e["step_s"] for e in steady),
                     hits / total if solar and total else None, fig["bound"],
                     sum(e["bytes_read"] for e in ep) / 2**20, sum(e["requests"] for e in ep), fig["val_loss"])


def loader_names(runs: dict[str, dict]) -> list[str]:
    return [n for n in runs if n in LOADERS or n.startswith("solar rel ")]


def print_loader_table(rows: list[LoaderRow], epochs: int, samples: int, world: int, storage: str) -> None:
    print(f"\nloaders: {epochs} epochs x {samples} samples on {world} rank(s), storage {storage} "
          f"(a shared machine: compare within this table)")
    head = (f"{'loader':<16}{'epoch 0 s':>10}{'epoch s':>9}{'wait s':>8}{'step s':>8}{'hit rate':>10}{'bound':>7}"
            f"{'MiB read':>10}{'requests':>10}{'val loss':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        hit = f"{r.hit_rate:.3f}" if r.hit_rate is not None else "-"
        bound = f"{r.bound:.3f}" if r.bound is not None else "-"
        print(f"{r.name:<16}{r.first_s:>10.2f}{r.steady_s:>9.2f}{r.wait_s:>8.2f}{r.step_s:>8.2f}{hit:>10}{bound:>7}"
              f"{r.mib_read:>10.2f}{r.requests:>10}{r.val_loss:>10.5f}")
    print("epoch s, wait s (the time the loop waited for batches: loader-only) and step s are per epoch, "
          "mean of epochs >= 1; hit rate over epochs >= 1 against the bound min(1, P*C/N)")


def raw_spread(runs: dict[str, dict]) -> RawSpread:
    vals = [f["val_loss"] for n, f in runs.items() if n == "solar raw" or n.startswith("solar raw seed ")]
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return RawSpread(len(vals), statistics.fmean(vals), std, min(vals), max(vals))


def validation_rows(runs: dict[str, dict], ratios: dict[float, float]) -> tuple[RawSpread, list[ValRow]]:
    spread = raw_spread(runs)
    seed0 = runs["solar raw"]["val_loss"]
    rows = []
    for bound, ratio in ratios.items():
        v = runs[f"solar rel {bound:.0e}"]["val_loss"]
        rows.append(ValRow(f"rel {bound:.0e}", ratio, v, v / spread.mean - 1,
                           abs(v - spread.mean) / spread.std if spread.std else float("inf"), v / seed0 - 1))
    return spread, rows


def print_validation_table(spread: RawSpread, rows: list[ValRow], val_samples: int, mean_loss: float) -> None:
    print(f"\nvalidation loss (MSE on {val_samples} held-out samples, raw data) of the surrogate trained on "
          "compressed data, against the raw run's seed-to-seed spread")
    head = f"{'trained on':<22}{'ratio':>8}{'val loss':>11}{'vs raw mean':>13}{'in raw std':>12}{'vs raw seed 0':>15}"
    print(head)
    print("-" * len(head))
    print(f"{'mean predictor':<22}{'-':>8}{mean_loss:>11.5f}{mean_loss / spread.mean - 1:>+13.2%}   (the training "
          f"set's mean target; the raw runs reach {spread.mean / mean_loss:.1%} of its loss)")
    print(f"{f'raw, {spread.seeds} seeds':<22}{'x1.0':>8}{spread.mean:>11.5f}   +- {spread.std:.5f} "
          f"(std; min {spread.lo:.5f}, max {spread.hi:.5f}; spread {(spread.hi - spread.lo) / spread.mean:.1%})")
    for r in rows:
        print(f"{r.data:<22}{f'x{r.ratio:.1f}':>8}{r.val_loss:>11.5f}{r.vs_mean:>+13.2%}{r.in_std:>12.2f}"
              f"{r.vs_seed0:>+15.2%}")
    for r in rows:
        print(f"{r.data}: {verdict(spread, r)}")


def verdict(spread: RawSpread, row: ValRow) -> str:
    """Where a compressed run's loss falls against the raw seeds: inside their range, outside it
    but within 2 standard deviations of their mean, or beyond (better or worse)."""
    if spread.lo <= row.val_loss <= spread.hi:
        return f"inside the raw seeds' range ({spread.seeds} seeds)"
    side = "above" if row.val_loss > spread.hi else "below"
    if row.in_std <= 2:
        return f"{side} the raw seeds' range, within 2 std of their mean ({row.in_std:.2f} std)"
    return f"{'worse' if side == 'above' else 'better'} than the raw seeds: {row.in_std:.2f} std from their mean"


def _panels(axes, runs: dict[str, dict], ckpt: list[dict], spread: RawSpread, rows: list[ValRow],
            mean_loss: float) -> None:
    names = loader_names(runs)
    color = {n: f"C{i}" for i, n in enumerate(names)}  # one colour per loader in every panel
    ax = axes[0]
    for n in names:
        ep = runs[n]["epochs"]
        ax.plot([e["epoch"] for e in ep], [e["seconds"] for e in ep], marker="o", color=color[n], label=n)
        ax.plot([e["epoch"] for e in ep], [e["wait_s"] for e in ep], ls="--", color=color[n])
    ax.set(title="epoch time per loader", xlabel="epoch", ylabel="seconds (dashed: waiting for batches)",
           yscale="log")
    ax.legend(fontsize=7)
    ax = axes[1]
    for n in names[1:]:
        ep = runs[n]["epochs"]
        ax.plot([e["epoch"] for e in ep], [e["hits"] / max(1, e["hits"] + e["misses"]) for e in ep], marker="o",
                color=color[n], label=n)
    bound = runs["solar raw"]["bound"]
    ax.axhline(bound, color="k", ls=":", label=f"bound {bound:.2f}")
    ax.set(title="hit rate against the bound per epoch", xlabel="epoch", ylabel="hit rate", ylim=(-0.05, 1.05))
    ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_xticks([e["epoch"] for e in runs["torch raw"]["epochs"]])
    ax = axes[2]
    mib = [sum(e["bytes_read"] for e in runs[n]["epochs"]) / 2**20 for n in names]
    ax.bar(range(len(names)), mib, color=[color[n] for n in names])
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set(title="bytes read from storage", ylabel="MiB, all epochs and ranks", yscale="log")
    ax = axes[3]
    ax.bar([str(c["step"]) for c in ckpt], [c["bytes_written"] / 2**10 for c in ckpt],
           label="written to the shared store")
    ax.plot([str(c["step"]) for c in ckpt], [c["logical_bytes"] / 2**10 for c in ckpt], "k.--",
            label="state of all ranks (logical)")
    ax.set(title="checkpoint bytes per version", xlabel="step (job-wide version)", ylabel="KiB")
    ax.legend(fontsize=7)
    ax = axes[4]
    ax.axhspan(spread.mean - spread.std, spread.mean + spread.std, color="C0", alpha=0.2,
               label=f"raw: mean +- std of {spread.seeds} seeds")
    ax.axhline(spread.mean, color="C0")
    ax.plot([float(r.data.split()[1]) for r in rows], [r.val_loss for r in rows], "C3o-", label="compressed")
    if mean_loss < 3 * max([spread.hi, *(r.val_loss for r in rows)]):  # (else it squeezes the rest flat)
        ax.axhline(mean_loss, color="k", ls=":", label="mean predictor")
    else:
        ax.text(0.02, 0.96, f"mean predictor: {mean_loss:.4g} (off the scale)", transform=ax.transAxes, va="top",
                fontsize=7)
    ax.set(title="validation loss per bound", xlabel="relative error bound", ylabel="validation MSE", xscale="log")
    ax.legend(fontsize=7)


def plot(path: str, runs: dict[str, dict], ckpt: list[dict], spread: RawSpread, rows: list[ValRow],
         mean_loss: float, extra: dict) -> list[str]:
    """Write the five-panel ``report.png`` and ``report.json`` beside it; the panels' titles."""
    import matplotlib  # optional (the plot/test/bench extras); only the picture needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the headless backend

    fig, axes = plt.subplots(1, 5, figsize=(24, 4.8))
    _panels(axes, runs, ckpt, spread, rows, mean_loss)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    titles = [ax.get_title() for ax in fig.axes]
    size = [int(v) for v in fig.get_size_inches() * 80]
    plt.close(fig)
    with open(path[:-len(".png")] + ".json", "w") as f:
        json.dump({"png": path, "size_px": size, "panels": titles, "validation": {"raw": spread._asdict(),
                   "mean_predictor": mean_loss,
                   "bounds": [dict(r._asdict(), verdict=verdict(spread, r)) for r in rows]}, **extra}, f, indent=1)
    return titles
