"""The Python examples in README.md and docs/*.md run as written.

Each ```python block is found by the first line of its code, run in a fresh directory holding
the files it names (a small synthetic train.h5 ...), with stand-ins only for what a reader
supplies (``epochs``, a model step, credentials). ``device="cuda"`` becomes ``"cpu"`` (no GPU
here), and ``...`` in a loop body stays a no-op. A block that no longer matches an entry here
fails the coverage test, so a new or edited example is either run or listed as not runnable.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Blocks that need what this machine has not: a GPU, DALI, credentials or a remote store.
NOT_RUN = {
    "import nvidia.dali.fn as fn": "needs NVIDIA DALI (tests/test_dali.py runs DALILoader on a stand-in)",
    "open_backend(\"s3://bucket/train.h5\"": "placeholder credentials and hosts",
    "ds = solar.H5Dataset(\"s3://bucket/train.h5\"": "placeholder credentials and hosts",
    "import aiohttp": "placeholder credentials (the timeouts are tested in tests/test_backends_fsspec.py)",
    "fut = writer.save(state, step, lazy=True)": "a fragment of a training step (tests/test_checkpoint.py)",
    "from solar.testing.codecs import CodecTests": "a class for a third-party codec's own tests",
}


def _blocks():
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            yield f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)


def _ptycho(name, n=128):
    from solar.synthetic import write_ptycho_h5

    write_ptycho_h5(name, n, 16, seed=0, progress=False)


def _setup_loader(tmp):
    _ptycho("train.h5")
    _ptycho("ptycho.h5")
    return {"epochs": 2}


def _setup_compressed(tmp):
    from solar.ingest import ingest

    np.save("raw.npy", np.random.default_rng(0).standard_normal((64, 16, 16)).astype(np.float32))
    ingest(["raw.npy"], "ptycho-c.h5", rel_error=1e-3, progress=False)
    import torch.utils.data as tud

    import solar

    return {"sampler": tud.RandomSampler(range(64)), "solar": solar}


def _setup_checkpoint(tmp):
    import torch

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_one_step():
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()

    return {"steps": 401, "model": model, "opt": opt, "train_one_step": train_one_step,
            "__rewrite__": [("/scratch/run42/ckpt", str(tmp / "ckpt"))]}


def _setup_staging(tmp):
    from solar.checkpoint import CheckpointWriter

    return {"CheckpointWriter": CheckpointWriter,
            "__rewrite__": [("/lustre/run42/ckpt", str(tmp / "ckpt")), ("/local_nvme/run42", str(tmp / "stage"))],
            "__after__": "writer.close()"}


def _setup_codec(tmp):
    import solar.codec as sc

    rng = np.random.default_rng(1)
    np.save("sample.npy", np.cumsum(rng.standard_normal((32, 32)), axis=0))
    return {"blobs": [sc.encode(rng.standard_normal((8, 8)).astype(np.float32), abs_error=1e-2) for _ in range(3)]}


def _setup_storage(tmp):
    _ptycho("train.h5", 16)
    return {"buf": np.empty((1, 1, 16, 16), np.float32)}


def _setup_throttled(tmp):
    from solar.io_backends import open_backend
    from solar.io_backends.hdf5 import HDF5Backend

    _ptycho("train.h5", 16)
    return {"HDF5Backend": HDF5Backend, "open_backend": open_backend}


def _setup_nothing(tmp):
    return {}


RUN = {
    "import h5py, numpy as np": _setup_nothing,
    "import torch.utils.data as tud": _setup_loader,
    "ds = solar.H5Dataset(\"ptycho-c.h5\", device=\"cuda\")": _setup_compressed,
    "from solar.checkpoint import CheckpointWriter, load, list_versions": _setup_checkpoint,
    "writer = CheckpointWriter(\"/lustre/run42/ckpt\"": _setup_staging,
    "import numpy as np, solar.codec as sc": _setup_codec,
    "from solar.io_backends import open_backend": _setup_storage,
    "from solar.io_backends.throttled import ThrottledBackend": _setup_throttled,
}


def _entry(code: str, table: dict):
    first = code.lstrip().splitlines()[0]
    hits = [k for k in table if first.startswith(k)]
    return table[hits[0]] if hits else None


def test_every_example_is_run_or_listed():
    unknown = [where for where, code in _blocks() if _entry(code, RUN) is None and _entry(code, NOT_RUN) is None]
    assert not unknown, f"examples neither run nor listed in NOT_RUN: {unknown}"


@pytest.mark.parametrize("where, code", [b for b in _blocks() if _entry(b[1], RUN) is not None],
                         ids=lambda v: v if ":" in str(v) and "\n" not in str(v) else "")
def test_example_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = _entry(code, RUN)(tmp_path)
    for old, new in env.pop("__rewrite__", []):
        code = code.replace(old, new)
    after = env.pop("__after__", "")
    code = code.replace('device="cuda"', 'device="cpu"')
    exec(compile(code + "\n" + after, where, "exec"), {"__name__": "__docs__", **env})
