"""The decoder path and thread count a decode asks for: per call (``decoder=``, ``threads=``),
else the environment (``SOLAR_CODEC_DECODER``, ``SOLAR_CODEC_THREADS``).

Numpy-only, so ``import solar.codec`` stays light; :mod:`solar.codec.paths` decides what runs.
``threads`` is the ``cpu-kernel`` path's thread count: default 1 (a loader already decodes in
several workers or threads), 0 = every core this process may use.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import NamedTuple

from solar.errors import ConfigError

__all__ = ["DECODERS", "use", "current", "name", "check", "getenv"]

DECODERS = ("auto", "reference", "cpu-kernel", "triton")


class _Choice(NamedTuple):
    decoder: str | None
    threads: int | None


_CHOICE: contextvars.ContextVar[_Choice] = contextvars.ContextVar("solar_codec_decoder", default=_Choice(None, None))


def check(decoder, threads) -> None:
    """ConfigError for a ``decoder=`` or ``threads=`` no decode takes."""
    if decoder is not None and decoder not in DECODERS:
        raise ConfigError(f"decoder= must be one of {', '.join(map(repr, DECODERS))}, got {decoder!r}")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
        raise ConfigError(f"threads= must be an int >= 0 (0: every core), got {threads!r}")


@contextlib.contextmanager
def use(decoder: str | None = None, threads: int | None = None):
    """Within the block, decode with ``decoder`` on ``threads`` threads (None: the environment)."""
    check(decoder, threads)
    token = _CHOICE.set(_Choice(decoder, threads))
    try:
        yield
    finally:
        _CHOICE.reset(token)


def name() -> str:
    """The decoder path in effect (:func:`current`'s, without resolving the thread count: a
    one-blob decode asks per call)."""
    c = _CHOICE.get()
    if c.decoder is not None:
        return c.decoder
    env = (getenv("SOLAR_CODEC_DECODER"), getenv("SOLAR_CODEC_THREADS"))
    parsed = _ENV.get(env)
    if parsed is None:
        parsed = _ENV.setdefault(env, _parse_env(*env))
    return parsed.decoder


def current() -> _Choice:
    """The decoder path and the thread count (0 resolved to the usable cores) in effect."""
    c = _CHOICE.get()
    if c.decoder is not None and c.threads:
        return c
    env = (getenv("SOLAR_CODEC_DECODER"), getenv("SOLAR_CODEC_THREADS"))
    parsed = _ENV.get(env)
    if parsed is None:
        parsed = _ENV.setdefault(env, _parse_env(*env))
    return _Choice(c.decoder or parsed.decoder, len(os.sched_getaffinity(0)) if c.threads == 0 else c.threads or
                   parsed.threads)


_DATA = os.environ._data if isinstance(getattr(os.environ, "_data", None), dict) else None
_KEYS: dict[str, object] = {}


def getenv(name: str) -> str | None:
    """``os.environ.get(name)`` at a dictionary lookup's cost: on CPython ``os.environ`` keeps
    its variables in a dict by encoded name (``_data``, which every assignment through
    ``os.environ`` updates), and ``get`` of an unset variable raises and catches a KeyError,
    several microseconds of a small blob's decode. Elsewhere, ``os.environ.get``."""
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS.setdefault(name, os.environ.encodekey(name))
    raw = _DATA.get(key)
    return None if raw is None else os.environ.decodevalue(raw)


#: the environment's choice by its raw strings (decoding runs per mini-batch: parsed once)
_ENV: dict[tuple, _Choice] = {}


def _parse_env(decoder: str | None, threads: str | None) -> _Choice:
    name = (decoder or "auto").strip().lower() or "auto"
    try:
        count = int((threads or "1").strip() or "1")
    except ValueError:
        count = -1
    if name not in DECODERS or count < 0:
        raise ConfigError(f"SOLAR_CODEC_DECODER must be one of {', '.join(DECODERS)} and SOLAR_CODEC_THREADS "
                          f"an int >= 0, got {decoder!r} and {threads!r}")
    return _Choice(name, count or len(os.sched_getaffinity(0)))
