"""solar.DataLoader under a real ``mpirun -n 2`` (and 3): identical plans without communication, balanced
ranks, DistributedSampler's global batches, buffer hits from epoch 2, collective parallel HDF5."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.schedule import PlanConfig, Planner, global_order
from solar.synthetic import write_ptycho_h5


@pytest.mark.mpi
def test_two_ranks_plan_alike_split_global_batches_and_hit_from_epoch_two(comm, shared_tmp):
    path = os.path.join(shared_tmp, "ptycho.h5")
    write_ptycho_h5(path, 120, 8, seed=2, comm=comm, progress=False)
    comm.Barrier()
    P, b = comm.size, 5
    C = 120 // 2 // P  # buffer=0.5: each rank keeps half its share
    ds = solar.H5Dataset(path)  # backend "auto": parallel HDF5 (collective reads) under mpirun
    sampler = tud.DistributedSampler(ds, num_replicas=P, rank=comm.rank, seed=9)
    loader = solar.DataLoader(ds, batch_size=b, sampler=sampler, buffer=0.5)
    assert loader.solar_sampler.mode == "schedule"
    # identical plans computed independently on every rank
    plan = Planner(PlanConfig(120, P, b, C, seed=9)).plan(0)
    digest = int(np.bitwise_xor.reduce(plan.rank * 1_000_003 + plan.samples * 7 + plan.hit))
    assert len(set(comm.allgather(digest))) == 1
    y_ref = torch.stack([torch.from_numpy(solar.synthetic.ptycho_sample(i, 8, 2)[1]) for i in range(120)])
    for e in range(3):
        sampler.set_epoch(e)
        mine = []
        for x, y in loader:
            assert x.shape[0] == b and y.shape[0] == b
            mine.append(y)
        everyone = comm.allgather([t.numpy() for t in mine])
        order = global_order(120, P, 9, e)
        for k in range(len(mine)):
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(P * b, -1)
            want = y_ref[order[k * P * b:(k + 1) * P * b]].numpy().reshape(P * b, -1)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
        if e == 0:
            assert comm.allreduce(ds.stats.hits) == 0
    total_hits = comm.allreduce(ds.stats.hits)
    planned = Planner(PlanConfig(120, P, b, C, seed=9))
    planned_hits = sum(int(planned.plan(e).hit.sum()) for e in range(3))
    assert total_hits == planned_hits  # what the buffers served is exactly what the plan promised
    assert total_hits >= 0.95 * 2 * P * C  # ~ every rank's C pinned samples in epochs 2 and 3
    assert ds.backend.name == "mpi-hdf5" and ds.backend.collective
    ds.close()  # collective on parallel HDF5: every rank closes


def _ptycho_loader(comm, path, data_seed, order_seed, buffer):
    """A synthetic PtychoNN file written by every rank, and a 4-per-rank loader over it."""
    write_ptycho_h5(path, 96, 8, seed=data_seed, comm=comm, progress=False)
    comm.Barrier()
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=order_seed)
    return ds, sampler, solar.DataLoader(ds, batch_size=4, sampler=sampler, buffer=buffer, prefetch=2)


@pytest.mark.mpi
def test_breaking_out_of_an_epoch_early_keeps_collective_reads_in_step(comm, shared_tmp):
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "early.h5"), 3, 1, 0.25)
    for e in range(3):
        sampler.set_epoch(e)
        for k, (x, _) in enumerate(loader):
            if comm.rank == 0:
                import time

                time.sleep(0.01)  # rank 0 consumes slower: prefetch progress differs between ranks
            if k == 4:
                break  # every rank stops after the same step, as a training loop would
    sampler.set_epoch(3)
    old = iter(loader)
    next(old)  # the tutorial's look at one batch (`dataiter = iter(loader)`), the iterator kept
    planner = loader.solar_sampler._planner
    h0 = ds.stats.hits
    # the training loop: its iteration ends the held one on every rank alike (its read-ahead's
    # passes finish first, so no MPI call interleaves; before: a ConfigError), rewinds to the
    # step it stopped at and runs a full epoch, collective reads still matching up
    n = sum(len(x) for x, _ in loader)
    assert n == 96 // comm.size
    with pytest.raises(StopIteration):
        next(old)  # ended
    # the ranks agreed on the stop step, so the planner was rewound, not started over: the
    # buffer still serves what the cut-short epochs kept (before: an empty buffer, no hits);
    # the held iteration's read-ahead ran on when it was ended, so its hits count here too
    assert loader.solar_sampler._planner is planner
    assert comm.allreduce(ds.stats.hits - h0) > 0
    assert comm.allreduce(1) == comm.size
    ds.close()


@pytest.mark.mpi
def test_ranks_that_end_an_epoch_differently_keep_identical_plans(comm, shared_tmp):
    """Rank 0 leaves the loop right after the epoch's last batch (its iteration stays open),
    the others run it to its end. Every rank must still plan the next epoch alike (they decide
    without communication who serves which sample); before, rank 0 alone started over with a
    fresh planner: no hits there, and its rebalancing (which moves ownership by residency) no
    longer matched the other ranks'."""
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "ends.h5"), 5, 2, 0.5)
    for k, _ in enumerate(loader):
        if comm.rank == 0 and k == len(loader) - 1:
            break
    sampler.set_epoch(1)
    n = sum(len(x) for x, _ in loader)
    assert n == 96 // comm.size
    plan = loader.solar_sampler.current["plan"]
    ranks = comm.allgather(plan.rank.tobytes())
    assert all(r == ranks[0] for r in ranks)
    assert plan.hit.sum() > 0  # and nobody started over: the epoch-0 keeps are hits
    ds.close()


@pytest.mark.mpi
@pytest.mark.parametrize("verify, whole, workers, concat", [(True, 1 << 20, 0, False), (True, 0, 0, False),
                                                           (False, 0, 0, False), (False, 0, 1, False),
                                                           (False, 0, 1, True), (True, 0, 0, True)],
                         ids=["checksum", "checksum-rows", "codec", "codec-workers", "codec-workers-concat",
                              "checksum-rows-concat"])
def test_a_damaged_sample_on_one_rank_fails_every_rank_instead_of_hanging(comm, shared_tmp, verify, whole, workers,
                                                                          concat, monkeypatch):
    """A checksum (or codec) failure on one rank is agreed before the next collective read; before,
    the other rank waited in that read forever. ``checksum-rows``: the checksums are read with
    each pass's rows (a collective read of its own), not whole. ``codec-workers``: batches are
    decoded in a DataLoader worker, where the damaged blob raised on its rank alone (NOTE
    [ Damaged blobs stop every rank ] in solar/dataset.py); ``concat``: the file is both members
    of a ConcatDataset (``checksum-rows-concat``: the rank whose checksum fails in the first file
    reads the second with the others, and every rank raises at the pass's end: NOTE [ One
    agreement per pass ])."""
    monkeypatch.setattr(solar.H5Dataset, "WHOLE_CHECKSUMS_BYTES", whole)
    import faulthandler

    import h5py

    from solar.ingest import ingest

    src = os.path.join(shared_tmp, "dmg.npy")
    path = os.path.join(shared_tmp, f"dmg-{verify}-{whole}-{workers}-{concat}.h5")
    if comm.rank == 0:
        np.save(src, np.random.default_rng(3).standard_normal((40, 12, 12)).astype(np.float32))
    comm.Barrier()
    ingest([src], path, rel_error=1e-3, progress=False)
    if comm.rank == 0:
        with h5py.File(path, "r+") as f:
            off = f["x/offsets"][:]
            f["x/data"][off[13] + 40:off[13] + 44] ^= np.uint8(0xFF)  # damage sample 13's codec blob
    comm.Barrier()
    ds = solar.H5Dataset(path, verify=verify)
    data = tud.ConcatDataset([solar.H5Dataset(path, verify=verify), ds]) if concat else ds
    loader = solar.DataLoader(data, batch_size=4, buffer=0, num_workers=workers, sampler=tud.DistributedSampler(
        data, num_replicas=comm.size, rank=comm.rank, shuffle=False))
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job instead of blocking CI
    try:
        with pytest.raises(solar.CorruptDataError):
            for _ in loader:
                pass
    finally:
        faulthandler.cancel_dump_traceback_later()
    del loader
    for d in (data.datasets if concat else [ds]):
        d.close()  # collective; an mpio file still open at MPI_Finalize aborts the job
    comm.Barrier()


@pytest.mark.mpi
def test_checksums_read_with_each_pass_match_under_remapping(comm, shared_tmp, monkeypatch):
    """Above ``WHOLE_CHECKSUMS_BYTES`` each rank reads only its pass's checksums, in the same
    collective fetch as the rows (a rank with nothing to read still joins). A wrong row mapping
    would fail a sample's checksum; reading them whole would fill ``_checksums``."""
    monkeypatch.setattr(solar.H5Dataset, "WHOLE_CHECKSUMS_BYTES", 0)
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "sumrows.h5"), 7, 3, 0.5)
    assert ds.backend.collective
    for e in range(2):
        sampler.set_epoch(e)
        assert comm.allreduce(sum(len(x) for x, _ in loader)) == 96
    assert loader.solar_sampler.current["plan"].hit.sum() > 0  # buffer hits skipped their reads
    assert ds._checksums == {}
    ds.close()


@pytest.mark.mpi
@pytest.mark.parametrize("repeats", [False, True], ids=["random_split", "repeated-rows"])
def test_a_random_split_runs_the_schedule_with_collective_reads(comm, shared_tmp, repeats):
    """NOTE [ Subsets ]: a random_split of a parallel-HDF5 file under mpirun is scheduled like the
    file itself: every global batch holds DistributedSampler's samples of the split, and the
    buffers serve exactly the planned hits. A Subset that repeats rows reads without the
    disjoint (collective-transfer) promise and still gives the right batches."""
    path = os.path.join(shared_tmp, f"split{int(repeats)}.h5")
    write_ptycho_h5(path, 120, 8, seed=3, comm=comm, progress=False)
    comm.Barrier()
    ds = solar.H5Dataset(path)
    assert ds.backend.collective
    if repeats:
        train = tud.Subset(ds, [i // 2 for i in range(90)])
    else:
        train, _ = tud.random_split(ds, [90, 30], generator=torch.Generator().manual_seed(0))
    rows = np.asarray(train.indices)
    P, b, n = comm.size, 5, len(train)
    sampler = tud.DistributedSampler(train, num_replicas=P, rank=comm.rank, seed=9)
    loader = solar.DataLoader(train, batch_size=b, sampler=sampler, buffer=0.5)
    assert loader.solar_sampler.mode == "schedule" and loader.dataset.distinct == (not repeats)
    y_ref = np.stack([solar.synthetic.ptycho_sample(i, 8, 3)[1] for i in range(120)])
    for e in range(3):
        sampler.set_epoch(e)
        mine = [y.numpy() for _, y in loader]
        everyone = comm.allgather(mine)
        order = global_order(n, P, 9, e)
        for k in range(len(mine)):
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(P * b, -1)
            want = y_ref[rows[order[k * P * b:(k + 1) * P * b]]].reshape(P * b, -1)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
    planned = Planner(PlanConfig(n, P, b, n // 2 // P, seed=9))
    assert comm.allreduce(ds.stats.hits) == sum(int(planned.plan(e).hit.sum()) for e in range(3)) > 0
    del loader
    ds.close()


@pytest.mark.mpi
@pytest.mark.parametrize("split", ["", "split", "nested"], ids=["concat", "split-of-concat", "concat-of-split"])
def test_several_files_run_one_schedule_with_collective_reads(comm, shared_tmp, split):
    """NOTE [ Several files ]: a ConcatDataset of three parallel-HDF5 files (one a Subset), or a
    random_split of it, is one schedule: every global batch holds DistributedSampler's samples,
    each file is read collectively in every pass (also by ranks with nothing to read there),
    and the buffers serve exactly the planned hits (every file's hits are taken before the
    pass evicts)."""
    sizes = (50, 34, 46)
    paths = [os.path.join(shared_tmp, f"part{split}{i}.h5") for i in range(3)]
    for i, (p, n) in enumerate(zip(paths, sizes)):
        write_ptycho_h5(p, n, 8, seed=20 + i, comm=comm, progress=False)
    comm.Barrier()
    dss = [solar.H5Dataset(p) for p in paths]
    assert all(d.backend.collective for d in dss)
    members = [dss[0], tud.Subset(dss[1], list(range(4, 34))), dss[2]]  # 50 + 30 + 46 = 126
    ys = [np.stack([solar.synthetic.ptycho_sample(i, 8, 20 + k)[1] for i in range(n)]) for k, n in enumerate(sizes)]
    y_all = np.concatenate([ys[0], ys[1][4:34], ys[2]])
    data = tud.ConcatDataset(members)
    pick = np.arange(126)
    if split == "split":
        data, _ = tud.random_split(data, [120, 6], generator=torch.Generator().manual_seed(1))
        pick = np.asarray(data.indices)
    elif split == "nested":  # a split of files 0-1 (interleaving them) beside file 2
        inner = np.random.default_rng(2).permutation(80)[:74]
        data = tud.ConcatDataset([tud.Subset(tud.ConcatDataset(members[:2]), inner.tolist()), members[2]])
        pick = np.r_[inner, 80 + np.arange(46)]
    P, b, n = comm.size, 5, len(data)
    sampler = tud.DistributedSampler(data, num_replicas=P, rank=comm.rank, seed=4)
    loader = solar.DataLoader(data, batch_size=b, sampler=sampler, buffer=0.5)
    assert loader.solar_sampler.mode == "schedule"
    for e in range(3):
        sampler.set_epoch(e)
        mine = [y.numpy() for _, y in loader]
        everyone = comm.allgather(mine)
        order = global_order(n, P, 4, e)
        steps = min(len(m) for m in everyone)
        for k in range(steps):
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(-1, 128)
            want = y_all[pick[order[k * P * b:(k + 1) * P * b]]].reshape(-1, 128)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
    hits = comm.allreduce(sum(d.stats.hits for d in dss))
    planned = Planner(PlanConfig(n, P, b, n // 2 // P, seed=4))
    assert hits == sum(int(planned.plan(e).hit.sum()) for e in range(3)) > 0
    del loader
    for d in dss:
        d.close()


@pytest.mark.mpi
def test_a_pass_over_several_files_agrees_once_on_what_its_reads_found(comm, shared_tmp):
    """NOTE [ One agreement per pass ]: the failures that show after a collective read (a read
    error, a checksum mismatch) are agreed once, at the end of the pass's reads, not once per
    file and field; only the check before each collective read still agrees on its own. Three
    checksummed files of two fields: 3 + 6 agreements (the indices, the reads, the decode check;
    a request check per collective read), where there were 3 + 6 + 12."""
    from solar.views import stored_concat
    from solar.ingest import ingest

    paths = [os.path.join(shared_tmp, f"agree{i}.h5") for i in range(3)]
    rng = np.random.default_rng(40)
    xs, ys = rng.standard_normal((72, 8, 8)).astype(np.float32), rng.standard_normal((72, 2, 8)).astype(np.float32)
    for i, p in enumerate(paths):
        if comm.rank == 0:
            np.savez(p + ".npz", x=xs[24 * i:24 * (i + 1)], y=ys[24 * i:24 * (i + 1)])
        comm.Barrier()
        ingest([p + ".npz"], p, progress=False)  # with per-sample checksums
    dss = [solar.H5Dataset(p) for p in paths]
    assert all(d.backend.collective and all(d._has_checksum.values()) for d in dss)
    data = stored_concat(tud.ConcatDataset(dss))
    mine = [i for i in range(72) if i % comm.size == comm.rank]  # disjoint, in every file
    made = lambda: sum(d.backend.stats.extra.get("agreements", 0) for d in dss)  # noqa: E731
    before = made()
    (got,) = data.fetch_steps([mine], disjoint=True)
    assert made() - before == 3 + len(dss) * len(dss[0].specs)
    out = data.decode(got)
    np.testing.assert_array_equal(out["x"].numpy(), xs[mine])
    np.testing.assert_array_equal(out["y"].numpy(), ys[mine])
    for d in dss:
        d.close()


@pytest.mark.mpi
def test_files_no_rank_reads_in_a_pass_are_skipped_by_every_rank(comm, shared_tmp):
    """NOTE [ Several files ]: one allreduce per pass tells the ranks which files some rank reads;
    a file of the concatenation the split never selects makes no collective call at all (before,
    every pass read every file, each with a few collective calls), and the batches stay right."""
    paths = [os.path.join(shared_tmp, f"skip{i}.h5") for i in range(3)]
    for i, p in enumerate(paths):
        write_ptycho_h5(p, 24, 8, seed=30 + i, comm=comm, progress=False)
    comm.Barrier()
    dss = [solar.H5Dataset(p) for p in paths]
    picked = list(range(0, 24)) + list(range(48, 72))  # files 0 and 2 only
    data = tud.Subset(tud.ConcatDataset(dss), picked)
    sampler = tud.DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, seed=1)
    loader = solar.DataLoader(data, batch_size=4, sampler=sampler, buffer=0.25)
    calls = [d.backend.stats.read_calls for d in dss]
    ys = [np.stack([solar.synthetic.ptycho_sample(i, 8, 30 + k)[1] for i in range(24)]) for k in range(3)]
    want = np.concatenate([ys[0], ys[2]])
    for e in range(2):
        sampler.set_epoch(e)
        got = np.concatenate([y.numpy() for _, y in loader])
        everyone = np.concatenate(comm.allgather(got))
        assert sorted(map(bytes, everyone)) == sorted(map(bytes, want))
    assert dss[1].backend.stats.read_calls == calls[1]  # file 1: not one read
    assert dss[0].backend.stats.read_calls > calls[0] and dss[2].backend.stats.read_calls > calls[2]
    del loader
    for d in dss:
        d.close()


@pytest.mark.mpi
def test_a_buffer_spilled_to_local_disk_hits_under_collective_reads(comm, shared_tmp):
    """spill= on every rank (each its own directory) with parallel HDF5: 8 KB of memory plus 400 KB
    of disk serve the same batches and the same hits as the memory those 400 KB stand for (each
    field a file of whole blocks: 768 B of samples per 2 blocks) plus 8 KB, alone (the schedule
    plans one capacity; disk hits are read on the MPI thread with the collective passes)."""
    path = os.path.join(shared_tmp, "spill.h5")
    write_ptycho_h5(path, 96, 8, seed=2, comm=comm, progress=False)
    comm.Barrier()
    local = os.path.join(shared_tmp, f"nvme{comm.rank}")
    os.makedirs(local)
    bs = os.statvfs(local).f_bsize
    on_disk = -(-256 // bs) * bs + -(-512 // bs) * bs  # fields x (1x8x8 float32) and y (2x8x8)
    runs = []
    for kw in ({"buffer": f"{8000 + 400_000 * 768 // on_disk}B"}, {"buffer": "8KB", "spill": (local, "400KB")}):
        ds = solar.H5Dataset(path)
        assert ds.backend.collective
        sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=3)
        loader = solar.DataLoader(ds, batch_size=4, sampler=sampler, **kw)
        batches = []
        for e in range(3):
            sampler.set_epoch(e)
            batches += [x.numpy().tobytes() for x, _ in loader]
        runs.append((batches, ds.stats.hits, len(loader.solar_sampler.buffer)))  # the same samples kept
        if "spill" in kw:
            assert loader.solar_sampler.buffer.second.nbytes > 0  # part of it on disk
        del loader
        ds.close()
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1] > 0 and runs[0][2] == runs[1][2]


@pytest.mark.mpi
def test_resuming_a_one_rank_state_on_every_rank_gives_each_a_batch_in_the_last_step(comm, shared_tmp):
    """A state saved by a 1-rank job of 7 per batch after one step (position 7) resumed on this
    world with 4 per rank: 89 positions left, whose last step (1 on 2 ranks, 5 on 3) is evened out
    (NOTE [ Resumed tail ]). Before, a rank got an empty batch: IndexError there, the others hung
    in their next collective read."""
    path = os.path.join(shared_tmp, "tail.h5")
    write_ptycho_h5(path, 96, 8, seed=6, comm=comm, progress=False)
    comm.Barrier()
    state = None
    if comm.rank == 0:
        one = solar.H5Dataset(path, backend="hdf5")
        first = solar.DataLoader(one, batch_size=7, buffer=0.5,
                                 sampler=tud.DistributedSampler(one, num_replicas=1, rank=0, seed=8))
        it = iter(first)
        next(it)
        state = first.state_dict()
        del it
        one.close()
    state = comm.bcast(state)
    assert state is not None and state["position"] == 7
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=8)
    loader = solar.DataLoader(ds, batch_size=4, sampler=sampler, buffer=0.5)
    loader.load_state_dict(state)
    ys = [y for _, y in loader]
    counts = comm.allgather([len(y) for y in ys])
    assert all(c == counts[0] for c in counts)  # same steps, same batch sizes on every rank
    assert min(counts[0]) >= 1
    y_ref = torch.stack([torch.from_numpy(solar.synthetic.ptycho_sample(i, 8, 6)[1]) for i in range(96)])
    got = {bytes(r) for ys_r in comm.allgather([y.numpy() for y in ys]) for y in ys_r for r in y.reshape(len(y), -1)}
    want = {bytes(r) for r in y_ref[global_order(96, comm.size, 8, 0)[7:]].numpy().reshape(89, -1)}
    assert got >= want
    ds.close()


def _no_hang(seconds: int = 120):
    """A hang fails the job (with every thread's stack) instead of blocking CI."""
    import faulthandler

    faulthandler.dump_traceback_later(seconds, exit=True)


@pytest.mark.mpi
def test_a_validation_pass_in_the_middle_of_an_epoch_keeps_both_loaders_in_step(comm, shared_tmp):
    """Validate every few training steps with a second loader over a DistributedSampler, as
    training scripts do, while the training loader reads ahead. Before, each loader's read-ahead
    thread made its collective calls when it got to them, so the two loaders' calls met in a
    different order on each rank: a hang (or an allreduce paired with the wrong one). Now every
    collective pass runs on one MPI thread, in the order the loop submitted it
    (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py)."""
    import time

    _no_hang()
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "train.h5"), 7, 3, 0.5)
    vpath = os.path.join(shared_tmp, "val.h5")
    write_ptycho_h5(vpath, 48, 8, seed=8, comm=comm, progress=False)
    comm.Barrier()
    val = solar.H5Dataset(vpath)
    vloader = solar.DataLoader(val, batch_size=5, sampler=tud.DistributedSampler(
        val, num_replicas=comm.size, rank=comm.rank, shuffle=False), prefetch=2)
    # 48 samples: no DistributedSampler padding on 2 or 3 ranks, so every pass sums each once
    want = sum(float(torch.from_numpy(solar.synthetic.ptycho_sample(i, 8, 8)[1]).double().sum()) for i in range(48))
    sums, seen = [], 0
    try:
        for e in range(2):
            sampler.set_epoch(e)
            for k, (x, y) in enumerate(loader):
                seen += len(y)
                if comm.rank == 0:
                    time.sleep(0.005)  # the ranks' read-ahead progress differs, as on a real cluster
                if k % 3 == 1:
                    mine = sum(float(vy.double().sum()) for _, vy in vloader)
                    sums.append(sum(comm.allgather(mine)))
    finally:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    assert seen == 2 * 96 // comm.size
    assert len(sums) >= 4 and all(s == pytest.approx(want, rel=1e-9) for s in sums)
    assert len(set(comm.allgather(len(sums)))) == 1
    val.close()
    ds.close()


@pytest.mark.mpi
def test_a_scripts_own_mpi4py_collectives_never_pair_with_the_loaders(comm, shared_tmp):
    """A training loop that averages its metrics with mpi4py on COMM_WORLD while the loader
    reads ahead: SOLAR's collectives run on a private duplicate communicator. Before, they used
    COMM_WORLD, and the script's allreduce met the loader's (a TypeError adding an int to the
    loader's tuple on one rank, a hang on the other)."""
    import time

    from mpi4py import MPI

    _no_hang()
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "own.h5"), 9, 4, 0.5)
    assert ds.backend.comm is not comm and ds.backend.comm.size == comm.size
    steps = 0
    try:
        for e in range(2):
            sampler.set_epoch(e)
            for k, (x, y) in enumerate(loader):
                if comm.rank == 0:
                    time.sleep(0.003)
                assert comm.allreduce(len(y), op=MPI.SUM) == 4 * comm.size
                assert comm.allgather(k) == [k] * comm.size
                steps += 1
    finally:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    assert steps == 2 * 96 // (4 * comm.size)
    ds.close()


@pytest.mark.mpi
def test_torch_workers_over_parallel_hdf5_leave_the_inherited_handles_alone(comm, shared_tmp, capfd):
    """A plain torch DataLoader with workers over an H5Dataset under mpirun: each forked worker
    reopened the file serially and dropped the parallel handle it inherited, and h5py printed
    "Can't decrement id ref count" tracebacks as the workers exited (8 per run, results right)."""
    path = os.path.join(shared_tmp, "workers.h5")
    write_ptycho_h5(path, 64, 8, seed=4, comm=comm, progress=False)
    comm.Barrier()
    ds = solar.H5Dataset(path)
    assert ds.backend.name == "mpi-hdf5"
    n = sum(len(y) for _, y in tud.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2))
    assert n == 64
    err = capfd.readouterr().err
    assert "decrement" not in err and "Traceback" not in err, err[-2000:]
    ds.close()


@pytest.mark.mpi
def test_a_loop_only_one_rank_runs_says_why_it_waits(comm, shared_tmp, monkeypatch):
    """`if rank == 0: validate(loader)` over a DistributedSampler on parallel HDF5 waited for the
    other ranks forever without a word. Here the others join late (as a slow rank would), so the
    loop ends, and the waiting rank has said what it waits for and what to do instead."""
    import time
    import warnings

    import solar.collective as ss

    _no_hang()
    monkeypatch.setattr(ss, "WAIT_WARN_S", 1.0)
    ds, sampler, loader = _ptycho_loader(comm, os.path.join(shared_tmp, "alone.h5"), 5, 6, 0.5)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if comm.rank != 0:
                time.sleep(3.0)
            n = sum(len(y) for _, y in loader)
    finally:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    assert n == 96 // comm.size
    said = [str(w.message) for w in caught if "waited" in str(w.message)]
    if comm.rank == 0:
        assert said and "every rank must iterate the loader together" in said[0] and "alone.h5" in said[0]
    else:
        assert not said
    ds.close()
