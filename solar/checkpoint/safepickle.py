"""Unpickling of the skeleton's pickled values through an allow-list of safe globals.

A pickle names the callables it calls (``GLOBAL``/``STACK_GLOBAL`` + ``REDUCE``), so unpickling one
from a downloaded checkpoint runs whatever its author chose (``os.system``, ``builtins.exec``).
:class:`SafeUnpickler` resolves a global only if it is on :data:`SAFE_GLOBALS` (plain values,
containers, numbers, numpy arrays/dtypes/scalars and RNG states), or if it is an ``enum.Enum``
class of a module this process has already imported (``find_class`` never imports: importing a
module runs its code). Everything else raises :class:`UnsafeGlobalError`, naming the global, which
the caller turns into an error naming the key and the opt-in (``weights_only=False``).

The globals allowed are the ones whose calls cannot reach other code and cannot allocate more
than the pickle's own bytes imply: constructors that take a size (``bytearray(n)``, numpy's
``_reconstruct(cls, shape, ...)``) are wrapped so a size argument is refused. This is the same
idea as ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import sys
from typing import Any, Callable

__all__ = ["SafeUnpickler", "UnsafeGlobalError", "safe_loads", "SAFE_GLOBALS"]

#: a numpy ``_reconstruct`` may build at most this many elements before ``__setstate__`` fills it
#: (pickles numpy writes always pass shape ``(0,)``)
_RECONSTRUCT_MAX = 0


class UnsafeGlobalError(pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


def _safe_bytearray(*args: Any) -> bytearray:
    """``bytearray`` from bytes, never ``bytearray(n)`` (an allocation of a size the pickle names)."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise pickle.UnpicklingError(f"bytearray({type(args[0]).__name__}) is not a pickled value")
    return bytearray(*args)


def _numpy_reconstruct(real: Callable) -> Callable:
    def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        import numpy as np

        if not (isinstance(subtype, type) and subtype is np.ndarray):
            raise pickle.UnpicklingError(f"numpy _reconstruct of {subtype!r:.80} is not a pickled array")
        count = 1
        for n in (shape if isinstance(shape, tuple) else (shape,)):
            count *= int(n)
        if count > _RECONSTRUCT_MAX:
            raise pickle.UnpicklingError(f"numpy _reconstruct with shape {shape!r:.80} is not a pickled array")
        return real(subtype, shape, dtype)

    return _reconstruct


_BUILTINS = ("bool", "int", "float", "complex", "str", "bytes", "tuple", "list", "dict", "set", "frozenset",
             "slice", "range")
#: module -> names of the globals a pickled leaf may use
SAFE_GLOBALS: dict[str, tuple[str, ...]] = {
    "builtins": _BUILTINS,
    "collections": ("OrderedDict", "defaultdict", "deque", "Counter"),
    "fractions": ("Fraction",),
    "decimal": ("Decimal",),
    "datetime": ("datetime", "date", "time", "timedelta", "timezone"),
    "numpy": ("ndarray", "dtype"),
    "numpy._core.multiarray": ("scalar",),
    "numpy.core.multiarray": ("scalar",),
    "numpy.random._pickle": ("__generator_ctor", "__randomstate_ctor", "__bit_generator_ctor"),
    "numpy.random._mt19937": ("MT19937",),
    "numpy.random._pcg64": ("PCG64", "PCG64DXSM"),
    "numpy.random._philox": ("Philox",),
    "numpy.random._sfc64": ("SFC64",),
}
#: allowed globals that are replaced by a checking wrapper
_WRAPPED: dict[tuple[str, str], Callable[[], Callable]] = {
    ("builtins", "bytearray"): lambda: _safe_bytearray,
    ("numpy._core.multiarray", "_reconstruct"):
        lambda: _numpy_reconstruct(importlib.import_module("numpy._core.multiarray")._reconstruct),
    ("numpy.core.multiarray", "_reconstruct"):
        lambda: _numpy_reconstruct(importlib.import_module("numpy._core.multiarray")._reconstruct),
}


def _numpy_dtype_class(module: str, name: str) -> Any:
    """numpy's per-dtype classes (``numpy.dtypes.Float32DType``), which numpy 2 pickles name."""
    if module != "numpy.dtypes" or not name.endswith("DType"):
        return None
    import numpy as np

    cls = getattr(importlib.import_module("numpy.dtypes"), name, None)
    return cls if isinstance(cls, type) and issubclass(cls, np.dtype) else None


def _loaded_enum(module: str, name: str) -> Any:
    """An ``Enum`` class of an already imported module (looked up, never imported)."""
    mod = sys.modules.get(module)
    obj: Any = mod
    for part in name.split("."):
        if obj is None or part.startswith("__"):
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, enum.Enum) else None


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allow-listed globals (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        wrapped = _WRAPPED.get((module, name))
        if wrapped is not None:
            return wrapped()
        if name in SAFE_GLOBALS.get(module, ()):
            return getattr(importlib.import_module(module), name)
        found = _numpy_dtype_class(module, name) or _loaded_enum(module, name)
        if found is not None:
            return found
        raise UnsafeGlobalError(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a pickled value with persistent ids (e.g. a tensor inside an object)")


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` through :class:`SafeUnpickler`.

    Raises:
        UnsafeGlobalError: the pickle names a global off the allow-list (nothing of it ran).
        pickle.UnpicklingError: a malformed pickle, or an allowed global called with refused arguments.
    """
    return SafeUnpickler(io.BytesIO(data)).load()
