"""Shared by the solar.DataLoader tests (tests/test_loader_*.py): small plain datasets, a
96-sample PtychoNN-like file (the ``h5path`` fixture, which tests/conftest.py imports) and one loader
per rank over it."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import solar
from solar.synthetic import write_ptycho_h5


class Squares(tud.Dataset):
    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return {"x": torch.tensor([float(i), float(i) ** 2]), "i": i,
                "worker": -1 if info is None else info.id, "seed": torch.initial_seed() % 1000}


class Stream(tud.IterableDataset):
    def __init__(self, n=17):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = tud.get_worker_info()
        lo, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(lo, self.n, step))


@pytest.fixture(scope="module")
def h5path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("loader") / "ptycho.h5")
    write_ptycho_h5(path, 96, 8, seed=1, progress=False)
    return path


def _rank_loaders(path, P, b, buffer, **kw):
    out = []
    for r in range(P):
        ds = solar.H5Dataset(path)
        s = tud.DistributedSampler(ds, num_replicas=P, rank=r, seed=4)
        out.append(solar.DataLoader(ds, batch_size=b, sampler=s, buffer=buffer, **kw))
    return out
