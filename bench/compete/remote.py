"""SOLAR reading remote HDF5 against the link: NOTE [ Remote rows by byte ranges ] and NOTE
[ Staging a remote file ].

Run: ``.venv/bin/python bench/compete/remote.py [--where http|s3] [--rounds 2]
[--out bench/compete/remote-http.json]``

Serves the data file with nginx (``--where http``, the tests' server, tests/servers.py) or
uploads it to npm's s3rver (``--where s3``, bench/compete/s3rver.py), then, alternated round by
round in one run: ``link_s``, a plain parallel ranged download of the whole file (``--threads``
concurrent 8 MiB GETs, nothing kept); and each of ``--contenders``, ``--epochs`` epochs of
``solar.DataLoader(batch_size=32, shuffle, buffer=--buffer)`` summing both tensors:

* ``solar-ranges``: rows read as byte ranges from the URL (the default);
* ``solar-staged``: ``backend_options={"stage": DIR}``, the file copied to node-local disk in
  large pieces while it is read (a fresh ``--stage-dir`` subdirectory per run);
* ``solar-spill``: by byte ranges, with ``spill=(DIR, "1GiB")``: the buffer's spill tier on
  node-local disk keeps what does not fit in memory;
* ``solar-h5py-blocks``: through h5py's block-cached file object (``direct_reads=False``);
* ``solar-local``: the local file (the steady epoch staging should reach).

``first_vs_link`` is the link's throughput over the first epoch's (goal: >= 0.7; per round:
``first_round_vs_link``); ``open_and_first_vs_link`` counts the making of the dataset and the
loader too (``open_s``: a staged copy starts with the file's open, before the first epoch's
clock). The load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import solar  # noqa: E402
from solar.fileio import write_text_atomic  # noqa: E402

from run import link_download  # noqa: E402
from servers import nginx_server  # noqa: E402

CONTENDERS = ("solar-ranges", "solar-staged", "solar-spill", "solar-h5py-blocks", "solar-local")


def solar_epochs(url: str, epochs: int, buffer: str, options: dict, spill=None) -> list[float]:
    """``[open, epoch 1, epoch 2, ...]`` seconds: ``open`` makes the dataset and the loader
    (a staged copy starts there, with the file's open)."""
    t0 = time.perf_counter()
    ds = solar.H5Dataset(url, ("x", "y"), backend_options=options or None)
    loader = solar.DataLoader(ds, batch_size=32, shuffle=True, distributed=True, buffer=buffer, spill=spill)
    times = [time.perf_counter() - t0]
    try:
        for e in range(epochs):
            loader.set_epoch(e)
            t0 = time.perf_counter()
            for x, y in loader:
                float(x.sum()) + float(y.sum())
            times.append(time.perf_counter() - t0)
    finally:
        ds.close()
    return times


@contextlib.contextmanager
def served(where: str, data: str, bucket: str):
    """``(url, storage_options)`` of ``data`` on a server started here."""
    if where == "http":
        root = os.path.dirname(data)
        os.chmod(root, 0o755)
        with nginx_server(root) as base:
            yield f"{base}/{os.path.basename(data)}", {}
        return
    import s3fs

    from s3rver import s3rver

    with s3rver(bucket) as so:
        url = f"s3://{bucket}/{os.path.basename(data)}"
        s3fs.S3FileSystem(skip_instance_cache=True, **so).put(data, url)
        yield url, so


def run_one(name: str, url: str, so: dict, args) -> list[float]:
    if name == "solar-local":
        return solar_epochs(os.path.realpath(args.data), args.epochs, args.buffer, {})
    if name in ("solar-staged", "solar-spill"):
        with tempfile.TemporaryDirectory(dir=args.stage_dir, prefix="solar-bench-stage-") as d:
            if name == "solar-spill":
                return solar_epochs(url, args.epochs, args.buffer, so, spill=(d, "1GiB"))
            return solar_epochs(url, args.epochs, args.buffer, {**so, "stage": d})
    return solar_epochs(url, args.epochs, args.buffer, {**so, "direct_reads": name != "solar-h5py-blocks"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/solar-compete/ptycho.h5")
    ap.add_argument("--where", choices=("http", "s3"), default="http")
    ap.add_argument("--bucket", default="solar-compete")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer", default="192MiB")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--stage-dir", default=tempfile.gettempdir(),
                    help="node-local directory for solar-staged and solar-spill")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the loop in one thread, as bench/compete/run.py's: torch's second intra-op thread spun on the
    # core the server and the copy need, and slowed every remote epoch (more than twice here)
    torch.set_num_threads(1)
    if not os.path.exists(args.data):
        from solar.synthetic import write_ptycho_h5

        os.makedirs(os.path.dirname(args.data), exist_ok=True)
        write_ptycho_h5(args.data, 2048, size=128, progress=False)
    data = os.path.realpath(args.data)
    names = [n for n in args.contenders.split(",") if n]
    load_start = os.getloadavg()
    size = os.path.getsize(data)
    out: dict[str, list] = {"link_s": [], **{n: [] for n in names}}
    with served(args.where, data, args.bucket) as (url, so):
        for r in range(args.rounds):
            out["link_s"].append(link_download(url, size, so, args.threads))
            print(f"round {r} link download {out['link_s'][-1]:.3f} s ({size / out['link_s'][-1] / 1e6:.0f} MB/s)")
            for name in names:
                out[name].append(run_one(name, url, so, args))
                print(f"round {r} {name:18s} open {out[name][-1][0]:6.3f} epochs "
                      + " ".join(f"{t:7.3f}" for t in out[name][-1][1:]), flush=True)
    link = float(np.mean(out["link_s"]))
    results = {}
    for name in names:
        first = float(np.mean([t[1] for t in out[name]]))
        opened = float(np.mean([t[0] + t[1] for t in out[name]]))
        steady = float(np.mean([np.mean(t[2:]) for t in out[name]]))
        results[name] = {"epochs_s": [t[1:] for t in out[name]], "open_s": [t[0] for t in out[name]],
                         "first_s": first, "steady_s": steady, "first_vs_link": link / first,
                         "first_round_vs_link": [lk / t[1] for lk, t in zip(out["link_s"], out[name])],
                         "open_and_first_vs_link": link / opened}
        print(f"{name:20s} first {first:7.3f} s ({link / first:.2f} of the link; with the open "
              f"{link / opened:.2f})  steady {steady:7.3f} s")
    load = os.getloadavg()
    print(f"load average at start {load_start[0]:.2f}, at end {load[0]:.2f}")
    if args.out:
        config = {**vars(args), "file_bytes": size, "link_s": out["link_s"], "loadavg_start": load_start,
                  "loadavg_end": load}
        write_text_atomic(args.out, json.dumps({"config": config, "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
