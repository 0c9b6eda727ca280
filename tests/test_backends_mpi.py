"""mpi-hdf5 under a real `mpirun -n 2`: the conformance suite (every rank runs every test, so
every collective call is matched) plus rank-dependent collective reads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from solar.testing.backends import SAMPLE_ATTRS, BackendTests, sample_arrays, write_h5

pytestmark = pytest.mark.mpi


def _shared_file(comm, shared_tmp, arrays, attrs=None) -> str:
    path = os.path.join(shared_tmp, "c.h5")
    if comm.rank == 0:
        write_h5(path, arrays, attrs)
    comm.Barrier()
    return path


class TestMPIHDF5(BackendTests):
    @pytest.fixture
    def backend(self, arrays, comm, shared_tmp):
        from solar.io_backends.mpi_hdf5 import MPIHDF5Backend

        b = MPIHDF5Backend(_shared_file(comm, shared_tmp, arrays, SAMPLE_ATTRS))
        assert b.collective
        yield b
        b.close()
        comm.Barrier()


@pytest.mark.parametrize("options", [{}, {"mpi_hints": {"romio_cb_read": "enable"}}, {"transfer": "independent"}],
                         ids=["collective", "cb-hints", "independent"])
def test_each_rank_reads_its_own_ranges_in_one_call(comm, shared_tmp, options):
    from solar.io_backends import open_backend

    arrays = sample_arrays()
    path = _shared_file(comm, shared_tmp, arrays)
    b = open_backend(path, **options)  # auto under mpirun with MPI h5py
    assert type(b).__name__ == "MPIHDF5Backend" and b.transfer == options.get("transfer", "collective")
    # rank r reads every (r+1)-th run of 3 rows; the last rank also reads nothing in a second call
    ranges = [(s, s + 3) for s in range(comm.rank, 34, 6 + comm.rank)]
    got = b.read_ranges("x", ranges)
    np.testing.assert_array_equal(got, np.concatenate([arrays["x"][s:e] for s, e in ranges]))
    empty = b.read_ranges("y", [] if comm.rank == comm.size - 1 else [(0, 37)])
    assert len(empty) == (0 if comm.rank == comm.size - 1 else 37)
    assert b.stats.read_calls == 2  # one collective call per read_ranges, whatever the range count
    b.close()
    comm.Barrier()


def test_missing_file_fails_on_every_rank(comm, shared_tmp):
    from solar.io_backends.mpi_hdf5 import MPIHDF5Backend

    with pytest.raises(FileNotFoundError, match="every rank"):
        MPIHDF5Backend(os.path.join(shared_tmp, "absent.h5")).keys()


def test_filtered_sparse_and_empty_datasets_read_right_under_the_default_transfer(comm, shared_tmp):
    """NOTE [ Filtered and sparse chunked datasets ] in io_backends/mpi_hdf5.py: HDF5's collective
    path gave wrong rows (LZF), errors or a hang (unwritten chunks) and 'addr overflow' (no rows)."""
    import h5py

    from solar.io_backends import open_backend

    path = os.path.join(shared_tmp, "odd.h5")
    x = np.arange(250, dtype="<i4").reshape(50, 5)
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            f.create_dataset("lzf", data=x, chunks=(7, 5), compression="lzf")
            f.create_dataset("lzf_be", data=x.astype(">i4"), chunks=(7, 5), compression="lzf")
            sparse = f.create_dataset("sparse", shape=(50, 5), dtype="<i4", chunks=(5, 5), fillvalue=-1)
            sparse[10:20] = x[10:20]
            f.create_dataset("empty", shape=(0, 3), dtype="f4")
            f.create_dataset("unwritten", shape=(6, 2), dtype="f8", fillvalue=2.5)
    comm.Barrier()
    b = open_backend(f"file://{path}")  # auto: mpi-hdf5, collective transfer
    assert type(b).__name__ == "MPIHDF5Backend" and b.transfer == "collective"
    ranges = [(3, 9), (40, 50)] if comm.rank == 0 else [(0, 2), (15, 30)]
    want = np.concatenate([x[s:e] for s, e in ranges])
    for key in ("lzf", "lzf_be"):
        np.testing.assert_array_equal(b.read_ranges(key, ranges), want)
    sparse_want = np.where((np.arange(50) >= 10) & (np.arange(50) < 20), x.T, -1).T
    np.testing.assert_array_equal(b.read_ranges("sparse", ranges),
                                  np.concatenate([sparse_want[s:e] for s, e in ranges]))
    assert b.read_all("empty").shape == (0, 3)
    np.testing.assert_array_equal(b.read_all("unwritten"), np.full((6, 2), 2.5))
    b.close()
    comm.Barrier()


@pytest.mark.timeout(90, method="thread")  # a hang (the bug) ends the MPI job instead of stalling it
def test_a_bad_request_on_one_rank_fails_every_rank_instead_of_hanging(comm, shared_tmp):
    """NOTE [ Collective request checks ] in solar/collective.py: a sample index or row range out of
    range (or a wrong out=) on one rank used to raise there alone while the other ranks entered the
    collective read and hung; now, in lockstep (the loader's passes), every rank raises, and the
    ranks stay in step afterwards."""
    import re

    import solar
    from solar.ingest import ingest
    from solar.collective import lockstep

    path = os.path.join(shared_tmp, "checked.h5")
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    if comm.rank == 0:
        np.save(os.path.join(shared_tmp, "in.npy"), x)
        ingest([os.path.join(shared_tmp, "in.npy")], path, comm=None, progress=False)  # with checksums
    comm.Barrier()
    ds = solar.H5Dataset(path, "x")
    b = ds.backend
    assert type(b).__name__ == "MPIHDF5Backend"
    # the first fetch, with nothing to read on the other ranks: every rank loads the checksums alike
    assert ds.fetch_stored([3] if comm.rank == 0 else []).n == (1 if comm.rank == 0 else 0)
    size, last = comm.size, comm.rank == comm.size - 1
    with lockstep():
        if comm.rank == 0:
            with pytest.raises(IndexError, match=rf"^{re.escape(path)}: sample index 45 out of range for 40 samples"):
                ds.fetch_stored([1, 45])
        else:
            with pytest.raises(IndexError, match=rf"rank 0 of {size} rejected .*sample index 45 out of range.*rank 0"):
                ds.fetch_stored([2, 3])
        with pytest.raises(IndexError, match=r"^\S+:x: row 40 out of range" if last else
                           rf"rank {size - 1} of {size} rejected .*row 40 out of range for 40 rows"):
            b.read_ranges("x", [(39, 41)] if last else [(0, 2)], disjoint=True)  # (the check fails first)
    # a disjoint read is collective, so it agrees in or out of lockstep; an independent one raises
    # on its own rank only (it makes no MPI call)
    if last:
        with pytest.raises(IndexError, match=r"^\S+:x: row 40 out of range"):
            b.read_ranges("x", [(39, 41)])
    with pytest.raises(ValueError, match=r"^\S+:x: out has shape" if last else rf"rank {size - 1} .*out has shape"):
        b.read_ranges("x", [(0, 2)], out=np.empty((3 if last else 2, 3), np.float32), disjoint=True)
    # every rank is still in step: the next collective reads pair up and return the right rows
    got = ds.__getitems__([7, 3 + comm.rank])
    np.testing.assert_array_equal(np.stack([t.numpy() for t in got]), x[[7, 3 + comm.rank]])
    np.testing.assert_array_equal(b.read_ranges("x", [(comm.rank, comm.rank + 2)]), x[comm.rank:comm.rank + 2])
    ds.close()
    comm.Barrier()


@pytest.mark.timeout(90, method="thread")  # a hang (the bug) ends the MPI job instead of stalling it
def test_ranks_read_alone_outside_the_loader(comm, shared_tmp):
    """Outside the loader's passes reads are independent (NOTE [ Collective request checks ]):
    rank 0 alone looks at a sample, each rank loads its own subset (a torch DataLoader over a
    Subset of its own length), and a bad index raises on its rank only. Every one of these hung
    before: each read agreed with an allreduce the other ranks never made."""
    import torch.utils.data as tud

    import solar

    path = os.path.join(shared_tmp, "alone.h5")
    x = np.arange(103 * 4, dtype=np.float32).reshape(103, 4)
    if comm.rank == 0:
        write_h5(path, {"x": x})
    comm.Barrier()
    ds = solar.H5Dataset(path, "x")
    assert type(ds.backend).__name__ == "MPIHDF5Backend"
    if comm.rank == 0:
        np.testing.assert_array_equal(ds[5].numpy(), x[5])
        with pytest.raises(IndexError, match="sample index 103 out of range"):
            ds[103]
    mine = list(range(0, 50)) if comm.rank == 0 else list(range(50, 103))
    got = [b.numpy() for b in solar.DataLoader(tud.Subset(ds, mine), batch_size=10)]
    np.testing.assert_array_equal(np.concatenate(got), x[mine])
    comm.Barrier()
    ds.close()
    comm.Barrier()


def test_virtual_datasets_are_read_not_filled(comm, shared_tmp):
    """Parallel HDF5 cannot read a virtual dataset (h5py.VirtualLayout) and its storage size is 0,
    so every row came back as the fill value, silently; it is read through a serial handle now."""
    import h5py

    import solar

    x = np.arange(80 * 6, dtype=np.float32).reshape(80, 6)
    if comm.rank == 0:
        for i in range(2):
            with h5py.File(os.path.join(shared_tmp, f"part{i}.h5"), "w") as f:
                f["x"] = x[40 * i:40 * (i + 1)]
        layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
        for i in range(2):
            layout[40 * i:40 * (i + 1)] = h5py.VirtualSource(os.path.join(shared_tmp, f"part{i}.h5"), "x", (40, 6))
        with h5py.File(os.path.join(shared_tmp, "vds.h5"), "w") as f:
            f.create_virtual_dataset("x", layout, fillvalue=-1)
    comm.Barrier()
    ds = solar.H5Dataset(os.path.join(shared_tmp, "vds.h5"), "x")
    assert type(ds.backend).__name__ == "MPIHDF5Backend"
    np.testing.assert_array_equal(ds[3 + comm.rank].numpy(), x[3 + comm.rank])
    rows = [(2 * comm.rank, 2 * comm.rank + 2), (60 + 5 * comm.rank, 65 + 5 * comm.rank)]  # disjoint
    np.testing.assert_array_equal(ds.backend.read_ranges("x", rows, disjoint=True),
                                  np.concatenate([x[a:b] for a, b in rows]))
    comm.Barrier()
    ds.close()
    comm.Barrier()


@pytest.mark.timeout(120, method="thread")  # a hang (the bug) ends the MPI job instead of stalling it
@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "codec"])
def test_reading_alone_then_training_together(comm, shared_tmp, compressed):
    """Rank-local use next to the loader's passes: rank 0 peeks at a sample (caching the
    checksums, and a codec field's offsets, on rank 0 only), then every rank trains over a
    DistributedSampler; then rank 0 alone runs a validation loader, a torch DataLoader with
    workers reads each rank's subset, and rank 0 alone reads a virtual dataset. Each hung: a
    cached read agreed on some ranks only (an unmatched allreduce), a pass agreed with nobody,
    workers opened the file with MPI after fork, and ``is_virtual`` made a collective call."""
    import h5py
    import torch.utils.data as tud

    import solar
    from solar.ingest import ingest

    x = np.random.default_rng(1).standard_normal((48, 8, 8)).astype(np.float32)
    src, path = os.path.join(shared_tmp, "alone.npy"), os.path.join(shared_tmp, f"alone-{compressed}.h5")
    if comm.rank == 0:
        np.save(src, x)
        ingest([src], path, comm=None, progress=False, abs_error=1e-3 if compressed else None)
        for i in range(2):
            with h5py.File(os.path.join(shared_tmp, f"vpart{i}.h5"), "w") as f:
                f["x"] = x[24 * i:24 * (i + 1)]
        layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
        for i in range(2):
            layout[24 * i:24 * (i + 1)] = h5py.VirtualSource(os.path.join(shared_tmp, f"vpart{i}.h5"), "x", (24, 8, 8))
        with h5py.File(os.path.join(shared_tmp, "valone.h5"), "w") as f:
            f.create_virtual_dataset("x", layout)
    comm.Barrier()
    ds = solar.H5Dataset(path, "x")
    vds = solar.H5Dataset(os.path.join(shared_tmp, "valone.h5"), "x")
    tol = 1e-3 if compressed else 0
    if comm.rank == 0:
        assert np.abs(ds[0].numpy() - x[0]).max() <= tol
    s = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=1)
    seen = 0
    for epoch in range(2):
        s.set_epoch(epoch)
        for b in solar.DataLoader(ds, batch_size=4, sampler=s, buffer=0):
            seen += len(b)
    assert seen == 2 * 48 // comm.size
    if comm.rank == 0:
        got = torch_cat([b for b in solar.DataLoader(ds, batch_size=10)])
        assert np.abs(got - x).max() <= tol
        np.testing.assert_array_equal(vds[30].numpy(), x[30])
    mine = list(range(comm.rank, 48, comm.size))
    got = torch_cat([b for b in tud.DataLoader(tud.Subset(ds, mine), batch_size=4, num_workers=2)])
    assert np.abs(got - x[mine]).max() <= tol
    comm.Barrier()
    ds.close()
    vds.close()
    comm.Barrier()


def torch_cat(batches):
    return np.concatenate([b.numpy() for b in batches])


@pytest.mark.timeout(120, method="thread")
def test_a_damaged_chunk_on_one_rank_fails_every_rank_of_the_loader(comm, shared_tmp):
    """h5py's read error (a Fletcher32 mismatch) on the rank that reads the damaged chunk raised
    there alone; the others waited in the next pass's allreduce forever. Now every rank raises."""
    import h5py
    import torch.utils.data as tud

    import solar

    path = os.path.join(shared_tmp, "f32.h5")
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(40 * 8, dtype=np.float32).reshape(40, 8), chunks=(1, 8),
                             fletcher32=True)
            info = f["x"].id.get_chunk_info(21)
        with open(path, "r+b") as fh:
            fh.seek(info.byte_offset + 4)
            byte = fh.read(1)
            fh.seek(info.byte_offset + 4)
            fh.write(bytes([byte[0] ^ 0xFF]))
    comm.Barrier()
    ds = solar.H5Dataset(path, "x")
    loader = solar.DataLoader(ds, batch_size=2, buffer=0, prefetch=1, sampler=tud.DistributedSampler(
        ds, num_replicas=comm.size, rank=comm.rank, shuffle=False))
    with pytest.raises(solar.StorageError,
                       match=r"rows \d+-\d+ of 'x' failed .*Fletcher32|rank \d+ of \d+ failed to read"):
        for _ in loader:
            pass
    del loader
    comm.Barrier()
    ds.close()
    comm.Barrier()
