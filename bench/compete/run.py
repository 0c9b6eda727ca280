"""SOLAR beside the loaders a new user would try, on the same data, alternated in one run.

Run (competitors live in their own environment, see bench/compete/README.md):
``.venv-compete/bin/python bench/compete/run.py [--where local|s3] [--cold] [--touch sum|one]
[--contenders solar-w0,solar-w2,torch-w0,...] [--cnn] [--out bench/compete/local-warm.json]``

The data is PtychoNN-shaped (``--samples`` 2,048 samples, x ``1 x size x size`` and y
``2 x size x size`` float32, ``--size`` 128: 403 MB), each loader fed by its own documented
conversion (LitData: ``litdata.optimize``; the rest read the HDF5 file). Batch 32, shuffled,
``--epochs`` 3 epochs; each epoch's loop takes every batch and sums both tensors (``--touch one``:
reads one value per sample, pure loader throughput; ``--cnn``: a small CNN's forward and
backward per step instead). Steady epoch = mean of epochs 2..E. The contenders are alternated
round by round (``--rounds``), each round running every contender's epochs back to back, so a
load change on the shared machine spreads over all of them.

``--cold``: before every epoch, the page cache of every file the contender reads is dropped
(``posix_fadvise(DONTNEED)``: only these files, nothing else on the machine).

Limits measured in the same run: ``one_copy_s`` = the epoch's bytes over this machine's memcpy
bandwidth (``numpy.copyto`` of 256 MiB, best of 5), and ``loop_s`` = the same loop over the same
batches already in memory (what the consumer's own work costs). A loader cannot beat
``loop_s``; one that moves each byte once more costs about ``one_copy_s`` on top of it.

``--where s3``: the HDF5 file (and LitData's chunks) are uploaded to an S3 server on 127.0.0.1
(npm's s3rver, started here: bench/compete/s3rver.py; or ``--endpoint`` of one running) and every contender reads
from there; ``link_s``: a plain parallel ranged download of the whole file (``--link-threads``
concurrent 8 MiB GETs) in the same run, so the first epoch can be compared with the link.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import solar  # noqa: E402
from solar.fileio import write_text_atomic  # noqa: E402
from solar.synthetic import write_ptycho_h5  # noqa: E402

from contenders import CONTENDERS, VENVS, Setup, upload  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def memcpy_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes per second of one large ``numpy.copyto`` (best of ``repeat``)."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def link_download(url: str, size: int, storage_options: dict, threads: int, piece: int = 8 << 20) -> float:
    """Seconds to fetch the whole object with ``threads`` concurrent ranged GETs (fsspec's
    ``cat_file`` per piece): the link's throughput as a plain parallel download sees it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    starts = list(range(0, size, piece))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(len(b) for b in pool.map(lambda s: fs.cat_file(path, start=s, end=min(size, s + piece)), starts))
    dt = time.perf_counter() - t0
    assert got == size, (got, size)
    return dt


def make_step(touch: str, cnn: bool) -> Callable[[Any], float]:
    """The per-batch work of the loop: sum both tensors, touch one value per sample, or a small
    CNN's forward/backward on x predicting y."""
    if cnn:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(8, 8, 3, padding=1, stride=2), torch.nn.ReLU(),
                                  torch.nn.ConvTranspose2d(8, 2, 2, stride=2))
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def train(batch) -> float:
            x, y = batch
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            return float(loss)
        return train
    if touch == "one":
        return lambda batch: float(batch[0][:, 0, 0, 0].sum()) + float(batch[1][:, 0, 0, 0].sum())
    return lambda batch: float(batch[0].sum()) + float(batch[1].sum())


def run_epochs(c, epochs: int, step: Callable, cold: Callable[[], None] | None) -> list[float]:
    times = []
    for e in range(epochs):
        if cold is not None:
            cold()
        loader = c.epoch(e)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            step(batch)
            n += len(batch[0])
        times.append(time.perf_counter() - t0)
        assert n == c.setup.samples, f"{c.name}: epoch {e} gave {n} samples, not {c.setup.samples}"
    return times


def loop_floor(setup: Setup, step: Callable, batch: int) -> float:
    """Seconds of the loop's own work over one epoch of distinct batches already in memory."""
    n = setup.samples
    batches = [(torch.rand(min(batch, n - a), 1, setup.size, setup.size),
                torch.rand(min(batch, n - a), 2, setup.size, setup.size)) for a in range(0, n, batch)]
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    return time.perf_counter() - t0


def run_one(setup: Setup, name: str, epochs: int, step: Callable, cold: bool) -> dict:
    """One contender's epochs, in this process (a fresh one per contender and round: no
    contender's threads or memory reach another's)."""
    try:
        c = CONTENDERS[name](setup, name)
    except ImportError as exc:
        return {"skipped": str(exc)}
    try:
        out = {"epochs_s": run_epochs(c, epochs, step, c.drop_cache if cold else None), "version": c.version}
        if hasattr(c, "prepare_s"):
            out["prepare_s"] = c.prepare_s
        return out
    finally:
        c.close()


def alternate(args, names: list[str]) -> dict[str, list]:
    """Every contender's epochs, round by round, each in its own process (``--one``)."""
    times: dict[str, list] = {n: [] for n in names}
    skipped = {}
    for name in names:
        py = os.path.join(ROOT, VENVS[name], "bin", "python") if name in VENVS else sys.executable
        if not os.path.exists(py):
            skipped[name] = f"{py} is missing: run `bash bench/compete/venvs.sh {name}`"
            print(f"{name}: skipped ({skipped[name]})")
    for r in range(args.rounds):
        for name in names:
            if name in skipped:
                continue
            py = os.path.join(ROOT, VENVS[name], "bin", "python") if name in VENVS else sys.executable
            where = ["--endpoint", args.endpoint] if args.endpoint else []
            got = subprocess.run([py, os.path.abspath(__file__), *sys.argv[1:], *where, "--one", name],
                                 capture_output=True, text=True)
            lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
            res = json.loads(lines[-1]) if lines and not got.returncode else \
                {"skipped": f"failed: {(got.stderr.strip().splitlines() or ['?'])[-1]}"}
            if "skipped" in res:
                skipped[name] = res["skipped"]
                print(f"{name}: skipped ({res['skipped']})")
                continue
            times[name].append(res)
            print(f"round {r} {name:18s} " + " ".join(f"{t:7.3f}" for t in res["epochs_s"]), flush=True)
    return {n: t for n, t in times.items() if t}


def default_contenders(where: str) -> list[str]:
    """Every contender; over S3 without torch's and torchdata's (h5py on an s3fs file: minutes per
    epoch), and the staged SOLAR only over S3."""
    if where == "s3":
        return [n for n in CONTENDERS if not n.startswith(("torch-", "stateful-"))]
    return [n for n in CONTENDERS if "staged" not in n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/solar-compete/ptycho.h5")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--buffer", default="192MiB", help="SOLAR's buffer= (the issue's setting)")
    ap.add_argument("--contenders", default=None,
                    help="default: every contender (solar-staged-w0 over s3 only; torch's, torchdata's locally only)")
    ap.add_argument("--where", choices=("local", "s3"), default="local")
    ap.add_argument("--endpoint", default=None, help="an S3 server already running (default: start s3rver)")
    ap.add_argument("--bucket", default="solar-compete")
    ap.add_argument("--link-threads", type=int, default=16)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--touch", choices=("sum", "one"), default="sum")
    ap.add_argument("--cnn", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one contender, in a child process
    args = ap.parse_args()
    torch.set_num_threads(1)  # every contender's loop in one thread: a fair, steady consumer

    if not os.path.exists(args.data):
        os.makedirs(os.path.dirname(args.data), exist_ok=True)
        write_ptycho_h5(args.data, args.samples, size=args.size, progress=False)
    setup = Setup(args.data, args.samples, args.size, args.batch, args.buffer, args.where, args.endpoint,
                  args.bucket)
    names = [n for n in (args.contenders or "").split(",") if n] or default_contenders(args.where)
    step = make_step(args.touch, args.cnn)
    if args.one:
        print(json.dumps(run_one(setup, args.one, args.epochs, step, args.cold)))
        return
    if args.where == "s3" and args.endpoint is None:
        from s3rver import s3rver

        with s3rver(args.bucket) as so:
            args.endpoint = so["client_kwargs"]["endpoint_url"]
            compare(args, setup._replace(endpoint=args.endpoint), names, step)
    else:
        compare(args, setup, names, step)


def compare(args, setup: Setup, names: list[str], step: Callable) -> None:
    """Every contender alternated, the limits measured, the table printed and written."""
    load_start = os.getloadavg()
    epoch_bytes = args.samples * 3 * args.size * args.size * 4
    bw = memcpy_bandwidth()
    floor = loop_floor(setup, step, args.batch)
    link = None
    if args.where == "s3":
        upload(setup, args.data, setup.h5_url)
        link = link_download(setup.h5_url, os.path.getsize(args.data), setup.storage_options, args.link_threads)
    runs = alternate(args, names)
    results = {}
    for name, got in runs.items():
        ts = [g["epochs_s"] for g in got]
        steady = float(np.mean([np.mean(t[1:]) if len(t) > 1 else t[0] for t in ts]))
        results[name] = {"epochs_s": ts, "steady_s": steady, "first_s": float(np.mean([t[0] for t in ts])),
                         "version": got[0]["version"]}
        if "prepare_s" in got[0]:
            results[name]["prepare_s"] = [g["prepare_s"] for g in got]
    one_copy = epoch_bytes / bw
    fastest_other = min((r["steady_s"] for n, r in results.items() if not n.startswith("solar")), default=None)
    best_solar = min((r["steady_s"] for n, r in results.items() if n.startswith("solar")), default=None)
    print(f"\nmemcpy {bw / 1e9:.2f} GB/s; epoch {epoch_bytes / 1e6:.0f} MB; one-copy limit {one_copy:.3f} s; "
          f"loop alone {floor:.3f} s" + (f"; link download {link:.3f} s" if link else ""))
    print(f"{'':20s}{'first s':>9s}{'steady s':>10s}{'/ limit':>9s}{'/ best':>8s}")
    limit = one_copy + floor
    best = min(r["steady_s"] for r in results.values())
    for name, r in results.items():
        print(f"{name:20s}{r['first_s']:9.3f}{r['steady_s']:10.3f}{r['steady_s'] / limit:9.2f}"
              f"{r['steady_s'] / best:8.2f}")
        r["vs_limit"] = r["steady_s"] / limit
        if link:
            r["first_vs_link"] = link / r["first_s"]
    ratios = {}
    if fastest_other and best_solar:
        ratios["best_solar_over_fastest_other"] = best_solar / fastest_other
        ratios["best_solar_over_one_copy_plus_loop"] = best_solar / limit
        print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    load = os.getloadavg()
    print(f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    config = {**vars(args), "epoch_bytes": epoch_bytes, "memcpy_Bps": bw, "one_copy_s": one_copy, "loop_s": floor,
              "link_s": link, "loadavg_start": load_start, "loadavg_end": load, "torch": torch.__version__,
              "solar": solar.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    if args.out:
        write_text_atomic(args.out, json.dumps({"config": config, "results": results, "ratios": ratios}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
