"""The checkpoint package's errors, defined in :mod:`solar.errors` (the one home of SOLAR's
exception classes) and named here for ``from solar.checkpoint.errors import ...``."""

from __future__ import annotations

from solar.errors import (CheckpointReadOnlyError, CheckpointVersionRemovedError, NotACheckpointRootError,
                          UntrustedPickleError)

__all__ = ["CheckpointVersionRemovedError", "CheckpointReadOnlyError", "NotACheckpointRootError",
           "UntrustedPickleError"]
