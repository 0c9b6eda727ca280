"""Synthetic scientific datasets for the demo, tests and benchmarks.

``ptycho_like`` makes PtychoNN-shaped samples: a diffraction-like input field ``x`` (1 x H x W,
float32) and two targets, amplitude and phase, stacked as ``y`` (2 x H x W). Fields are smooth
(sums of Gaussian blobs with a speckle term), like the real data, so lossy codecs see realistic
structure. Each sample is a pure function of (seed, index): any rank can make any slice, and a
parallel write is byte-identical to a serial one.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["ptycho_sample", "ptycho_block", "write_ptycho_h5"]


def ptycho_sample(index: int, size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, index])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    amp = np.zeros((size, size), np.float32)
    phase = np.zeros((size, size), np.float32)
    for _ in range(4):
        cx, cy, w = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.05, 0.2)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * w * w))
        amp += rng.uniform(0.3, 1.0) * blob
        phase += rng.uniform(-np.pi / 2, np.pi / 2) * blob
    obj = amp * np.exp(1j * phase)
    diff = np.abs(np.fft.fftshift(np.fft.fft2(obj))).astype(np.float32)
    x = np.log1p(diff)[None]
    y = np.stack([amp, phase])
    return x.astype(np.float32), y.astype(np.float32)


def ptycho_block(start: int, stop: int, size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*(ptycho_sample(i, size, seed) for i in range(start, stop))) if stop > start else ((), ())
    x = np.stack(xs) if xs else np.empty((0, 1, size, size), np.float32)
    y = np.stack(ys) if ys else np.empty((0, 2, size, size), np.float32)
    return x, y


def write_ptycho_h5(path: str, n: int, size: int = 64, seed: int = 0, comm=None, progress: bool = True,
                    block: int = 64) -> None:
    """Write ``n`` samples to ``path`` (fields ``x`` and ``y``), in parallel when ``comm`` is given.

    Under MPI every rank writes a contiguous share with collective I/O; the file is written to
    ``path + '.tmp'`` and renamed only when complete, so a crash never leaves a partial dataset.
    """
    import h5py  # heavy; only writing the file needs it
    from tqdm import tqdm  # the progress bar; imported with h5py, when a file is written

    rank, size_ = (comm.rank, comm.size) if comm is not None else (0, 1)
    tmp = path + ".tmp"
    kw = {"driver": "mpio", "comm": comm} if comm is not None else {}
    lo, hi = rank * n // size_, (rank + 1) * n // size_
    with h5py.File(tmp, "w", **kw) as f:
        dx = f.create_dataset("x", shape=(n, 1, size, size), dtype="f4")
        dy = f.create_dataset("y", shape=(n, 2, size, size), dtype="f4")
        f.attrs["solar_synthetic"] = "ptycho_like"
        f.attrs["seed"] = seed
        # every rank must make the same number of collective calls
        nblocks = -(-((n + size_ - 1) // size_) // block)
        bar = tqdm(total=n, desc="writing", unit="sample", disable=not progress or rank != 0)
        for b in range(nblocks):
            s, e = min(lo + b * block, hi), min(lo + (b + 1) * block, hi)
            x, y = ptycho_block(s, e, size, seed)
            if comm is not None:
                with dx.collective:
                    dx[s:e] = x
                with dy.collective:
                    dy[s:e] = y
            else:
                dx[s:e] = x
                dy[s:e] = y
            bar.update((e - s) * size_)
        bar.close()
    if comm is not None:
        comm.Barrier()
    if rank == 0:
        os.replace(tmp, path)
    if comm is not None:
        comm.Barrier()
