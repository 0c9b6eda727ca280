"""A backend wrapper that makes storage slower on purpose: a bandwidth cap and a per-request latency.

Benchmarks on one laptop-sized machine read files that sit in the page cache, at memory speed.
A rank on a shared parallel file system sees something else: each request pays a round trip, and
the bytes it moves share the link with every other rank. ``ThrottledBackend`` models that share so
benchmark ratios (coalesced vs per-sample reads, hit rates that save reads) mean what they would
on a PFS.

NOTE [ Throttle model ]
    A call that made ``k`` storage requests and moved ``b`` bytes takes at least
    ``k * latency + b / bandwidth`` seconds; if the real read was faster, the wrapper sleeps for
    the difference. ``k`` is one request per contiguous range of the call (one per call when the
    inner backend is collective), ``b`` the bytes of the call's buffer, so coalescing ranges pays
    fewer latencies, exactly as on real storage. Both come from the call itself, not from the
    inner backend's shared counters, so concurrent callers (a loader's I/O threads) are each
    charged only their own requests, like a PFS client with several outstanding requests. The
    model is per process: with ``P`` ranks sharing an aggregate bandwidth ``B``, pass
    ``bandwidth=B / P`` (and divide again among concurrent readers to keep the rank's share).

    Reads that would hold h5py's process-wide lock on real storage (``inner.serializes_reads``:
    HDF5 read through h5py, NOTE [ Reads outside h5py's lock ] in io_backends/hdf5.py) hold one
    lock per process here too, across the inner read *and* the modelled wait, so their threads
    take turns as they would on a parallel file system. Without it a process's request threads
    would overlap their modelled waits, which h5py never does, and a benchmark would credit
    concurrent requests on HDF5 with a speed-up real storage does not give.

Use it directly, ``ThrottledBackend(HDF5Backend(path), bandwidth=200e6, latency=2e-3)``, or by
name, ``open_backend(path, "throttled", inner="hdf5", bandwidth=200e6, latency=2e-3)``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np

from solar.errors import ConfigError

from .base import ArrayInfo, Backend, disjoint_read

__all__ = ["ThrottledBackend", "delay_for"]

#: The model of h5py's one lock per process (reentrant: a throttle may wrap a throttle).
_SERIAL = threading.RLock()


def _fresh_lock_after_fork() -> None:
    """A forked child gets a new lock, as h5py re-creates its own: one held by a thread of the
    parent at the fork would otherwise never be released in the child."""
    global _SERIAL
    _SERIAL = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def delay_for(calls: int, nbytes: int, bandwidth: float | None, latency: float) -> float:
    """Seconds the modelled storage needs for ``calls`` requests moving ``nbytes`` bytes
    (NOTE [ Throttle model ]; ``bandwidth=None``: unlimited)."""
    t = calls * latency
    if bandwidth is not None:
        t += nbytes / bandwidth
    return t


class ThrottledBackend(Backend):
    """Wraps another backend; every read is slowed to at most ``bandwidth`` and pays ``latency``.

    Args:
        source: the backend to wrap, or a path/URL (then ``inner`` names the backend that opens
            it, default ``"auto"``, and the remaining options go to it), so
            ``open_backend(url, "throttled", inner="hdf5", bandwidth=...)`` works.
        bandwidth: bytes per second this process may move (``None``: unlimited).
        latency: seconds added per storage request (``0``: none).
        inner: registry name of the wrapped backend when ``source`` is a path/URL.
    """

    name = "throttled"

    def __init__(self, source: Backend | str, bandwidth: float | None = None, latency: float = 0.0,
                 inner: str = "auto", **options: Any) -> None:
        if isinstance(source, Backend):
            if options:
                raise ConfigError(f"options {sorted(options)} apply only when ThrottledBackend opens a path; "
                                  "pass them to the inner backend instead")
        else:
            from . import open_backend  # the registry's package imports this module: at call time

            if not isinstance(inner, str) or inner == self.name:
                raise ConfigError(f"inner= must name a registered backend other than 'throttled', got {inner!r}")
            source = open_backend(source, inner, **options)
        inner_backend: Backend = source
        if bandwidth is not None and not bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes/s or None (unlimited), got bandwidth={bandwidth!r}")
        if latency < 0:
            raise ConfigError(f"latency must be >= 0 seconds, got latency={latency!r}")
        super().__init__(inner_backend.url)
        self.inner = inner_backend
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.latency = float(latency)
        # A collective inner backend stays collective: every rank must still make every call.
        self.collective = inner_backend.collective

    @property
    def comm(self):
        """The inner backend's communicator (collective inner backends only)."""
        return self.inner.comm

    def __repr__(self) -> str:
        return f"ThrottledBackend({self.inner!r}, bandwidth={self.bandwidth}, latency={self.latency})"

    def _open(self) -> None:
        self.inner.ensure_open()

    def _close(self) -> None:
        self.inner.close()

    def keys(self) -> list[str]:
        return self.inner.keys()

    def broken_links(self) -> dict[str, str]:
        return self.inner.broken_links()

    def info(self, key: str) -> ArrayInfo:
        return self.inner.info(key)

    def attrs(self, key: str = "/") -> dict[str, Any]:
        return self.inner.attrs(key)

    def delay_for(self, calls: int, nbytes: int) -> float:
        """Seconds the modelled storage needs for ``calls`` requests moving ``nbytes`` bytes."""
        return delay_for(calls, nbytes, self.bandwidth, self.latency)

    def serializes_reads(self, key: str) -> bool:
        return self.inner.serializes_reads(key)

    def _read_ranges(self, key: str, ranges: np.ndarray, out: np.ndarray) -> None:
        with _SERIAL if self.inner.serializes_reads(key) else contextlib.nullcontext():
            t0 = time.perf_counter()
            self.inner.read_ranges(key, ranges, out=out, disjoint=disjoint_read())
            spent = time.perf_counter() - t0
            calls = 1 if self.collective else len(ranges)
            wait = self.delay_for(calls, out.nbytes) - spent
            if wait > 0:
                time.sleep(wait)
                self.stats.extra["throttle_sleep_us"] = self.stats.extra.get("throttle_sleep_us", 0) + int(wait * 1e6)
        self.stats.read_calls += calls
