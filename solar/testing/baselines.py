"""The baseline SOLAR is measured against: what training scripts do today.

:class:`PerSampleH5` is a map-style dataset that reads one sample per ``__getitem__`` (one read
request per field), through any :class:`solar.io_backends.Backend` opened lazily in the process
that reads (so with ``num_workers > 0`` every worker opens the file itself). Its request and byte
counters live in shared memory, so they count the reads of every DataLoader worker.
"""

from __future__ import annotations

import multiprocessing
from typing import Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["PerSampleH5"]


class PerSampleH5(Dataset):
    """Per-sample reads of ``fields`` from ``backend``; ``calls``/``bytes`` count them across workers."""

    def __init__(self, backend, fields: Sequence[str] = ("x", "y")) -> None:
        self.backend = backend
        self.fields = tuple(fields)
        self.n = backend.info(self.fields[0]).shape[0]
        backend.close()  # opened only to read the length; workers reopen lazily
        self._calls = multiprocessing.Value("q", 0)
        self._bytes = multiprocessing.Value("q", 0)

    def __len__(self) -> int:
        return self.n

    @property
    def calls(self) -> int:
        return self._calls.value

    @property
    def bytes(self) -> int:
        return self._bytes.value

    def __getitem__(self, i: int):
        out = tuple(torch.from_numpy(self.backend.read_ranges(f, [(i, i + 1)])[0]) for f in self.fields)
        with self._calls.get_lock():
            self._calls.value += len(self.fields)
        with self._bytes.get_lock():
            self._bytes.value += sum(t.numel() * t.element_size() for t in out)
        return out
