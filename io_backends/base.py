"""The storage-backend contract.

A backend reads *rows* (entries along the leading axis) of named arrays in one container — an
HDF5 file today, a directory of ``.npy`` shards through fsspec, ... — for a **sorted list of
disjoint, contiguous row ranges**, into one preallocated buffer. It does not know why those rows
are wanted: the schedule decides what to read, the backend only reads it as cheaply as it can
(one call per range, or one collective call per step on parallel HDF5).

NOTE [ Backends and processes ]
    Handles are opened lazily, in the process that reads, on first use, and reopened after
    ``fork`` (the pid is checked): h5py handles and MPI communicators do not survive fork, and
    pickling a backend (to send it to a DataLoader worker) carries only its arguments.

NOTE [ Disjoint collective reads ]
    Open MPI 4.1's default MPI-IO (OMPIO, fcoll ``dynamic``/``dynamic_gen2``) returns zeros for
    parts of a collective read whose ranks' selections overlap (93 of 200 such reads of small
    rows were wrong on 3 ranks; 2 ranks happened to be fine; ROMIO and independent reads were
    right). A backend cannot see other ranks' selections without gathering them, so the caller
    says: ``read_ranges(..., disjoint=True)`` promises that no row is read by two ranks in this
    call, and only such a call may use the collective transfer. Every other call (the default)
    is read with the independent transfer, never wrong. The
    loader's schedule knows when it may promise it (each sample of a global batch goes to one
    rank; a pass holding one sample twice, from DistributedSampler's padding, may not).
"""

from __future__ import annotations

import contextvars
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from solar.collective import agree, lockstep
from solar.errors import InputError

#: the ``disjoint`` promise of the running ``read_ranges`` call (per thread)
_DISJOINT: contextvars.ContextVar[bool] = contextvars.ContextVar("solar_disjoint_read", default=False)


#: handles a forked child inherited from its parent (see :meth:`Backend.ensure_open`)
_INHERITED: list = []


def disjoint_read() -> bool:
    """Whether the running ``read_ranges`` call was promised disjoint across ranks; wrappers
    that forward to an inner backend pass it on."""
    return _DISJOINT.get()


__all__ = ["Backend", "ArrayInfo", "IOStats", "normalize_ranges"]


@dataclass(frozen=True)
class ArrayInfo:
    """Shape and dtype of one stored array; ``shape[0]`` is the number of rows."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class IOStats:
    """Counters a backend keeps: bytes moved from storage and storage calls made."""

    bytes_read: int = 0
    read_calls: int = 0
    rows_read: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read, "read_calls": self.read_calls,
                "rows_read": self.rows_read, **self.extra}

    def reset(self) -> None:
        self.bytes_read = self.read_calls = self.rows_read = 0
        self.extra.clear()

    def absorb(self, other: "IOStats") -> None:
        """Add ``other``'s counts to these and zero ``other`` (a request thread's backend clone
        reporting to the backend its owner reads through)."""
        self.bytes_read += other.bytes_read
        self.read_calls += other.read_calls
        self.rows_read += other.rows_read
        for k, v in other.extra.items():
            self.extra[k] = self.extra.get(k, 0) + v
        other.reset()


def normalize_ranges(ranges: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """Return ``ranges`` as an ``(k, 2)`` int64 array of sorted, disjoint ``[start, stop)`` pairs.

    Raises ``ValueError`` if they are unsorted, overlapping or empty-length.
    """
    arr = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    if len(arr):
        if np.any(arr[:, 1] <= arr[:, 0]):
            raise InputError(f"row ranges must have stop > start, got {arr[arr[:, 1] <= arr[:, 0]][:3].tolist()}")
        if np.any(arr[1:, 0] < arr[:-1, 1]):
            raise InputError("row ranges must be sorted and disjoint; sort and coalesce them first")
    return arr


class Backend(ABC):
    """Reads row ranges of named arrays from one storage container.

    Subclasses set ``name`` and implement :meth:`_open`, :meth:`_close`, :meth:`keys`,
    :meth:`info`, :meth:`attrs` and :meth:`_read_ranges`. The base class handles lazy per-process
    opening, pickling, argument checks and statistics.

    Args:
        url: path or URL of the container.
        **options: backend-specific options (block size, storage options ...).
    """

    name: ClassVar[str] = "abstract"
    #: True if :meth:`read_ranges` is collective: every rank must call it, in the same order,
    #: the same number of times (with an empty range list when it has nothing to read). Such a
    #: backend has a ``comm`` attribute (an mpi4py communicator), used by :meth:`agree`.
    collective: ClassVar[bool] = False

    def __init__(self, url: str | os.PathLike, **options: Any) -> None:
        self.url = os.fspath(url)
        self.options = options
        self.stats = IOStats()
        self._pid: int | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def ensure_open(self) -> None:
        """Open (or reopen after fork) the underlying handles in this process."""
        if self._pid != os.getpid():
            if self._pid is not None:
                # handles inherited across fork belong to the parent: dropping them here would
                # close or free them in this child (h5py printed "Can't decrement id ref count"
                # tracebacks when DataLoader workers exited, for parallel-HDF5 files), so they are
                # parked, never touched (torch's workers leave by os._exit: no teardown)
                _INHERITED.append({k: self.__dict__.pop(k) for k in self._handle_attrs() if k in self.__dict__})
            self._pid = None
            self._open()
            self._pid = os.getpid()

    def close(self) -> None:
        if self._pid == os.getpid():
            self._close()
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in self._handle_attrs():
            state.pop(key, None)
        state["_pid"] = None
        state["stats"] = IOStats()
        return state

    def _handle_attrs(self) -> Sequence[str]:
        """Names of instance attributes holding open handles (dropped when pickled)."""
        return ()

    def __enter__(self) -> "Backend":
        self.ensure_open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def _open(self) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    # -- metadata --------------------------------------------------------------------------------
    @abstractmethod
    def keys(self) -> list[str]:
        """Paths of every array in the container, in storage order."""

    def broken_links(self) -> dict[str, str]:
        """Paths that name an array but resolve to nothing (an HDF5 external link whose file is
        missing), each with its target; they are not in :meth:`keys`."""
        return {}

    @abstractmethod
    def info(self, key: str) -> ArrayInfo:
        """Shape and dtype of array ``key``."""

    @abstractmethod
    def attrs(self, key: str = "/") -> dict[str, Any]:
        """Attributes of the container root (``"/"``) or of one array/group."""

    # -- data ------------------------------------------------------------------------------------
    def serializes_reads(self, key: str) -> bool:
        """Whether reads of ``key`` hold a process-wide lock for their whole duration, storage wait
        included, so concurrent requests of one process cannot overlap (h5py's: NOTE [ Reads
        outside h5py's lock ] in io_backends/hdf5.py). :class:`ThrottledBackend` models it."""
        return False

    def mapped(self, key: str) -> bool:
        """Whether rows of ``key`` are copied from a memory map of the file (NOTE [ Mapped reads ]
        in io_backends/mapped.py) rather than requested from storage."""
        return False

    def read_ranges(self, key: str, ranges: Sequence[Sequence[int]] | np.ndarray,
                    out: np.ndarray | None = None, *, disjoint: bool = False) -> np.ndarray:
        """Read rows ``[start, stop)`` for each range, concatenated in range order.

        Args:
            key: array path.
            ranges: sorted, disjoint ``[start, stop)`` pairs (may be empty; collective backends
                still take part in the collective call then).
            out: optional preallocated buffer of shape ``(total_rows, *row_shape)`` and the
                array's dtype; reading straight into it avoids a copy.
            disjoint: collective backends only: no other rank reads any of these rows in this
                call, so the collective transfer is safe (NOTE [ Disjoint collective reads ]).
        """
        self.ensure_open()
        info = self.info(key)
        problem = None
        # on a collective backend every rank learns of a bad request:
        # NOTE [ Collective request checks ] in solar/collective.py
        try:
            rng = normalize_ranges(ranges)
            total = int((rng[:, 1] - rng[:, 0]).sum()) if len(rng) else 0
            if len(rng) and rng[-1, 1] > info.shape[0]:
                raise IndexError(f"{self.url}:{key}: row {int(rng[-1, 1]) - 1} out of range for {info.shape[0]} rows")
            if len(rng) and rng[0, 0] < 0:
                raise IndexError(f"{self.url}:{key}: row range starts at {int(rng[0, 0])}; ranges are of rows "
                                 f"0..{info.shape[0] - 1} (no negative rows)")
            want = (total, *info.row_shape)
            if out is not None and (out.shape != want or out.dtype != info.dtype or not out.flags.c_contiguous):
                raise ValueError(f"{self.url}:{key}: out has shape {out.shape} dtype {out.dtype}"
                                 f"{'' if out.flags.c_contiguous else ' and is not C-contiguous'}, "
                                 f"need a C-contiguous {want} {info.dtype} array")
        except (IndexError, ValueError) as exc:
            problem = exc
        if disjoint:
            with lockstep():  # a collective transfer follows: every rank is in this call
                agree(self, problem)
        elif problem is not None:  # an independent read: nothing to keep in step (the caller agrees)
            raise problem
        if out is None:
            out = np.empty(want, dtype=info.dtype)
        token = _DISJOINT.set(bool(disjoint))
        try:
            self._read_ranges(key, rng, out)
        finally:
            _DISJOINT.reset(token)
        self.stats.rows_read += total
        self.stats.bytes_read += total * info.row_nbytes
        return out

    @abstractmethod
    def _read_ranges(self, key: str, ranges: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out`` with the rows of ``ranges`` (already checked); count ``stats.read_calls``."""

    def read_fields(self, keys: Sequence[str], ranges: Sequence[Sequence[int]] | np.ndarray,
                    out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The same row ranges of several arrays (the fields of one step), key -> buffer.

        ``out`` may hold preallocated buffers for some or all keys. On a collective backend this
        is one collective call per key, in the order given, so every rank must pass the same keys.
        """
        out = dict(out or {})
        for key in keys:
            out[key] = self.read_ranges(key, ranges, out=out.get(key))
        return out

    def read_all(self, key: str) -> np.ndarray:
        """Read a whole (small) array, e.g. an offsets index."""
        n = self.info(key).shape[0]
        return self.read_ranges(key, [(0, n)] if n else [])
