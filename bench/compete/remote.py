"""SOLAR over HTTP (nginx on 127.0.0.1) against the link: NOTE [ Remote rows by byte ranges ].

Run: ``.venv/bin/python bench/compete/remote.py [--data /tmp/solar-compete/ptycho.h5] [--epochs 3]
[--out bench/compete/remote-http.json]``

Serves the data file's directory with nginx (the tests' server, tests/servers.py), then, alternated
in one run: ``link_s``, a plain parallel ranged download of the whole file (``--threads``
concurrent 8 MiB GETs); SOLAR reading rows as byte ranges (the default); SOLAR reading through
h5py's block-cached file object (``direct_reads=False``, how it read before). Each SOLAR run is
``--epochs`` epochs of ``solar.DataLoader(batch_size=32, shuffle, buffer=--buffer)`` summing both
tensors; ``first_vs_link`` is the first epoch's throughput over the link's (goal: >= 0.7).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import solar  # noqa: E402
from solar.fileio import write_text_atomic  # noqa: E402

from run import link_download  # noqa: E402
from servers import nginx_server  # noqa: E402


def solar_epochs(url: str, epochs: int, buffer: str, direct: bool) -> list[float]:
    ds = solar.H5Dataset(url, ("x", "y"), backend_options={"direct_reads": direct})
    loader = solar.DataLoader(ds, batch_size=32, shuffle=True, distributed=True, buffer=buffer)
    times = []
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/solar-compete/ptycho.h5")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer", default="192MiB")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = os.path.realpath(args.data)
    root = os.path.dirname(data)
    os.chmod(root, 0o755)
    load_start = os.getloadavg()
    size = os.path.getsize(data)
    out: dict[str, list] = {"link_s": [], "solar-ranges": [], "solar-h5py-blocks": []}
    with nginx_server(root) as base:
        url = f"{base}/{os.path.basename(data)}"
        for r in range(args.rounds):
            out["link_s"].append(link_download(url, size, {}, args.threads))
            print(f"round {r} link download {out['link_s'][-1]:.3f} s ({size / out['link_s'][-1] / 1e6:.0f} MB/s)")
            for name, direct in (("solar-ranges", True), ("solar-h5py-blocks", False)):
                out[name].append(solar_epochs(url, args.epochs, args.buffer, direct))
                print(f"round {r} {name:18s} " + " ".join(f"{t:7.3f}" for t in out[name][-1]), flush=True)
    link = float(np.mean(out["link_s"]))
    results = {}
    for name in ("solar-ranges", "solar-h5py-blocks"):
        first = float(np.mean([t[0] for t in out[name]]))
        steady = float(np.mean([np.mean(t[1:]) for t in out[name]]))
        results[name] = {"epochs_s": out[name], "first_s": first, "steady_s": steady, "first_vs_link": link / first}
        print(f"{name:20s} first {first:7.3f} s ({link / first:.2f} of the link)  steady {steady:7.3f} s")
    load = os.getloadavg()
    print(f"load average at start {load_start[0]:.2f}, at end {load[0]:.2f}")
    if args.out:
        config = {**vars(args), "file_bytes": size, "link_s": out["link_s"], "loadavg_start": load_start,
                  "loadavg_end": load}
        write_text_atomic(args.out, json.dumps({"config": config, "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
