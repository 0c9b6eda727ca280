"""Per-epoch statistics of one ``solar.DataLoader``: the record, the history, the summary line
and the report table.

The dataset's counters (``ds.stats``: hits, misses, bytes and requests to storage, in the
process that does SOLAR's I/O) are cumulative over every loader and epoch; an epoch's figures
are their differences between the start of an iteration and its end (``StopIteration``).
An epoch left early (``break``) is not recorded. The wait is measured in the loader's
iterator: the time the caller spent inside ``iter(loader)`` and each ``next()``, so it is what
the training loop waited for its batches, whatever made them (this process or workers).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

__all__ = ["EpochStats", "EpochMeter", "StatsHistory"]

#: the dataset counters an epoch's record takes differences of: record field -> counter name
_COUNTERS = {"hits": "hits", "misses": "misses", "bytes_read": "bytes_in", "read_calls": "read_calls",
             "decode_s": "decode_s"}


class EpochStats(NamedTuple):
    """One completed epoch of one loader, on this rank.

    ``hits``/``misses`` count samples served from the rank buffer / read from storage;
    ``bound`` is the hit-rate limit of this geometry, ``min(1, P*C/N)`` (P ranks, C samples
    per rank buffer, N samples; ``solar.schedule.PlanConfig.bound``). Counters the loader
    cannot see are ``None``: all of them on a dataset that is not storage-backed (the loader
    is then torch's), and ``decode_s`` where the dataset does not count decode time or workers
    decode (``num_workers > 0``: the time is spent in their processes).
    """

    epoch: int  #: the sampler's epoch (``set_epoch``), else the count of this loader's earlier epochs
    batches: int  #: batches the iterator returned
    hits: int | None
    misses: int | None
    bound: float | None
    bytes_read: int | None  #: bytes read from storage
    read_calls: int | None  #: storage requests (after coalescing and sieving)
    decode_s: float | None  #: seconds spent decoding compressed fields
    wait_s: float  #: seconds the training loop waited for batches (inside iter() and next())
    wall_s: float  #: seconds from iter() to the end of the epoch

    @property
    def hit_rate(self) -> float | None:
        """hits / (hits + misses); ``None`` without counters or accesses."""
        if self.hits is None or self.misses is None or not self.hits + self.misses:
            return None
        return self.hits / (self.hits + self.misses)

    def summary(self) -> str:
        """One line: ``epoch 2: 12 batches, hit rate 0.500 (bound 0.500), 1.2 MiB in 8 requests,
        decode 0.000 s, waited 0.012 s of 0.250 s``."""
        parts = [f"epoch {self.epoch}: {self.batches} batches"]
        if self.hit_rate is not None:
            parts.append(f"hit rate {self.hit_rate:.3f} ({self.hits} hits, {self.misses} misses, "
                         f"bound {_num(self.bound, '.3f')})")
        if self.bytes_read is not None:
            parts.append(f"{self.bytes_read / 2 ** 20:.1f} MiB read in {self.read_calls} requests")
        if self.decode_s is not None:
            parts.append(f"decode {self.decode_s:.3f} s")
        parts.append(f"waited {self.wait_s:.3f} s of {self.wall_s:.3f} s")
        return ", ".join(parts)


class EpochMeter:
    """One iteration being measured: counters taken at its start, wait time added by the
    iterator (two clock reads per batch, no per-sample work)."""

    __slots__ = ("counters", "start", "wait", "epoch", "skipped", "_source", "_decode_here")

    def __init__(self, source: Any, epoch: int, decode_here: bool = True) -> None:
        self._source = source  # the dataset whose ``stats`` count this loader's I/O, or None
        self._decode_here = decode_here  # False: workers decode, so this process's counter misses it
        self.counters = _snapshot(source)
        self.start = time.perf_counter()
        self.wait = 0.0
        self.epoch = epoch
        self.skipped = 0  # batches of the epoch consumed before it was resumed (not returned here)

    def finish(self, batches: int, bound: float | None) -> EpochStats:
        """The epoch's record, now that its last batch has been returned."""
        now = _snapshot(self._source)
        diff = {k: None if now[k] is None or self.counters[k] is None else now[k] - self.counters[k]
                for k in _COUNTERS}
        if not self._decode_here:
            diff["decode_s"] = None
        return EpochStats(epoch=self.epoch, batches=batches, bound=bound, wait_s=self.wait,
                          wall_s=time.perf_counter() - self.start, **diff)


class StatsHistory(tuple):
    """Every completed epoch's :class:`EpochStats`, oldest first (a tuple)."""

    def report(self) -> str:
        """A short table, one row per epoch."""
        head = ("epoch", "batches", "hits", "misses", "hit rate", "bound", "MiB read", "requests", "decode s",
                "wait s", "wall s")
        rows = [head] + [(str(r.epoch), str(r.batches), _num(r.hits), _num(r.misses), _num(r.hit_rate, ".3f"),
                          _num(r.bound, ".3f"), _num(None if r.bytes_read is None else r.bytes_read / 2 ** 20, ".2f"),
                          _num(r.read_calls), _num(r.decode_s, ".3f"), f"{r.wait_s:.3f}", f"{r.wall_s:.3f}")
                         for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        return "\n".join(lines if len(self) else [*lines, "(no completed epoch yet)"])


def _snapshot(source: Any) -> dict[str, Any]:
    """``source.stats`` now (read each time: a ConcatDataset view sums its files' afresh);
    ``None`` for each counter it lacks."""
    stats = getattr(source, "stats", None)
    return {k: getattr(stats, name, None) for k, name in _COUNTERS.items()}


def _num(value: Any, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)
