"""Every code block of README.md and the guide (docs/*.md) runs as written.

Each page is one script: its ```python and ```bash blocks run in the order they appear, in a
fresh directory that the page's set-up fills with the small real files the page names (a
train.h5, .npy inputs, a checkpoint root ...). Python blocks share one namespace, so a later
block uses what an earlier one built; bash blocks run with the project's .venv on PATH, in the
same directory, with ``mpirun -n 4`` (or 8) run as ``mpirun -n 2``. A few stand-ins replace what
only a reader supplies (a model step, site paths such as /lustre, rewritten into the directory).

A python block whose first line is a comment naming a file (``# train.py``) is that file: it is
written, not run, and a later shell block runs it (``mpirun -n 4 python train.py``).

Blocks that need what this machine lacks (a GPU, DALI, Slurm, remote credentials) are listed in
NOT_RUN with the reason, by the start of their first line. ```text blocks are output shown to
the reader, not code. A fenced block without one of these three languages fails the test, and so
does a NOT_RUN entry that no block matches any more.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from servers import python_http_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV_BIN = pathlib.Path(sys.executable).parent
# The guide; docs/architecture.md is for developers, and its diagrams are not code.
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                              if p.name != "architecture.md")]
LANGS = {"python", "bash", "text"}

# Blocks that cannot run here, by the start of their first line.
NOT_RUN = {
    "git clone <this repository> solar": "the set-up itself: `make test` runs it before these tests",
    "make demo": "tests/test_demo.py runs `solar demo` on a small configuration",
    "#!/bin/bash": "needs Slurm (srun); the same script runs under mpirun in running.md's other blocks",
    "ds = solar.H5Dataset(\"train.h5\", device=\"cuda\")": "needs a CUDA device",
}

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_hwloc_base_binding_policy": "none",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


def _blocks(page: str):
    """(line, language, code) of every fenced block of a page."""
    text = (ROOT / page).read_text()
    for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M):
        yield text[:m.start()].count("\n") + 1, m.group(1).strip(), m.group(2)


def _skipped(code: str) -> str | None:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    return next((why for start, why in NOT_RUN.items() if first.startswith(start)), None)


# ---- set-ups: the small real files each page names ---------------------------------------------

def _ptycho(name, n=128, size=16):
    from solar.synthetic import write_ptycho_h5

    write_ptycho_h5(name, n, size, seed=0, progress=False)


def _train_h5(request):
    _ptycho("train.h5")
    return {}


def _readme(request):
    _ptycho("train.h5")
    rng = np.random.default_rng(0)
    for i in range(2):
        np.save(f"run{i}.npy", rng.standard_normal((16, 8, 8)).astype(np.float32))
    from solar.checkpoint import CheckpointWriter
    import torch

    with CheckpointWriter("ckpt") as w:
        for step in (100, 200):
            w.save({"w": torch.full((4,), float(step)), "step": step}, step)
    return {}


def _loader_page(request):
    from solar.ingest import ingest

    _ptycho("train.h5")
    ingest(["train.h5"], "train-c.h5", rel_error=1e-3, progress=False)
    return {}


def _storage_page(request):
    rng = np.random.default_rng(0)
    os.makedirs("data")
    for i in range(4):
        np.save(f"data/run{i}.npy", rng.standard_normal((16, 8, 8)).astype(np.float32))
    np.save("X.npy", rng.standard_normal((32, 1, 8, 8)).astype(np.float32))
    np.save("Y.npy", rng.standard_normal((32, 2)).astype(np.float32))
    import h5py

    for name in ("run1.h5", "run2.h5"):
        with h5py.File(name, "w") as f:
            f["entry/data"] = rng.standard_normal((24, 8, 8)).astype(np.float32)
    stack = contextlib.ExitStack()  # the HTTP example reads the train.h5 the page's ingest writes
    request.addfinalizer(stack.close)
    url = stack.enter_context(python_http_server(os.getcwd()))
    bucket, opts = request.getfixturevalue("s3_root")  # the S3 example: moto on 127.0.0.1 (tests/servers.py)
    import s3fs

    _ptycho("s3-train.h5", 16)
    s3fs.S3FileSystem(skip_instance_cache=True, **opts).put("s3-train.h5", f"{bucket}/train.h5")
    return {"__rewrite__": [("https://data.example.org", url), ("s3://bucket", bucket),
                            ('"key": "...", "secret": "..."', '"key": "testing", "secret": "testing"'),
                            ("https://s3.example.org", opts["client_kwargs"]["endpoint_url"])]}


def _codec_page(request):
    rng = np.random.default_rng(1)
    np.save("sample.npy", np.cumsum(rng.standard_normal((32, 32)), axis=0))
    _ptycho("train.h5", 32)
    return {}


def _checkpoint_page(request):
    import torch

    _ptycho("train.h5")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_one_step(*_):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()

    return {"model": model, "opt": opt, "train_one_step": train_one_step}


def _nothing(request):
    return {}


SETUP = {
    "README.md": _readme,
    "docs/index.md": _nothing,
    "docs/install.md": _nothing,
    "docs/loader.md": _loader_page,
    "docs/tuning.md": _train_h5,
    "docs/storage.md": _storage_page,
    "docs/codec.md": _codec_page,
    "docs/checkpoint.md": _checkpoint_page,
    "docs/checkpoint-job.md": _train_h5,
    "docs/running.md": _nothing,
    "docs/cli.md": _nothing,
    "docs/troubleshooting.md": _nothing,
    "docs/schedule.md": _nothing,
    "docs/codec-internals.md": _nothing,
    "docs/internals.md": _train_h5,
}

# Site paths a reader replaces with their own; here they point into the test's directory.
REWRITE = [("/lustre/run42/", "lustre/run42/"), ("/scratch/run42/", "scratch/run42/"),
           ("/local_nvme/run42", "local_nvme/run42"), ("/local/nvme/solar", "local_nvme")]


def _shell(code: str, where: str, cwd: pathlib.Path) -> None:
    code = re.sub(r"mpirun -n (4|8)\b", "mpirun -n 2", code)
    env = {**os.environ, **MPI_ENV, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "MPLBACKEND": "Agg"}
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "SOLAR_EXPECT_WORLD"):
        env.pop(var, None)
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, f"{where} failed (exit {r.returncode}):\n{code}\n--- stdout\n{r.stdout[-3000:]}" \
                              f"\n--- stderr\n{r.stderr[-3000:]}"


def _runnable(page: str) -> bool:
    return any(lang in ("python", "bash") and not _skipped(code) for _, lang, code in _blocks(page))


def test_every_block_has_a_language_and_every_exception_is_used():
    untagged = [f"{p}:{line} ({lang or 'no language'})" for p in PAGES for line, lang, _ in _blocks(p)
                if lang not in LANGS]
    assert not untagged, f"fenced blocks must be python (run), bash (run) or text (output): {untagged}"
    used = {start for p in PAGES for _, lang, code in _blocks(p) for start in NOT_RUN
            if code.lstrip().startswith(start)}
    assert set(NOT_RUN) == used, f"NOT_RUN entries no block matches any more: {set(NOT_RUN) - used}"
    assert set(PAGES) <= set(SETUP), f"pages without a set-up here: {set(PAGES) - set(SETUP)}"


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)])
def test_page_runs_as_written(page, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__docs__", **SETUP[page](request)}
    rewrite = REWRITE + namespace.pop("__rewrite__", [])
    for line, lang, code in _blocks(page):
        if lang not in ("python", "bash") or _skipped(code):
            continue
        for old, new in rewrite:
            code = code.replace(old, new)
        where = f"{page}:{line}"
        script = re.match(r"# (\S+\.py)\n", code)
        if script:  # a script file the page's shell blocks run
            (tmp_path / script.group(1)).write_text(code)
        elif lang == "bash":
            _shell(code, where, tmp_path)
        else:
            exec(compile(code, where, "exec"), namespace)
