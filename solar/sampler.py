"""``SolarBatchSampler``: the batch sampler ``solar.DataLoader`` puts in place of torch's.

It wraps the ``BatchSampler`` torch built from the user's arguments (so ``len()``, ``sampler``,
``batch_size`` and ``drop_last`` stay torch's) and yields each step's indices as a
:class:`~solar.fetch.StepBatch` whose stored bytes were already loaded by the prefetch thread.

Two modes:

``schedule``
    The sampler is a ``DistributedSampler`` (stock ``__iter__``). The batches come from the SOLAR
    plan (``solar/schedule.py``) for the sampler's ``num_replicas``/``rank``/``seed``/``shuffle``/
    ``drop_last`` and its current ``epoch`` (so ``set_epoch`` is honoured): every global mini-batch
    is DistributedSampler's, but its samples go to the rank that holds them.
``passthrough``
    Any other sampler (``shuffle=True/False``, custom samplers and batch samplers), or a
    ``batch_size`` larger than the rank's share of the samples: torch's
    batches, unchanged, with buffer hits for the samples this process owns and background
    prefetch.

NOTE [ Buffer and workers ]
    The rank buffer, the storage reads and the prefetch thread all live in the main process, in
    this object; DataLoader workers receive each step's loaded bytes inside the batch they are sent
    (raw fields and codec blobs as tensors in shared memory: ``StepBatch.stored``) and do only the
    per-sample work (decode, transform, collate). So the buffer is never copied into, or lost
    with, worker processes, and worker count does not multiply its memory; h5py handles are opened
    lazily in the process that reads (the backend checks the pid), which is this one. Without
    workers, compressed passes are decoded on the prefetch thread, a whole pass per
    ``decode_batch`` (NOTE [ Stored vs decoded ] in ``solar/dataset.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import os
import weakref
import zlib
from typing import Any, Iterator

import numpy as np
from torch.utils.data import BatchSampler, DistributedSampler

from solar.cache import MemoryTier
from solar.cache.spill import SpillTier
from solar.collective import agree_iteration
from solar.decoded import BufferUsage, usage
from solar.dist import collective_call, mpi_executor, plan_comm, plan_executor
from solar.errors import ConfigError
from solar.exchange import run_mpi
from solar.firststeps import Head
from solar.nodeshare import NodeOrder
from solar.options import BufferSpec, parse_buffer, parse_spill
from solar.passes import PassFetcher, PassGeometry, drop_frame_locals, in_groups, raise_failed
from solar.prefetch import prefetch as _prefetch
from solar.schedule import PlanConfig, Planner, capacity_for_bytes
from solar.shardplan import ShardPlanner

__all__ = ["SolarBatchSampler", "is_storage_backed", "mean_stored_bytes"]

#: Upper bound of the stored bytes one prefetch pass reads (two passes are in flight at most).
GROUP_BYTES = 256 << 20
#: From this many samples on, ranks of a collective backend plan sharded (NOTE [ Sharded planning ])
SHARD_FROM = 1 << 20

def is_storage_backed(dataset: Any) -> bool:
    """True for datasets SOLAR can drive (they implement ``fetch_stored``, like ``H5Dataset``)."""
    return callable(getattr(dataset, "fetch_stored", None)) and callable(getattr(dataset, "sample_nbytes", None))


def _decoded_bytes(specs) -> int:
    """Bytes of one sample's fields as arrays (``specs``: the dataset's field specs)."""
    return sum(int(np.prod(s.sample_shape, dtype=np.int64)) * s.dtype.itemsize for s in specs)


def _all_raw(dataset: Any) -> bool:
    """Whether every field is stored raw (each sample then costs the same bytes)."""
    specs = getattr(dataset, "specs", None)
    return bool(specs) and all(getattr(s, "kind", None) == "raw" for s in specs)


def mean_stored_bytes(dataset: Any) -> float:
    """Mean stored bytes of a sample (0 for an empty dataset). Raw fields cost their shape's
    bytes, without ``sample_nbytes()``'s array of every sample's size (8 bytes per sample:
    160 MB at N = 2e7, on every iteration's way to its first batch)."""
    if _all_raw(dataset):
        return float(_decoded_bytes(dataset.specs)) if len(dataset) else 0.0
    sizes = dataset.sample_nbytes()
    return float(sizes.mean()) if len(sizes) else 0.0


def _on_plan_thread(fn, *args):
    """``fn(*args)`` on the planning thread (a sharded planner's collective calls: NOTE [ SOLAR's
    own MPI traffic ] in solar/dist.py)."""
    return plan_executor().submit(fn, *args).result()


def _stock_distributed(sampler: Any) -> bool:
    return isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__


def _no_iteration() -> None:
    """What ``SolarBatchSampler._live`` dereferences to before any iteration (a dead weakref)."""
    return None


class SolarBatchSampler(BatchSampler):
    """Wraps torch's batch sampler; see the module docstring.

    Args:
        inner: the batch sampler torch built (or the user's ``batch_sampler``).
        dataset: a storage-backed dataset (``H5Dataset``).
        buffer: see :func:`parse_buffer`.
        spill: see :func:`parse_spill`.
        prefetch: steps read together in one pass on the background thread, one pass ahead of
            the consumer (0: read each step inline when it is asked for).
        shared: allocate loaded batches in shared memory (``num_workers > 0``).
        timeout: the loader's ``timeout`` with workers (else 0): seconds to wait for a pass read
            ahead before raising torch's ``RuntimeError("DataLoader timed out ...")``. With
            workers, torch's timeout covers the reads, which run in the workers; here they run
            on the read-ahead thread, so the wait for them must time out too.
    """

    def __init__(self, inner: Any, dataset: Any, *, buffer: Any = "1GiB", prefetch: int = 8,
                 shared: bool = False, spill: Any = None, timeout: float = 0) -> None:
        # No BatchSampler.__init__: its checks already ran on `inner` (or it is a user object).
        self.inner = inner
        self.sampler = getattr(inner, "sampler", None)
        self.batch_size = getattr(inner, "batch_size", None)
        self.drop_last = getattr(inner, "drop_last", False)
        self.dataset = dataset
        self.buffer_spec = parse_buffer(buffer)
        self.spill_spec = parse_spill(spill, self.buffer_spec)
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch={prefetch!r}: pass the number of steps to load ahead (>= 0)")
        self.prefetch = prefetch
        self.shared = shared
        self.timeout = timeout
        self.buffer = None
        self._planner: Planner | None = None
        self._key: Any = None
        self._capacity = 0
        self._resume: dict | None = None
        self._open = False  # a scheduled iteration started and not run to its end
        self._stopped: int | None = None  # steps the last iteration handed out, once it is closed
        self._handed = 0  # steps the newest iteration has handed out so far
        self._token: object | None = None  # identifies the newest iteration
        self._live: Any = _no_iteration  # weakref to the newest iteration's generator
        self._capacities: dict[tuple[int, int, int], int] = {}
        self._ahead: tuple | None = None  # (planner it was copied from, epoch, future): NOTE [ Planning ahead ]
        self._rest: Head | None = None  # an epoch whose head was handed out first (NOTE [ First steps ])
        self._last_epoch: int | None = None  # the epoch the last scheduled iteration planned
        #: plan the next epoch in the background (NOTE [ Planning ahead ]); False saves its memory
        self.plan_ahead = True
        #: what the running (or last) iteration is: mode, epoch, start position, global batch ...
        self.current: dict[str, Any] = {}
        if self.mode == "schedule":
            self.plan_config()  # nonsense (batch larger than the data, bad buffer ...) fails now

    def __getstate__(self) -> dict:
        # the plan made ahead is a cache holding a Future (a lock): copies and pickles go without
        # it; a buffer spilled to disk is a directory of this process: a copy starts over
        state = self.__dict__.copy()
        state["_ahead"] = state["_rest"] = None
        state["_live"] = _no_iteration  # a generator is of this process
        if self.spill_spec is not None:
            state["buffer"], state["_key"], state["_planner"] = None, None, None
        return state

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        # loader.batch_sampler is this object: the wrapped batch sampler's own attributes and
        # methods (set_epoch, a bucketing sampler's fields ...) stay reachable through it
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    @property
    def _distributed(self) -> bool:
        """Torch's batches over a stock ``DistributedSampler``: every rank gets as many."""
        return type(self.inner) is BatchSampler and _stock_distributed(self.sampler)

    @property
    def mode(self) -> str:
        ok = self._distributed
        # a batch larger than the rank's share is one partial step (or none with drop_last): as in
        # torch, and there is nothing to plan, so such a loader passes through
        return "schedule" if ok and len(self.sampler) >= self.inner.batch_size else "passthrough"

    # -- configuration --------------------------------------------------------------------------
    def _geometry(self) -> tuple[int, int, int]:
        """(world size, rank, per-rank batch) of the current mode."""
        if self.mode == "schedule":
            return self.sampler.num_replicas, self.sampler.rank, self.batch_size
        return 1, 0, self.batch_size or 1

    def capacity(self, world_size: int, batch_size: int) -> int:
        """Samples each rank's buffer may keep, from the ``buffer=`` option."""
        spec, n = self.buffer_spec, len(self.dataset)
        if spec.nbytes is None:
            return spec.per_rank(n, world_size)
        key = (n, world_size, batch_size)
        raw = self.spill_spec is None and _all_raw(self.dataset)
        if key not in self._capacities and raw:  # every sample costs the same: no O(N) sizes
            each = max(1, _decoded_bytes(self.dataset.specs))
            self._capacities[key] = BufferSpec(samples=spec.nbytes // each).per_rank(n, world_size)
        if key not in self._capacities:
            sizes, budget = self.dataset.sample_nbytes(), spec.nbytes
            if self.spill_spec is not None and len(sizes):
                # on disk each field of a sample is a file of whole blocks: the spill holds fewer
                # samples than its bytes / their sizes (cache/spill.py charges the same)
                on_disk = self.dataset.sample_nbytes(os.statvfs(self.spill_spec.directory).f_bsize)
                budget += int(self.spill_spec.nbytes * sizes.sum() / max(1, on_disk.sum()))
            self._capacities[key] = capacity_for_bytes(sizes, budget, world_size, batch_size)
        return self._capacities[key]

    def plan_config(self) -> PlanConfig:
        """The schedule configuration of the next iteration (schedule mode)."""
        s = self.sampler
        P, _, b = self._geometry()
        cfg = PlanConfig(len(s.dataset), P, b, self.capacity(P, b), int(s.seed), bool(s.shuffle),
                         bool(s.drop_last), bool(self.drop_last))
        # a sharded plan's head is planned in pieces ahead of the rest (NOTE [ First steps ])
        return dataclasses.replace(cfg, long_head=True) if self._sharded_for(cfg) else cfg

    def _prepare(self) -> tuple[int, int]:
        """Make the buffer (and planner) for the current geometry; reuse them while it holds."""
        P, rank, b = self._geometry()
        if self.mode == "schedule":
            cfg = self.plan_config()
            key = cfg
        else:
            cfg = None
            key = ("passthrough", len(self.dataset), b)
        if key != self._key:
            self._key = key
            self._capacity = cfg.capacity if cfg else self.capacity(1, b)
            self._planner = self._new_planner(cfg) if cfg else None
            if self.spill_spec is not None:
                # a fresh directory per buffer; an older iteration may still read the old one,
                # whose files go when it is garbage collected
                self.buffer = SpillTier.on_disk(self.spill_spec.directory, self.buffer_spec.nbytes,
                                                self.spill_spec.nbytes, tier=self.spill_spec.tier)
            else:
                self.buffer = MemoryTier(self.buffer_spec.nbytes)
        return P, rank

    def _sharded_for(self, cfg: PlanConfig) -> bool:
        """Whether ``cfg`` is planned sharded: see :meth:`_new_planner`."""
        mode = os.environ.get("SOLAR_PLANNER", "auto")
        if mode not in ("auto", "sharded", "full"):
            raise ConfigError(f"SOLAR_PLANNER={mode!r}: use auto (sharded from {SHARD_FROM} samples on), "
                              "sharded or full")
        big = mode == "sharded" or (mode == "auto" and cfg.num_samples >= SHARD_FROM)
        return big and self._collective and cfg.world_size > 1

    def _new_planner(self, cfg: PlanConfig):
        """NOTE [ Sharded planning ] in solar/shardplan.py: on a collective backend with two or
        more ranks and a dataset of ``SHARD_FROM`` samples or more, each rank plans only its
        share (collective calls, on the MPI thread), the order once per node (or computed,
        ``order="feistel"``); otherwise the whole plan, on every rank alike (its ``EpochPlan``
        shows every rank's part). ``SOLAR_PLANNER=sharded`` or ``full`` decides for any size."""
        old = self._planner
        if isinstance(old, ShardPlanner) and isinstance(old.order, NodeOrder):
            _on_plan_thread(old.order.close)  # every rank replaces its planner at the same point
        if not self._sharded_for(cfg):
            return Planner(cfg)
        comm = plan_comm(self.dataset.backend.comm)
        order = None if cfg.order == "feistel" and cfg.shuffle else _on_plan_thread(NodeOrder, cfg, comm)
        return ShardPlanner(cfg, comm.rank, order, exchange=functools.partial(run_mpi, comm=comm))

    @property
    def _sharded(self) -> bool:
        return isinstance(self._planner, ShardPlanner)

    def buffer_usage(self) -> BufferUsage:
        """What this rank's buffer holds now: stored bytes, and the decoded copies in its left-over
        bytes (NOTE [ Decoded copies ] in solar/decoded.py)."""
        return usage(self.buffer)

    # -- resume ---------------------------------------------------------------------------------
    def set_resume(self, state: dict | None) -> None:
        """Start the next iteration where ``state`` (from the loader's ``state_dict``) left off."""
        self._resume = state
        if state is not None:
            self._drop_ahead()

    # -- iteration ------------------------------------------------------------------------------
    def _steps(self, resume: dict | None, P: int, rank: int) -> Iterator[tuple[list[int], Any, Any]]:
        """This rank's steps: ``(indices, samples to keep, samples to evict, (step, twin))``; the
        last three are ``None`` in passthrough mode (keep what this process owns, never evict).
        ``twin``: the latest step up to this one that reads one of its samples again
        (:meth:`EpochPlan.twin_steps`)."""
        if self.mode == "schedule":
            epoch = int(self.sampler.epoch)
            start = 0
            if resume and resume.get("mode") == "schedule" and resume["epoch"] == epoch:
                # a state saved with more padding (another world size) may lie past this epoch's end
                start = min(int(resume["position"]), self._planner.config.epoch_length)
            plan, head = self._planned_ahead(epoch, start), None
            if plan is None and self._sharded:  # NOTE [ First steps ]: the head in pieces, then the rest
                head = Head(self._planner, epoch, start)
                if head:
                    self._rest = head
                else:
                    plan, head = head.take(), None
            if plan is None and head is None:
                plan = self._planner.plan(epoch, start)
            shown = plan if head is None else head.first()
            self.current = {"mode": "schedule", "epoch": epoch, "start": start, "global_batch": shown.global_batch,
                            "world_size": P, "plan": plan}
            # the next iteration's epoch: the next one, or this one again where the epoch does not
            # advance (a loader whose sampler never gets set_epoch, e.g. for validation)
            last, self._last_epoch = self._last_epoch, epoch
            ahead = epoch if last == epoch else epoch + 1
            twin = shown.twin_steps()
            k0 = 0 if head is None else head.num_steps
            # planned ahead once the first pass is on its way, and after the plan it copies
            first = max(k0, self.group_size(self._geometry()[2]))
            if head is not None:
                for k, (step, (keep, evict)) in head.iter_steps(rank):
                    yield step.tolist(), keep, evict, (k, int(twin[k]))
                plan = self._take_rest()
            lazy = getattr(plan, "iter_steps", None)  # a RankPlan: each step as it is asked for
            steps = lazy(rank, k0) if lazy is not None else zip(plan.rank_steps(rank), plan.rank_actions(rank))
            for k, (step, (keep, evict)) in enumerate(steps, k0):
                if k == first:
                    self._plan_ahead(ahead)
                yield step.tolist(), keep, evict, (k, int(twin[k]))
            if plan.num_steps <= first:
                self._plan_ahead(ahead)
            return
        skip = int(resume["batches"]) if resume and resume.get("mode") == "passthrough" else 0
        self.current = {"mode": "passthrough", "start": skip}
        for k, batch in enumerate(self.inner):
            if k >= skip:
                yield list(batch), None, None, None

    def __iter__(self) -> Iterator[list[int]]:
        me: list = []
        it = self._iterate(me)
        me.append(weakref.ref(it))  # what the iteration knows itself by, once it runs
        return it

    def _iterate(self, me: list) -> Iterator[list[int]]:
        resume, self._resume = self._resume, None
        if self.mode == "schedule":
            self._settle_last_iteration()
        self._open = self.mode == "schedule"
        self._stopped = None
        self._handed = 0
        token = self._token = object()  # this iteration; an older one closing later reports nothing
        self._live = me[0]  # NOTE [ Early stop ]: a newer iteration on a collective backend ends it
        P, rank = self._prepare()
        buffer = self.buffer  # an older iteration's last read never lands in a newer buffer
        b = self._geometry()[2]
        in_step = self._distributed
        collective = self._collective
        in_lockstep = collective and in_step
        fetch = PassFetcher(self.dataset, buffer, PassGeometry(P, rank, b, self._capacity), shared=self.shared,
                            in_step=in_step, decode=self._decode_ahead, must_agree=in_lockstep and P > 1)
        groups = in_groups(self._steps(resume, P, rank), self.group_size(b))
        handed = 0
        # passes in step make collective calls: on the process's one MPI thread, shared by every
        # loader (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py)
        executor = mpi_executor() if in_lockstep else None
        passes = _prefetch(groups, fetch, 1 if self.prefetch else 0, cancel=not collective, executor=executor,
                           timeout=self.timeout)
        try:
            for group in passes:
                for batch in group:
                    if self.shared and batch.error is not None:
                        # bound for a worker: raised here instead, after the batches before it
                        # (raised in a worker, torch's re-raise keeps its iterator, and the
                        # workers, alive in a reference cycle until a garbage collection)
                        raise_failed(batch)
                    handed += 1
                    if self._token is token:
                        self._handed = handed
                    yield batch
        except Exception as exc:
            drop_frame_locals(exc)
            raise
        finally:
            passes.close()  # the running read has finished (or stalled past timeout=, abandoned)
            if self._token is token:
                self._stopped = handed
        if self._token is token:
            self._open = False

    def _plan_ahead(self, epoch: int) -> None:
        """NOTE [ Planning ahead ]: plan ``epoch`` on a copy of the planner, in the background.

        Why: an epoch's plan needs the previous plan's residency; made inline, it runs when the
        epoch's iteration starts, before its first batch, on every rank, and costs far more than
        torch's ``randperm`` there (bench/plan/ahead.json: first batch inline vs ahead). The next
        iteration is usually ``epoch + 1`` from its start (or the same epoch again, where the last
        two iterations had one: a loader never given ``set_epoch``), with the residency the
        current plan left, so the plan is made on a copy of the planner on the planning thread
        (``solar.dist.plan_executor``; a sharded plan, which is collective, after the epoch's first pass)
        while this epoch trains, and taken at the next iteration if nothing changed the planner
        meanwhile (:meth:`_planned_ahead`). An early stop (rewind), a new geometry, a loaded state
        or another epoch discards it and plans inline: the plans are the same either way
        (planning is a pure function of the planner's state). Only with read-ahead on
        (``prefetch > 0``) and ``plan_ahead`` (default True).
        Until it is taken it holds a copy of the planner's state and the plan made ahead: 19
        bytes per sample (tracemalloc, N = 2e6), on top of the planner's own 9 and the current
        plan's 10; ``loader.solar_sampler.plan_ahead = False`` gives that back.
        """
        self._drop_ahead()
        if not self.prefetch or not self.plan_ahead or self._planner is None:
            return
        planner = self._planner
        spec = copy.deepcopy(planner)
        # a sharded plan is collective: every rank submits it at the same point of its program
        # (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py)
        pool = plan_executor()
        submit = pool.submit if self._sharded else pool.submit_local
        self._ahead = (planner, epoch, submit(lambda: (spec, spec.plan(epoch))))

    def _take_rest(self):
        """The whole plan of the epoch whose head the last iteration handed out (NOTE [ First
        steps ]; it waits for it): the iteration's plan from then on. None where there is none
        pending."""
        rest, self._rest = self._rest, None
        if rest is None:
            return None
        plan = rest.take()
        if self.current.get("mode") == "schedule" and self.current.get("plan") is None:
            self.current["plan"] = plan
        return plan

    def _planned_ahead(self, epoch: int, start: int):
        """The plan made ahead for ``epoch`` (from position 0) if it still applies; it then
        replaces the planner with the copy it was made on. ``None``: plan inline."""
        ahead = self._ahead
        if ahead is None or start != 0 or ahead[0] is not self._planner or ahead[1] != epoch:
            self._drop_ahead()
            return None
        self._ahead = None
        try:
            spec, plan = ahead[2].result()
        except Exception:  # noqa: BLE001 - planned inline again, which raises it where it belongs
            return None
        self._planner = spec
        return plan

    def start_over(self) -> None:
        """Make the next iteration start with a new planner and an empty buffer (the dataset's
        positions changed meaning: a ``Subset`` whose indices changed, NOTE [ Subsets ])."""
        self._drop_ahead()
        self._key = None

    def _drop_ahead(self) -> None:
        """Forget the plan made ahead (cancelled if it has not started: the plan thread is shared)."""
        if self._ahead is not None:
            if not self._sharded:  # (a collective plan runs on every rank or on none: never cancelled)
                self._ahead[2].cancel()
            self._ahead = None

    def _settle_last_iteration(self) -> None:
        """NOTE [ Early stop ]: before a scheduled iteration, account for how the last one ended.

        The planner applied the last plan's whole epoch of keeps and evictions when it made it.
        If that iteration stopped early (``break``, a step limit, an error), the planner is
        rewound to the steps it handed out (:meth:`Planner.rewind`), and the buffer drops what
        the read-ahead kept past them; what the read-ahead evicted is a planned hit the buffer
        lacks, read and put back when it comes (``EpochPlan.rank_actions``).

        The planners of all ranks must stay identical (they decide, without communication, which
        rank serves which sample), so a rewind needs every rank stopped at the same step. In one
        process that is given. With a collective backend every rank iterates together anyway, so
        each reports how its last iteration ended in one allreduce, ended or not: the same stop
        everywhere rewinds, anything else starts every rank over. With several ranks on a serial
        backend (torchrun, mpirun without parallel HDF5) there is nothing to agree with: an
        early stop starts that rank over with an empty buffer and a fresh plan, which every rank
        of a data-parallel loop does alike. So does an iteration whose iterator is still
        referenced when the next one starts (its read-ahead may still run). On a collective
        backend such an iteration is ended instead (its generator closed: its read-ahead's
        passes finish on every rank alike, as many as the consumer took), then settled as an
        early stop: a peek before the training loop (torch's tutorial does
        ``dataiter = iter(loader); next(dataiter)``) is an early stop like any other, not an error.
        """
        self._take_rest()
        plan = self.current.get("plan") if self.current.get("mode") == "schedule" else None
        if self._open and plan is not None and self._handed >= plan.num_steps:
            # every step was handed out: the iteration ran to its end, whether or not its loop
            # saw StopIteration (islice(loader, len(loader)), zip over loaders); counted as an
            # early stop, it would start over on one rank while the others keep their plans
            self._open = False
        P, rank, _ = self._geometry()
        if self._open and self._stopped is None:
            # an iterator only a reference cycle keeps alive (an error re-raised from torch's
            # worker iterator holds it through its traceback) is garbage: collect it, which
            # closes the iteration and reports where it stopped
            gc.collect()
        collective = self._collective and P > 1
        live = self._live() if collective and self._open and self._stopped is None else None
        if live is not None:
            try:
                live.close()  # its finally waits for its passes and reports where it stopped
            except ValueError:  # running in another thread right now: it cannot be ended from here
                pass
        if self._open:  # stopped early, or still open
            ok = (self._stopped is not None and plan is not None and plan.undo is not None
                  and self._planner is not None and self._key == self.plan_config())
            mine = self._stopped if ok else -1
        else:  # ran to its end (or there was none): nothing to rewind here
            mine = plan.num_steps if plan is not None else -2
        if collective and self._open and self._stopped is None:
            # the old iteration's read-ahead may still be in collective calls on its thread: MPI
            # calls of this one would pair with them in a different order on each rank (a hang)
            raise ConfigError(
                "on a collective backend (parallel HDF5) one iteration of a loader runs at a time, and the "
                "previous iterator is still being iterated in another thread; exhaust it or drop it first")
        if collective:
            steps, any_open = self._agree(mine, int(self._open))
        elif P == 1 or not self._open:
            steps, any_open = mine, self._open
        else:
            steps, any_open = -1, True
        if not any_open or steps == -2:
            return
        self._drop_ahead()  # planned from where the last plan ended, which no longer holds
        if steps < 0:
            self._key = None  # start over: new planner and buffer, on every rank alike
            return
        if self._sharded:
            _on_plan_thread(self._planner.rewind, plan, steps)
        else:
            self._planner.rewind(plan, steps)
        if self.buffer is not None:
            keys = [k for k in self.buffer.keys()
                    if isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], (int, np.integer))]
            if keys:
                held = self._planner.holds(np.fromiter((k[1] for k in keys), np.int64, len(keys)), rank)
                for k, h in zip(keys, held.tolist()):
                    if not h:
                        self.buffer.delete(k)

    def _agreed_values(self) -> dict[str, int]:
        """What every rank's iteration must share: the plan's inputs, how passes are cut (each
        pass makes collective calls) and the fields read. Integers, for one allreduce."""
        cfg = self.plan_config()
        specs = getattr(self.dataset, "specs", ())
        fields = repr([(s.name, tuple(s.sample_shape), str(s.dtype)) for s in specs]).encode()
        return {"dataset size": cfg.num_samples, "world size": cfg.world_size, "batch_size": cfg.batch_size,
                "seed": cfg.seed, "epoch (set_epoch)": int(self.sampler.epoch), "shuffle": int(cfg.shuffle),
                "DistributedSampler drop_last": int(cfg.drop_last),
                "sharded planning (SOLAR_PLANNER)": int(self._sharded_for(cfg)),
                "drop_last": int(cfg.drop_last_batch), "buffer capacity (samples)": cfg.capacity,
                "steps per pass (prefetch=)": self.group_size(cfg.batch_size),
                "decode ahead (num_workers == 0 on compressed data)": int(self._decode_ahead),
                "fields (names, shapes, dtypes; crc32)": zlib.crc32(fields)}

    def _agree(self, steps: int, is_open: int) -> tuple[int, bool]:
        """Over all ranks of the collective backend: ``(steps if all ranks have it, else -1,
        whether any rank's last iteration is open)``, once every rank is known to iterate with
        the same :meth:`_agreed_values` (NOTE [ One agreement per iteration ] in solar/collective.py)."""
        comm = self.dataset.backend.comm
        path = getattr(self.dataset, "path", "")
        values = self._agreed_values()
        found = collective_call(agree_iteration, comm, path, values, steps, is_open)
        return found.steps, found.any_open

    @property
    def _collective(self) -> bool:
        """Whether the dataset's reads are collective (every rank must make every call)."""
        return bool(getattr(getattr(self.dataset, "backend", None), "collective", False))

    @property
    def _decode_ahead(self) -> bool:
        """Decode whole passes on the prefetch thread: compressed data and no workers (workers
        decode their own batches in parallel, and shipping decoded tensors to them would cost
        ratio-times more shared memory)."""
        return not self.shared and bool(getattr(self.dataset, "compressed", False))

    def group_size(self, batch_size: int) -> int:
        """Steps read in one pass: ``prefetch``, but at most ``GROUP_BYTES`` of stored data (of
        decoded data when the pass is decoded ahead)."""
        if not self.prefetch:
            return 1
        nbytes = _decoded_bytes(self.dataset.specs) if self._decode_ahead else mean_stored_bytes(self.dataset)
        per_step = max(1, int(batch_size * nbytes))
        return max(1, min(self.prefetch, GROUP_BYTES // per_step))
