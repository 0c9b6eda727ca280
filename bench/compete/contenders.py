"""The loaders bench/compete/run.py runs, each as a new user would set it up from its documentation.

A contender is built once (with its own conversion of the data, done before any timing) and gives
one iterable per epoch whose batches are ``(x, y)`` tensors of ``batch`` samples, shuffled.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from typing import Any, Callable, NamedTuple

import h5py
import numpy as np
import torch
import torch.utils.data as tud

import solar


class Setup(NamedTuple):
    """What every contender reads and how."""

    data: str  # the local HDF5 file (the source of every conversion)
    samples: int
    size: int
    batch: int
    buffer: str
    where: str  # "local" or "s3"
    endpoint: str
    bucket: str

    @property
    def storage_options(self) -> dict:
        return {"key": "S3RVER", "secret": "S3RVER", "client_kwargs": {"endpoint_url": self.endpoint}} \
            if self.where == "s3" else {}  # (s3rver's fixed credentials)

    @property
    def h5_url(self) -> str:
        return f"s3://{self.bucket}/{os.path.basename(self.data)}" if self.where == "s3" else self.data


def drop_page_cache(paths: list[str]) -> None:
    """Evict ``paths`` from the page cache (only these files)."""
    for p in paths:  # (written long before: no dirty pages to write back first)
        with open(p, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def upload(setup: Setup, local: str, url: str) -> None:
    """Put ``local`` (a file, or a directory's files) at ``url`` on the S3 server unless it is
    there, one plain PUT per file (s3fs's multipart upload of LitData's 64 MB chunks failed on
    s3rver: "We encountered an internal error")."""
    import boto3

    so = setup.storage_options
    s3 = boto3.client("s3", endpoint_url=so["client_kwargs"]["endpoint_url"], aws_access_key_id=so["key"],
                      aws_secret_access_key=so["secret"], region_name="us-east-1")
    bucket, _, key = url.removeprefix("s3://").partition("/")
    files = [(local, key)] if os.path.isfile(local) else \
        [(os.path.join(local, f), f"{key}/{f}") for f in sorted(os.listdir(local))]
    for path, k in files:
        try:
            if s3.head_object(Bucket=bucket, Key=k)["ContentLength"] == os.path.getsize(path):
                continue
        except s3.exceptions.ClientError:
            pass
        with open(path, "rb") as f:
            s3.put_object(Bucket=bucket, Key=k, Body=f)


def s3_env(setup: Setup) -> None:
    """The S3 server's endpoint and credentials as boto3 reads them from the environment (how
    Streaming is told where S3 is)."""
    so = setup.storage_options
    os.environ.update({"S3_ENDPOINT_URL": so["client_kwargs"]["endpoint_url"], "AWS_ACCESS_KEY_ID": so["key"],
                       "AWS_SECRET_ACCESS_KEY": so["secret"], "AWS_DEFAULT_REGION": "us-east-1"})


class H5PerSample(tud.Dataset):
    """The usual PyTorch HDF5 dataset: the file opened lazily in the process that reads (each
    worker its own), one h5py read per field per sample."""

    def __init__(self, url: str, storage_options: dict) -> None:
        self.url, self.storage_options = url, storage_options
        self._f = self._pid = None
        with self._open() as f:
            self.n = f["x"].shape[0]

    def _open(self):
        if self.url.startswith("s3://"):
            import fsspec

            return h5py.File(fsspec.open(self.url, "rb", **self.storage_options).open(), "r")
        return h5py.File(self.url, "r")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self._pid != os.getpid():
            self._f, self._pid = self._open(), os.getpid()
        return torch.from_numpy(self._f["x"][i]), torch.from_numpy(self._f["y"][i])

    def __getstate__(self):
        return {**self.__dict__, "_f": None, "_pid": None}


class Contender:
    """One loader: ``epoch(e)`` gives epoch ``e``'s batches; ``files`` are what it reads locally."""

    version = ""

    def __init__(self, setup: Setup, name: str) -> None:
        self.setup, self.name = setup, name
        self.files = [setup.data] if setup.where == "local" else []

    def epoch(self, e: int):
        raise NotImplementedError

    def drop_cache(self) -> None:
        drop_page_cache([f for f in self.files if os.path.exists(f)])

    def close(self) -> None:
        pass


class Solar(Contender):
    """``solar.DataLoader`` over ``solar.H5Dataset`` (the README's usage), ``buffer=`` the issue's;
    ``solar-staged-w0`` (for ``--where s3``) with ``backend_options={"stage": <a fresh directory>}``."""

    version = solar.__version__

    def __init__(self, setup: Setup, name: str) -> None:
        super().__init__(setup, name)
        options = dict(setup.storage_options)
        self.stage = None
        if "staged" in name:  # NOTE [ Staging a remote file ]: a fresh node-local directory per run
            self.stage = options["stage"] = tempfile.mkdtemp(prefix="solar-stage-")
        self.ds = solar.H5Dataset(setup.h5_url, ("x", "y"), backend_options=options or None)
        self.loader = solar.DataLoader(self.ds, batch_size=setup.batch, num_workers=_workers(name), shuffle=True,
                                       distributed=True, buffer=setup.buffer)

    def epoch(self, e: int):
        self.loader.set_epoch(e)
        return self.loader

    def drop_cache(self) -> None:
        # pages mapped by this process (NOTE [ Mapped reads ]) are never evicted: unmap them first
        mapping = getattr(self.ds.backend, "_mapping", lambda: None)() if self.files else None
        if mapping is not None:
            mapping.drop_pages()
        super().drop_cache()

    def close(self) -> None:
        self.ds.close()
        if self.stage is not None:
            os.rmdir(self.stage)  # (the copy has no name: the directory is empty)


class Torch(Contender):
    """``torch.utils.data.DataLoader`` over :class:`H5PerSample`, ``shuffle=True``."""

    version = torch.__version__
    loader_class: Callable[..., Any] = tud.DataLoader

    def __init__(self, setup: Setup, name: str) -> None:
        super().__init__(setup, name)
        ds = H5PerSample(setup.h5_url, setup.storage_options)
        self.loader = self.loader_class(ds, batch_size=setup.batch, shuffle=True, num_workers=_workers(name),
                                        generator=torch.Generator().manual_seed(0))

    def epoch(self, e: int):
        return self.loader


class Stateful(Torch):
    """torchdata's ``StatefulDataLoader`` (torch's, with a ``state_dict``) over the same dataset."""

    def __init__(self, setup: Setup, name: str) -> None:
        from torchdata import __version__
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.version = __version__
        self.loader_class = StatefulDataLoader
        super().__init__(setup, name)


class LitData(Contender):
    """LitData: ``litdata.optimize`` into chunks once, then ``StreamingDataset(shuffle=True)`` and
    ``StreamingDataLoader``; ``litdata`` its defaults, ``litdata-tuned`` with ``batch_decode=0``."""

    def __init__(self, setup: Setup, name: str) -> None:
        import litdata

        super().__init__(setup, name)
        self.version = litdata.__version__
        local = os.path.splitext(setup.data)[0] + "-litdata"
        if not os.path.exists(os.path.join(local, "index.json")):
            litdata.optimize(fn=_sample_of(setup.data), inputs=list(range(setup.samples)), output_dir=local,
                             chunk_bytes="64MB", num_workers=1, verbose=False)
        kw = {"batch_decode": 0} if name.endswith("tuned") else {}
        src = local
        if setup.where == "s3":
            src = f"s3://{setup.bucket}/{os.path.basename(local)}"
            upload(setup, local, src)
            so = setup.storage_options  # (boto3's client arguments, not s3fs's)
            kw["storage_options"] = {"endpoint_url": so["client_kwargs"]["endpoint_url"],
                                     "aws_access_key_id": so["key"], "aws_secret_access_key": so["secret"]}
            kw["cache_dir"] = tempfile.mkdtemp(prefix="litdata-cache-")
            self.files = []
            self._obstore_off()
        else:
            self.files = glob.glob(os.path.join(local, "*.bin"))
        self.ds = litdata.StreamingDataset(src, shuffle=True, **kw)
        self.loader = litdata.StreamingDataLoader(self.ds, batch_size=setup.batch)

    @staticmethod
    def _obstore_off() -> None:
        """LitData downloads chunks with obstore when it is installed, and obstore refuses a
        plain-http endpoint such as the S3 server's on 127.0.0.1: use its boto3 path instead."""
        from litdata.streaming import downloader

        downloader._OBSTORE_AVAILABLE = False

    def epoch(self, e: int):
        return ((b["x"], b["y"]) for b in self.loader)


class Streaming(Contender):
    """MosaicML Streaming (its defaults): ``MDSWriter`` into 64 MB shards once, then
    ``StreamingDataset(shuffle=True, batch_size=...)`` under ``StreamingDataLoader``; over S3 its
    ``remote=`` with a fresh local cache (boto3, endpoint from ``S3_ENDPOINT_URL``). Runs in
    ``.venv-streaming`` (bench/compete/venvs.sh), torchvision's two operators defined first."""

    def __init__(self, setup: Setup, name: str) -> None:
        import torchvision_ops  # noqa: F401  (before streaming: NOTE [ torchvision without its compiled operators ])
        import streaming
        from streaming.base.util import clean_stale_shared_memory

        super().__init__(setup, name)
        self.version = streaming.__version__
        clean_stale_shared_memory()
        local = os.path.splitext(setup.data)[0] + "-mds"
        if not os.path.exists(os.path.join(local, "index.json")):
            shape = f"{setup.size},{setup.size}"
            cols = {"x": f"ndarray:float32:1,{shape}", "y": f"ndarray:float32:2,{shape}"}
            with h5py.File(setup.data, "r") as f, streaming.MDSWriter(out=local, columns=cols,
                                                                      size_limit="64mb") as w:
                for a in range(0, setup.samples, 256):
                    xs, ys = f["x"][a:a + 256], f["y"][a:a + 256]
                    for x, y in zip(xs, ys):
                        w.write({"x": x, "y": y})
        if setup.where == "s3":
            s3_env(setup)
            src = f"s3://{setup.bucket}/{os.path.basename(local)}"
            upload(setup, local, src)
            kw = {"remote": src, "local": tempfile.mkdtemp(prefix="streaming-cache-")}
            self.files = []
        else:
            kw = {"local": local}
            self.files = glob.glob(os.path.join(local, "*.mds"))
        self.ds = streaming.StreamingDataset(shuffle=True, batch_size=setup.batch, **kw)
        self.loader = streaming.StreamingDataLoader(self.ds, batch_size=setup.batch)

    def epoch(self, e: int):
        return ((b["x"], b["y"]) for b in self.loader)


class HFDatasets(Contender):
    """Hugging Face ``datasets``: its HDF5 loader (``load_dataset("hdf5", data_files=...)``,
    which converts the file to Arrow in its cache once; over S3 it downloads it first, timed as
    ``prepare_s``), ``with_format("torch")``, under torch's ``DataLoader(shuffle=True)``. Runs in
    ``.venv-hf`` (bench/compete/venvs.sh)."""

    def __init__(self, setup: Setup, name: str) -> None:
        import datasets

        super().__init__(setup, name)
        self.version = datasets.__version__
        cache = os.path.splitext(setup.data)[0] + f"-hf-{setup.where}"
        kw: dict[str, Any] = {"cache_dir": cache}
        src = setup.data
        if setup.where == "s3":
            src = setup.h5_url
            upload(setup, setup.data, src)
            kw["storage_options"] = setup.storage_options
        t0 = time.perf_counter()
        ds = datasets.load_dataset("hdf5", data_files=src, split="train", **kw).with_format("torch")
        self.prepare_s = time.perf_counter() - t0
        self.files = sorted(glob.glob(os.path.join(cache, "**", "*.arrow"), recursive=True))
        self.loader = tud.DataLoader(ds, batch_size=setup.batch, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))

    def epoch(self, e: int):
        return ((b["x"], b["y"]) for b in self.loader)


class _sample_of:
    """``litdata.optimize``'s function: sample ``i`` of the HDF5 file as a dict of arrays."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        with h5py.File(self.path, "r") as f:
            return {"x": f["x"][i], "y": f["y"][i]}


def _workers(name: str) -> int:
    return int(name.rsplit("-w", 1)[1]) if "-w" in name else 0


CONTENDERS: dict[str, Callable[[Setup, str], Contender]] = {
    "solar-w0": Solar, "solar-w2": Solar, "solar-staged-w0": Solar, "torch-w0": Torch, "torch-w2": Torch,
    "stateful-w0": Stateful, "stateful-w2": Stateful, "litdata": LitData, "litdata-tuned": LitData,
    "streaming": Streaming, "hf": HFDatasets,
}

#: the environment (bench/compete/venvs.sh) a contender runs in, where not .venv-compete
VENVS = {"streaming": ".venv-streaming", "hf": ".venv-hf"}
