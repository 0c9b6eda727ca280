"""Incremental, Merkle-indexed, content-addressed checkpoints of PyTorch state dicts.

``CheckpointWriter(root).save(state_dict, step)`` returns a future; only chunks never stored
before are written, and the manifest is committed last. ``load(root, step)`` restores any version
directly from its manifest. ``solar-ckpt`` (also ``solar ckpt``) logs, diffs, verifies, restores,
exports and garbage-collects. ``CheckpointWriter(root, comm=MPI.COMM_WORLD)`` in every rank of a job
commits one version for the whole job (``docs/checkpoint-job.md``). See ``docs/checkpoint.md``.
"""

from __future__ import annotations

from .collect import GcReport, gc
from .errors import (CheckpointReadOnlyError, CheckpointVersionRemovedError, NotACheckpointRootError,
                     UntrustedPickleError)
from .job import COMMIT_POINTS, JobWriter
from .reader import Reader, list_versions, load
from .reshard import Loaded, load_into
from .shard import Shard
from .manifest import Manifest
from .store import CheckpointStore
from .verify import VerifyReport, verify
from .writer import CheckpointWriter, SaveResult

__all__ = [
    "CheckpointWriter",
    "JobWriter",
    "COMMIT_POINTS",
    "SaveResult",
    "load",
    "load_into",
    "Loaded",
    "Shard",
    "list_versions",
    "gc",
    "GcReport",
    "verify",
    "VerifyReport",
    "Reader",
    "CheckpointStore",
    "Manifest",
    "CheckpointVersionRemovedError",
    "CheckpointReadOnlyError",
    "NotACheckpointRootError",
    "UntrustedPickleError",
]
