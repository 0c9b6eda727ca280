"""Shared by the `solar ingest` tests (tests/test_ingest_*.py): inputs, a reader of any field, a
crash at a chosen write, and `mpirun -n 2 solar ingest` as a subprocess (optionally slowed down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from solar import codec
from solar.ingest import ingest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLAR = os.path.join(os.path.dirname(sys.executable), "solar")
SLOWLY = os.path.join(ROOT, "tests", "ingest_slowly.py")  # `solar` with each ingest batch slowed down


def _npy_inputs(d, sizes=(13, 7, 20), shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    arrays, paths = [], []
    for i, n in enumerate(sizes):
        a = rng.standard_normal((n, *shape)).astype(np.float32)
        p = os.path.join(d, f"part{i}.npy")
        np.save(p, a)
        arrays.append(a)
        paths.append(p)
    return paths, np.concatenate(arrays)


def _read_field(path, name):
    with h5py.File(path, "r") as f:
        if isinstance(f[name], h5py.Dataset):
            return f[name][:]
        data, off = f[name]["data"][:], f[name]["offsets"][:]
        return np.stack([codec.decode(data[off[i]:off[i + 1]]).numpy() for i in range(len(off) - 1)])


def _crash(paths, out, monkeypatch, writes, **kw):
    """An ingest (batches of 8, a commit after each) that dies in its checksum number ``writes + 1``."""
    import solar.ingest.write as ing

    real, calls = ing.sample_checksum, {"n": 0}

    def dying(buf):
        calls["n"] += 1
        if calls["n"] > writes:
            raise KeyboardInterrupt
        return real(buf)

    monkeypatch.setattr(ing, "sample_checksum", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest(paths, out, batch_size=8, progress=False, commit_interval=0, **kw)
    monkeypatch.setattr(ing, "sample_checksum", real)


def _children(pid: int) -> list[int]:
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _ranks_after_commits(proc, journal: str, commits: int = 3, then: str = "it could be killed") -> list[int]:
    """Wait until the running `mpirun ... solar ingest` has committed ``commits`` batches (its
    journal says so), then the pids of its two rank processes (the job must still be running)."""
    deadline, done = time.monotonic() + 120, 0
    while time.monotonic() < deadline and proc.poll() is None and done < commits:
        try:
            with open(journal) as f:
                done = json.load(f)["batches_done"]
        except (OSError, ValueError, KeyError):
            pass
        if done < commits:
            time.sleep(0.05)
    assert proc.poll() is None, f"ingest ended before {then}: {proc.communicate()}"
    ranks = [p for p in _children(proc.pid) if "python" in open(f"/proc/{p}/cmdline").read()]
    assert len(ranks) == 2, f"expected 2 rank processes under mpirun, found {ranks}"
    return ranks


def _mpirun_env() -> dict:
    """An environment for a nested `mpirun` (as root, oversubscribed)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "SOLAR_EXPECT_WORLD"):
        env.pop(var, None)
    return env


def _mpirun(args, env, delay=0.25, **kw):
    """`mpirun -n 2 solar ingest ARGS`, each batch ``delay`` seconds slower (so a test can act mid-run)."""
    solar = [sys.executable, SLOWLY, str(delay)] if delay else [SOLAR]
    return subprocess.Popen(["mpirun", "-n", "2", "--bind-to", "none", *solar, "ingest", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)
