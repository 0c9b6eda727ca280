"""One training run of ``solar demo``: ``python -m solar.demo.train CONFIG.json``, alone or in every
rank of ``mpirun -n P``.

Trains the small surrogate (``solar.demo.model``: diffraction -> amplitude and phase) with torch's DataLoader or with
SOLAR's, on a throttled storage model; gradients are averaged over the ranks with an MPI allreduce
(the same arithmetic on every rank, so every rank holds the same weights). Measures, per epoch, the
time the loop waited for a batch (loader-only time) and the time of its steps, and the loader's
hits, misses, bytes and requests, summed over the ranks. With ``ckpt`` it saves a job-wide SOLAR
checkpoint (model, optimizer, loader) every ``ckpt_every`` steps; ``kill_at`` makes the last rank
SIGKILL itself at that step (after the newest checkpoint committed: mpirun then ends the job);
``resume`` continues from the newest version. Rank 0 writes the figures to ``out`` as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.utils.data as tud

import solar
from solar.checkpoint import CheckpointWriter, load
from solar.demo.model import Surrogate
from solar.dist import mpi_comm
from solar.io_backends import open_backend
from solar.io_backends.throttled import ThrottledBackend
from solar.testing.baselines import PerSampleH5


@dataclass
class RunConfig:
    """What one training run does (the JSON the orchestrator writes)."""

    name: str
    loader: str  # "torch" or "solar"
    data: str  # the SOLAR HDF5 file (raw or compressed)
    val: str  # the held-out validation set: an .npz with x and y
    out: str  # the JSON of figures rank 0 writes
    norm: str = ""  # the raw training set's statistics (.npz), which the surrogate normalizes with
    epochs: int = 3
    batch_size: int = 32
    buffer: float = 0.5
    seed: int = 0
    bandwidth: float = 200e6  # bytes/s of one rank's storage share; 0: unthrottled
    latency: float = 1e-3
    lr: float = 3e-3  # Adam's learning rate
    workers: int = 1  # num_workers of torch's loader
    decoder: str = ""  # SOLAR_CODEC_DECODER for the compressed files; "" leaves the environment's choice
    ckpt: str = ""  # job-wide checkpoint root; "" saves none
    ckpt_every: int = 4
    kill_at: int = -1  # the last rank SIGKILLs itself at this step (-1: never)
    resume: bool = False


@dataclass
class Epoch:
    """One epoch's figures, summed over the ranks (times are rank 0's). Epochs are numbered from 0
    everywhere: the loop's number, the sampler's ``set_epoch``, the checkpoint's ``epoch`` and
    ``solar.DataLoader``'s ``stats.epoch``."""

    epoch: int = 0  # the number given to the sampler's set_epoch
    loader_epoch: int | None = None  # the same epoch's number in the SOLAR loader's stats (None: torch's loader)
    seconds: float = 0.0
    wait_s: float = 0.0  # time the loop waited for its batches: the loader's own time
    step_s: float = 0.0  # forward, backward, gradient allreduce, optimizer step
    ckpt_s: float = 0.0  # time the loop spent in save() (the host copy; the rest is in the background)
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    requests: int = 0


@dataclass
class Figures:
    """What a run writes: per epoch, per step and per checkpoint version."""

    name: str
    loader: str
    data: str
    seed: int
    world: int
    samples: int
    epochs: list[Epoch] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean training loss of each step, over the ranks
    first_step: int = 0  # losses[i] is step first_step + i + 1 (first_step > 0 after a resume)
    val_loss: float = float("nan")
    ckpt: list[dict] = field(default_factory=list)  # step, bytes written, logical bytes (all ranks)
    resumed_from: int | None = None
    bound: float | None = None  # SOLAR's hit-rate bound min(1, P*C/N) from epoch 1 on (its loader's stats.bound)
    loader_report: str = ""  # rank 0's loader.stats_history.report() (SOLAR's loader)


class _Comm:
    """The ranks' sums: over MPI under mpirun, the identity alone."""

    def __init__(self) -> None:
        self.mpi = mpi_comm()
        self.rank, self.size = (self.mpi.rank, self.mpi.size) if self.mpi is not None else (0, 1)

    def mean_(self, flat: np.ndarray) -> np.ndarray:
        if self.mpi is not None:
            from mpi4py import MPI  # present whenever mpi_comm() returned a communicator

            self.mpi.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        flat /= self.size
        return flat

    def sum(self, values: list[float]) -> list[float]:
        return list(self.mean_(np.asarray(values, np.float64)) * self.size)


def _storage(cfg: RunConfig, readers: int):
    """The file behind the throttle: one rank's share of a parallel file system, split evenly among
    its concurrent readers."""
    if not cfg.bandwidth:
        return open_backend(cfg.data, "hdf5")
    return ThrottledBackend(cfg.data, bandwidth=cfg.bandwidth / readers, latency=cfg.latency, inner="hdf5")


def build_loader(cfg: RunConfig, comm: _Comm):
    """torch's DataLoader over per-sample reads, or SOLAR's over ``solar.H5Dataset``; both sharded by
    the same DistributedSampler."""
    if cfg.loader == "torch":
        ds = PerSampleH5(_storage(cfg, max(1, cfg.workers)))
        sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=cfg.seed)
        return ds, tud.DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                                  persistent_workers=cfg.workers > 0)
    threads = 4
    sieve = int(cfg.latency * cfg.bandwidth / threads) if cfg.bandwidth else 64 << 10
    ds = solar.H5Dataset(cfg.data, ("x", "y"), backend=_storage(cfg, threads), io_threads=threads, sieve_bytes=sieve)
    sampler = tud.DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, seed=cfg.seed)
    return ds, solar.DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, buffer=cfg.buffer)


def _counters(ds) -> list[float]:
    if isinstance(ds, PerSampleH5):  # every read is a miss: torch's loader keeps nothing
        return [0, ds.calls // 2, ds.bytes, ds.calls]
    st = ds.stats
    return [st.hits, st.misses, st.bytes_in, st.read_calls]


def _mean_grads(model: nn.Module, comm: _Comm, loss: float) -> float:
    """Average the gradients over the ranks, the step's loss in the same allreduce (one collective
    per step: on a loaded machine each is a wait for the other ranks to be scheduled); the mean loss."""
    if comm.size == 1:
        return loss
    grads = [p.grad for p in model.parameters()]
    flat = comm.mean_(torch.cat([g.reshape(-1).double() for g in grads] + [torch.tensor([loss], dtype=torch.float64)])
                      .numpy())
    at = 0
    for g in grads:
        g.copy_(torch.from_numpy(flat[at:at + g.numel()]).view_as(g))
        at += g.numel()
    return float(flat[-1])


class Trainer:
    """The training loop of one run, with its counters and checkpoints."""

    def __init__(self, cfg: RunConfig, comm: _Comm) -> None:
        self.cfg, self.comm = cfg, comm
        self.ds, self.loader = build_loader(cfg, comm)
        torch.manual_seed(cfg.seed)
        with np.load(cfg.norm) as stats:
            self.model = Surrogate(dict(stats))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.figures = Figures(cfg.name, cfg.loader, os.path.basename(cfg.data), cfg.seed, comm.size, len(self.ds))
        self.writer = CheckpointWriter(cfg.ckpt, comm=comm.mpi, keep_last=None) if cfg.ckpt else None
        self.saves: list = []
        self.step, self.start_epoch = 0, 0

    def resume(self) -> None:
        """Model, optimizer and loader position from the newest version of the job's checkpoint."""
        state = load(self.cfg.ckpt, comm=self.comm.mpi, loader=self.loader)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.step, self.start_epoch = int(state["step"]), int(state["epoch"])
        self.figures.first_step = self.figures.resumed_from = self.step

    def _save(self, epoch: int) -> None:
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step, "epoch": epoch}
        self.saves.append(self.writer.save(state, self.step, loader=self.loader))

    def epoch(self, epoch: int) -> Epoch:
        cfg, e = self.cfg, Epoch(epoch=epoch)
        if epoch != self.start_epoch or not cfg.resume:
            self.loader.sampler.set_epoch(epoch)  # a resumed epoch keeps the one its state carries
        before = _counters(self.ds)
        t_epoch = time.perf_counter()
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            e.wait_s += t1 - t0
            self._train_step(*batch)
            e.step_s += time.perf_counter() - t1
            if self.writer is not None and self.step % cfg.ckpt_every == 0:
                t2 = time.perf_counter()
                self._save(epoch)
                e.ckpt_s += time.perf_counter() - t2
            if self.step == cfg.kill_at and self.comm.rank == self.comm.size - 1:
                self.saves[-1].result()  # the version before the kill is committed on every rank
                os.kill(os.getpid(), signal.SIGKILL)
        e.seconds = time.perf_counter() - t_epoch
        if isinstance(self.loader, solar.DataLoader):
            e.loader_epoch = self.loader.stats.epoch
        after = _counters(self.ds)
        e.hits, e.misses, e.bytes_read, e.requests = map(int, self.comm.sum([a - b for a, b in zip(after, before)]))
        return e

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        mean_loss = _mean_grads(self.model, self.comm, float(loss.detach()))
        self.opt.step()
        self.step += 1
        self.figures.losses.append(mean_loss)

    def validate(self) -> float:
        with np.load(self.cfg.val) as f:
            x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
        with torch.no_grad():
            total = sum(float(nn.functional.mse_loss(self.model(x[i:i + 64]), y[i:i + 64], reduction="sum"))
                        for i in range(0, len(x), 64))
        return total / y.numel()

    def finish(self) -> Figures:
        f = self.figures
        f.val_loss = self.validate()
        if self.writer is not None:
            results = [s.result() for s in self.saves]
            self.writer.close()
            sums = self.comm.sum([v for r in results for v in (r.bytes_written, r.logical_bytes)])
            f.ckpt = [{"step": r.step, "bytes_written": int(sums[2 * i]), "logical_bytes": int(sums[2 * i + 1])}
                      for i, r in enumerate(results)]
        if isinstance(self.loader, solar.DataLoader) and self.loader.stats is not None:
            f.bound = self.loader.stats.bound
            f.loader_report = self.loader.stats_history.report()
        return f


def main(argv: list[str]) -> int:
    cfg = RunConfig(**json.load(open(argv[0])))
    if cfg.decoder:
        os.environ["SOLAR_CODEC_DECODER"] = cfg.decoder
    torch.set_num_threads(1)
    comm = _Comm()
    trainer = Trainer(cfg, comm)
    if cfg.resume:
        trainer.resume()
    for epoch in range(trainer.start_epoch, cfg.epochs):
        trainer.figures.epochs.append(trainer.epoch(epoch))
    figures = trainer.finish()
    if comm.rank == 0:
        with open(cfg.out + ".tmp", "w") as f:
            json.dump(asdict(figures), f, indent=1)
        os.replace(cfg.out + ".tmp", cfg.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
