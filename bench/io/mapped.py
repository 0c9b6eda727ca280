"""Rows from the page cache: a memory map of the file against ``preadv``, through the hdf5 backend.

Run: ``.venv/bin/python bench/io/mapped.py [--data /tmp/solar-compete/ptycho.h5] [--rows 1200]
[--rounds 5] [--out bench/io/mapped.json]``

The decision behind NOTE [ Mapped reads ] in io_backends/mapped.py, measured: one shuffled
epoch's worth of misses (``--rows`` random rows of every field of bench/compete's PtychoNN-shaped
file, sorted as a pass reads them) read by ``HDF5Backend.read_rows_to`` into one row place each,
as the loader reads them, with ``mmap=True`` and ``mmap=False`` (``preadv``), alternated round by
round, the file warm in the page cache (the map's pages touched once before, as after a first
epoch). Also: the same mapped reads split over 2 and 4 request threads (as ``io_threads`` splits
a pass's reads), and the machine's ``memcpy`` bandwidth in the same run.
Reported: GB/s per way (best and median round) and the ratios. The machine is shared: compare
ratios within one run, next to its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from solar.fileio import write_text_atomic
from solar.io_backends.hdf5 import HDF5Backend
from solar.synthetic import write_ptycho_h5


def _places(backend: HDF5Backend, keys: list, n: int) -> dict:
    info = {k: backend.info(k) for k in keys}
    return {k: [np.empty(info[k].row_shape, info[k].dtype) for _ in range(n)] for k in keys}


def read_all(backend: HDF5Backend, keys: list, rows: np.ndarray, places: dict, threads: int = 1,
             pool: ThreadPoolExecutor | None = None) -> float:
    """Seconds to read ``rows`` of every key into their places, split over ``threads``."""
    ranges = np.stack([rows, rows + 1], axis=1)
    cut = np.linspace(0, len(rows), threads + 1).round().astype(int)
    t0 = time.perf_counter()
    for k in keys:
        if threads == 1:
            backend.read_rows_to(k, ranges, places[k])
        else:
            list(pool.map(lambda i: backend.read_rows_to(k, ranges[cut[i]:cut[i + 1]],
                                                         places[k][cut[i]:cut[i + 1]]), range(threads)))
    return time.perf_counter() - t0


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/solar-compete/ptycho.h5")
    ap.add_argument("--rows", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not os.path.exists(args.data):
        os.makedirs(os.path.dirname(args.data), exist_ok=True)
        write_ptycho_h5(args.data, 2048, size=128, progress=False)
    load_start = os.getloadavg()
    ways = {"mmap": HDF5Backend(args.data, mmap=True), "preadv": HDF5Backend(args.data, mmap=False)}
    keys = [k for k in ways["mmap"].keys() if ways["mmap"].mapped(k)]
    n = ways["mmap"].info(keys[0]).shape[0]
    nbytes = args.rows * sum(ways["mmap"].info(k).row_nbytes for k in keys)
    places = _places(ways["mmap"], keys, args.rows)
    every = np.arange(n)
    for b in ways.values():  # warm: the file in the page cache, the map's pages touched once
        read_all(b, keys, every, _places(b, keys, n))
        read_all(b, keys, every[: args.rows], places)
    pool = ThreadPoolExecutor(4)
    rng = np.random.default_rng(0)
    secs: dict[str, list] = {w: [] for w in ("mmap", "preadv", "mmap-2-threads", "mmap-4-threads")}
    for _ in range(args.rounds):
        rows = np.sort(rng.permutation(n)[: args.rows])
        secs["mmap"].append(read_all(ways["mmap"], keys, rows, places))
        secs["preadv"].append(read_all(ways["preadv"], keys, rows, places))
        secs["mmap-2-threads"].append(read_all(ways["mmap"], keys, rows, places, 2, pool))
        secs["mmap-4-threads"].append(read_all(ways["mmap"], keys, rows, places, 4, pool))
    bw = memcpy_bandwidth()
    gbps = {w: {"best": nbytes / min(s) / 1e9, "median": nbytes / float(np.median(s)) / 1e9, "seconds": s}
            for w, s in secs.items()}
    ratios = {"mmap_over_preadv": gbps["mmap"]["median"] / gbps["preadv"]["median"],
              "mmap_over_memcpy": gbps["mmap"]["median"] / (bw / 1e9),
              "mmap_2_threads_over_1": gbps["mmap-2-threads"]["median"] / gbps["mmap"]["median"],
              "mmap_4_threads_over_1": gbps["mmap-4-threads"]["median"] / gbps["mmap"]["median"]}
    load = os.getloadavg()
    print(f"{nbytes / 1e6:.0f} MB of rows per round; memcpy {bw / 1e9:.2f} GB/s")
    for w, g in gbps.items():
        print(f"{w:15s} best {g['best']:6.2f} GB/s  median {g['median']:6.2f} GB/s")
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"load average at start {load_start[0]:.2f}, at end {load[0]:.2f}")
    for b in ways.values():
        b.close()
    if args.out:
        config = {**vars(args), "keys": keys, "bytes_per_round": nbytes, "memcpy_Bps": bw,
                  "loadavg_start": load_start, "loadavg_end": load, "cpus": os.cpu_count()}
        write_text_atomic(args.out, json.dumps({"config": config, "GBps": gbps, "ratios": ratios}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
