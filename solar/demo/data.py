"""The demo's data: a PtychoNN-like training set as .npy files (``solar.synthetic.ptycho_posed_block``:
the target is a function of the input), ingested by ``solar ingest x=X.npy y=Y.npy`` (under
``mpirun -n P`` when MPI and parallel HDF5 are here, else in one process) into a raw SOLAR file and
one compressed file per error bound; a held-out validation set; the raw training set's statistics
(``norm.npz``), which the surrogate normalizes with, and the mean predictor's validation loss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from typing import NamedTuple

import numpy as np

import solar.ingest
from solar.capabilities import h5py_has_mpi
from solar.synthetic import ptycho_posed_block, ptycho_posed_sample

#: OpenMPI as root, more ranks than cores, no CMA (containers forbid it)
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


class Launcher(NamedTuple):
    """How each step of the demo runs: ``ranks`` processes under mpirun, or one alone."""

    ranks: int
    why: str  # what the demo says about it

    def command(self, *args: str) -> list[str]:
        py = [sys.executable, *args]
        return ["mpirun", "-n", str(self.ranks), "--bind-to", "none", *py] if self.ranks > 1 else py

    def run(self, *args: str, quiet: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
        env = dict(os.environ, **MPI_ENV) if self.ranks > 1 else os.environ.copy()
        return subprocess.run(self.command(*args), env=env, timeout=timeout, text=True,
                              stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE if quiet else None)


def launcher(ranks: int) -> Launcher:
    """``mpirun -n ranks`` when mpirun and MPI-enabled h5py are here, else one process (and why)."""
    if ranks <= 1:
        return Launcher(1, "1 process (--ranks 1)")
    if shutil.which("mpirun") is None or not h5py_has_mpi():
        return Launcher(1, "1 process: mpirun or MPI-enabled h5py not found, so every step runs without MPI "
                           "(run `make setup` as root for OpenMPI and parallel HDF5)")
    return Launcher(ranks, f"mpirun -n {ranks}")


class DemoData(NamedTuple):
    raw: str  # the raw SOLAR file
    compressed: dict[float, str]  # bound -> compressed SOLAR file
    ratios: dict[float, float]  # bound -> compression ratio
    val: str  # .npz with x and y
    nbytes: int  # bytes of the training set's samples
    norm: str  # .npz: the raw training set's statistics (:func:`statistics`)
    mean_val_loss: float  # validation MSE of the training set's mean target, the floor to beat


def statistics(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """What the surrogate normalizes with (``solar.demo.model``): the per-pixel mean of the inputs
    and one scale (their per-pixel standard deviation averaged: no pixel's own, which would blow a
    nearly constant pixel's codec error up), the per-pixel mean and standard deviation of the
    targets (floored at a thousandth of their average, for pixels no sample changes)."""
    x_std, y_std = x.std(0, dtype=np.float64), y.std(0, dtype=np.float64)
    return {"x_mean": x.mean(0, dtype=np.float64).astype(np.float32),
            "x_scale": np.float32(max(float(x_std.mean()), 1e-12)),
            "y_mean": y.mean(0, dtype=np.float64).astype(np.float32),
            "y_scale": (y_std + 1e-3 * y_std.mean() + 1e-12).astype(np.float32)}


class Inputs(NamedTuple):
    x: str  # X.npy
    y: str  # Y.npy
    val: str  # val.npz
    norm: str  # norm.npz
    mean_val_loss: float


def write_inputs(out: str, samples: int, val_samples: int, size: int, seed: int) -> Inputs:
    """X.npy (n, 1, size, size), Y.npy (n, 2, size, size), val.npz and norm.npz; the validation
    samples are the generator's next indices, never trained on."""
    x, y = ptycho_posed_block(0, samples, size, seed)
    paths = [os.path.join(out, name) for name in ("X.npy", "Y.npy", "val.npz", "norm.npz")]
    np.save(paths[0], x)
    np.save(paths[1], y)
    vx, vy = ptycho_posed_block(samples, samples + val_samples, size, seed)
    np.savez(paths[2], x=vx, y=vy)
    stats = statistics(x, y)
    np.savez(paths[3], **stats)
    mean_loss = float(np.mean((vy.astype(np.float64) - stats["y_mean"]) ** 2))
    return Inputs(*paths, mean_loss)


def ingest(run: Launcher, inputs: tuple[str, str], output: str, bound: float | None) -> dict:
    """``mpirun -n P solar ingest x=X.npy y=Y.npy -o output [--rel-error bound]``, or in one process
    the same ``solar.ingest.ingest`` call; its report."""
    named = [f"x={inputs[0]}", f"y={inputs[1]}"]
    if run.ranks == 1:
        rep = solar.ingest.ingest(named, output, rel_error=bound, overwrite=True, comm=None, progress=False)
        return dict(asdict(rep), ratio=rep.ratio)
    args = ["-m", "solar.cli", "ingest", *named, "-o", output, "--overwrite",
            "--no-progress", "--json"]
    done = run.run(*args, *(["--rel-error", f"{bound:g}"] if bound else []), quiet=True)
    if done.returncode != 0:
        raise RuntimeError(f"solar ingest -o {output} failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_raw(path: str, size: int, seed: int) -> tuple[list[int], bool]:
    """Whether samples of the raw file equal the generator's (first, middle, last)."""
    import h5py  # heavy; only the read-back needs it

    with h5py.File(path, "r") as f:
        n = f["x"].shape[0]
        probe = [0, n // 2, n - 1]
        return probe, all(np.array_equal(f["x"][i], ptycho_posed_sample(i, size, seed)[0]) and
                          np.array_equal(f["y"][i], ptycho_posed_sample(i, size, seed)[1]) for i in probe)


def build(run: Launcher, out: str, samples: int, val_samples: int, size: int, seed: int,
          bounds: list[float]) -> DemoData:
    """Write the inputs and ingest them: raw (``ptycho.h5``) and one file per bound."""
    inputs = write_inputs(out, samples, val_samples, size, seed)
    raw = os.path.join(out, "ptycho.h5")
    report = ingest(run, (inputs.x, inputs.y), raw, None)
    print(f"  raw           {raw}: {report['num_samples']} samples, {report['stored_bytes'] / 2**20:.1f} MiB, "
          f"{report['seconds']:.1f} s on {report['world_size']} rank(s)")
    compressed, ratios = {}, {}
    for b in bounds:
        path = os.path.join(out, f"ptycho-rel{b:.0e}.h5")
        r = ingest(run, (inputs.x, inputs.y), path, b)
        compressed[b], ratios[b] = path, float(r["ratio"])
        print(f"  rel {b:<9.0e} {path}: {r['stored_bytes'] / 2**20:.2f} MiB (x{r['ratio']:.1f}), "
              f"{r['seconds']:.1f} s on {r['world_size']} rank(s)")
    return DemoData(raw, compressed, ratios, inputs.val, int(report["input_bytes"]), inputs.norm,
                    inputs.mean_val_loss)
