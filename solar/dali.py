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

Without a GPU the pipeline is CPU-only (``device_id=None``; DALI 2.4 rejects
``types.CPU_ONLY_DEVICE_ID``). With one, pass ``device_id=0`` and move data to the GPU inside
``define`` (``x.gpu()``) to run GPU operators there.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from solar.errors import ConfigError, MissingDependencyError

__all__ = ["DALILoader"]

_HINT = "pip install 'solar-loader[dali]' (nvidia-dali-cuda130==2.4.0; CPU pipelines need no GPU)"


def _dali():
    try:
        import nvidia.dali as dali
        import nvidia.dali.fn as fn
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as exc:
        raise MissingDependencyError(f"solar.dali needs NVIDIA DALI ({exc}); {_HINT}") from exc
    return dali, fn, DALIGenericIterator, LastBatchPolicy


def _as_numpy(t) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().numpy()
    return np.ascontiguousarray(t)


class _EpochSource:
    """Batch-mode source for ``fn.external_source``: one SOLAR epoch per run of :meth:`epoch`.

    With ``cycle="raise"`` DALI re-invokes the generator function after every reset (without it,
    a batch-mode generator source ends for good after one epoch), so each DALI epoch iterates
    the SOLAR loader once more, in the order of the loader's current epoch."""

    def __init__(self, loader, n_outputs: int) -> None:
        self.loader = loader
        self.n = n_outputs

    def epoch(self):
        for batch in self.loader:
            fields = batch if isinstance(batch, (tuple, list)) else (batch,)
            if len(fields) != self.n:
                raise ConfigError(f"the dataset gives {len(fields)} fields per sample, the pipeline expects {self.n}")
            yield tuple(_as_numpy(f) for f in fields)


class DALILoader:
    """A DALI pipeline over the batches :class:`solar.DataLoader` plans and reads.

    Args:
        dataset: a storage-backed dataset (:class:`solar.H5Dataset`), or any dataset
            ``solar.DataLoader`` accepts; samples are tuples of fields or one tensor.
        batch_size: per-rank batch size.
        define: ``define(*fields) -> outputs``: DALI operators on the fields' DataNodes
            (default: the fields unchanged). Return one node or a tuple.
        output_map: names of the pipeline's outputs (default: the dataset's ``fields`` if it has
            them and ``define`` keeps their number, else ``out0, out1 ...``).
        device_id: ``None`` for a CPU-only pipeline (default), or a CUDA device index.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: batches DALI prepares ahead.
        **loader_options: everything else goes to :class:`solar.DataLoader` (``shuffle``,
            ``seed``, ``buffer``, ``prefetch``, ``drop_last``, ``distributed`` ...). By default
            ``distributed=True`` under a launcher (this rank's share), as ``solar.DataLoader``.
    """

    def __init__(self, dataset, batch_size: int, *, define: Callable | None = None,
                 output_map: Sequence[str] | None = None, device_id: int | None = None, num_threads: int = 2,
                 prefetch_queue_depth: int = 2, **loader_options: Any) -> None:
        dali, fn, DALIGenericIterator, LastBatchPolicy = _dali()
        from solar.loader import DataLoader

        loader_options.setdefault("distributed", "sampler" not in loader_options
                                  and "batch_sampler" not in loader_options)
        self.loader = DataLoader(dataset, batch_size=batch_size, **loader_options)
        fields = tuple(getattr(dataset, "fields", ()) or ())
        n_in = len(fields) if fields and not getattr(dataset, "_single", False) else 1
        self.pipe = dali.Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                                  prefetch_queue_depth=prefetch_queue_depth)
        with self.pipe:
            nodes = fn.external_source(source=_EpochSource(self.loader, n_in).epoch, num_outputs=n_in, batch=True,
                                       cycle="raise", no_copy=False)
            nodes = list(nodes) if isinstance(nodes, (list, tuple)) else [nodes]
            outs = define(*nodes) if define is not None else nodes
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            self.pipe.set_outputs(*outs)
        if output_map is None:
            output_map = list(fields) if fields and len(fields) == len(outs) else [f"out{i}" for i in range(len(outs))]
        if len(output_map) != len(outs):
            raise ConfigError(f"output_map has {len(output_map)} names for {len(outs)} pipeline outputs")
        self.output_map = list(output_map)
        self.pipe.build()
        self._iter = DALIGenericIterator([self.pipe], self.output_map, last_batch_policy=LastBatchPolicy.PARTIAL,
                                         auto_reset=False, prepare_first_batch=False)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose seeded order the next iteration follows (as ``DataLoader.set_epoch``)."""
        self.loader.set_epoch(epoch)

    def __iter__(self):
        for out in self._iter:
            yield out[0]

    def state_dict(self) -> dict[str, Any]:
        """The SOLAR loader's resume state (DALI holds no order of its own)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
