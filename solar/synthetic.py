"""Synthetic scientific datasets for the demo, tests and benchmarks.

Two PtychoNN-shaped generators, each sample an input field ``x`` (1 x H x W, float32) and two
targets, amplitude and phase, stacked as ``y`` (2 x H x W). Each sample is a pure function of
(seed, index): any rank can make any slice, and a parallel write is byte-identical to a serial one.

- ``ptycho_sample`` / ``ptycho_block`` (the tests' and benchmarks' data; their bytes are fixed):
  smooth objects (sums of Gaussian blobs), ``x`` the log-magnitude of the object's own Fourier
  transform. Realistic structure for codecs, but not a learning problem: an object and its
  shifted copy (or its conjugate twin) have the same ``x``, so a surrogate trained on it learns
  the mean target and nothing more.
- ``ptycho_posed_sample`` / ``ptycho_posed_block`` (the demo's): the target is a function of the
  input. A fixed probe (a soft disk with a phase curvature and a ramp, so not point-symmetric)
  illuminates an object of a five-parameter family (one Gaussian feature: its centre, width,
  amplitude dip and phase bump, the phase bump positive), and ``x`` is the log-magnitude of the
  exit wave's Fourier transform on a fixed scale. The probe pins the position and the positive
  phase excludes the twin, so nothing in the family shares another's ``x``.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["ptycho_sample", "ptycho_block", "ptycho_posed_sample", "ptycho_posed_block", "write_ptycho_h5"]


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
    return _block(ptycho_sample, start, stop, size, seed)


def _block(sample, start: int, stop: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*(sample(i, size, seed) for i in range(start, stop))) if stop > start else ((), ())
    x = np.stack(xs) if xs else np.empty((0, 1, size, size), np.float32)
    y = np.stack(ys) if ys else np.empty((0, 2, size, size), np.float32)
    return x, y


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres' coordinates in units of the field, -0.5..0.5 (x across, y down)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size - 0.5
    return xx, yy


def _probe(size: int) -> np.ndarray:
    """The fixed illumination: a disk of radius 0.3 with a soft edge, a phase curvature and a ramp
    (P(r) != P*(-r): the exit wave's twin is not another object's under the same probe)."""
    xx, yy = _grid(size)
    r2 = xx ** 2 + yy ** 2
    disk = 1 / (1 + np.exp((np.sqrt(r2) - 0.3) / 0.01))
    return disk * np.exp(1j * (3.0 * r2 + 1.0 * xx))


def ptycho_posed_sample(index: int, size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One sample whose target is a function of its input (module docstring): ``x`` the exit wave's
    log-magnitude diffraction, divided by ``log1p(size * size)`` (the largest possible value of
    ``log1p(|F|)``: about 1 at the centre), ``y`` the object's amplitude (0.2..1) and phase (0..2)."""
    rng = np.random.default_rng([seed, index, 1])  # (a stream of its own, apart from ptycho_sample's)
    xx, yy = _grid(size)
    cx, cy = rng.uniform(-0.15, 0.15, 2)
    width = rng.uniform(0.05, 0.15)
    feature = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * width * width))
    amp = 1 - rng.uniform(0.1, 0.8) * feature
    phase = rng.uniform(0.2, 2.0) * feature
    wave = _probe(size) * amp * np.exp(1j * phase)
    x = np.log1p(np.abs(np.fft.fftshift(np.fft.fft2(wave)))) / np.log1p(size * size)
    return x[None].astype(np.float32), np.stack([amp, phase]).astype(np.float32)


def ptycho_posed_block(start: int, stop: int, size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start..stop-1`` of :func:`ptycho_posed_sample`, stacked."""
    return _block(ptycho_posed_sample, start, stop, size, seed)


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
