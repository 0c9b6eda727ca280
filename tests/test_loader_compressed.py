"""Compressed data end to end: ``solar ingest --rel-error`` -> ``solar.DataLoader`` with a byte budget.

The loader keeps *compressed* blobs in the rank buffer and decodes each mini-batch at once, so
the same byte budget holds about ratio-times more samples and serves strictly more hits, while
every batch is the uncompressed run's batch within the stored absolute bound.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

import solar
from solar.ingest import ingest
from solar.schedule import capacity_for_bytes, owner_of
from solar.synthetic import write_ptycho_h5

N, SIZE, BATCH, SEED = 96, 32, 8, 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(raw path, compressed path): the compressed one made from the raw one by ``solar ingest``."""
    d = tmp_path_factory.mktemp("compressed")
    raw, comp = str(d / "raw.h5"), str(d / "comp.h5")
    write_ptycho_h5(raw, N, SIZE, seed=1, progress=False)
    ingest([raw], comp, rel_error=1e-2, comm=None, progress=False)
    return raw, comp


def budget_bytes(raw: str, fraction: float) -> int:
    ds = solar.H5Dataset(raw, backend="hdf5")
    try:
        return int(fraction * ds.sample_nbytes().sum())
    finally:
        ds.close()


def run(path: str, budget: int, epochs: int = 2, num_workers: int = 0, **ds_options):
    """Every batch of ``epochs`` epochs, the dataset (its hit counters) and the loader."""
    ds = solar.H5Dataset(path, backend="hdf5", io_threads=1, **ds_options)
    loader = solar.DataLoader(ds, batch_size=BATCH, buffer=str(budget), num_workers=num_workers,
                              sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
    batches = []
    for e in range(epochs):
        loader.sampler.set_epoch(e)
        batches += [[t.numpy().copy() for t in b] for b in loader]
    ds.close()
    return batches, ds, loader


def torch_order(epochs: int) -> list[np.ndarray]:
    """The sample indices of every batch torch's DistributedSampler forms (world size 1)."""
    s = tud.DistributedSampler(range(N), num_replicas=1, rank=0, seed=SEED)
    out = []
    for e in range(epochs):
        s.set_epoch(e)
        order = np.array(list(s))
        out += [order[k:k + BATCH] for k in range(0, N, BATCH)]
    return out


def test_ingest_made_a_compressed_file(files):
    raw, comp = files
    ds = solar.H5Dataset(comp, backend="hdf5")
    assert [s.kind for s in ds.specs] == ["codec", "codec"]
    assert all(s.abs_error > 0 for s in ds.specs)
    assert ds.sample_nbytes().sum() * 4 < budget_bytes(raw, 1.0)  # ratio > 4: the buffer claim has room to show
    ds.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_equal_uncompressed_within_bound(files, num_workers):
    raw, comp = files
    budget = budget_bytes(raw, 0.25)
    rb, _, _ = run(raw, budget)
    cb, cds, _ = run(comp, budget, num_workers=num_workers)
    bounds = [s.abs_error for s in cds.specs]
    with h5py.File(raw, "r") as f:
        originals = [f["x"][...], f["y"][...]]
    order = torch_order(2)
    assert len(rb) == len(cb) == len(order)
    for idx, r, c in zip(order, rb, cb):
        for field, (rv, cv, orig, bound) in enumerate(zip(r, c, originals, bounds)):
            np.testing.assert_array_equal(rv, orig[idx], err_msg=f"raw field {field}")
            assert cv.shape == rv.shape and cv.dtype == rv.dtype
            err = np.abs(cv.astype(np.float64) - orig[idx].astype(np.float64)).max()
            assert err <= bound, f"field {field}: decoded error {err} exceeds the bound {bound}"


@pytest.mark.parametrize("fraction", [0.25, 0.02])
def test_same_byte_budget_more_resident_samples_and_hits(files, fraction):
    """0.25: the compressed buffer holds the whole dataset; 0.02: it holds about ratio-times
    the uncompressed buffer's samples (and the uncompressed one holds 1)."""
    raw, comp = files
    budget = budget_bytes(raw, fraction)
    _, rds, rl = run(raw, budget, epochs=3)
    _, cds, cl = run(comp, budget, epochs=3)
    r_res, c_res = len(rl.solar_sampler.buffer) // 2, len(cl.solar_sampler.buffer) // 2
    assert r_res == int(fraction * N)  # the uncompressed budget holds that fraction of the samples
    stored = cds.sample_nbytes()
    # the compressed buffer holds every sample whose (pinned) set fits the same bytes
    want = N if stored.sum() <= budget else int(np.searchsorted(np.cumsum(stored), budget, side="right"))
    assert c_res == cl.solar_sampler.plan_config().capacity == want > r_res
    assert cl.solar_sampler.buffer.nbytes <= budget and rl.solar_sampler.buffer.nbytes <= budget
    assert cds.stats.hits > rds.stats.hits
    # both reach their bound after the fill epoch: min(1, C/N) of every access
    for ds, C in ((rds, r_res), (cds, c_res)):
        assert ds.stats.hits == 2 * N * min(1.0, C / N)
    assert cds.stats.bytes_in < rds.stats.bytes_in


class CountingDataset(solar.H5Dataset):
    def decode(self, stored):
        self.decode_calls = getattr(self, "decode_calls", 0) + 1
        return super().decode(stored)


@pytest.mark.parametrize("prefetch", [4, 0])
def test_without_workers_a_whole_pass_is_decoded_at_once(files, prefetch):
    """No workers: one decode per prefetch pass of ``prefetch`` steps (inline: one per step)."""
    _, comp = files
    ds = CountingDataset(comp, backend="hdf5", io_threads=1)
    loader = solar.DataLoader(ds, batch_size=BATCH, buffer="1MB", prefetch=prefetch,
                              sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
    with h5py.File(files[0], "r") as f:
        x = f["x"][...]
    got = np.concatenate([b[0].numpy() for b in loader])
    steps = N // BATCH
    assert ds.decode_calls == (-(-steps // prefetch) if prefetch else steps)
    np.testing.assert_allclose(got, x[np.concatenate(torch_order(1))], atol=ds.specs[0].abs_error, rtol=0)
    ds.close()


def test_a_random_split_of_a_compressed_file_decodes_and_names_the_files_sample(files, tmp_path):
    """NOTE [ Subsets ]: a random_split of a compressed file is driven like the file (compressed
    bytes buffered, whole passes decoded): the batches are torch's over the same Subset. A
    damaged blob is named by the file's sample number, not by its position in the split."""
    import shutil

    raw, comp = files
    bad = str(tmp_path / "damaged.h5")
    shutil.copy(comp, bad)
    probe = solar.H5Dataset(comp, backend="hdf5")
    spec = probe.specs[0]
    start = int(probe._offsets_of(spec)[10])
    probe.close()
    with h5py.File(bad, "r+") as f:
        f[spec.data_key][start] ^= 0xFF  # the first magic byte of sample 10's blob of field x
    for path in (comp, bad):
        ds = solar.H5Dataset(path, backend="hdf5", io_threads=1, verify=False)
        ref = solar.H5Dataset(comp, backend="hdf5", io_threads=1)
        train, _ = tud.random_split(ds, [0.5, 0.5], generator=torch.Generator().manual_seed(2))
        ref_train, _ = tud.random_split(ref, [0.5, 0.5], generator=torch.Generator().manual_seed(2))
        loader = solar.DataLoader(train, batch_size=BATCH, shuffle=True, buffer="1MB",
                                  generator=torch.Generator().manual_seed(5))
        assert loader.solar_sampler is not None and ds.compressed
        torch_loader = tud.DataLoader(ref_train, batch_size=BATCH, shuffle=True,
                                      generator=torch.Generator().manual_seed(5))
        if path == comp:
            for _ in range(2):  # whole epochs of both
                got, want = list(loader), list(torch_loader)
                assert len(got) == len(want) and all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
            assert ds.stats.hits > 0
        else:
            assert 10 in train.indices
            with pytest.raises(solar.CorruptDataError, match=r"sample '10 of .*damaged.h5:x'"):
                list(loader)
        ds.close()
        ref.close()


@pytest.mark.slow
def test_compiled_decoding_gives_the_same_batches(files, monkeypatch):
    """``decode_compile=True`` (the torch.compile-d decoder graph) changes speed, not one bit."""
    from solar.codec import fused

    graph_runs = []
    real_run = fused.run
    monkeypatch.setattr(fused, "run", lambda *a: graph_runs.append(1) or real_run(*a))
    _, comp = files
    budget = budget_bytes(files[0], 0.5)
    eager, _, _ = run(comp, budget, epochs=1, decode_compile=False)
    assert not graph_runs
    compiled, _, _ = run(comp, budget, epochs=1, decode_compile=True)
    assert graph_runs  # the batches really went through the graph
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


@pytest.mark.gpu
def test_decoded_on_the_gpu_equals_the_cpu_decode(files):
    """``device="cuda"``: passes are decoded on the GPU (prefetch thread) and the batches, on the
    GPU, are bit-identical to the CPU decode."""
    import torch

    _, comp = files
    out = {}
    for device in ("cpu", "cuda"):
        ds = solar.H5Dataset(comp, backend="hdf5", device=device)
        loader = solar.DataLoader(ds, batch_size=BATCH, buffer="1MB",
                                  sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
        out[device] = [list(b) for b in loader]
        ds.close()
    for c, g in zip(out["cpu"], out["cuda"]):
        for tc, tg in zip(c, g):
            assert tg.device.type == "cuda"
            assert torch.equal(tc, tg.cpu())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=80), st.integers(0, 20000), st.integers(1, 4),
       st.integers(1, 8))
def test_capacity_for_variable_sizes_is_the_largest_that_fits(sizes, budget, world, batch):
    """A byte budget with variable-size (compressed) samples: C is the largest per-rank capacity
    whose owned samples fit ``budget`` on every rank (so smaller blobs -> more samples)."""
    sizes = np.array(sizes, dtype=np.int64)
    n = len(sizes)

    def fits(c):
        m = min(n, world * c)
        per = np.bincount(owner_of(np.arange(m), world, batch, c), weights=sizes[:m], minlength=world)
        return per.max(initial=0) <= budget

    C = capacity_for_bytes(sizes, budget, world, batch)
    assert 0 <= C <= -(-n // world) and fits(C)
    if C < -(-n // world):
        assert not fits(C + 1)
    halved = capacity_for_bytes(np.maximum(1, sizes // 2), budget, world, batch)
    assert halved >= C


@pytest.fixture(scope="module")
def bytes_file(tmp_path_factory):
    """One uint8 field of 300 kB: rows are bytes, like a compressed field's blob data."""
    path = str(tmp_path_factory.mktemp("bytes") / "bytes.h5")
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f["x"] = data
    return path, data


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300_000), min_size=2, max_size=12, unique=True), st.integers(1, 5))
def test_threaded_reads_split_long_ranges_exactly(bytes_file, edges, threads):
    """Reads over ``io_threads`` request threads cut long (sieved) ranges into equal shares; the
    bytes come back exactly, in order, however the ranges and thread shares fall."""
    path, data = bytes_file
    e = np.sort(np.array(edges, dtype=np.int64))
    ranges = np.stack([e[:-1:2], e[1::2]], axis=1)
    ds = solar.H5Dataset(path, fields="x", backend="hdf5", io_threads=threads)
    got = ds._read("x", ranges)
    ds.close()
    np.testing.assert_array_equal(got, np.concatenate([data[a:b] for a, b in ranges]))


@pytest.mark.mpi
def test_two_ranks_collective_compressed_reads_within_bound_and_more_hits(comm, shared_tmp):
    """Under mpirun: ``solar ingest`` (collective) makes the compressed file; with the same byte
    budget per rank, the compressed run on parallel HDF5 decodes every sample within its bound
    (indices from the schedule) and serves more buffer hits than the uncompressed run."""
    import os

    raw, comp = os.path.join(shared_tmp, "raw.h5"), os.path.join(shared_tmp, "comp.h5")
    write_ptycho_h5(raw, N, SIZE, seed=1, comm=comm, progress=False)
    comm.Barrier()
    ingest([raw], comp, rel_error=1e-2, comm=comm, progress=False)
    comm.Barrier()
    P, rank = comm.size, comm.rank
    budget = budget_bytes(raw, 0.25) // P
    with h5py.File(raw, "r") as f:
        originals = [f["x"][...], f["y"][...]]
    hits = {}
    for path in (raw, comp):
        ds = solar.H5Dataset(path, io_threads=1)  # backend "auto": collective parallel HDF5
        assert ds.backend.collective
        loader = solar.DataLoader(ds, batch_size=BATCH // P, buffer=str(budget),
                                  sampler=tud.DistributedSampler(ds, num_replicas=P, rank=rank, seed=SEED))
        bounds = [s.abs_error if s.kind == "codec" else 0.0 for s in ds.specs]
        for e in range(3):
            loader.sampler.set_epoch(e)
            steps = None
            for k, batch in enumerate(loader):
                steps = steps or loader.solar_sampler.current["plan"].rank_steps(rank)
                for t, orig, bound in zip(batch, originals, bounds):
                    err = np.abs(t.numpy().astype(np.float64) - orig[steps[k]]).max()
                    assert err <= bound, f"{path} epoch {e} step {k}: error {err} > bound {bound}"
        hits[path] = comm.allreduce(ds.stats.hits)
        ds.close()
    assert hits[comp] > hits[raw] > 0


def test_passes_of_large_steps_are_decoded_step_by_step_in_parallel(files, monkeypatch):
    """NOTE [ Decoding ahead in parallel ] in solar/passes.py: steps of DECODE_STEP_SAMPLES samples
    or more are decoded one ``decode`` each, on the decode threads, to the same batches as one
    decode per pass."""
    import threading

    import solar.passes as passes

    _, comp = files
    # every sample decoded in both epochs: no decoded copies (NOTE [ Decoded copies ] in solar/decoded.py)
    monkeypatch.setenv("SOLAR_DECODED_COPIES", "0")

    def epochs(step_samples):
        monkeypatch.setattr(passes, "DECODE_STEP_SAMPLES", step_samples)
        monkeypatch.setattr(passes, "_cores", lambda: 2)
        ds = CountingDataset(comp, backend="hdf5", io_threads=1)
        threads = set()
        decode = ds.decode

        def seen(stored):
            threads.add(threading.current_thread().name.split("_")[0])
            return decode(stored)
        ds.decode = seen
        loader = solar.DataLoader(ds, batch_size=BATCH, buffer="1MB", prefetch=4,
                                  sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED))
        got = []
        for e in range(2):
            loader.sampler.set_epoch(e)
            got += [[t.clone() for t in b] for b in loader]
        ds.close()
        return got, ds.decode_calls, threads

    whole, whole_calls, whole_threads = epochs(1 << 20)
    by_step, step_calls, step_threads = epochs(BATCH)
    assert whole_calls == 2 * (N // BATCH // 4) and step_calls == 2 * N // BATCH
    assert whole_threads == {"solar-prefetch"} and step_threads == {"solar-decode"}
    assert len(whole) == len(by_step) and all(torch.equal(a, b) for x, y in zip(whole, by_step) for a, b in zip(x, y))
