"""The epoch's order once per node: an MPI-3 shared-memory window (NOTE [ Sharded planning ]).

NOTE [ One order per node ]
    The permutation is the one O(N) array of sharded planning. The ranks of a node share one
    copy: ``comm.Split_type(MPI.COMM_TYPE_SHARED)`` groups them, and ``MPI.Win.Allocate_shared``
    gives them one buffer of two slots of N entries (int32 below 2**31 samples: 8 bytes per
    sample per node), holding the epochs a plan reads (e and e + 1). A slot is filled in place
    by one rank of the node (``torch.randperm(out=)``, :func:`solar.order.permutation_into`;
    epoch e by node rank ``e % node size``, so the O(N) cost rotates), between two barriers of
    the node: no rank still reads the old epoch when it is overwritten, and none reads the new
    one before it is whole. Which epoch a slot holds is decided alike on every rank (the same
    calls in the same order), so no rank asks another.

    ``SOLAR_NODE_RANKS=k`` splits each shared-memory node further into groups of at most ``k``
    consecutive ranks, each with its own window: for tests (two "nodes" on one machine) and for
    nodes whose memory should be split (one window per NUMA domain).

    Every call here is collective over the node's communicator and runs where SOLAR's MPI calls
    run (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py); a rank that dies in between leaves
    the others in a barrier, which NOTE [ Fail fast ] turns into an abort naming the rank.
"""

from __future__ import annotations

import os

import numpy as np

from solar.errors import ConfigError
from solar.order import index_dtype, permutation_into

__all__ = ["NodeOrder", "node_comm", "NODE_RANKS_ENV"]

NODE_RANKS_ENV = "SOLAR_NODE_RANKS"


def node_comm(comm):
    """The ranks of ``comm`` sharing this rank's memory (``COMM_TYPE_SHARED``), split into
    groups of at most ``$SOLAR_NODE_RANKS`` (collective over ``comm``)."""
    from mpi4py import MPI  # only under mpirun

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    raw = os.environ.get(NODE_RANKS_ENV, "")
    if not raw:
        return node
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        node.Free()
        raise ConfigError(f"{NODE_RANKS_ENV}={raw!r}: give the most ranks one node's window serves (an integer >= 1)")
    part = node.Split(node.rank // k, key=node.rank)
    node.Free()
    return part


class NodeOrder:
    """:class:`~solar.shardplan.OrderSource` over the node's shared window (NOTE [ One order per node ]).

    Collective over ``comm`` (creating it, :meth:`prepare`, :meth:`close`).
    """

    def __init__(self, config, comm) -> None:
        from mpi4py import MPI  # only under mpirun

        self.config = config
        self.node = node_comm(comm)
        n = config.num_samples
        self.dtype = np.dtype(index_dtype(n, config.world_size))
        size = 2 * n * self.dtype.itemsize if self.node.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(size, self.dtype.itemsize, comm=self.node)
        buf, _ = self.win.Shared_query(0)
        self.slots = np.ndarray(buffer=buf, dtype=self.dtype, shape=(2, n))
        self.epochs = [None, None]  # the epoch each slot holds, the same on every rank of the node

    @property
    def shared_bytes(self) -> int:
        return self.slots.nbytes

    def prepare(self, epochs: tuple[int, ...]) -> None:
        """Make the slots hold ``epochs`` (at most two), filling the missing ones (collective)."""
        missing = [e for e in dict.fromkeys(epochs) if e not in self.epochs]
        if not missing:
            return
        free = [s for s in (0, 1) if self.epochs[s] not in epochs]
        self.node.Barrier()  # nobody reads a slot about to change
        c = self.config
        for e, s in zip(missing, free):
            self.epochs[s] = e
            if e % self.node.size == self.node.rank:
                permutation_into(self.slots[s], c.seed, e, c.shuffle)
        self.win.Sync()
        self.node.Barrier()  # every slot is whole before anyone reads it

    def perm_at(self, epoch: int, idx: np.ndarray) -> np.ndarray:
        try:
            s = self.epochs.index(epoch)
        except ValueError:
            raise ConfigError(f"epoch {epoch}'s order is not in this node's window (it holds {self.epochs}); "
                              "NodeOrder.prepare makes it") from None
        return self.slots[s][idx]

    def close(self) -> None:
        """Free the window and the node's communicator (collective over the node)."""
        if self.win is not None:
            self.slots = None
            self.win.Free()
            self.node.Free()
            self.win = None
