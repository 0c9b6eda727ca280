"""``solar.DataLoader``: ``torch.utils.data.DataLoader`` plus SOLAR's schedule, buffer and prefetch.

A training script changes one import line. The constructor takes torch's signature with torch's
defaults and validates through torch (same ``ValueError`` s); SOLAR's own options are
keyword-only extras. On any dataset that is not storage-backed (anything without
``fetch_stored``, e.g. a ``TensorDataset``) or with ``batch_size=None``, the loader *is* torch's
loader: nothing is replaced. On a storage-backed dataset (:class:`solar.H5Dataset`, or a torch
``Subset`` of one, as ``random_split`` makes: NOTE [ Subsets ] in ``solar/subset.py``) the batch
sampler torch built is wrapped by :class:`solar.sampler.SolarBatchSampler` (see its NOTE
[ Buffer and workers ]); torch's iterators, workers, collation and pinning run unchanged.

NOTE [ Resume ]
    ``state_dict()`` records how far the *consumer* got (batches returned by the iterator, not
    batches the sampler or workers prefetched): in ``schedule`` mode the epoch and the global
    position ``start + steps * P * b`` in DistributedSampler's order, plus N, P, b and the seed;
    in ``passthrough`` mode the batches done and the RNG state the epoch's sampler drew from
    (and, once the epoch has ended, the state the next epoch will draw from, so a checkpoint taken
    after the loop resumes with the next epoch of the uninterrupted run). An ``IterableDataset``
    has no indices to skip: its stream is replayed and the batches already consumed are dropped.
    ``load_state_dict`` makes the next iteration continue from there. Positions are global, so a
    run resumed with another world size (or per-rank batch) continues the same global order:
    the remaining samples are the same, cut into the new global batches (the last one evened
    out across the new ranks: NOTE [ Resumed tail ] in solar/schedule.py). After a resume the
    buffers start empty (a new process), so the rank assignment inside a global batch may differ
    from the uninterrupted run; each global batch's samples do not.

    A state only fits a loader that draws the same order: the same dataset size, sampler and
    batch sampler classes, and in ``schedule`` mode the same seed, shuffle and drop_last; in
    ``passthrough`` mode the same shuffle (a ``RandomSampler`` or not), generator seed (the
    ``generator=``'s, or the sampler's own, as the loader was built; unknown, and not recorded,
    for torch's global RNG) and, mid-epoch, batch size (its position is a count of batches: 5
    batches of 64 resumed with batches of 32 trained 160 samples twice). Anything else is
    refused with a ``ValueError`` naming both values. States of version 1 lack some of these
    keys; what a state lacks is not checked. A mid-epoch ``schedule`` state whose epoch is then
    replaced (``set_epoch(e)`` with another ``e`` before the next iteration) is dropped with a
    warning: the position belongs to its own epoch's order.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from typing import Any, TypeVar

import torch
import torch.utils.data as tud

from solar.dist import get_dist_info
from solar.errors import ConfigError
from solar.fetch import Stay, collate, forget_held
from solar.iterators import InProcessIter, SkipOnce, TrackedIter, in_process_iterator
from solar.memory import check_buffer_memory
from solar.options import parse_buffer, parse_spill
from solar.order import epoch_positions
from solar.sampler import SolarBatchSampler, is_storage_backed, mean_stored_bytes
from solar.stats import EpochMeter, EpochStats, StatsHistory
from solar.subset import StoredSubset
from solar.views import refresh, stored_concat, stored_subset

__all__ = ["DataLoader"]

#: 2: states also record the sampler and batch sampler classes and, in passthrough mode,
#: shuffle and the generator's seed (NOTE [ Resume ]); version 1 states still load.
STATE_VERSION = 2
_LOADABLE_VERSIONS = (1, 2)
_END = object()
#: ``log_stats=True`` logs each epoch's summary line here, at INFO
_LOG = logging.getLogger("solar.loader")
#: What the loader yields: solar.DataLoader[T] annotates and subclasses as torch's DataLoader[T] does.
T_co = TypeVar("T_co", covariant=True)


class _DefaultBuffer(str):
    """The type of :data:`DEFAULT_BUFFER`: ``"1GiB"``, told apart by identity from a buffer
    the caller passed (an option given for a dataset SOLAR cannot drive is warned about)."""


#: ``buffer=`` when the caller gives none: 1 GiB per rank.
DEFAULT_BUFFER = _DefaultBuffer("1GiB")


class DataLoader(tud.DataLoader[T_co]):
    """Drop-in ``torch.utils.data.DataLoader``; see the module docstring.

    Positional and keyword arguments are torch's, with torch's defaults and behaviour.

    Keyword-only SOLAR options:
        buffer: per-rank buffer for storage-backed datasets: samples (``int``), bytes
            (``"2GiB"``) or a fraction of the dataset over all ranks (``0.5``); ``0`` disables it.
            Default ``"1GiB"`` per rank (never more than the rank's share of the dataset). A
            buffer whose memory part is more than the node's available memory over its ranks is
            refused (:func:`solar.memory.check_buffer_memory`); given for a dataset SOLAR cannot
            drive, it is not used, with a warning.
        prefetch: steps read together in one coalesced pass on the background I/O thread, one
            pass ahead of the training loop (default 8, capped at 256 MB; 0 = each step inline).
        spill: ``(directory, size)`` on node-local disk (``("/local/nvme/solar", "100GiB")``):
            the buffer keeps ``buffer=`` bytes in memory and up to ``size`` more in files there,
            and the schedule plans for both (``buffer=`` must then be bytes). Default ``None``.
            ``{"tier": name, "dir": ..., "size": ...}`` keeps the files in another registered
            cache tier (``"disk"``, ``"fsspec"``: :func:`solar.options.parse_spill`).
        distributed: when True and no sampler is given, shard with a ``DistributedSampler`` whose
            rank and world size come from ``solar.dist.get_dist_info()`` (torch.distributed, then
            mpi4py under mpirun, then ``RANK``/``WORLD_SIZE``, else 1), ``shuffle`` and ``seed``;
            the epoch advances by itself on every iteration unless :meth:`set_epoch` is called.
        seed: seed of that sampler (``distributed=True`` only).
        log_stats: log each completed epoch's summary line (:meth:`solar.stats.EpochStats.summary`)
            to the ``"solar.loader"`` logger at INFO (``logging.basicConfig(level=logging.INFO)``
            shows it). Whether or not, :attr:`stats`, :attr:`stats_history` and :meth:`report`
            give the per-epoch statistics (docs/loader.md, "Statistics per epoch").
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, buffer: Any = DEFAULT_BUFFER, prefetch: int = 8,
                 spill: Any = None, distributed: bool = False, seed: int = 0, log_stats: bool = False) -> None:
        self._auto_epoch = False
        self._log_stats = bool(log_stats)
        self._history = StatsHistory()
        self._epochs_done = 0  # completed epochs, also those of the run a state came from
        if isinstance(dataset, (tud.Subset, tud.ConcatDataset)) and not is_storage_backed(dataset) and \
                (batch_size is not None or batch_sampler is not None):
            # NOTE [ Subsets ] in solar/subset.py, NOTE [ Several files ] in solar/concat.py
            view = stored_subset(dataset) if isinstance(dataset, tud.Subset) else stored_concat(dataset)
            if isinstance(dataset, tud.Subset) and view is not None:
                view.watch(dataset)  # its indices may change between epochs, as torch follows them
            dataset = dataset if view is None else view  # (an empty view is falsy: compare with None)
        if distributed:
            if sampler is not None or batch_sampler is not None:
                raise ConfigError("distributed=True builds the DistributedSampler itself; do not also pass "
                                  "sampler= or batch_sampler= (pass sampler=DistributedSampler(...) alone instead)")
            info = get_dist_info()
            sampler = tud.DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                             shuffle=bool(shuffle), seed=seed, drop_last=drop_last)
            shuffle = None
            self._auto_epoch = True
        if collate_fn is None and is_storage_backed(dataset) and (batch_size is not None or batch_sampler is not None):
            collate_fn = collate  # default_collate, without its second copy: NOTE [ One copy into the batch ]
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
                         drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self._progress: dict[str, Any] = {"batches": 0, "done": False, "rng": None, "started": False}
        self._stay_key = object()  # this loader's batches held for its workers (NOTE [ Batches that stay ])
        self._epoch_set = False
        self.solar_sampler: SolarBatchSampler | None = None
        if self.batch_sampler is not None and is_storage_backed(dataset) and \
                self._dataset_kind == tud.dataloader._DatasetKind.Map:
            self.solar_sampler = SolarBatchSampler(self.batch_sampler, dataset, buffer=buffer, prefetch=prefetch,
                                                   shared=num_workers > 0, spill=spill,
                                                   timeout=timeout if num_workers > 0 else 0)
            # torch forbids re-assigning batch_sampler after __init__ (its __setattr__ guard); this
            # one replacement happens inside __init__ by design.
            object.__setattr__(self, "batch_sampler", self.solar_sampler)
            self._check_buffer_memory(buffer)
        else:
            spec = parse_buffer(buffer)
            parse_spill(spill, spec)  # bad options fail here too, not only on storage-backed datasets
            asked = [f"buffer={buffer!r}"] if buffer is not DEFAULT_BUFFER and not _zero(spec) else []
            asked += [f"spill={spill!r}"] if spill is not None else []
            message = _undriven(dataset, self.batch_sampler is not None,
                                self._dataset_kind == tud.dataloader._DatasetKind.Map, " and ".join(asked))
            if message is not None:
                warnings.warn(message, UserWarning, stacklevel=2)
        # the order's seed as the loader was built (NOTE [ Resume ]): the sampler's own generator
        # (a RandomSampler's is the loader's generator= when torch built it), else generator=
        gen = getattr(self._order_sampler(), "generator", None)
        gen = gen if isinstance(gen, torch.Generator) else self.generator
        self._seed = int(gen.initial_seed()) if isinstance(gen, torch.Generator) else None

    def _check_buffer_memory(self, buffer: Any) -> None:
        """Refuse a buffer the node's memory cannot hold for each of its ranks (solar/memory.py).
        What counts is what the buffer keeps in memory at most: what ``buffer=`` asks, but never
        more than the rank's share of the dataset fills (SolarBatchSampler.capacity caps it);
        a ``spill=`` part is disk. So a big buffer on a small dataset stays accepted."""
        ss = self.solar_sampler
        spec = ss.buffer_spec
        if _zero(spec):
            return
        if not len(self.dataset):
            return
        samples = ss.plan_config().capacity if ss.mode == "schedule" else ss.capacity(1, ss.batch_size or 1)
        mean = mean_stored_bytes(self.dataset)
        fills = int(samples * mean)
        in_memory = fills if spec.nbytes is None else min(spec.nbytes, fills)
        option = f"buffer={buffer!r}" if buffer is not DEFAULT_BUFFER else f"the default buffer={buffer!r}"
        check_buffer_memory(in_memory, option, samples, mean)

    # -- epochs ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler's ``set_epoch`` (a ``DistributedSampler``'s epoch picks the order)."""
        fn = getattr(self.sampler, "set_epoch", None)
        if fn is None:
            raise ConfigError(f"set_epoch: the sampler {type(self.sampler).__name__} has no epochs; "
                              "pass sampler=DistributedSampler(...) or distributed=True")
        fn(epoch)
        self._epoch_set = True

    # -- statistics -----------------------------------------------------------------------------
    @property
    def stats(self) -> EpochStats | None:
        """The last completed epoch's :class:`solar.stats.EpochStats` (None before the first)."""
        return self._history[-1] if self._history else None

    @property
    def stats_history(self) -> StatsHistory:
        """Every completed epoch's :class:`solar.stats.EpochStats`, oldest first."""
        return self._history

    def report(self) -> None:
        """Print a short table of :attr:`stats_history`, one row per completed epoch
        (``loader.stats_history.report()`` returns it as a string)."""
        print(self._history.report())

    def _record(self, meter: EpochMeter) -> None:
        """An iteration has returned its last batch: its epoch's record joins the history."""
        record = meter.finish(self._progress["batches"] - meter.skipped, self._bound())
        self._history = StatsHistory((*self._history, record))
        self._epochs_done += 1
        if self._log_stats:
            _LOG.info("solar.DataLoader %s", record.summary())

    def _bound(self) -> float | None:
        """The hit-rate limit ``min(1, P*C/N)`` of this geometry (``PlanConfig.bound``); None
        when SOLAR does not drive the dataset."""
        ss = self.solar_sampler
        if ss is None or not len(self.dataset):
            return None
        if _zero(ss.buffer_spec):
            return 0.0
        if ss.mode == "schedule":
            return ss.plan_config().bound
        return min(1.0, ss.capacity(1, ss.batch_size or 1) / len(self.dataset))

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self):
        meter = EpochMeter(self.dataset if self.solar_sampler is not None else None, 0,
                           decode_here=self.num_workers == 0)
        # advance by itself only if nobody chose the epoch since the last iteration started: not
        # loader.set_epoch, and not the torch idiom loader.sampler.set_epoch (which bypasses us)
        if self._auto_epoch and self._progress["started"] and not self._epoch_set \
                and self.sampler.epoch == self._progress.get("epoch"):
            self.sampler.set_epoch(self.sampler.epoch + 1)
        self._epoch_set = False
        resume = self._progress.pop("resume", None)
        if self.solar_sampler is not None:
            if isinstance(self.dataset, StoredSubset) and refresh(self.dataset):
                self.solar_sampler.start_over()  # NOTE [ Subsets ]: a position now names another sample
            self.solar_sampler.set_resume(resume)
        rng = self._rng_state()
        if resume and resume.get("mode") == "passthrough" and resume.get("rng") is not None:
            self._set_rng_state(resume["rng"])
            rng = resume["rng"]
        self._progress.update(batches=int(resume["batches"]) if resume and resume.get("mode") == "passthrough" else 0,
                              done=False, rng=rng, next_rng=None, started=True,
                              epoch=getattr(self.sampler, "epoch", None),
                              start=int(resume["position"]) if resume and resume.get("mode") == "schedule" else 0)
        if resume and resume.get("mode") == "schedule" and resume["epoch"] != self._progress["epoch"]:
            if int(resume.get("position", 0)) > 0:  # (a state saved at an epoch's end never gets here)
                warnings.warn(
                    f"solar.DataLoader: the loaded state stopped in epoch {resume['epoch']} at global position "
                    f"{resume['position']}, but this iteration runs epoch {self._progress['epoch']} (set_epoch was "
                    f"called after load_state_dict): epoch {self._progress['epoch']} runs from its start and the "
                    f"rest of epoch {resume['epoch']} is not resumed. To resume it, iterate epoch "
                    f"{resume['epoch']} first (set_epoch({resume['epoch']}), or call set_epoch before "
                    "load_state_dict)", UserWarning, stacklevel=2)
            self._progress["start"] = 0
        replay = 0
        if resume and self.solar_sampler is None:
            if self._dataset_kind == tud.dataloader._DatasetKind.Iterable:
                # an IterableDataset has no indices to skip: its stream is replayed and the batches
                # the consumer already had are dropped (torchdata's StatefulDataLoader does the same
                # for datasets without a state of their own); this assumes the stream replays alike
                replay = self._plain_skip(resume)
            else:
                self._pending_skip = SkipOnce(super()._index_sampler, self._plain_skip(resume))
        if self.solar_sampler is not None:
            self._choose_transfer()
        if isinstance(self._iterator, InProcessIter) != bool(self.__dict__.get("_in_process")):
            self._iterator = None  # a persistent iterator of the other kind (its workers end with it)
        try:
            it = super().__iter__()
        finally:
            self._pending_skip = None
        for _ in range(replay):
            if next(it, _END) is _END:
                break
        epoch = self._progress["epoch"]
        meter.epoch = int(epoch) if epoch is not None else self._epochs_done
        meter.skipped = self._progress["batches"]  # a resumed passthrough epoch counts those before
        meter.wait = time.perf_counter() - meter.start  # the wait for iter(loader) itself
        return TrackedIter(it, self, meter)

    def _batches_stay(self) -> bool:
        """Whether this iteration's batches may stay in this process while workers make them
        (NOTE [ Batches that stay ] in solar/fetch.py): workers, this loader's own collate, H5Dataset's
        own raw samples on the CPU (``plain_batches()``) and no pinning thread between the workers
        and the consumer (it would see the workers' placeholders, not the tensors)."""
        return self.num_workers > 0 and self._plain()

    def _plain(self) -> bool:
        """Batches that are their loaded rows as they are: this loader's own collate, H5Dataset's
        own raw samples on the CPU (``plain_batches()``), no pinning thread."""
        plain = getattr(self.dataset, "plain_batches", None)
        pinned = self.pin_memory and torch.accelerator.is_available()
        return self.solar_sampler is not None and self.collate_fn is collate and not pinned and callable(plain) \
            and bool(plain())

    def _choose_transfer(self) -> None:
        """Before an iteration: how its batches reach the consumer. Without workers, in this
        process; with workers, in shared memory, or staying here (NOTE [ Batches that stay ]).
        What an earlier iteration of this loader left held is dropped. Where the workers would
        have nothing to do, the iteration runs in this process (NOTE [ Workers with nothing to do ]
        in solar/iterators.py)."""
        forget_held(self._stay_key)
        stay = self._batches_stay()
        # NOTE [ Workers with nothing to do ] in solar/iterators.py
        # (num_workers=0 with a timeout: torch's own iterator, which refuses it)
        self._in_process = self._plain() and (self.worker_init_fn is None if self.num_workers else self.timeout == 0)
        self.solar_sampler.shared = False if self._in_process else Stay(self._stay_key) if stay else \
            self.num_workers > 0

    def _get_iterator(self) -> Any:
        if self.__dict__.get("_in_process"):  # solar/iterators.py
            return in_process_iterator(self)
        return super()._get_iterator()

    def _epoch_positions(self) -> int:
        """Global positions an epoch of the (Distributed) sampler consumes after drop_last."""
        return epoch_positions(len(self.sampler), self.sampler.num_replicas, self.batch_size, self.drop_last)

    def _plain_skip(self, resume: dict[str, Any]) -> int:
        """Batches a plain (not storage-backed) dataset skips to resume: torch's own batches."""
        if resume["mode"] == "passthrough":
            return int(resume["batches"])
        if self._progress["start"] == 0:
            return 0
        G = self.sampler.num_replicas * self.batch_size
        if self._progress["start"] >= self._epoch_positions():  # saved after the last batch
            self._progress["start"] = 0
            self._progress["batches"] = -(-self._epoch_positions() // G)
            return self._progress["batches"]
        if self._progress["start"] % G:
            raise ConfigError(f"load_state_dict: the state stopped at global position {self._progress['start']}, "
                              f"inside a global batch of {G} (world size x batch size); a dataset that is not "
                              "storage-backed can only resume there with the world size and batch size it was "
                              "saved with")
        self._progress["start"] = 0  # counted in batches from here on
        self._progress["batches"] = resume["position"] // G
        return self._progress["batches"]

    @property
    def _index_sampler(self):
        # torch reads this when it builds an iterator; a resumed epoch on a plain dataset skips
        # the batches already consumed here, before anything is loaded.
        pending = self.__dict__.get("_pending_skip")
        return pending if pending is not None else super()._index_sampler

    def _rng_state(self) -> torch.Tensor | None:
        if self.generator is None:
            return torch.get_rng_state()
        # not a Generator: torch's own iterator raises its TypeError about it
        return self.generator.get_state() if isinstance(self.generator, torch.Generator) else None

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            torch.set_rng_state(state)

    # -- resume ---------------------------------------------------------------------------------
    def _user_batch_sampler(self) -> Any:
        """The batch sampler torch built (or the ``batch_sampler=`` given), under SOLAR's wrapper;
        None with ``batch_size=None``."""
        return self.solar_sampler.inner if self.solar_sampler is not None else self.batch_sampler

    def _order_sampler(self) -> Any:
        """The sampler whose order the batches follow: the batch sampler's own when it has one
        (a ``batch_sampler=`` argument), else the loader's."""
        own = getattr(self._user_batch_sampler(), "sampler", None)
        return own if own is not None else self.sampler

    def _sampler_classes(self) -> dict[str, str | None]:
        """The classes a state records and checks: ``sampler`` and ``batch_sampler``."""
        inner = self._user_batch_sampler()
        return {"sampler": _class_name(self._order_sampler()),
                "batch_sampler": None if inner is None else _class_name(inner)}

    def _mode(self) -> str:
        return self.solar_sampler.mode if self.solar_sampler is not None else (
            "schedule" if isinstance(self.sampler, tud.DistributedSampler) and self.batch_size else "passthrough")

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is; see NOTE [ Resume ]."""
        p = self._progress
        n = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        state: dict[str, Any] = {"version": STATE_VERSION, "mode": self._mode(), "num_samples": n,
                                 "batch_size": self.batch_size, **self._sampler_classes()}
        if state["mode"] == "schedule":
            s = self.sampler
            G = s.num_replicas * self.batch_size
            done = p["done"]
            epoch = p.get("epoch", s.epoch) if p["started"] else s.epoch
            position = 0 if not p["started"] else (p.get("start", 0) + p["batches"] * G)
            # after the epoch's last, short global batch the count overshoots: the end is the end
            position = min(position, self._epoch_positions())
            state.update(epoch=int(epoch), position=int(position), world_size=s.num_replicas, seed=int(s.seed),
                         shuffle=bool(s.shuffle), drop_last=bool(s.drop_last), global_batch=G, epoch_done=bool(done))
        else:
            state.update(batches=int(p["batches"]) if p["started"] else 0, epoch_done=bool(p["done"]),
                         rng=p["rng"] if p["started"] else None,
                         shuffle=isinstance(self._order_sampler(), tud.RandomSampler), seed=self._seed,
                         epochs_done=self._epochs_done)
            if p["done"] and p.get("next_rng") is not None:
                state["next_rng"] = p["next_rng"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next iteration; raises ``ValueError`` if it does not fit."""
        if not isinstance(state, dict) or state.get("version") not in _LOADABLE_VERSIONS:
            raise ConfigError("load_state_dict: not a solar.DataLoader state (missing or unknown 'version'); "
                              "pass what DataLoader.state_dict() returned")
        n = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        if state.get("num_samples") != n:
            raise ConfigError(f"load_state_dict: the state was saved with a dataset of {state.get('num_samples')} "
                              f"samples but this loader's dataset has {n}; load it into a loader over the same dataset")
        mode = self._mode()
        if state["mode"] != mode:
            raise ConfigError(f"load_state_dict: the state is from a '{state['mode']}' loader but this one is "
                              f"'{mode}'; use the same kind of sampler (DistributedSampler or not) as when it "
                              "was saved")
        if mode == "passthrough":
            self._check_passthrough_state(state)
            # without a sampler's epoch, stats number epochs by this count: it goes on from the run saved
            self._epochs_done = int(state.get("epochs_done", 0))
        for key, value in self._sampler_classes().items():  # (version 1 states lack them: not checked)
            if key in state and state[key] != value:
                raise ConfigError(f"load_state_dict: the state is from a loader whose {key} is {state[key]} but "
                                  f"this loader's {key} is {value}; the order it resumes would be another. Build "
                                  f"the loader with the {key} it was saved with")
        if mode == "schedule":
            s = self.sampler
            for key in ("seed", "shuffle", "drop_last"):
                if state[key] != getattr(s, key):
                    raise ConfigError(f"load_state_dict: the state's sampler {key}={state[key]!r} differs from this "
                                      f"sampler's {key}={getattr(s, key)!r}; the global order would change. Build the "
                                      f"DistributedSampler with {key}={state[key]!r}")
            if state["epoch_done"]:
                s.set_epoch(state["epoch"] + 1)
                self._epoch_set = True  # chosen: the next iteration must not advance it again
                return
            s.set_epoch(state["epoch"])
            self._epoch_set = True
        elif state["epoch_done"]:
            if state.get("next_rng") is not None:  # the next epoch draws what it would have drawn
                self._set_rng_state(state["next_rng"])
            return
        self._progress["resume"] = dict(state)

    def _check_passthrough_state(self, state: dict[str, Any]) -> None:
        """Refuse a passthrough state from a loader that draws another order (NOTE [ Resume ])."""
        shuffle = isinstance(self._order_sampler(), tud.RandomSampler)
        if "shuffle" in state and state["shuffle"] != shuffle:
            raise ConfigError(f"load_state_dict: the state was saved with shuffle={state['shuffle']} but this loader "
                              f"has shuffle={shuffle} (its sampler is a RandomSampler or not); the order it resumes "
                              f"would be another. Build the loader with shuffle={state['shuffle']}")
        if "seed" in state and state["seed"] != self._seed:
            none = "no generator (it draws from torch's global RNG, whose seed a state cannot know)"
            saved = f"generator seed {state['seed']}" if state["seed"] is not None else none
            mine = f"generator seed {self._seed}" if self._seed is not None else none
            raise ConfigError(f"load_state_dict: the state was saved with {saved} but this loader has {mine}; the "
                              "order it resumes would be another. Build the loader with the generator it was saved "
                              "with (generator=torch.Generator().manual_seed(seed), seeded before the loader is "
                              "built)")
        if not state["epoch_done"] and int(state["batches"]) and state.get("batch_size") != self.batch_size:
            raise ConfigError(f"load_state_dict: the state was saved {state['batches']} batches into an epoch with "
                              f"batch_size={state.get('batch_size')} but this loader has batch_size={self.batch_size}; "
                              "counted in these batches, it would train some samples twice and skip others. Load it "
                              f"into a loader with batch_size={state.get('batch_size')} (or start the epoch over "
                              "without it)")


def _class_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s class, as states record samplers."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _zero(spec: Any) -> bool:
    """A parsed ``buffer=`` that keeps nothing (``0``, ``None``, ``"0B"``, ``0.0``)."""
    return not (spec.samples or spec.nbytes or spec.fraction)


def _undriven(dataset: Any, batched: bool, mapstyle: bool, asked: str) -> str | None:
    """Why SOLAR's options are off for a dataset the loader does not drive, and what to do; None
    when there is nothing to say (a plain dataset without SOLAR's options). ``asked``: the
    SOLAR options the caller passed (``"buffer='2GiB'"``), or ``""``."""
    unused = f" ({asked} not used)" if asked else ""
    off_short = "SOLAR's schedule, buffer and read-ahead are off"
    off = f"{off_short}: this loader runs as torch's would, its batches torch's, every sample read from storage " \
          f"every epoch{unused}"
    inner = _wrapped_storage(dataset) if batched else None
    if inner is not None:
        return (f"solar.DataLoader: the dataset is a {type(dataset).__name__} of {type(inner).__name__} "
                f"{getattr(inner, 'path', '')!s} that SOLAR cannot drive, so {off}. SOLAR drives an H5Dataset "
                "(a subclass that overrides __getitem__ too), Subsets (random_split) and ConcatDatasets of these, "
                "nested in any way: torch's own classes, not subclasses, over H5Datasets that make their batches "
                "with H5Dataset's own __getitems__, with the same field names in every file, all read through "
                "parallel HDF5 or none")
    held = _held_storage(dataset) if batched and mapstyle else None
    if held is not None:
        name, inner = held
        return (f"solar.DataLoader: the dataset is a {type(dataset).__name__} holding {type(inner).__name__} "
                f"{getattr(inner, 'path', '')!s} in its attribute {name!r}; SOLAR cannot see through it, so {off}. "
                "To keep them, subclass H5Dataset and override __getitem__ (SOLAR applies it to every sample it "
                "loads), or pass the H5Dataset itself to the loader (transform= for per-sample work, collate_fn= "
                "for per-batch work)")
    if not asked:
        return None
    why = "with batch_size=None the loader is torch's (SOLAR drives batched loaders)" if not batched else \
        "an IterableDataset has no indices to plan" if not mapstyle else \
        f"the dataset is a {type(dataset).__name__}, not storage-backed (SOLAR drives solar.H5Dataset, Subsets and " \
        "ConcatDatasets of it)"
    todo = "pass batch_size= to use them" if not batched else \
        "for data in an HDF5 file, open it with solar.H5Dataset (subclass it and override __getitem__ for " \
        "per-sample work)"
    return f"solar.DataLoader: {asked} not used: {why}, so {off_short}. To use them, {todo}; otherwise leave " \
        "the option out"


def _held_storage(dataset: Any) -> tuple[str, Any] | None:
    """``(attribute, dataset)`` for a storage-backed dataset (or a Subset / ConcatDataset of one)
    that ``dataset``, which SOLAR cannot drive, holds in an attribute (directly, or among the
    first items of a list, tuple or dict there), else None: a wrapper that turned SOLAR off."""
    for name, value in list(getattr(dataset, "__dict__", {}).items()):
        items = itertools.islice(value.values(), 16) if isinstance(value, dict) else \
            value[:16] if isinstance(value, (list, tuple)) else [value]
        for item in items:
            try:
                found = item if is_storage_backed(item) else _wrapped_storage(item)
            except Exception:  # noqa: BLE001 - an attribute that fails to answer is not a dataset
                continue
            if found is not None:
                return name, found
    return None


def _wrapped_storage(dataset) -> Any:
    """The storage-backed dataset inside a torch ``Subset`` / ``ConcatDataset`` the loader cannot
    drive (NOTE [ Subsets ] in solar/subset.py, NOTE [ Several files ] in solar/concat.py), else
    None. Such wrappers hide ``fetch_stored``, so SOLAR would be silently off for them."""
    inner = [dataset.dataset] if isinstance(dataset, tud.Subset) else \
        list(dataset.datasets) if isinstance(dataset, tud.ConcatDataset) else []
    for d in inner:
        found = d if is_storage_backed(d) else _wrapped_storage(d)
        if found is not None:
            return found
    return None
