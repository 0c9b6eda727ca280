"""What a save returns: :class:`SaveResult`, the future that carries it (which knows whether its
failure was seen), and the check of a save's ``meta``."""

from __future__ import annotations

import json
import warnings
from concurrent.futures import Future
from dataclasses import dataclass

from solar.errors import ConfigError

__all__ = ["SaveResult", "SaveFuture", "checked_meta", "check_new_step"]


@dataclass
class SaveResult:
    """What one save did; the value of the future ``save`` returns.

    The chunk counters never overlap, so ``chunks_written + chunks_unchanged <= chunks_total``:

    - ``chunks_total``: the version's chunk positions (every blob's chunks, duplicates included);
    - ``chunks_unchanged``: positions whose bytes equal the previous version's at the same place
      (the Merkle diff) and that the store already held, so nothing was written for them;
    - ``chunks_written``: distinct chunks actually written, new ones and rewritten ones;
    - ``chunks_rewritten``: those of ``chunks_written`` whose bytes equal the previous version's
      at the same place but which the store no longer held (``verify --repair`` deleted or marked
      them, or ``gc`` removed them): the save wrote them again, which heals every version using them.

    A position that changed but whose bytes the store already held (de-duplicated against another
    tensor or an older version) is in neither ``unchanged`` nor ``written``. A rewritten chunk is
    not also counted as unchanged, because it was written.
    """

    step: int
    logical_bytes: int
    bytes_written: int
    chunks_total: int
    chunks_written: int
    chunks_unchanged: int
    manifest_bytes: int
    stage_seconds: float
    persist_seconds: float
    root: str
    chunks_rewritten: int = 0
    #: bytes the host copy copied: ``logical_bytes`` at most, fewer where the staging buffer
    #: already held unchanged chunks (see ``solar/checkpoint/host.py``)
    bytes_staged: int = 0

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / max(1, self.bytes_written + self.manifest_bytes)


class SaveFuture(Future):
    """The future ``save`` returns: it knows whether its failure was seen (``result`` or
    ``exception`` called), so :meth:`CheckpointWriter.wait` and ``close`` raise every failure
    exactly once, whether the caller kept the future or not."""

    seen = False

    def result(self, timeout=None):
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.seen = True
        return super().exception(timeout)

    def unseen_failure(self) -> BaseException | None:
        if not self.done() or self.seen:
            return None
        return Future.exception(self, 0)

    @classmethod
    def following(cls, fut: Future) -> "SaveFuture":
        out = cls()

        def copy(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())

        fut.add_done_callback(copy)
        return out


def checked_meta(meta: dict | None, step: int) -> dict:
    """A JSON copy of ``meta``, made when ``save`` is called.

    The manifest encodes ``meta`` only when the background commit writes it, after every chunk
    was hashed and written. Copying it here makes a NaN or a tensor in it a ``ConfigError`` that
    names ``meta`` before any work, and keeps a dict changed after ``save`` returns out of the
    version.
    """
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ConfigError(f"meta of step {step} must be a dict of JSON values, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"meta of step {step} is not JSON-serialisable ({exc}); keep plain values (numbers, "
                          f"strings, lists, dicts) in it, or put other objects in the state dict") from exc


def check_new_step(saved: set[int], step: int, overwrite: bool | None, root: str) -> None:
    """What a save of a step the root already holds (or a save in flight) does, before any work.

    ``overwrite=None`` (the default) warns and replaces the version, as ``torch.save`` and DCP's
    ``save`` (``overwrite=True`` by default) replace what they write over, and as a job relaunched
    from step S expects when its loop saves step S again; ``True`` replaces it without a warning;
    ``False`` refuses. The replacement is committed like any save (the old version stays whole
    until the new one is), and ``saved`` gains ``step``.

    Raises:
        ConfigError: the step exists and ``overwrite=False``.
    """
    if step in saved:
        if overwrite is False:
            raise ConfigError(f"step {step} already exists in {root} and overwrite=False; save another step, or pass "
                              "overwrite=True to replace it (nothing was saved)")
        if overwrite is None:
            warnings.warn(f"step {step} already exists in {root}: this save replaces it (the old version stays "
                          "whole until the new one is committed); pass overwrite=True to replace it without this "
                          "warning, or overwrite=False to refuse", UserWarning, stacklevel=3)
    saved.add(step)
