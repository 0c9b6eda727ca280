"""Benchmark fields: synthetic smooth and turbulent 3-D fields, and real data a package ships.

The synthetic fields follow ``shared/research/compression.md`` section 4.1 (seeded, so every run
compresses the same bytes). The real fields are matplotlib's shipped sample data (no download).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

__all__ = ["smooth_sines", "turbulence", "real_fields", "all_fields"]


def smooth_sines(n: int = 128, seed: int = 12345) -> np.ndarray:
    """Sum of 4 products of sines (wavenumbers 1-4, random phases/amplitudes) + N(0, 0.01) noise."""
    rng = np.random.default_rng(seed)
    g = np.linspace(0, 2 * np.pi, n, endpoint=False, dtype=np.float64)
    z, y, x = np.meshgrid(g, g, g, indexing="ij")
    f = np.zeros((n, n, n))
    for _ in range(4):
        kx, ky, kz = rng.integers(1, 5, 3)
        px, py, pz = rng.uniform(0, 2 * np.pi, 3)
        f += rng.uniform(0.5, 1.5) * np.sin(kx * x + px) * np.sin(ky * y + py) * np.sin(kz * z + pz)
    f += rng.normal(0, 0.01, f.shape)
    return f.astype(np.float32)


def turbulence(n: int = 128, seed: int = 12345, slope: float = -11 / 3) -> np.ndarray:
    """Gaussian random field with power spectrum k^slope (E(k) ~ k^-5/3): turbulence-like roughness."""
    rng = np.random.default_rng(seed)
    k = np.fft.fftfreq(n) * n
    kz, ky, kx = np.meshgrid(k, k, np.fft.rfftfreq(n) * n, indexing="ij")
    kk = np.sqrt(kx**2 + ky**2 + kz**2)
    kk[0, 0, 0] = 1.0
    amp = kk ** (slope / 2)
    amp[0, 0, 0] = 0.0
    noise = rng.standard_normal((n, n, n // 2 + 1)) + 1j * rng.standard_normal((n, n, n // 2 + 1))
    f = np.fft.irfftn(noise * amp, s=(n, n, n))
    return (f / f.std()).astype(np.float32)


def _sample_data() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data"


def real_fields() -> dict[str, np.ndarray]:
    """matplotlib's shipped sample data: DEM elevation, topography/bathymetry, an MRI slice."""
    d = _sample_data()
    out = {}
    with np.load(d / "jacksboro_fault_dem.npz") as z:
        out["jacksboro_dem"] = z["elevation"].astype(np.float32)
    with np.load(d / "topobathy.npz") as z:
        out["topobathy"] = z["topo"].astype(np.float32)
    with gzip.open(d / "s1045.ima.gz") as fh:
        out["mri_s1045"] = np.frombuffer(fh.read(), ">u2").reshape(256, 256).astype(np.float32)
    return out


def all_fields(n: int = 128) -> dict[str, np.ndarray]:
    return {f"smooth_sines_{n}^3": smooth_sines(n), f"turbulence_{n}^3": turbulence(n), **real_fields()}
