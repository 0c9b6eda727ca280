"""solar.DataLoader with sharded planning under a real ``mpirun`` (NOTE [ Sharded planning ] in
solar/shardplan.py; the sampler's choice of planner: ``SolarBatchSampler._new_planner``). On 4
ranks with ``SOLAR_NODE_RANKS=2`` the job has two "nodes", two windows of the order."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch.utils.data as tud

import solar
from solar.nodeshare import NODE_RANKS_ENV
from solar.order import global_order
from solar.shardplan import RankPlan, ShardPlanner
from solar.synthetic import ptycho_sample, write_ptycho_h5


@pytest.mark.mpi
def test_the_loader_plans_its_share_and_its_buffers_hit_as_planned(comm, shared_tmp, monkeypatch):
    """On a collective backend the loader plans with ShardPlanner (SOLAR_PLANNER=sharded, as for
    large datasets): every step's union over the ranks is DistributedSampler's global batch, and
    the buffers serve exactly the hits the ranks' plans promised."""
    monkeypatch.setenv(NODE_RANKS_ENV, "2")
    monkeypatch.setenv("SOLAR_PLANNER", "sharded")  # (auto shards from solar.sampler.SHARD_FROM samples on)
    n, P, b = 150, comm.size, 3
    path = os.path.join(shared_tmp, "sharded.h5")
    write_ptycho_h5(path, n, 8, seed=2, comm=comm, progress=False)
    comm.Barrier()
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=P, rank=comm.rank, seed=4)
    loader = solar.DataLoader(ds, batch_size=b, sampler=sampler, buffer=0.5)
    y_ref = np.stack([ptycho_sample(i, 8, 2)[1] for i in range(n)])
    planned = 0
    for e in range(3):
        sampler.set_epoch(e)
        mine = [y.numpy() for _, y in loader]
        plan = loader.solar_sampler.current["plan"]
        assert isinstance(plan, RankPlan) and isinstance(loader.solar_sampler._planner, ShardPlanner)
        planned += comm.allreduce(plan.hits)
        everyone = comm.allgather(mine)
        order = global_order(n, P, 4, e)
        _assert_windows_hold_torchs_order(loader, n, P, 4)
        for k in range(len(mine)):
            want = y_ref[order[k * P * b:(k + 1) * P * b]]  # the last step is partial
            want = want.reshape(len(want), -1)
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(len(want), -1)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
    assert comm.allreduce(ds.stats.hits) == planned > 0
    # an early stop rewinds every rank's share alike: later epochs serve the planned hits, less
    # any the read-ahead past the stop evicted (read and put back: NOTE [ Early stop ] in
    # solar/sampler.py), as with the whole plan on every rank
    sampler.set_epoch(3)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    for e in (4, 5):
        sampler.set_epoch(e)
        hits0 = ds.stats.hits
        list(loader)
        served = comm.allreduce(ds.stats.hits - hits0)
        promised = comm.allreduce(loader.solar_sampler.current["plan"].hits)
        assert 0.9 * promised <= served <= promised, (e, served, promised)
    ds.close()


def _assert_windows_hold_torchs_order(loader, n: int, P: int, seed: int) -> None:
    """Every node's window (NOTE [ One order per node ]) holds DistributedSampler's order of the
    epochs it names, once the planning thread is done with it."""
    ss = loader.solar_sampler
    if ss._ahead is not None:
        ss._ahead[2].result()  # the plan made ahead may still be filling a slot
    window = ss._planner.order
    assert any(e is not None for e in window.epochs)
    for epoch, slot in zip(window.epochs, window.slots):
        if epoch is not None:
            want = global_order(n, P, seed, epoch)[:n]  # (the padding repeats the head)
            assert np.array_equal(slot, want), f"node window's epoch {epoch}"


@pytest.mark.mpi
@pytest.mark.parametrize("prefetch, n, b", [(8, 600, 2), (0, 600, 2), (8, 4000, 16)])
def test_the_first_steps_come_from_the_head_and_the_buffers_follow_the_plan(comm, shared_tmp, monkeypatch, prefetch,
                                                                             n, b):
    """An epoch not planned ahead hands out its head first, in pieces (NOTE [ First steps ] in
    solar/schedule.py: one piece at b = 2, two at b = 16), its plan made behind them on the
    planning thread; an iteration stopped inside the head (a peek) has its plan taken when the
    next one settles it. Every step is still DistributedSampler's global batch and the buffers
    serve the hits the plans promised."""
    monkeypatch.setenv("SOLAR_PLANNER", "sharded")
    heads, pieces = [], []
    real_head = ShardPlanner.head

    def head(self, epoch, start, lo=0, hi=None):
        pieces.append((lo, hi, real_head(self, epoch, start, lo, hi)))
        if lo == 0:
            heads.append(pieces[-1][2])
        return pieces[-1][2]

    monkeypatch.setattr(ShardPlanner, "head", head)
    P = comm.size
    path = os.path.join(shared_tmp, f"head{prefetch}-{b}.h5")
    write_ptycho_h5(path, n, 4, seed=3, comm=comm, progress=False)
    comm.Barrier()
    ds = solar.H5Dataset(path)
    sampler = tud.DistributedSampler(ds, num_replicas=P, rank=comm.rank, seed=6)
    loader = solar.DataLoader(ds, batch_size=b, sampler=sampler, buffer=0.5, prefetch=prefetch)
    y_ref = np.stack([ptycho_sample(i, 4, 3)[1] for i in range(n)])
    next(iter(loader))  # a peek: stopped inside epoch 0's head
    planned = served = 0
    for e in range(3):
        sampler.set_epoch(e)
        hits0 = ds.stats.hits
        mine = [y.numpy() for _, y in loader]
        plan = loader.solar_sampler.current["plan"]
        assert isinstance(plan, RankPlan) and plan.num_steps == len(mine)
        planned += comm.allreduce(plan.hits)
        served += comm.allreduce(ds.stats.hits - hits0)
        everyone = comm.allgather(mine)
        order = global_order(n, P, 6, e)
        for k in range(len(mine)):
            want = y_ref[order[k * P * b:(k + 1) * P * b]]  # (at b = 16 the last step is partial)
            want = want.reshape(len(want), -1)
            got = np.concatenate([everyone[r][k] for r in range(P)]).reshape(len(want), -1)
            assert sorted(map(bytes, got)) == sorted(map(bytes, want)), f"epoch {e} step {k}"
    # the peek, epoch 0 after it (rewound) and epoch 1 begin with their heads (after two
    # iterations of epoch 0 the sampler plans epoch 0 ahead); epoch 2 was planned ahead, except
    # without read-ahead (prefetch=0), where every epoch is planned inline
    assert len(heads) == (3 if prefetch else 4) and all(h is not None for h in heads)
    cuts = loader.solar_sampler._planner.head_cuts(0, 0)
    assert len(pieces) == len(heads) * (len(cuts) - 1) and len(cuts) == (3 if b == 16 else 2)
    assert 0 < planned and 0.9 * planned <= served <= planned
    ds.close()
