"""solar.DataLoader as a drop-in torch DataLoader, and its SOLAR path on storage-backed data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import solar
from solar.testing.resume import batches_equal, check_save_load_state
from solar.synthetic import write_ptycho_h5


class Squares(tud.Dataset):
    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return {"x": torch.tensor([float(i), float(i) ** 2]), "i": i,
                "worker": -1 if info is None else info.id, "seed": torch.initial_seed() % 1000}


class Stream(tud.IterableDataset):
    def __init__(self, n=17):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = tud.get_worker_info()
        lo, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(lo, self.n, step))


class Boom(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 7:  # in the last batch: torch's workers are idle when it raises, so they stop at once
            raise KeyError(f"sample {i} is bad")
        return i


def _init(worker_id):
    np.random.seed(worker_id)


def _collate(batch):
    return [b["i"] * 10 for b in batch]


CASES = {
    "defaults": dict(),
    "batch7": dict(batch_size=7),
    "drop_last": dict(batch_size=7, drop_last=True),
    "shuffle_gen": dict(batch_size=4, shuffle=True, generator="g"),
    "no_batch": dict(batch_size=None),
    "collate": dict(batch_size=5, collate_fn=_collate),
    "sampler": dict(batch_size=3, sampler=[5, 1, 9, 2, 2]),
    "batch_sampler": dict(batch_sampler=[[0, 1], [7, 3, 2]]),
    "distributed": dict(batch_size=4, sampler="dist"),
    "workers": dict(batch_size=4, shuffle=True, generator="g", num_workers=2, worker_init_fn=_init,
                    persistent_workers=True, prefetch_factor=3, timeout=30, multiprocessing_context="fork"),
    "pin": dict(batch_size=6, pin_memory=True),
}


def _build(cls, ds, kw):
    kw = dict(kw)
    if kw.get("generator") == "g":
        kw["generator"] = torch.Generator().manual_seed(5)
    if kw.get("sampler") == "dist":
        kw["sampler"] = tud.DistributedSampler(ds, num_replicas=3, rank=1, seed=2)
    return cls(ds, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_batches_as_torch_on_any_dataset(case):
    kw = CASES[case]
    if kw.get("pin_memory"):
        pytest.importorskip("torch.cuda")
    out = []
    for cls in (tud.DataLoader, solar.DataLoader):
        torch.manual_seed(0)
        loader = _build(cls, Squares(), kw)
        epochs = []
        for e in range(2):
            if kw.get("sampler") == "dist":
                loader.sampler.set_epoch(e)
            epochs.append(list(loader))
        out.append((len(loader), epochs))
    assert out[0][0] == out[1][0]
    assert batches_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_like_torch(workers):
    a = list(tud.DataLoader(Stream(), batch_size=3, num_workers=workers))
    b = list(solar.DataLoader(Stream(), batch_size=3, num_workers=workers))
    assert batches_equal(a, b)
    assert len(solar.DataLoader(Stream(), batch_size=3)) == len(tud.DataLoader(Stream(), batch_size=3))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_resumes_after_the_batches_consumed(workers):
    def make():
        return solar.DataLoader(Stream(), batch_size=3, num_workers=workers)

    assert check_save_load_state(make, set_epoch=False, midpoints=None if workers == 0 else [0, 2]) >= 3


def test_batch_sampler_keeps_the_wrapped_samplers_attributes(h5path):
    class EpochBatches(tud.BatchSampler):
        def set_epoch(self, epoch):
            self.epoch = epoch

    ds = solar.H5Dataset(h5path)
    bs = EpochBatches(tud.SequentialSampler(ds), batch_size=8, drop_last=False)
    loader = solar.DataLoader(ds, batch_sampler=bs)
    loader.batch_sampler.set_epoch(3)
    assert bs.epoch == loader.batch_sampler.epoch == 3
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loader.batch_sampler.nope


@pytest.mark.parametrize("kw", [
    dict(batch_size=2, batch_sampler=[[0]]),
    dict(shuffle=True, sampler=[0, 1]),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=-1),
    dict(prefetch_factor=2),
    dict(persistent_workers=True),
    dict(timeout=-1),
    dict(batch_size=0),
    dict(multiprocessing_context="fork"),
])
def test_same_value_errors_as_torch(kw):
    with pytest.raises(ValueError) as want:
        list(tud.DataLoader(Squares(), **kw))
    with pytest.raises(ValueError) as got:
        list(solar.DataLoader(Squares(), **kw))
    assert str(got.value) == str(want.value)


def test_worker_exception_is_reraised_with_its_type():
    it = iter(solar.DataLoader(Boom(), batch_size=2, num_workers=2))
    with pytest.raises(KeyError, match="sample 7 is bad"):
        list(it)
    it._shutdown_workers()  # torch's iterator, reached through the wrapper: stop its workers now, not at gc


def test_workers_get_torch_seeding_and_worker_info():
    torch.manual_seed(3)
    a = list(tud.DataLoader(Squares(8), batch_size=2, num_workers=2))
    torch.manual_seed(3)
    b = list(solar.DataLoader(Squares(8), batch_size=2, num_workers=2))
    assert [x["worker"].tolist() for x in b] == [[0, 0], [1, 1], [0, 0], [1, 1]]
    assert batches_equal(a, b)


def test_attributes_stay_torchs():
    s = tud.DistributedSampler(Squares(), num_replicas=2, rank=0)
    loader = solar.DataLoader(Squares(), batch_size=4, sampler=s)
    assert loader.sampler is s and loader.batch_size == 4 and loader.drop_last is False
    with pytest.raises(ValueError, match="should not be set"):
        loader.batch_size = 3


# -- storage-backed: H5Dataset ------------------------------------------------------------------
@pytest.fixture(scope="module")
def h5path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("loader") / "ptycho.h5")
    write_ptycho_h5(path, 96, 8, seed=1, progress=False)
    return path


def _rank_loaders(path, P, b, buffer, **kw):
    out = []
    for r in range(P):
        ds = solar.H5Dataset(path)
        s = tud.DistributedSampler(ds, num_replicas=P, rank=r, seed=4)
        out.append(solar.DataLoader(ds, batch_size=b, sampler=s, buffer=buffer, **kw))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_world_size_one_matches_torch_and_hits_from_epoch_two(h5path, workers):
    ds = solar.H5Dataset(h5path)
    ref_s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=4)
    ref = tud.DataLoader(ds, batch_size=10, sampler=ref_s)
    loader = _rank_loaders(h5path, 1, 10, 0.5, num_workers=workers)[0]
    assert len(loader) == len(ref) == 10
    for e in range(3):
        ref_s.set_epoch(e)
        loader.sampler.set_epoch(e)
        assert batches_equal(list(ref), list(loader))
    stats = loader.dataset.stats
    assert stats.hits == 2 * 48  # epochs 2 and 3 hit the 48 samples the buffer keeps
    assert stats.misses == 3 * 96 - 2 * 48
    assert loader.solar_sampler.buffer.stats.hits == 2 * 48 * 2  # two fields


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_stopped_early_keeps_the_hits_of_its_executed_steps(h5path, workers):
    """NOTE [ Early stop ]: the planner is rewound to the steps handed out (read-ahead past them
    is dropped from the buffer), so the next epoch hits what those steps kept; later epochs
    reach the bound. (Before: the buffer started over empty, and 0 hits in epoch 1.)"""
    loader = _rank_loaders(h5path, 1, 8, 0.5, num_workers=workers)[0]
    ss = loader.solar_sampler
    for k, _ in enumerate(loader):
        if k == 1:
            break
    plan = ss.current["plan"]
    assert ss._stopped == 2 + (2 * workers if workers else 0)  # torch's workers draw 2 steps each ahead
    kept = int(plan.keep[:ss._stopped * plan.global_batch].sum())
    assert 0 < kept < 48
    hits = []
    for e in (1, 2, 3):
        loader.sampler.set_epoch(e)
        h0 = loader.dataset.stats.hits
        list(loader)
        hits.append(loader.dataset.stats.hits - h0)
    assert hits == [kept, 48, 48]


def test_an_older_iterator_closed_late_does_not_disturb_the_newer_one(h5path):
    loader = _rank_loaders(h5path, 1, 8, 0.5)[0]
    ss = loader.solar_sampler
    old = iter(loader)
    next(old)  # still open when the next iteration starts: that one starts over
    loader.sampler.set_epoch(1)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    plan = ss.current["plan"]
    kept = int(plan.keep[:3 * plan.global_batch].sum())
    del old  # closes now: must not report its 1 step as the newest iteration's stop
    loader.sampler.set_epoch(2)
    h0 = loader.dataset.stats.hits
    list(loader)
    assert loader.dataset.stats.hits - h0 == kept > 8


def test_an_error_from_workers_still_rewinds_the_planner(h5path):
    """The error re-raised by torch's worker iterator keeps that iterator alive in a reference
    cycle; the next iteration collects it instead of starting over with an empty buffer."""
    armed = {"bad": None}

    def boom(sample):
        if armed["bad"] is not None and float(sample[0].flatten()[0]) == armed["bad"]:
            raise RuntimeError("bad sample")
        return sample

    ds = solar.H5Dataset(h5path, transform=boom)
    s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=4)
    loader = solar.DataLoader(ds, batch_size=8, sampler=s, buffer=0.5, num_workers=2)
    first = next(iter(tud.DataLoader(solar.H5Dataset(h5path), batch_size=8, sampler=s)))
    armed["bad"] = float(first[0][3].flatten()[0])  # the 4th sample of epoch 0's first batch
    with pytest.raises(RuntimeError, match="bad sample"):
        list(loader)
    armed["bad"] = None
    buffer = loader.solar_sampler.buffer
    s.set_epoch(1)
    list(loader)
    # rewound, not started over (a new buffer). Not the planner's identity: when torch's workers
    # took every step of the epoch before the error came back, the iteration had ended, and the
    # next takes the plan made ahead, with the planner copy it was made on (a rare CI failure)
    assert loader.solar_sampler.buffer is buffer


def test_a_loop_that_cuts_every_epoch_short_still_fills_the_buffer(h5path):
    # prefetch=0: no read-ahead, so the hits counted are those of the steps consumed (with
    # read-ahead they depend on how far the background thread got before the break)
    loader = _rank_loaders(h5path, 1, 8, 0.5, prefetch=0)[0]
    hits = []
    for e in range(6):
        loader.sampler.set_epoch(e)
        h0 = loader.dataset.stats.hits
        for k, _ in enumerate(loader):
            if k == 5:  # a per-epoch step limit: 6 of 12 steps
                break
        hits.append(loader.dataset.stats.hits - h0)
    # 48 samples consumed per epoch, half of them the buffer's: the bound is 24 (before: 0)
    assert hits[0] == 0 and hits[1] > 0 and min(hits[3:]) >= 20


def test_shuffle_without_sampler_matches_torch_and_uses_the_buffer(h5path):
    ds = solar.H5Dataset(h5path)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    ref = tud.DataLoader(ds, batch_size=7, shuffle=True, generator=g1)
    loader = solar.DataLoader(solar.H5Dataset(h5path), batch_size=7, shuffle=True, generator=g2, buffer=24)
    assert loader.solar_sampler.mode == "passthrough"
    for _ in range(2):
        assert batches_equal(list(ref), list(loader))
    assert loader.dataset.stats.hits == 24


def test_ranks_split_each_global_batch_and_read_fewer_calls(h5path):
    P, b = 3, 4
    loaders = _rank_loaders(h5path, P, b, 0.5)
    for e in range(3):
        per_rank = []
        for loader in loaders:
            loader.sampler.set_epoch(e)
            per_rank.append([batch for batch in loader])
        for k in range(len(per_rank[0])):
            xs = torch.cat([per_rank[r][k][0] for r in range(P)])
            assert all(len(per_rank[r][k][0]) == b for r in range(P))
            order = solar.schedule.global_order(96, P, 4, e)[k * P * b:(k + 1) * P * b]
            ref = solar.H5Dataset(h5path).__getitems__(sorted(order.tolist()))
            want = torch.stack([s[0] for s in ref])
            assert torch.equal(torch.sort(xs.flatten(1), dim=0)[0], torch.sort(want.flatten(1), dim=0)[0])
    hits = sum(ld.dataset.stats.hits for ld in loaders)
    assert hits == 2 * 48  # every rank hits its pinned samples from epoch 2
    calls = sum(ld.dataset.stats.read_calls for ld in loaders)
    assert calls < 2 * (3 * 96 - hits)  # coalesced: fewer calls than samples x fields


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


def test_bad_input_says_what_to_change(h5path, tmp_path):
    ds = solar.H5Dataset(h5path)
    with pytest.raises(ValueError, match="negative"):
        solar.DataLoader(ds, batch_size=4, buffer=-1)
    with pytest.raises(ValueError, match="not understood"):
        solar.DataLoader(ds, batch_size=4, buffer="lots")
    state = solar.DataLoader(ds, batch_size=4, sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0)).state_dict()
    other = str(tmp_path / "small.h5")
    write_ptycho_h5(other, 40, 8, progress=False)
    small = solar.H5Dataset(other)
    loader = solar.DataLoader(small, batch_size=4, sampler=tud.DistributedSampler(small, num_replicas=1, rank=0))
    with pytest.raises(ValueError, match="dataset of 96 samples"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="not a solar.DataLoader state"):
        loader.load_state_dict({"epoch": 1})


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_larger_than_the_ranks_share_is_torchs_one_partial_batch(h5path, drop_last):
    ds = solar.H5Dataset(h5path)
    ref = tud.DataLoader(ds, batch_size=200, drop_last=drop_last,
                         sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=3))
    loader = solar.DataLoader(ds, batch_size=200, drop_last=drop_last, buffer=0.5,
                              sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=3))
    assert len(loader) == len(ref) == (0 if drop_last else 1)
    for _ in range(2):
        assert batches_equal(list(ref), list(loader))


def test_distributed_option_takes_rank_from_the_environment(h5path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    loader = solar.DataLoader(solar.H5Dataset(h5path), batch_size=4, shuffle=True, distributed=True, seed=3)
    assert loader.sampler.num_replicas == 4 and loader.sampler.rank == 2 and loader.solar_sampler.mode == "schedule"
    a = [b[0].shape[0] for b in loader]
    assert a == [4] * 6 and loader.sampler.epoch == 0
    list(loader)
    assert loader.sampler.epoch == 1  # advanced by itself
    for e in (2, 3):  # the torch idiom through the sampler: honoured, not advanced once more
        loader.sampler.set_epoch(e)
        list(loader)
        assert loader.sampler.epoch == e
    state = loader.state_dict()  # epoch 3 done
    list(loader)  # epoch 4
    loader.load_state_dict(state)  # back to after epoch 3: the next iteration is epoch 4, not 5
    list(loader)
    assert loader.sampler.epoch == 4


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


@pytest.mark.parametrize("cancel", [True, False])
def test_prefetch_order_errors_and_early_close(cancel):
    from solar.prefetch import prefetch

    ran = []

    def fn(i):
        ran.append(i)
        if i == 7:
            raise KeyError("item 7")
        return i * 2

    assert list(prefetch(range(5), fn, depth=2, cancel=cancel)) == [0, 2, 4, 6, 8]
    with pytest.raises(KeyError, match="item 7"):
        list(prefetch(range(10), fn, depth=3, cancel=cancel))
    ran.clear()
    gen = prefetch(range(100), fn, depth=2, cancel=cancel)
    assert next(gen) == 0
    gen.close()
    # items 0..2 were submitted before the first result was handed out; without cancel all of them
    # run (what every rank can count on), with cancel those not yet started are dropped
    assert ran == sorted(ran) and set(ran) <= {0, 1, 2} and (cancel or ran == [0, 1, 2])


def test_two_prefetches_on_the_shared_mpi_thread_run_in_submission_order():
    """Collective passes of every loader share one thread (NOTE [ SOLAR's own MPI traffic ]):
    their fetches run in the order the consumer submitted them, interleaved across loaders, and
    nested collective calls run inline there instead of waiting on themselves."""
    import threading

    from solar.dist import collective_call, mpi_executor, on_mpi_thread
    from solar.prefetch import prefetch

    ran, threads = [], set()

    def fn(tag):
        def f(i):
            threads.add(threading.get_ident())
            assert on_mpi_thread() and collective_call(lambda: i) == i  # nested: inline
            ran.append((tag, i))
            return i
        return f

    ex = mpi_executor()
    a = prefetch(range(4), fn("a"), depth=1, cancel=False, executor=ex)
    b = prefetch(range(3), fn("b"), depth=0, cancel=False, executor=ex)
    assert next(a) == 0  # submits a0, a1
    assert next(b) == 0  # submits b0 and waits for it
    assert next(a) == 1  # submits a2
    a.close()  # waits for a2 (cancel=False: every rank runs what it submitted)
    assert list(b) == [1, 2]
    assert ran == [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1), ("b", 2)]
    assert len(threads) == 1 and not on_mpi_thread()
    with pytest.raises(KeyError, match="boom"):
        collective_call(lambda: {}["boom"])
    assert mpi_executor() is ex


def test_buffers_follow_the_plan_exactly_when_ownership_moves(h5path):
    """Small batches at a high fill overflow single owners; the plan then moves ownership (keeps +
    evictions). The ranks' buffers must serve exactly the planned hits and never exceed C."""
    P, b, C = 3, 2, 24
    loaders = _rank_loaders(h5path, P, b, C)
    planner = solar.schedule.Planner(solar.schedule.PlanConfig(96, P, b, C, seed=4))
    planned = evictions = 0
    for e in range(4):
        plan = planner.plan(e)
        planned += int(plan.hit.sum())
        evictions += len(plan.evict_sample)
        for ld in loaders:
            ld.sampler.set_epoch(e)
            for _ in ld:
                assert len(ld.solar_sampler.buffer) <= 2 * C  # two fields per sample
    assert evictions > 0  # the case under test really happened
    assert sum(ld.dataset.stats.hits for ld in loaders) == planned


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


def test_an_empty_dataset_yields_no_batches(tmp_path):
    """A file whose dataset has 0 rows (extendible, nothing appended yet): torch's DataLoader yields
    nothing, and so does SOLAR's (it raised "cannot convert float NaN to integer" sizing its passes)."""
    import h5py

    path = str(tmp_path / "empty.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(0, 4), dtype=np.float32, maxshape=(None, 4), chunks=(8, 4))
    ds = solar.H5Dataset(path)
    assert list(tud.DataLoader(ds, batch_size=4)) == []
    assert list(solar.DataLoader(ds, batch_size=4)) == []
    with pytest.raises(IndexError, match="out of range for 0 samples \\(the dataset is empty\\)"):
        ds[0]
    ds.close()


def _epochs(loader, n, set_epoch=None):
    out = []
    for e in range(n):
        if set_epoch is not None:
            set_epoch(e)
        out.append([tuple(t.clone() for t in b) for b in loader])  # whole epochs: see torch's RandomSampler
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_random_split_is_driven_by_solar_and_gives_torchs_batches(h5path, workers):
    """NOTE [ Subsets ]: PtychoNN's script splits its dataset with random_split. The loader drives
    the Subset (schedule, buffer, coalesced read-ahead) instead of running as torch's: the same
    batches as torch's loader over the same Subset, epoch after epoch, with every sample of the
    split a hit from the second epoch (buffer=1.0) and fewer storage requests."""
    import warnings

    ds, ref = solar.H5Dataset(h5path), solar.H5Dataset(h5path)
    split = [0.75, 0.25]
    train, val = tud.random_split(ds, split, generator=torch.Generator().manual_seed(0))
    ref_train, _ = tud.random_split(ref, split, generator=torch.Generator().manual_seed(0))
    kw = dict(batch_size=8, shuffle=True, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs as torch's would" warning any more
        loader = solar.DataLoader(train, generator=torch.Generator().manual_seed(3), buffer=1.0, **kw)
    assert loader.solar_sampler is not None and isinstance(loader.dataset, tud.Subset)
    assert loader.dataset.dataset is ds and list(loader.dataset.indices) == list(train.indices)
    torch_loader = tud.DataLoader(ref_train, generator=torch.Generator().manual_seed(3), **kw)
    got, want = _epochs(loader, 3), _epochs(torch_loader, 3)
    assert len(got[0]) == len(want[0]) == 9
    for e, (g, w) in enumerate(zip(got, want)):
        assert all(torch.equal(a, b) for gb, wb in zip(g, w) for a, b in zip(gb, wb)), f"epoch {e}"
    assert ds.stats.hits == 2 * len(train)  # epochs 2 and 3: all of the split from the buffer
    if not workers:  # (torch's workers count their reads in their own processes)
        assert ds.stats.read_calls < ref.stats.read_calls
    # the other part of the split, with another loader over the same dataset
    v = [b for b in solar.DataLoader(val, batch_size=8)]
    assert torch.equal(torch.cat([b[1] for b in v]), torch.stack([ref[i][1] for i in val.indices]))
    ds.close()
    ref.close()


def test_nested_subsets_with_repeats_and_negative_indices_read_the_right_rows(h5path):
    """A Subset of a Subset composes its indices (negative ones count from the end, as in torch);
    a repeated row is two samples. Every batch equals torch's; errors and batch labels name the
    file's sample, and a bad position says it is a position in a Subset."""
    ds, ref = solar.H5Dataset(h5path), solar.H5Dataset(h5path)
    inner_idx, outer_idx = [5, 90, -1, 7, 7, 40], [1, -1, 3, 4, 0, 2, 5, 1]
    sub = tud.Subset(tud.Subset(ds, inner_idx), outer_idx)
    rows = np.arange(96)[inner_idx][outer_idx]
    loader = solar.DataLoader(sub, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1),
                              buffer=4)
    assert loader.solar_sampler is not None and not loader.dataset.distinct
    assert loader.dataset.rows.tolist() == rows.tolist()
    want = tud.DataLoader(tud.Subset(tud.Subset(ref, inner_idx), outer_idx), batch_size=3, shuffle=True,
                          generator=torch.Generator().manual_seed(1))
    for g, w in zip(_epochs(loader, 2), _epochs(want, 2)):
        assert all(torch.equal(a, b) for gb, wb in zip(g, w) for a, b in zip(gb, wb))
    stored = loader.dataset.fetch_stored([0, 4, -1])
    assert stored.indices == rows[[0, 4, -1]].tolist()  # what error messages name
    with pytest.raises(IndexError, match=r"sample index 8 of a Subset out of range for 8 samples"):
        loader.dataset.fetch_stored([8])
    with pytest.raises(IndexError, match=r"ptycho.h5: Subset index 6 out of range for the 6 samples .*position 2"):
        solar.DataLoader(tud.Subset(tud.Subset(ds, inner_idx), [0, 1, 6]), batch_size=2)
    ds.close()
    ref.close()


def test_plain_datasets_subsets_and_concatenations_stay_silent(h5path):
    """The "runs as torch's would" warning is for wrappers the loader cannot drive
    (tests/test_concat.py); datasets it drives, and datasets that are not storage-backed, get
    none. Unbatched (batch_size=None), the loader is torch's and keeps the dataset as given."""
    import warnings

    ds = solar.H5Dataset(h5path)
    train, _ = tud.random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert solar.DataLoader(tud.TensorDataset(torch.zeros(8)), batch_size=4).solar_sampler is None
        assert solar.DataLoader(ds, batch_size=4).solar_sampler is not None
        assert solar.DataLoader(train, batch_size=4).solar_sampler is not None
        both = tud.ConcatDataset([tud.Subset(ds, range(8)), train])
        assert solar.DataLoader(both, batch_size=4).solar_sampler is not None
        assert solar.DataLoader(train, batch_size=None).dataset is train
    ds.close()


def test_planning_ahead_gives_the_inline_plans_and_is_taken(h5path, monkeypatch):
    """NOTE [ Planning ahead ]: the next epoch is planned on a copy of the planner while this one
    runs. Across epoch changes, an early stop (rewind), a skipped epoch, a loaded state and an
    epoch run twice, the
    plans and batches equal those of a loader that plans inline (prefetch=0), and the plan made
    ahead is taken whenever the next epoch follows from its start (not planned again)."""
    import threading

    from solar.schedule import Planner

    inline_calls = []
    real_plan = Planner.plan

    def counting(self, epoch, start=0):
        if threading.current_thread() is threading.main_thread():
            inline_calls.append(epoch)
        return real_plan(self, epoch, start)

    monkeypatch.setattr(Planner, "plan", counting)
    ahead, inline = (_rank_loaders(h5path, 2, 6, 0.5, prefetch=p)[0] for p in (4, 0))
    script = [(0, None), (1, None), (2, 3), (3, None), (5, None), (6, "state"), (6, None), (7, None)]
    state = None
    for epoch, stop in script:
        got = []
        for loader in (ahead, inline):
            loader.sampler.set_epoch(epoch)
            if stop == "state":
                loader.load_state_dict(state)
            batches = []
            for k, b in enumerate(loader):
                batches.append(b)
                if stop == k:
                    break
            if epoch == 5:
                state = loader.state_dict()  # an epoch end; loaded at epoch 6
            p = loader.solar_sampler.current["plan"]
            got.append((batches, p.rank.tobytes(), p.hit.tobytes(), p.keep.tobytes()))
        assert batches_equal(got[0][0], got[1][0]) and got[0][1:] == got[1][1:], epoch
    # the prefetching loader planned inline only epoch 0, after the rewind (epoch 3), after the
    # skipped epoch 4 (5), epoch 6 run again and epoch 7 (after a repeat it planned 6 a third
    # time); the inline one every epoch (a state saved at an epoch's end starts the next epoch
    # from position 0: the plan made ahead applies)
    assert inline_calls.count(1) == 1 and inline_calls.count(7) == 2
    assert sorted(inline_calls) == sorted([0, 3, 5, 6, 7] + [e for e, _ in script])
    ahead.solar_sampler.plan_ahead = False  # turned off: epoch 8 was planned already, then inline
    for e in (8, 9, 10):
        ahead.sampler.set_epoch(e)
        list(ahead)
    assert inline_calls[-2:] == [9, 10] and 8 not in inline_calls and ahead.solar_sampler._ahead is None


def test_a_loader_whose_epoch_never_advances_takes_its_plan_made_ahead(h5path, monkeypatch):
    """A validation loader without set_epoch plans the same epoch every time: it is planned
    ahead as that epoch (not as epoch + 1, which was never used and cost a whole plan on the
    shared plan thread each time), and the sampler still copies and pickles (the plan made
    ahead is a cache holding a Future, left out)."""
    import copy
    import pickle
    import threading

    from solar.schedule import Planner

    calls = []
    real_plan = Planner.plan

    def counting(self, epoch, start=0):
        calls.append((epoch, threading.current_thread() is threading.main_thread()))
        return real_plan(self, epoch, start)

    monkeypatch.setattr(Planner, "plan", counting)
    loader = _rank_loaders(h5path, 2, 6, 0.5, prefetch=4)[0]
    runs = [[b[0].sum().item() for b in loader] for _ in range(4)]
    loader.solar_sampler._ahead[2].result()
    inline = [e for e, on_main in calls if on_main]
    ahead = [e for e, on_main in calls if not on_main]
    assert inline == [0, 0]  # the first iteration, and the second (the first guess was epoch 1)
    assert ahead.count(0) == 3 and ahead.count(1) <= 1  # then epoch 0 each time (1: unless cancelled)
    ref = _rank_loaders(h5path, 2, 6, 0.5, prefetch=0)[0]
    assert all(r == [b[0].sum().item() for b in ref] for r in runs[1:])
    assert copy.deepcopy(loader.solar_sampler)._ahead is None
    assert pickle.loads(pickle.dumps(loader.solar_sampler))._ahead is None


def test_spill_to_local_disk_extends_the_buffer(h5path, tmp_path):
    """spill=(dir, size): the buffer keeps what fits its memory budget and the rest in files
    under dir, the schedule plans for both, and batches stay torch's. 96 samples of 768 B: 24 KB
    of memory alone keeps 31 samples (hits 31 of 96 per epoch); with 800 KB of disk (each field a
    file of whole blocks: 8 KiB a sample with 4 KiB blocks), every one."""
    import gc

    spill_dir = tmp_path / "nvme"
    spill_dir.mkdir()
    ds = solar.H5Dataset(h5path)
    ref_s = tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=4)
    ref = tud.DataLoader(ds, batch_size=10, sampler=ref_s)
    hits = {}
    for name, spill in (("memory", None), ("spill", (str(spill_dir), "800KB"))):
        d = solar.H5Dataset(h5path)
        s = tud.DistributedSampler(d, num_replicas=1, rank=0, seed=4)
        loader = solar.DataLoader(d, batch_size=10, sampler=s, buffer="24KB", spill=spill)
        for e in range(3):
            ref_s.set_epoch(e)
            s.set_epoch(e)
            assert batches_equal(list(ref), list(loader))
        hits[name] = d.stats.hits
        if spill:
            buf = loader.solar_sampler.buffer
            assert buf.first.nbytes <= 24_000 and buf.second.nbytes > 0  # both parts hold samples
            files = [f for _, _, fs in os.walk(spill_dir) for f in fs]
            assert len(files) == len(buf._spilled) > 0
            del buf
            import copy

            twin = copy.deepcopy(loader.solar_sampler)  # a copy starts over, with no buffer of its own yet
            assert twin.buffer is None and twin._planner is None
            del twin
        del loader, s, d
    assert hits == {"memory": 2 * 31, "spill": 2 * 96}
    gc.collect()
    assert os.listdir(spill_dir) == []  # the buffer's directory went with it


def test_spill_options_say_what_to_pass(h5path, tmp_path):
    ds = solar.H5Dataset(h5path)
    with pytest.raises(solar.ConfigError, match="give buffer= in bytes too"):
        solar.DataLoader(ds, batch_size=4, buffer=0.5, spill=(str(tmp_path), "1GB"))
    with pytest.raises(solar.ConfigError, match="not a writable directory"):
        solar.DataLoader(ds, batch_size=4, buffer="1MB", spill=(str(tmp_path / "missing"), "1GB"))
    with pytest.raises(solar.ConfigError, match=r"pass \(directory, size\)"):
        solar.DataLoader(ds, batch_size=4, buffer="1MB", spill=str(tmp_path))
    with pytest.raises(solar.ConfigError, match="not a positive byte size"):
        solar.DataLoader(ds, batch_size=4, buffer="1MB", spill=(str(tmp_path), "lots"))


def test_prefetch_timeout_raises_torchs_error_and_abandons_the_stalled_fetch():
    """``timeout=``: a fetch that stalls (a hung storage request) raises torch's "DataLoader timed
    out" instead of waiting forever, and closing the generator does not wait for it either."""
    import threading

    from solar.prefetch import prefetch

    release, finished = threading.Event(), threading.Event()

    def fn(i):
        if i == 1:
            release.wait(10)
            finished.set()
        return i

    gen = prefetch(range(4), fn, depth=1, timeout=0.2)
    try:
        assert next(gen) == 0
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0\.2 seconds"):
            next(gen)
        gen.close()  # returns although item 1 is still running (waiting for it: 10 s, then finished)
        assert not finished.is_set()
    finally:
        release.set()
    assert list(prefetch(range(3), lambda i: i, depth=1, timeout=5)) == [0, 1, 2]  # in time: as without


def test_timeout_with_workers_covers_the_reads_ahead_as_torchs_covers_its_workers(h5path, monkeypatch):
    """With workers torch's ``timeout`` turns a stalled read (it runs in a worker) into an error;
    SOLAR reads on its read-ahead thread, so that wait times out too (before: it waited as long
    as the storage did)."""
    import threading

    ds = solar.H5Dataset(h5path, io_threads=1)
    release, finished = threading.Event(), threading.Event()
    read = ds.backend._read_ranges

    def stalled(*args):
        release.wait(10)
        finished.set()
        return read(*args)

    monkeypatch.setattr(ds.backend, "_read_ranges", stalled)
    loader = solar.DataLoader(ds, batch_size=4, num_workers=1, timeout=0.5)
    assert loader.solar_sampler is not None
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0\.5 seconds"):
            for _ in loader:
                pass
        assert not finished.is_set()  # raised while the read still stalls, not after it
    finally:
        release.set()


@pytest.mark.parametrize("buffer", [0, 0.5])
def test_a_subset_whose_indices_change_between_epochs_is_followed_as_torch_follows_it(h5path, buffer):
    """NOTE [ Subsets ]: an active-learning pool that grows (in place), is replaced in place, or
    is re-assigned between epochs: the loader reads what the Subset selects now, as torch's does
    (before: a misleading IndexError after a growth, and the old samples, from the buffer too,
    after a replacement)."""
    ds = solar.H5Dataset(h5path)
    want = lambda idx: torch.stack([ds[i][1] for i in idx])  # noqa: E731
    pool = tud.Subset(ds, [0, 1, 2, 3])
    loader = solar.DataLoader(pool, batch_size=4, buffer=buffer)
    assert loader.solar_sampler is not None

    def check(idx):
        for _ in range(2):  # twice: the second epoch's hits come from the buffer
            got = torch.cat([y for _, y in loader])
            assert torch.equal(got, want(idx))

    check([0, 1, 2, 3])
    pool.indices.extend([30, 31])
    check([0, 1, 2, 3, 30, 31])
    pool.indices[:] = [10, 11, 12, 13]
    check([10, 11, 12, 13])
    pool.indices = [20, 21, 22]
    check([20, 21, 22])
    nested = tud.Subset(tud.Subset(ds, list(range(40, 60))), [0, 1])
    loader = solar.DataLoader(nested, batch_size=2, buffer=buffer)
    nested.dataset.indices[0] = 77  # an inner level changed
    assert torch.equal(torch.cat([y for _, y in loader]), want([77, 41]))
    loader = solar.DataLoader(tud.Subset(ds, [0]), batch_size=1)
    loader.dataset.source.indices = [500]
    with pytest.raises(IndexError, match="Subset index 500 out of range"):
        next(iter(loader))


class _FailingSampler(tud.Sampler):
    """Yields 0, 1, ... and raises at position ``at`` (a user's sampler with a bug)."""

    def __init__(self, at):
        self.at = at

    def __len__(self):
        return 96

    def __iter__(self):
        for i in range(96):
            if i == self.at:
                raise RuntimeError(f"sampler failed at position {i}")
            yield i


@pytest.mark.parametrize("prefetch", [0, 2, 8])
def test_a_sampler_that_fails_hands_out_every_batch_before_it_as_torch(h5path, prefetch):
    """The read-ahead takes the sampler's steps early; when taking one raises, the batches before
    it still come out first, then the error, as with torch's loader (before: none at all, the
    error raised at the first batch, two passes early)."""
    ds = solar.H5Dataset(h5path)
    got = {}
    for name, cls, kw in (("torch", tud.DataLoader, {}), ("solar", solar.DataLoader, {"prefetch": prefetch})):
        batches = []
        with pytest.raises(RuntimeError, match="sampler failed at position 45"):
            for _, y in cls(ds, batch_size=5, sampler=_FailingSampler(45), **kw):
                batches.append(y)
        got[name] = batches
    assert len(got["solar"]) == len(got["torch"]) == 9
    assert all(torch.equal(a, b) for a, b in zip(got["solar"], got["torch"]))


def test_prefetch_hands_out_what_it_fetched_before_its_items_fail():
    from solar.prefetch import prefetch

    def items():
        yield from range(3)
        raise KeyError("no item 3")

    out = []
    with pytest.raises(KeyError, match="no item 3"):
        for x in prefetch(items(), lambda i: i * 2, depth=2):
            out.append(x)
    assert out == [0, 2, 4]


class _BadIndexSampler(tud.Sampler):
    """0, 1, ... with sample ``bad`` at position ``at`` (an index past the end of the file)."""

    def __init__(self, at, bad):
        self.at, self.bad = at, bad

    def __len__(self):
        return 96

    def __iter__(self):
        return iter([self.bad if i == self.at else i for i in range(96)])


@pytest.mark.parametrize("prefetch, workers", [(8, 0), (2, 0), (8, 2)])
def test_a_bad_index_in_a_pass_hands_out_every_batch_before_its_step_as_torch(h5path, prefetch, workers):
    """A pass is read as one unit; when it fails, its steps are read one at a time, so the
    batches before the failing step come out first, then its error, as with torch's loader
    (before: the error a pass early, with 8 or 4 of torch's 9 batches handed out). With workers
    the error is raised on the loader's side when torch takes the step for a worker, which it
    does a few batches ahead: torch's batches up to there, then the error."""
    ds = solar.H5Dataset(h5path)
    got = {}
    for name, cls, kw in (("torch", tud.DataLoader, {}), ("solar", solar.DataLoader, {"prefetch": prefetch})):
        batches = []
        with pytest.raises(IndexError, match="sample index 150 out of range"):
            for _, y in cls(ds, batch_size=5, sampler=_BadIndexSampler(47, 150), num_workers=workers, **kw):
                batches.append(y)
        got[name] = batches
    assert len(got["torch"]) == 9
    assert len(got["solar"]) == 9 if workers == 0 else 9 - 2 * workers <= len(got["solar"]) <= 9
    assert all(torch.equal(a, b) for a, b in zip(got["solar"], got["torch"]))


def test_a_loop_that_skips_bad_batches_gets_torchs_batches_around_them(h5path):
    """Two bad steps in one pass, and a loop that catches the error and goes on (torch's iterator
    allows it): every good batch, in torch's order, and an error for exactly the bad ones."""
    ds = solar.H5Dataset(h5path)

    class TwoBad(tud.Sampler):
        def __len__(self):
            return 96

        def __iter__(self):
            return iter([150 if i in (47, 62) else i for i in range(96)])

    def run(cls, **kw):
        it, out = iter(cls(ds, batch_size=5, sampler=TwoBad(), **kw)), []
        while True:
            try:
                out.append(next(it)[1])
            except StopIteration:
                return out
            except IndexError:
                out.append(None)

    want, got = run(tud.DataLoader), run(solar.DataLoader, buffer=0.5)
    assert [b is None for b in got] == [b is None for b in want] and sum(b is None for b in want) == 2
    assert all(a is None or torch.equal(a, b) for a, b in zip(got, want))
