"""NVIDIA DALI pipelines fed by SOLAR's schedule: DALI's operators, SOLAR's I/O.

``solar.DataLoader`` decides, per step and rank, which samples this rank gets (its share of the
seeded global order, remapped so that samples in its buffer are hits), reads the misses with
coalesced range requests and decodes compressed fields. :class:`DALILoader` takes exactly those
batches and feeds them to a DALI pipeline through ``fn.external_source`` in batch mode (a
generator of per-field batches, so a short last batch stays short), then iterates the pipeline
with ``nvidia.dali.plugin.pytorch.DALIGenericIterator``. A user who wants DALI's augmentations
writes only the ``define`` function; order, buffer hits and I/O stay SOLAR's.

Example::

    import nvidia.dali.fn as fn
    from solar.dali import DALILoader

    ds = solar.H5Dataset("train.h5", ("x", "y"))
    def define(x, y):                      # DALI graph: DataNodes in, DataNodes out
        return fn.flip(x, horizontal=1), y
    loader = DALILoader(ds, batch_size=32, shuffle=True, seed=0, buffer=0.5, define=define)
    for epoch in range(10):
        loader.set_epoch(epoch)
        for batch in loader:               # {"x": tensor, "y": tensor}, like DALIGenericIterator
            ...

Each field gets a channels-first DALI layout from its sample rank (``"CHW"`` for ``(C, H, W)``), so
``fn.flip(x, horizontal=1)`` above flips the width; ``layout=`` overrides it.

Without a GPU the pipeline is CPU-only (``device_id=None``; DALI 2.4 rejects
``types.CPU_ONLY_DEVICE_ID``). With one, pass ``device_id=0`` and move data to the GPU inside
``define`` (``x.gpu()``) to run GPU operators there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from solar.dist import get_dist_info
from solar.errors import ConfigError, MissingDependencyError
from solar.loader import DataLoader

__all__ = ["DALILoader"]

_HINT = "pip install 'solar-loader[dali]' (nvidia-dali-cuda130==2.4.0; CPU pipelines need no GPU)"


def _dali():
    try:  # DALI is optional (the dali extra): solar.dali imports without it
        import nvidia.dali as dali
        import nvidia.dali.fn as fn
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as exc:
        raise MissingDependencyError(f"solar.dali needs NVIDIA DALI ({exc}); {_HINT}") from exc
    return dali, fn, DALIGenericIterator, LastBatchPolicy


def _as_numpy(t) -> np.ndarray | list[np.ndarray]:
    """One field of a batch as DALI takes it: one dense array, or (a list or tuple of per-sample
    arrays, as a list ``collate_fn`` gives) a ragged batch, one array per sample."""
    if isinstance(t, (list, tuple)):
        return [_as_numpy(a) for a in t]
    if hasattr(t, "detach"):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().numpy()
    return np.ascontiguousarray(t)


_END = object()

#: DALI layout of a sample by its rank, in torch's channels-first order (``fn.flip(horizontal=1)``
#: then flips W, the last axis). Other ranks get no layout.
_LAYOUTS = {2: "HW", 3: "CHW", 4: "CDHW"}


def _rank(value) -> int:
    shape = getattr(value, "shape", None)
    return len(shape) if shape is not None else np.ndim(value)


def _sample_ranks(dataset) -> tuple[list[int] | None, tuple[str, ...] | None, bool]:
    """``(rank of each field of one sample, its dict keys, whether a sample was looked at)``;
    ranks are None when the dataset gives no sample to look at, keys None unless samples are dicts.

    A storage-backed dataset without a transform describes its fields (no read); any other
    dataset is asked for its first sample, which is also how the number of fields of a plain
    dataset (``TensorDataset(x, y)``, no ``fields``) or of a transform's output is known before
    the pipeline is built."""
    specs = getattr(dataset, "specs", None)
    if specs and getattr(dataset, "transform", None) is None and all(hasattr(s, "sample_shape") for s in specs):
        ranks = [len(s.sample_shape) for s in specs]
        return (ranks[:1] if getattr(dataset, "_single", False) else ranks), None, False
    try:
        if isinstance(dataset, IterableDataset):
            sample = next(iter(dataset), _END)  # a separate pass over the stream, not the loader's
        else:
            sample = dataset[0] if len(dataset) else _END
    except (TypeError, NotImplementedError):  # no len() or no item access: nothing to look at
        return None, None, False
    if sample is _END:
        return None, None, False
    if isinstance(sample, Mapping):
        return [_rank(v) for v in sample.values()], tuple(str(k) for k in sample), True
    fields = sample if isinstance(sample, (tuple, list)) else (sample,)
    return [_rank(f) for f in fields], None, True


class _EpochSource:
    """Batch-mode source for ``fn.external_source``: one SOLAR epoch per run of :meth:`epoch`.

    With ``cycle="raise"`` DALI re-invokes the generator function after every reset (without it,
    a batch-mode generator source ends for good after one epoch), so each DALI epoch iterates
    the SOLAR loader once more, in the order of the loader's current epoch.

    DALI pulls ``prefetch_queue_depth`` batches ahead of the caller, so the SOLAR loader's own
    position runs ahead too. ``states`` keeps, for the batches DALI has pulled, the SOLAR state
    after each (its head: the state after the last batch the caller received), so that the
    :class:`DALILoader` can report the caller's position; ``end`` is the state once the epoch's
    loop is over. Setting ``stop`` ends the running epoch at the next pull (an abandoned epoch:
    only the batches already prefetched are left to drain)."""

    def __init__(self, loader, n_outputs: int, keys: tuple[str, ...] | None = None) -> None:
        self.loader = loader
        self.n = n_outputs
        self.keys = keys  # dict samples: the fields in this key order
        self.states: deque[dict[str, Any]] = deque()
        self.end: dict[str, Any] | None = None
        self.stop = False

    def epoch(self):
        self.states.clear()
        self.end = None
        it = iter(self.loader)
        self.states.append(self.loader.state_dict())
        while not self.stop:
            batch = next(it, _END)
            if batch is _END:
                self.end = self.loader.state_dict()
                return
            if isinstance(batch, Mapping):
                if self.keys is None or set(batch) != set(self.keys):
                    raise ConfigError(f"a batch has the keys {sorted(map(str, batch))} but the pipeline was built for "
                                      f"{list(self.keys) if self.keys else f'{self.n} unnamed field(s)'}; every sample "
                                      "must have the same fields")
                fields = tuple(batch[k] for k in self.keys)
            else:
                fields = batch if isinstance(batch, (tuple, list)) else (batch,)
            if len(fields) != self.n:
                raise ConfigError(f"a batch has {len(fields)} fields but the pipeline was built for {self.n} (from the "
                                  "dataset's fields or its first sample); every sample must have the same fields")
            arrays = []
            for i, f in enumerate(fields):
                try:
                    arrays.append(_as_numpy(f))
                except (TypeError, ValueError) as exc:
                    name = self.keys[i] if self.keys else f"field {i}"
                    raise ConfigError(f"{name} of a batch is not an array DALI can take ({type(exc).__name__}: {exc}); "
                                      "give it as a tensor or array per batch, or as a list of per-sample arrays "
                                      "(ragged) from a collate_fn") from exc
                if isinstance(arrays[-1], np.ndarray) and arrays[-1].dtype == object:
                    name = self.keys[i] if self.keys else f"field {i}"
                    raise ConfigError(f"{name} of a batch holds Python objects ({type(f).__name__}); DALI takes "
                                      "numeric arrays: return tensors or numbers from the dataset")
            self.states.append(self.loader.state_dict())
            yield tuple(arrays)


class DALILoader:
    """A DALI pipeline over the batches :class:`solar.DataLoader` plans and reads.

    Each ``iter(loader)`` starts a new epoch, as ``solar.DataLoader`` does (the one
    :meth:`set_epoch` chose, else the next), even after a ``break``: what DALI had prefetched of
    the abandoned epoch is dropped (its samples stay in the buffers, so after a ``break`` the
    rank assignment inside a global batch may differ from ``solar.DataLoader``'s; the global
    batches do not). One iterator runs at a time (DALI has one pipeline): a new
    ``iter(loader)`` ends the previous one.

    Args:
        dataset: a storage-backed dataset (:class:`solar.H5Dataset`), or any dataset
            ``solar.DataLoader`` accepts; samples are tuples of fields or one tensor. Without a
            ``fields`` attribute the number of fields is read off the first sample.
        batch_size: per-rank batch size.
        define: ``define(*fields) -> outputs``: DALI operators on the fields' DataNodes
            (default: the fields unchanged). Return one node or a tuple.
        output_map: names of the pipeline's outputs (default: the dataset's ``fields``, or the keys
            of dict samples, if ``define`` keeps their number, else ``out0, out1 ...``).
        layout: DALI layout of each field's samples (one string, or one per field; ``None``
            entries are inferred). Default from the sample's rank in torch's channels-first
            order: ``"HW"`` (2-D), ``"CHW"`` (3-D), ``"CDHW"`` (4-D), none otherwise, so that
            ``fn.flip(x, horizontal=1)`` flips the width. Pass e.g. ``"HWC"`` for channels-last data.
        device_id: ``None`` for a CPU-only pipeline (default), or a CUDA device index.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: batches DALI prepares ahead.
        pipeline_options: more ``nvidia.dali.Pipeline`` arguments (``seed``, ``exec_dynamic`` ...).
            Without a ``seed`` there, DALI's random operators are seeded from ``seed`` (below) and
            the rank when ``seed`` is given, so augmentations repeat run to run; else DALI picks.
        **loader_options: everything else goes to :class:`solar.DataLoader` (``shuffle``,
            ``seed``, ``buffer``, ``prefetch``, ``drop_last``, ``distributed`` ...). Unlike
            ``solar.DataLoader`` (whose default is False), ``distributed`` defaults to True for a
            map-style dataset without a ``sampler``/``batch_sampler``: a DALI pipeline runs per
            rank, so each takes its share (the whole dataset in one process). An
            ``IterableDataset`` is not sharded (it splits itself, if at all). With
            ``batch_sampler=``, ``batch_size`` is DALI's maximum batch size and must bound its batches.
    """

    def __init__(self, dataset, batch_size: int, *, define: Callable | None = None,
                 output_map: Sequence[str] | None = None, layout: str | Sequence[str | None] | None = None,
                 device_id: int | None = None, num_threads: int = 2, prefetch_queue_depth: int = 2,
                 pipeline_options: dict[str, Any] | None = None, **loader_options: Any) -> None:
        dali, fn, DALIGenericIterator, LastBatchPolicy = _dali()
        loader_options.setdefault("distributed", loader_options.get("sampler") is None
                                  and loader_options.get("batch_sampler") is None
                                  and not isinstance(dataset, IterableDataset))
        # torch wants batch_size=1 beside a batch_sampler; DALI still needs its maximum batch size
        by_sampler = loader_options.get("batch_sampler") is not None
        self.loader = DataLoader(dataset, batch_size=1 if by_sampler else batch_size, **loader_options)
        fields = tuple(getattr(dataset, "fields", ()) or ())
        ranks, keys, looked = _sample_ranks(dataset)
        if looked:  # a sample (a transform's output, a dict) says how many fields there are
            n_in = len(ranks)
            fields = keys or (fields if len(fields) == n_in else ())
        elif fields:
            n_in = len(fields) if not getattr(dataset, "_single", False) else 1
        else:
            n_in = len(ranks) if ranks else 1
        if ranks is not None and len(ranks) != n_in:
            ranks = None
        self.layout = self._layouts(layout, n_in, ranks)
        self._source = _EpochSource(self.loader, n_in, keys)
        opts = dict(pipeline_options or {})
        clash = sorted(set(opts) & {"batch_size", "num_threads", "device_id", "prefetch_queue_depth"})
        if clash:
            raise ConfigError(f"pipeline_options sets {', '.join(clash)}; pass them as DALILoader arguments instead")
        if "seed" not in opts and loader_options.get("seed") is not None:
            opts["seed"] = (int(loader_options["seed"]) * 1_000_003 + get_dist_info().rank) % (2**31 - 1)
        self.pipe = dali.Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                                  prefetch_queue_depth=prefetch_queue_depth, **opts)
        with self.pipe:
            nodes = fn.external_source(source=self._source.epoch, num_outputs=n_in, batch=True,
                                       cycle="raise", no_copy=False, layout=list(self.layout))
            nodes = list(nodes) if isinstance(nodes, (list, tuple)) else [nodes]
            outs = define(*nodes) if define is not None else nodes
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if not outs:
                raise ConfigError("define returned no outputs; return at least one DataNode (or a tuple of them)")
            self.pipe.set_outputs(*outs)
        if output_map is None:
            output_map = list(fields) if fields and len(fields) == len(outs) else [f"out{i}" for i in range(len(outs))]
        if len(output_map) != len(outs):
            raise ConfigError(f"output_map has {len(output_map)} names for {len(outs)} pipeline outputs")
        self.output_map = list(output_map)
        self.pipe.build()
        self._iter = DALIGenericIterator([self.pipe], self.output_map, last_batch_policy=LastBatchPolicy.PARTIAL,
                                         auto_reset=False, prepare_first_batch=False)
        self._pulled = False     # DALI has run the source since its last reset (a reset is due)
        self._active = None      # token of the newest iterator while its epoch runs
        self._state: dict[str, Any] | None = None  # reported outside an epoch; None: the loader's

    @staticmethod
    def _layouts(layout, n: int, ranks: list[int] | None) -> list[str]:
        inferred = [_LAYOUTS.get(r, "") for r in ranks] if ranks is not None else [""] * n
        if layout is None:
            return inferred
        given = [layout] if isinstance(layout, str) else list(layout)
        if len(given) != n:
            raise ConfigError(f"layout has {len(given)} entries for {n} fields; pass one layout string per field "
                              "(None to infer it)")
        out = []
        for i, (g, inf) in enumerate(zip(given, inferred)):
            if g is None:
                out.append(inf)
                continue
            if not isinstance(g, str):
                raise ConfigError(f"layout for field {i} must be a string such as 'HWC' or None, got {g!r}")
            if g and ranks is not None and len(g) != ranks[i]:
                raise ConfigError(f"layout {g!r} for field {i} does not fit its {ranks[i]}-D samples; give one "
                                  f"letter per axis (e.g. {_LAYOUTS.get(ranks[i], 'none')!r}) or None to infer it")
            out.append(g)
        return out

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose seeded order the next iteration follows (as ``DataLoader.set_epoch``)."""
        self.loader.set_epoch(epoch)

    def __iter__(self):
        self._restart()
        token = self._active = object()
        return self._batches(token)

    def _restart(self) -> None:
        """Bring DALI to the start of a new epoch, whatever the last iteration did.

        DALI resets only at the end of an epoch and keeps what it prefetched, so an epoch left
        early is ended first (:meth:`_abandon`); the reset then makes DALI call the source again,
        which iterates the SOLAR loader anew (its next epoch)."""
        if not self._pulled:
            return
        if self._active is not None and self._source.states:  # left early: the caller's position
            self._state = self._source.states[0]
        self._abandon()
        self._pulled = False
        self._iter.reset()  # DALI may prefetch the new epoch right here
        self._pulled = True

    def _abandon(self) -> None:
        """End a running epoch: the source stops pulling from the SOLAR loader and the batches DALI
        already prepared (at most ``prefetch_queue_depth``) are drained and dropped."""
        if self._active is None:
            return
        self._active = None
        self._source.stop = True
        try:
            while True:
                next(self._iter)
        except StopIteration:
            pass
        finally:
            self._source.stop = False
            self._source.states.clear()

    def _batches(self, token):
        while True:
            if self._active is not token:
                raise ConfigError("this DALILoader iterator was superseded by a newer iter(loader): DALI runs one "
                                  "pipeline, so only the newest iterator yields; iterate one at a time or build "
                                  "another DALILoader")
            self._pulled = True
            try:
                out = next(self._iter)
            except StopIteration:
                self._state = self._source.end
                self._active = None
                return
            if self._source.states:
                self._source.states.popleft()  # the head is now the state after this batch
            yield out[0]

    def state_dict(self) -> dict[str, Any]:
        """The SOLAR loader's resume state at the batches the caller received (DALI holds no
        order of its own, and what it prefetched is not counted); see NOTE [ Resume ] in
        ``solar/loader.py``."""
        if self._active is not None and self._source.states:
            return dict(self._source.states[0])
        return dict(self._state) if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next ``iter(loader)`` (a running epoch is ended here)."""
        self._abandon()
        self.loader.load_state_dict(state)
        self._state = dict(state)
