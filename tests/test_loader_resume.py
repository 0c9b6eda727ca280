"""solar.DataLoader's state_dict / load_state_dict: resume at every point of an epoch (the shipped
check_save_load_state), onto another world size, after the last short batch, from a golden state.
The check over every storage backend x buffer tier is tests/test_resume_matrix.py."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import solar
from solar.testing.resume import check_save_load_state
from solar.synthetic import write_ptycho_h5

from loader_helpers import Squares, Stream, _rank_loaders


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_resumes_after_the_batches_consumed(workers):
    def make():
        return solar.DataLoader(Stream(), batch_size=3, num_workers=workers)

    assert check_save_load_state(make, set_epoch=False, midpoints=None if workers == 0 else [0, 2]) >= 3


@pytest.mark.parametrize("workers", [0, 2])
def test_save_load_state_mid_epoch_at_every_point(h5path, workers):
    def make():
        ds = solar.H5Dataset(h5path)
        s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=2)
        return solar.DataLoader(ds, batch_size=16, sampler=s, buffer=0.25, num_workers=workers)

    assert check_save_load_state(make, midpoints=None if workers == 0 else [0, 3, 6]) >= 3


@pytest.mark.parametrize("own_generator", [False, True])
def test_save_load_state_passthrough_random_order(h5path, own_generator):
    def make():  # own_generator: every new loader (a new process) starts from the same seed
        g = torch.Generator().manual_seed(7) if own_generator else None
        return solar.DataLoader(solar.H5Dataset(h5path), batch_size=20, shuffle=True, buffer=10, generator=g)

    assert check_save_load_state(make, set_epoch=False) == 7


def test_save_load_state_on_a_plain_dataset():
    def make():
        return solar.DataLoader(Squares(), batch_size=5, shuffle=True)

    assert check_save_load_state(make, set_epoch=False) == 7


def test_save_load_state_on_a_plain_dataset_with_distributed_sampler():
    def make():
        ds = Squares(40)
        return solar.DataLoader(ds, batch_size=3, sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=6))

    assert check_save_load_state(make) == 9


@pytest.mark.parametrize("storage", [True, False])
def test_resume_after_the_last_short_batch(h5path, storage):
    """96 samples in batches of 10 (or 45 in batches of 4): the last global batch is short, and a
    state saved right after it (before the loop sees StopIteration) resumes with nothing left."""
    def make():
        ds = solar.H5Dataset(h5path) if storage else Squares(45)
        s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
        return solar.DataLoader(ds, batch_size=10 if storage else 4, sampler=s, buffer=0.25)

    assert check_save_load_state(make) >= 3


def _two_rank_state_after_three_steps(h5path):
    """The state of 2 ranks of 6 per batch, stopped after 3 steps (global position 36)."""
    old = _rank_loaders(h5path, 2, 6, 0.5)
    iters = [iter(ld) for ld in old]
    for it in iters:
        for _ in range(3):
            next(it)
    return old[0].state_dict()


def test_resume_with_another_world_size_continues_the_global_order(h5path):
    state = _two_rank_state_after_three_steps(h5path)
    assert state["position"] == 3 * 12 and state["world_size"] == 2
    new = _rank_loaders(h5path, 4, 3, 0.5)
    for ld in new:
        ld.load_state_dict(state)
    got = [list(ld) for ld in new]
    order = solar.schedule.global_order(96, 2, 4, 0)
    for k in range(len(got[0])):
        xs = torch.cat([got[r][k][0] for r in range(4)]).flatten(1)
        want = torch.stack([solar.H5Dataset(h5path)[int(i)][0] for i in order[36 + 12 * k:48 + 12 * k]]).flatten(1)
        assert torch.equal(torch.sort(xs, dim=0)[0], torch.sort(want, dim=0)[0])
    assert (len(got[0]) - 1) * 12 + 12 == 96 - 36


def test_resume_onto_more_ranks_never_leaves_a_rank_an_empty_batch(h5path):
    """Saved at position 36 by 2 ranks of 6: 5 ranks of 3 have 64 positions left, steps of 15 and a
    last one of 4; padded to 5 (NOTE [ Resumed tail ]), so rank 4 gets a batch, not torch's
    IndexError on an empty one (and a hang of the other ranks under MPI)."""
    state = _two_rank_state_after_three_steps(h5path)
    new = _rank_loaders(h5path, 5, 3, 0.5)
    for ld in new:
        ld.load_state_dict(state)
    got = [list(ld) for ld in new]
    assert [len(g) for g in got] == [5] * 5
    assert [len(got[r][-1][0]) for r in range(5)] == [1] * 5
    ds = solar.H5Dataset(h5path)
    order = solar.schedule.global_order(96, 5, 4, 0)
    seen = sorted(x for r in range(5) for batch in got[r] for x in batch[0].flatten(1)[:, 0].tolist())
    want = sorted(float(ds[int(i)][0].flatten()[0]) for i in [*order[36:100], order[0]])
    assert seen == want
    assert new[0].state_dict()["epoch_done"]


def test_golden_state_v1_still_loads(tmp_path):
    """A state saved by SOLAR's first format (committed fixture) resumes at its global position."""
    import json
    from pathlib import Path

    state = json.loads((Path(__file__).parent / "fixtures" / "loader" / "state-v1-schedule.json").read_text())
    path = str(tmp_path / "a.h5")
    write_ptycho_h5(path, 40, 4, progress=False)
    ds = solar.H5Dataset(path)
    loaders = [solar.DataLoader(ds, batch_size=4, buffer=6,
                                sampler=tud.DistributedSampler(ds, num_replicas=2, rank=r, seed=3)) for r in range(2)]
    for ld in loaders:
        ld.load_state_dict(state)
        assert ld.sampler.epoch == 2
    got = [list(ld) for ld in loaders]
    order = solar.schedule.global_order(40, 2, 3, 2)
    assert len(got[0]) == 3  # 5 steps per epoch, 2 done at position 16
    for k in range(3):
        xs = torch.cat([got[r][k][0] for r in range(2)]).flatten(1)
        want = torch.stack([ds[int(i)][0] for i in order[16 + 8 * k:24 + 8 * k]]).flatten(1)
        assert torch.equal(torch.sort(xs, dim=0)[0], torch.sort(want, dim=0)[0])
