"""The shipped resume check (solar.testing.resume.check_save_load_state) over every registered
storage backend x every registered cache tier that can serve as the loader's rank buffer.

Backends come from ``solar.io_backends.registry`` and tiers from ``solar.cache.registry``, so a
newly registered one fails :func:`test_every_registered_backend_and_tier_has_a_recipe` until it
gets a recipe here (or a stated reason why it cannot run). The same 96-sample file is read through
each backend: ``hdf5`` locally, ``fsspec`` over HTTP from nginx on 127.0.0.1 (tests/servers.py),
``throttled`` wrapping the local file, and ``mpi-hdf5`` under ``mpirun`` only (an ``mpi`` test, run
by ``make test-mpi``). The loader builds its buffer itself: ``buffer=`` makes it a ``MemoryTier``,
``spill=(dir, size)`` a ``SpillTier`` (memory, then files), and ``spill={"tier": name, ...}`` a
``SpillTier`` whose files are kept by the cache tier registered as ``name``, built through the
registry (``disk`` and ``fsspec`` run that way, ``disk`` with no memory part at all).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, NamedTuple

import pytest
import torch
import torch.utils.data as tud

import solar
from solar.cache import Tier, registry as tiers
from solar.io_backends import registry as backends
from solar.synthetic import write_ptycho_h5
from solar.testing.resume import check_save_load_state


# 96 samples of 768 B (two fields), 8 a batch per rank; in one process the world mode runs 2 ranks
N, BATCH, WORLD = 96, 8, 2


def _hdf5(path, request):
    return solar.H5Dataset(path, backend="hdf5")


def _fsspec(path, request):
    root, base = request.getfixturevalue("http_root")
    name = f"matrix-{os.getpid()}-{os.path.basename(os.path.dirname(path))}.h5"
    if not os.path.exists(os.path.join(root, name)):
        shutil.copy(path, os.path.join(root, name))
    return solar.H5Dataset(f"{base}/{name}", backend="fsspec")


def _throttled(path, request):
    return solar.H5Dataset(path, backend="throttled",
                           backend_options=dict(inner="hdf5", bandwidth=2e9, latency=1e-4))


def _mpi_hdf5(path, request):
    return solar.H5Dataset(path, backend="mpi-hdf5")


#: registered backend -> how a test opens the file through it
BACKENDS = {"hdf5": _hdf5, "fsspec": _fsspec, "throttled": _throttled, "mpi-hdf5": _mpi_hdf5}
#: backends whose reads are collective over MPI: they run only under mpirun (make test-mpi)
NEEDS_MPIRUN = {"mpi-hdf5"}


class Recipe(NamedTuple):
    """How a registered tier becomes (part of) the loader's rank buffer."""

    options: Callable[[str], dict]  #: the loader options, given the rank's spill directory
    level: Callable[[Tier], Tier]  #: where the tier under test sits in the buffer the loader built


#: registered tier -> its recipe; a sample is 768 B in memory and 2 files of a 4 KiB block on disk
TIERS = {
    "memory": Recipe(lambda d: dict(buffer="24KB"), lambda buf: buf),  # keeps 31 of the 96 samples
    # memory for 10 samples, files for some 16 more
    "spill": Recipe(lambda d: dict(buffer="8KB", spill=(d, "128KiB")), lambda buf: buf),
    # no memory part: every buffered sample is a DiskTier's files (24 samples)
    "disk": Recipe(lambda d: dict(buffer="0B", spill={"tier": "disk", "dir": d, "size": "192KiB"}),
                   lambda buf: buf.second),
    # memory for 10 samples, then files written through fsspec's local file system
    "fsspec": Recipe(lambda d: dict(buffer="8KB", spill={"tier": "fsspec", "dir": d, "size": "128KiB"}),
                     lambda buf: buf.second),
}


def _cases():
    for b in backends.names():
        for t in tiers.names():
            marks = [pytest.mark.mpi] if b in NEEDS_MPIRUN else []
            yield pytest.param(b, t, marks=marks, id=f"{b}-{t}")


def _without_recipe() -> list[str]:
    """Registered backends and tiers that the matrix has no recipe for."""
    return [f"backend {b!r}" for b in sorted(set(backends.names()) - set(BACKENDS))] + \
        [f"tier {t!r}" for t in sorted(set(tiers.names()) - set(TIERS))]


def test_every_registered_backend_and_tier_has_a_recipe():
    missing = _without_recipe()
    assert not missing, f"add a recipe to BACKENDS or TIERS in tests/test_resume_matrix.py for: {missing}"


def test_a_tier_registered_without_a_recipe_is_reported():
    """The check above can fail: a tier registered (as a plug-in would be) and not in TIERS."""
    tiers.register("matrix-unlisted", "solar.cache.disk:DiskTier")
    try:
        assert _without_recipe() == ["tier 'matrix-unlisted'"]
    finally:
        tiers._entries.pop("matrix-unlisted")
    assert not _without_recipe()


@pytest.fixture(scope="module")
def matrix_h5(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("matrix") / "ptycho.h5")
    write_ptycho_h5(path, N, 8, seed=1, progress=False)
    return path


class _World:
    """The ranks of one DataLoader world seen as one loader: each step yields the *global* batch
    (every rank's batch of that step, rows sorted), so check_save_load_state compares what the
    docs promise for P > 1. A resume starts with empty buffers, so the rank a sample goes to
    inside a global batch may differ from the uninterrupted run; the global batch may not
    (docs/loader.md, "Resume"). ``ranks``: this process's loaders (all P in one process, or its
    own under mpirun, where ``comm`` gathers the others')."""

    def __init__(self, ranks, comm=None):
        self.ranks, self.comm = ranks, comm

    def set_epoch(self, epoch):
        for loader in self.ranks:
            loader.sampler.set_epoch(epoch)

    def state_dict(self):
        return self.ranks[0].state_dict()  # positions are global: every rank's state is the same

    def load_state_dict(self, state):
        for loader in self.ranks:
            loader.load_state_dict(state)

    def __iter__(self):
        # each rank's loop runs to its StopIteration, as a rank's own ``for`` loop does (zip would
        # leave the ranks after the first without it: see the xfail test below)
        its = [iter(loader) for loader in self.ranks]
        while True:
            step = [next(it, None) for it in its]
            if all(batch is None for batch in step):
                return
            assert all(batch is not None for batch in step), "the ranks gave different numbers of batches"
            fields = [[t.numpy() for t in batch] for batch in step]
            if self.comm is not None:
                fields = [f for mine in self.comm.allgather(fields) for f in mine]
            cat = [torch.cat([torch.from_numpy(f[i]) for f in fields]) for i in range(len(fields[0]))]
            keys = [row.numpy().tobytes() for row in cat[0]]
            order = sorted(range(len(keys)), key=keys.__getitem__)
            yield tuple(t[order] for t in cat)


def _setting(backend, request, tmp_path):
    """(path, world size, this process's ranks, comm or None, spill directory) for the backend."""
    if backend not in NEEDS_MPIRUN:
        return request.getfixturevalue("matrix_h5"), WORLD, range(WORLD), None, str(tmp_path)
    comm = request.getfixturevalue("comm")
    shared = request.getfixturevalue("shared_tmp")
    path = os.path.join(shared, "matrix.h5")
    write_ptycho_h5(path, N, 8, seed=1, comm=comm, progress=False)
    comm.Barrier()
    spill_dir = os.path.join(str(tmp_path), f"rank{comm.rank}")  # node-local, one per rank
    os.makedirs(spill_dir, exist_ok=True)
    return path, comm.size, [comm.rank], comm, spill_dir


@pytest.mark.parametrize("mode", ["rank", "world", "passthrough"])
@pytest.mark.parametrize("backend, tier", list(_cases()))
def test_resume_over_every_backend_and_tier(backend, tier, mode, request, tmp_path):
    """Every save point of epoch 1, and after the epoch's loop, resumes into the uninterrupted
    run's batches, with the loader reading through the backend and buffering in the tier under
    test. ``rank``: a DistributedSampler world of 1 (the rank's own batches, in order); ``world``:
    P ranks (2 in this process, or every rank under mpirun), compared by global batches;
    ``passthrough``: shuffle=True with a seeded generator (no DistributedSampler)."""
    path, P, mine, comm, spill_dir = _setting(backend, request, tmp_path)
    options = TIERS[tier].options(spill_dir)
    opened, loaders = [], []

    def make_rank(world, rank):
        ds = BACKENDS[backend](path, request)
        assert ds.backend.name == backend
        opened.append(ds)
        if mode == "passthrough":
            g = torch.Generator().manual_seed(7)
            loader = solar.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g, **options)
        else:
            s = tud.DistributedSampler(ds, num_replicas=world, rank=rank, seed=2)
            loader = solar.DataLoader(ds, batch_size=BATCH, sampler=s, **options)
        assert loader.solar_sampler is not None
        assert loader.solar_sampler.mode == ("passthrough" if mode == "passthrough" else "schedule")
        loaders.append(loader)
        return loader

    def make():
        if mode == "world":
            return _World([make_rank(P, r) for r in mine], comm)
        return make_rank(1, 0)

    steps = N // (BATCH * (P if mode == "world" else 1))  # batches per epoch
    assert check_save_load_state(make, set_epoch=mode != "passthrough") == steps + 2  # 0..steps, after the loop
    buf = loaders[0].solar_sampler.buffer  # the reference run's, after its three epochs
    level = TIERS[tier].level(buf)
    assert type(level) is tiers.get(tier), f"the buffer holds a {type(level).__name__}, not the {tier!r} tier"
    assert level.nbytes > 0, f"the {tier!r} tier holds no sample"
    if isinstance(buf, tiers.get("spill")):  # a memory part, then files
        if options["buffer"] == "0B":
            assert buf.first.nbytes == 0, "a memory part of 0 B kept samples"
        else:
            assert buf.first.nbytes > 0 and buf.second.nbytes > 0  # samples in memory and in files
    del level
    assert sum(ds.stats.hits for ds in opened) > 0, "the buffer never served a sample"
    del buf
    loaders.clear()  # the buffers (and spill files) go before the files close
    for ds in opened:
        ds.close()


def test_a_rank_that_never_sees_stop_iteration_plans_as_the_others(matrix_h5):
    import itertools

    ranks = []
    for r in range(WORLD):
        ds = solar.H5Dataset(matrix_h5)
        ranks.append(solar.DataLoader(ds, batch_size=BATCH, buffer=31,
                                      sampler=tud.DistributedSampler(ds, num_replicas=WORLD, rank=r, seed=2)))
    first = [float(ranks[0].dataset[i][1].flatten()[0]) for i in range(N)]  # tells the samples apart
    for epoch in range(2):
        got = []
        for r, loader in enumerate(ranks):
            loader.sampler.set_epoch(epoch)
            batches = loader if r == 0 else itertools.islice(loader, len(loader))  # rank 1: no StopIteration
            got.append([b[1].flatten(1)[:, 0].tolist() for b in batches])
        order = solar.schedule.global_order(N, WORLD, 2, epoch)
        G = WORLD * BATCH
        for k in range(N // G):
            want = sorted(first[i] for i in order[k * G:(k + 1) * G])
            assert sorted(got[0][k] + got[1][k]) == want, f"epoch {epoch}, global batch {k}"
