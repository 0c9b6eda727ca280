"""Checkpoint-specific errors (see :mod:`solar.errors` for the pattern).

Like every SOLAR error, each also subclasses the built-in a caller would naturally catch, so
``except FileNotFoundError`` / ``except PermissionError`` written against plain files keeps working,
while ``except CheckpointError`` (or ``SolarError``) catches them with the rest.
"""

from __future__ import annotations

import pickle

from solar.errors import CheckpointError

__all__ = ["CheckpointVersionRemovedError", "CheckpointReadOnlyError", "NotACheckpointRootError",
           "UntrustedPickleError"]


class CheckpointVersionRemovedError(CheckpointError, FileNotFoundError):
    """The version being read was removed meanwhile, by a writer's ``keep_last`` retention (or a
    ``gc``). Nothing is corrupt: load a newer version, or keep more versions."""


class NotACheckpointRootError(CheckpointError, FileNotFoundError):
    """An existing directory given as a checkpoint root holds no checkpoint (a parent of the
    root, a mistyped sibling, a rank's root before its first save). Raised so that ``verify``
    never reports OK having checked nothing and ``gc`` never leaves a ``.lock`` there."""


class CheckpointReadOnlyError(CheckpointError, PermissionError):
    """The checkpoint root cannot be written here (read-only mount, missing permissions), so
    saving, ``gc`` and ``verify --repair`` cannot run; reading it still works."""


class UntrustedPickleError(CheckpointError, pickle.UnpicklingError):
    """A pickled value in a checkpoint names a global off the allow-list of safe ones, so loading it
    by default (``weights_only=True``) refuses it instead of running code its author chose."""
