"""Parallel HDF5 over MPI: all of a step's row ranges in ONE collective ``H5Dread`` per field.

NOTE [ One collective read per step ]
    Per-sample reads (what SOLAR's released code does: ``dset[idx]`` per sample on an ``mpio``
    file) make one independent MPI-IO request per sample and rank; on a parallel file system each
    pays a round trip and the small requests defeat striping. Here a call's ranges become a single
    union hyperslab selection (``H5Sselect_hyperslab`` with ``H5S_SELECT_OR``) read with an
    ``H5FD_MPIO_COLLECTIVE`` transfer property list, so MPI-IO sees every rank's whole step at once
    and can aggregate it (two-phase collective buffering: a few aggregator ranks read large
    contiguous extents and scatter them).

    Because the read is collective, **every rank must call** :meth:`read_ranges` for the same
    keys, in the same order, the same number of times, passing an empty range list when it has
    nothing to read (the selection is then ``H5Sselect_none`` and the rank still joins the call).
    The class flag ``collective = True`` tells the loader so.

NOTE [ Collective or independent transfer ]
    The call is collective in both modes; what changes is the MPI-IO transfer. Collective
    (two-phase) transfers pay when ranks' requests interleave densely in the file (many ranks,
    large contiguous extents on a striped PFS): aggregators turn them into few large reads. For
    sparse random rows -- a shuffled epoch -- they have less to gain, and every call waits for
    the slowest rank (OpenMPI busy-polls meanwhile), so oversubscribed CPUs hurt: on this
    project's 2-core machine bench/io measured both transfers within 10% when the machine was
    quiet, and the collective one 2.8-4.5x slower while other jobs kept both cores busy. Both
    make the same single call per rank and step. Measure on your system (``bench/io/run.py``)
    and set ``transfer=`` or ``SOLAR_MPIIO_TRANSFER``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from solar.dist import collective_call, mpi_comm, private_comm, under_mpirun
from solar.failfast import register_exit_close, replace_exit_close, unregister_exit_close, weak_close
from solar.errors import ConfigError, MPIUnavailableError

from .base import disjoint_read
from .hdf5 import HDF5Backend, h5_read_errors, read_rows

__all__ = ["MPIHDF5Backend", "require_parallel_hdf5"]

_FIX = ("launch with `mpirun -n N python ...` (or srun/mpiexec), with mpi4py installed and h5py built "
        "against parallel HDF5 (`make setup` does this); or use backend='hdf5' for serial reads")


def require_parallel_hdf5(what: str):
    """``MPI.COMM_WORLD`` if this process can do parallel HDF5, else raise saying how to fix it."""
    import h5py  # heavy; imported when a parallel-HDF5 backend is asked for

    if not h5py.get_config().mpi:
        raise MPIUnavailableError(
            f"{what}: h5py {h5py.__version__} was built without MPI support, so the 'mpio' driver is missing; "
            f"{_FIX}")
    if not under_mpirun():
        raise MPIUnavailableError(f"{what}: not running under mpirun (no MPI launcher environment found); {_FIX}")
    comm = mpi_comm()
    if comm is None:
        raise MPIUnavailableError(f"{what}: mpi4py is not installed; pip install 'solar-loader[mpi]'; {_FIX}")
    return comm


def _close_parked(handles: dict) -> None:
    """Close the parked handles of a backend dropped without ``close()`` (datasets, then files)."""
    handles.pop("_dsets", None)
    for key in ("_vfile", "_file"):
        f = handles.pop(key, None)
        if f is not None:
            f.close()  # h5py closes the file's open objects first
    handles.clear()


class MPIHDF5Backend(HDF5Backend):
    """Reads an HDF5 file with the ``mpio`` driver and collective hyperslab I/O.

    Args:
        url: local path on a file system every rank sees.
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``); the backend makes its calls
            over SOLAR's private duplicate of it (:func:`solar.dist.private_comm`, made when the
            backend is constructed: collective over ``comm``). Not pickled.
        mpi_hints: MPI-IO hints (``MPI.Info``), e.g. ``{"romio_cb_read": "enable",
            "cb_buffer_size": "16777216"}``; strings only.
        transfer: ``"collective"`` (default; ``H5FD_MPIO_COLLECTIVE``, MPI-IO may aggregate with
            two-phase I/O) or ``"independent"`` (the same single union-selection read per rank,
            ``H5FD_MPIO_INDEPENDENT``). The environment variable ``SOLAR_MPIIO_TRANSFER`` sets
            the default. Either way every rank makes every call, so switching needs no other
            change. See NOTE [ Collective or independent transfer ]. Even with
            ``"collective"``, only calls promised ``disjoint=True`` use the collective transfer
            (NOTE [ Disjoint collective reads ] in io_backends/base.py).
    """

    name = "mpi-hdf5"
    collective = True

    def __init__(self, url, comm=None, **options: Any) -> None:
        require_parallel_hdf5(f"backend 'mpi-hdf5' for {url}")
        transfer = options.pop("transfer", None) or os.environ.get("SOLAR_MPIIO_TRANSFER", "collective")
        if transfer not in ("collective", "independent"):
            raise ConfigError(f"transfer must be 'collective' or 'independent' (also via SOLAR_MPIIO_TRANSFER), "
                              f"got {transfer!r}")
        super().__init__(url, **options)
        self.transfer = transfer
        # SOLAR's own duplicate of the communicator, made here, on the constructing thread, where
        # every rank constructs the backend (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py)
        self._comm = private_comm(comm if comm is not None else require_parallel_hdf5(f"backend 'mpi-hdf5' for {url}"))
        self._origin_pid = os.getpid()  # pickled along: a copy in a worker knows it is one
        self._child = False

    def _handle_attrs(self):
        return (*super()._handle_attrs(), "_comm", "_dxpl", "_dxpls", "_vfile")

    @property
    def comm(self):
        """SOLAR's private duplicate of the communicator (a pickled copy takes its process's cached one)."""
        if getattr(self, "_comm", None) is None:
            self._comm = private_comm(require_parallel_hdf5(f"backend 'mpi-hdf5' for {self.url}"))
        return self._comm

    def _open_file(self):
        import h5py

        # NOTE [ mpi-hdf5 in a child process ]: a DataLoader worker (forked, or a spawned copy)
        # must not make MPI calls: MPI does not survive fork, and H5Fopen with the mpio driver
        # (an MPI_Comm_dup) hung there. A child reads through a serial handle instead: reads
        # outside the loader's passes are independent anyway, and a worker only makes those.
        self._child = os.getpid() != self._origin_pid
        if self._child:
            return super()._open_file()
        from mpi4py import MPI

        kw: dict[str, Any] = {}
        hints = self.options.get("mpi_hints")
        if hints:
            info = MPI.Info.Create()
            for k, v in hints.items():
                info.Set(str(k), str(v))
            kw["info"] = info
        f = h5py.File(self.url, "r", driver="mpio", comm=self.comm,
                      rdcc_nbytes=self.options.get("rdcc_nbytes", 4 << 20), **kw)
        self._dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        self._dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE if self.transfer == "collective"
                                 else h5py.h5fd.MPIO_INDEPENDENT)
        return f

    def _open(self) -> None:
        if os.getpid() != self._origin_pid:  # a child reads through a serial handle: no MPI call
            super()._open()
            return
        # H5Fopen is collective: on the MPI thread, in order, and only once every rank can open
        collective_call(self._agreed_open)
        # NOTE [ Fail fast ] in solar/failfast.py: an mpio file still open when MPI_Finalize runs
        # aborts the job, and its close is collective, so it is closed at exit only once every
        # rank has ended, in the order of the opens (the same on every rank)
        self._exit_close = register_exit_close(weak_close(self, "close"))

    def _agreed_open(self) -> None:
        """Open once every rank has the file; else raise on every rank, naming the ranks without it.

        A rank that raised alone (node-local staging missing on one node) left the others
        waiting inside H5Fopen's MPI_File_open."""
        import socket

        from mpi4py import MPI

        problem = ""
        if not os.path.isfile(self.url):
            problem = "no such file" if not os.path.exists(self.url) else "not a regular file"
        elif not os.access(self.url, os.R_OK):
            problem = "not readable"
        comm = self.comm
        if comm.allreduce(int(bool(problem)), op=MPI.SUM):
            found = comm.allgather((comm.rank, socket.gethostname(), problem))
            bad = [f"rank {r} on {host}: {why}" for r, host, why in found if why]
            msg = (f"{self.url}: {len(bad)} of {comm.size} ranks cannot open it ({'; '.join(bad[:8])}"
                   f"{' ...' if len(bad) > 8 else ''}); parallel HDF5 opens a file on every rank together, so every "
                   "rank must see it at this path: stage it on every node, or give each rank its own copy "
                   "with backend='hdf5'")
            raise (FileNotFoundError if problem == "no such file" or not problem else PermissionError)(msg)
        super()._open()

    def _close(self) -> None:
        unregister_exit_close(self.__dict__.pop("_exit_close", 0))
        if not self._child:  # H5Fclose of an mpio file is collective too
            collective_call(self._close_handles)
        else:
            self._close_handles()

    def __del__(self) -> None:
        # Dropped without close(): its handles must not be freed here, at a point each rank's
        # garbage collector picks alone (an mpio H5Fclose is collective), nor file before
        # datasets (h5py's "Can't decrement id ref count" tracebacks). They are parked and
        # closed at exit, in opening order, once every rank has ended (NOTE [ Fail fast ]).
        try:
            token = self.__dict__.pop("_exit_close", None)
            if token is None or self._child or self._pid != os.getpid():
                return
            handles = {k: self.__dict__.pop(k) for k in self._handle_attrs() if k in self.__dict__}
            replace_exit_close(token, lambda: _close_parked(handles))
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to do
            pass

    def _close_handles(self) -> None:
        self.__dict__.pop("_dxpl", None)
        self.__dict__.pop("_dxpls", None)
        v = self.__dict__.pop("_vfile", None)
        if v is not None:
            v.close()
        super()._close()

    def _virtual(self, key: str):
        """Dataset ``key`` through a serial (default-driver) handle of the same file."""
        f = self.__dict__.get("_vfile")
        if f is None:
            import h5py

            f = self._vfile = h5py.File(self.url, "r")
        return f[key]

    def _dataset_dxpl(self, key: str, d):
        """The transfer list for ``d``: collective where HDF5 reads it correctly, else independent.

        NOTE [ Filtered and sparse chunked datasets ]: HDF5 1.10's collective read path for
        chunked datasets with filters (LZF: wrong rows or a decompression error; gzip happened to
        work) or with chunks never written (MPI_ERR_TYPE on one rank, a hang on the others) is
        broken; h5py's own ``read_direct`` inside ``d.collective`` fails the same way. Such
        datasets are read with an independent transfer (the call stays collective, so the loader's
        one-call-per-step contract holds). Filters and allocated chunks are file metadata, so every
        rank makes the same choice. Files ``solar ingest`` writes are unfiltered and fully written.
        """
        import h5py

        if self.transfer != "collective":
            return self._dxpl
        cache = self.__dict__.setdefault("_dxpls", {})
        if not disjoint_read():  # NOTE [ Disjoint collective reads ] in io_backends/base.py
            if "(independent)" not in cache:
                dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
                dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
                cache["(independent)"] = dxpl
            return cache["(independent)"]
        if key not in cache:
            risky = False
            if d.chunks is not None:
                expected = math.prod(-(-n // c) for n, c in zip(d.shape, d.chunks))
                try:
                    risky = d.id.get_create_plist().get_nfilters() > 0 or d.id.get_num_chunks() < expected
                except Exception:  # noqa: BLE001 - an HDF5 without chunk queries: be safe
                    risky = True
            if risky:
                dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
                dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
                cache[key] = dxpl
            else:
                cache[key] = self._dxpl
        return cache[key]

    def _read_ranges(self, key: str, ranges: np.ndarray, out: np.ndarray) -> None:
        import h5py

        if self._child:  # NOTE [ mpi-hdf5 in a child process ]
            return super()._read_ranges(key, ranges, out)
        d = self._dset(key)
        if d.shape[0] and d.id.get_storage_size() == 0 and self._virtual(key).is_virtual:
            # Parallel HDF5 cannot read virtual datasets (HDF5 1.10: "parallel reads not supported
            # on virtual datasets"), and their storage size is 0, so the branch below returned the
            # fill value for every row, silently. They are read through a serial handle of the
            # same file instead: independent reads, no MPI call, so any rank may make them alone.
            # (Asked of that handle too: ``is_virtual`` on the mpio one copies the layout, an
            # MPI_Comm_dup, collective, which hung a rank that read alone.)
            self.stats.read_calls += read_rows(self._virtual(key), self.url, key, ranges, out)
            return
        if d.shape[0] == 0 or d.id.get_storage_size() == 0:
            # nothing stored (no rows, or never written): HDF5 fails even a select-none read
            # ("addr overflow"); every rank sees the same metadata and skips alike
            if out.size:
                out[...] = d.fillvalue
            self.stats.read_calls += 1
            return
        fspace = d.id.get_space()
        total = int(out.shape[0])
        if total == 0:
            fspace.select_none()
            mspace = h5py.h5s.create_simple((1, *out.shape[1:]))
            mspace.select_none()
            buf = np.empty((1, *out.shape[1:]), dtype=out.dtype)
        else:
            tail = tuple(d.shape[1:])
            zeros = (0,) * len(tail)
            fspace.select_none()
            for start, stop in ranges.tolist():
                fspace.select_hyperslab((start, *zeros), (stop - start, *tail), op=h5py.h5s.SELECT_OR)
            mspace = h5py.h5s.create_simple(out.shape)
            buf = out
            if not (out.flags.c_contiguous and out.flags.writeable):
                buf = np.empty_like(out)
        with h5_read_errors(self.url, key, ranges):
            d.id.read(mspace, fspace, buf, dxpl=self._dataset_dxpl(key, d))
        if total and buf is not out:
            out[...] = buf
        self.stats.read_calls += 1
        self.stats.extra["collective_calls"] = self.stats.extra.get("collective_calls", 0) + 1
