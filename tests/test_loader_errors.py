"""solar.DataLoader when things fail: bad options and states, worker and sampler errors, bad indices,
timeouts on stalled reads, and the read-ahead (solar.prefetch) that must hand out what came before."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import solar
from solar.synthetic import write_ptycho_h5


class Boom(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 7:  # in the last batch: torch's workers are idle when it raises, so they stop at once
            raise KeyError(f"sample {i} is bad")
        return i


def test_worker_exception_is_reraised_with_its_type():
    it = iter(solar.DataLoader(Boom(), batch_size=2, num_workers=2))
    with pytest.raises(KeyError, match="sample 7 is bad"):
        list(it)
    it._shutdown_workers()  # torch's iterator, reached through the wrapper: stop its workers now, not at gc


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


def test_a_read_ahead_closed_by_the_garbage_collector_inside_threadings_locks_does_not_deadlock():
    """An abandoned read-ahead generator is closed wherever a garbage collection runs, also in a
    new thread's start-up while it holds threading's shutdown-locks lock (seen as a hang in the
    DALI tests: the loop waited forever for a thread to start). Joining the read-ahead's thread
    there needs that lock again; the close must return without waiting."""
    import _thread
    import threading

    from solar.prefetch import prefetch

    lock = getattr(threading, "_shutdown_locks_lock", None)
    if lock is None:
        pytest.skip("this Python's threading has no _shutdown_locks_lock")
    gen = prefetch(range(10), lambda i: i, depth=2)
    assert next(gen) == 0
    done = threading.Event()

    def unregistered():  # as a thread in its start-up: threading does not know it yet
        with lock:
            gen.close()
        done.set()

    _thread.start_new_thread(unregistered, ())
    assert done.wait(20), "closing the read-ahead deadlocked on threading's shutdown-locks lock"


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
