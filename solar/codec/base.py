"""The :class:`Codec` contract and the codec registry (numcodecs' codec interface is the model).

A codec turns one float array into one self-describing blob (:mod:`solar.codec.header`) and
decodes *groups* of blobs with one sequence of tensor ops. A codec class is registered under its
name (``"ebq"``); the blob's descriptor (``"ebq/1"``) names the codec and the format version that
wrote it, and a codec class must keep decoding every version it ever wrote (golden fixtures in
``tests/fixtures/codec`` enforce this).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from solar.errors import ConfigError, CorruptDataError, UnknownCodecError
from solar.registry import Registry

from .header import Header

__all__ = ["Codec", "Parsed", "registry", "get_codec"]


@dataclass
class Parsed:
    """A blob whose header and payload checksum have been verified."""

    header: Header
    payload: memoryview
    what: str  # names the blob/sample in error messages
    meta: Any = None  # the codec's validated metadata, cached by the codec on first use


class Codec(ABC):
    """Base class of every SOLAR codec.

    Subclasses set ``codec_id`` and ``version`` (the newest format version they write), accept
    their options as keyword arguments (JSON-serializable, returned by :meth:`get_config`), and
    implement :meth:`encode` and :meth:`decode_group`.
    """

    codec_id: ClassVar[str]
    version: ClassVar[int]
    #: format versions this class can decode
    decodes: ClassVar[frozenset[int]] = frozenset()

    @property
    def descriptor(self) -> str:
        return f"{self.codec_id}/{self.version}"

    def get_config(self) -> dict[str, Any]:
        """JSON-serializable options, including ``id``; ``get_codec(cfg)`` rebuilds the codec."""
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        cfg = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**cfg)
        except TypeError as exc:
            raise ConfigError(f"bad options for codec {cls.codec_id!r}: {exc}") from None

    @abstractmethod
    def encode(self, array: np.ndarray, abs_error: float) -> bytes:
        """Encode a C-contiguous little-endian float32/float64 array with the absolute bound."""

    @abstractmethod
    def decode_group(self, blobs: Sequence[Parsed], device, out=None):
        """Decode blobs that share codec, version, dtype and shape (and :meth:`group_key`).

        Returns a ``(B, *shape)`` tensor on ``device`` (written into ``out`` when given).
        Raises :class:`CorruptDataError` naming ``blob.what`` for any inconsistency.
        """

    def group_key(self, blob: Parsed) -> Any:
        """Blobs with equal keys (and equal shape/dtype) are decoded together."""
        return None

    def check_version(self, blob: Parsed) -> None:
        if blob.header.version not in self.decodes:
            raise CorruptDataError(
                f"{blob.what}: codec {self.codec_id!r} format version {blob.header.version} is not "
                f"supported by this solar (supports {sorted(self.decodes)}); upgrade solar")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({opts})"


registry: Registry[type[Codec]] = Registry("codec", "solar.codecs")
registry.register("ebq", "solar.codec.ebq:EBQCodec", hint="part of solar; reinstall solar-loader")


def get_codec(spec=None) -> Codec:
    """A codec instance from ``None`` (default ebq), a name, a config dict, or a Codec instance."""
    if spec is None:
        spec = "ebq"
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, str):
        return _registered(spec)()
    if isinstance(spec, dict):
        if "id" not in spec:
            raise ConfigError(f"codec config {spec!r} has no 'id' (e.g. {{'id': 'ebq'}})")
        return _registered(str(spec["id"])).from_config(spec)
    raise ConfigError(f"codec= must be a name, a config dict or a Codec, got {type(spec).__name__}")


def _registered(name: str) -> type:
    """The codec class registered as ``name`` (:class:`UnknownCodecError` if none)."""
    try:
        return registry.get(name.partition("/")[0])
    except LookupError as exc:
        raise UnknownCodecError(f"codec={name!r}: {exc}") from None
