"""Sharded planning: each rank computes only its share of the SOLAR plan (solar/schedule.py).

NOTE [ Sharded planning ]
    :class:`solar.schedule.Planner` plans every rank's steps on every rank: O(N) time and memory
    per rank, which at N = 1e8 and P = 4096 costs far more than training the rank's N/P samples.
    :class:`ShardPlanner` makes *the same plan* (bit for bit: the same batches, hits, keeps and
    evictions for every rank) with O(N/P + C) private memory and work per rank, plus a handful
    of all-to-all exchanges of O(N/P) records per epoch (:mod:`solar.exchange`):

    * **The order** (DistributedSampler's permutation, NOTE [ Global order ]) is the one O(N)
      array. Ranks read it through an :class:`OrderSource`: one copy per process
      (:class:`LocalOrder`, a single process or the in-process simulation of many ranks), one
      per node in an MPI-3 shared window (solar/nodeshare.py), or none at all (an opt-in order
      computed position by position, solar/permute.py). A rank reads only the positions it plans.
    * **Homes.** The planner state that was two N-arrays on every rank (each sample's owner and
      whether it is resident) is split by sample index: rank h is the *home* of samples
      ``[h*B, (h+1)*B)``, ``B = ceil(N/P)``, and holds their owner (int32/64) and resident bit.
    * **Steps.** Rank q plans steps ``[q*S//P, (q+1)*S//P)`` of the epoch's ``S`` steps: it reads
      those positions of the order, asks the samples' homes for owner and residency (one
      exchange each way), and assigns them with the same step-local rule as the Planner
      (``assign_pinned``: NOTE [ Pinned residency: why the bound is reached ]). Keeps go back to
      the homes. Where DistributedSampler's padding (or a resumed tail's) repeats a sample, the
      steps after each repeat are a later *part*, planned after the homes know the earlier
      part's keeps, as the Planner does. Each assignment then goes to the rank it names: every
      rank ends up with its own positions only. With S < P (few steps per epoch: 763 at
      N = 1e8, P = 4096, b = 32) some ranks plan nothing and others one step: O(G) = O(P*b)
      records, still well within the budget.
    * **Rebalancing** (NOTE [ Rebalancing with the next epoch's order ]) touches only the
      (next step, r) cells of rank r: its own residents that overflow next epoch are swapped
      for its own plain reads of unowned samples. So each rank rebalances itself, given, for
      its residents and its plain reads, the next epoch's step and this epoch's position. Those
      come from the homes: every rank sends the homes the (sample, position) pairs of its share
      of the next epoch's order and of this epoch's assignment; the homes answer each owner and
      reader. The swaps go back to the homes.
    * **Buffer model.** Each rank keeps the sorted set of samples it holds (:meth:`holds`), as
      the Planner's ``resident & owner == rank`` would say, from its own keeps and evictions.
    * **Rewind** (an early stop): the homes restore what the plan changed in their range, and
      each rank re-sends the keeps, evictions and releases of its executed steps.

    * **Posts are not kept.** A rank yields each post out of a one-element list it pops in the
      ``yield`` (``yield box.pop()``), and drops the arrays it was built from before: while an
      exchange runs, the rank's frame holds nothing it sent, so a driver may free a post once
      it has delivered it (:func:`solar.exchange.run_together` with ``spill=`` writes every
      rank's posts to a file and keeps only the records of the ranks it is delivering to).

    * **The head first.** :meth:`ShardPlanner.plan_head` plans the epoch's first steps alone, with
      three small exchanges and no next epoch's order (NOTE [ First steps ] in solar/schedule.py):
      the loader's first batch then waits for those, not for the epoch.

    Five exchanges per epoch (two more per part where padding repeats a sample): questions to
    the homes, with the next epoch's positions; their answers; the assignments to their ranks,
    with every occurrence and keep to its home; the homes' answers to owners and readers; the
    swaps. Every exchange is collective: every rank makes the same ones in the same order, posting
    nothing where it has nothing. Under MPI they run on SOLAR's MPI thread (NOTE [ SOLAR's own
    MPI traffic ] in solar/dist.py), so a rank that dies aborts the job (NOTE [ Fail fast ]).
    In one process :func:`solar.exchange.run_together` runs every rank's code in lockstep and
    hands each the records the exchange would: the same code path, the collective replaced by
    its result (``bench/plan/scale.py``, ``tests/test_scale.py``).
"""

from __future__ import annotations

import copy
import ctypes
from typing import Generator, Protocol

import numpy as np

from solar.errors import ConfigError
from solar.exchange import Post, by_rank, post
from solar.order import index_dtype, permutation_into
from solar.permute import FeistelOrder
from solar.rankplan import _HIT, _KEEP, Layout, RankPlan
from solar.schedule import PlanConfig, assign_pinned, grouped_accept, owner_of, stable_argsort

__all__ = ["ShardPlanner", "RankPlan", "OrderSource", "LocalOrder", "Layout"]

#: what a home does with a sample (in this order when one exchange carries several): kept on its
#: owner; owned by the sender and kept (an adoption, a rewind's re-applied keep); dropped by its
#: owner (a rebalancing drop, an eviction); released (no owner)
_K_KEEP, _K_ADOPT, _K_DROP, _K_RELEASE = 1, 2, 3, 4
_RESIDENT, _READ = 1, 2  # what a home tells an owner (its resident) or a reader (its plain read)
_ASK, _NEXT = 1, 2  # to a home: a question (owner, resident?), or a next-epoch position
_RESULT, _SEEN = 1, 2  # an assignment to its rank, or an occurrence (and keep) to its home


class OrderSource(Protocol):
    """DistributedSampler's permutation of an epoch, read at positions ``idx`` (< N)."""

    def perm_at(self, epoch: int, idx: np.ndarray) -> np.ndarray: ...


class LocalOrder:
    """The permutation in this process, computed once per epoch (two epochs kept: a plan reads
    epochs e and e + 1). Shared by every rank of an in-process simulation, as a node's window is."""

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self._perms: dict[int, np.ndarray] = {}

    def perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            c = self.config
            if len(self._perms) >= 2:  # the epoch farthest from this one goes
                self._perms.pop(max(self._perms, key=lambda e: abs(e - epoch)))
            dt = index_dtype(c.num_samples, c.world_size)
            if _feistel(c):
                self._perms[epoch] = FeistelOrder(c.num_samples, c.seed).perm(epoch).astype(dt)
            else:
                self._perms[epoch] = permutation_into(np.empty(c.num_samples, dt), c.seed, epoch, c.shuffle)
        return self._perms[epoch]

    def perm_at(self, epoch: int, idx: np.ndarray) -> np.ndarray:
        return self.perm(epoch)[idx]


class ShardPlanner:
    """Rank ``rank``'s planner of a sharded plan (NOTE [ Sharded planning ]).

    :meth:`plan_steps` and :meth:`rewind_steps` are generators of the exchange protocol of
    :mod:`solar.exchange`: drive every rank's with :func:`~solar.exchange.run_together` (one
    process) or each with :func:`~solar.exchange.run_mpi` (``exchange=`` set: then :meth:`plan`
    and :meth:`rewind` drive it).
    """

    rebalance: bool = True

    def __init__(self, config: PlanConfig, rank: int, order: OrderSource | None = None, exchange=None) -> None:
        if config.policy != "solar":
            raise ConfigError(f"ShardPlanner plans policy 'solar', not {config.policy!r}")
        if not 0 <= rank < config.world_size:
            raise ConfigError(f"rank {rank} is outside world size {config.world_size}")
        self.config, self.rank = config, rank
        if order is None:
            order = FeistelOrder(config.num_samples, config.seed) if _feistel(config) else LocalOrder(config)
        self.order = order
        self.exchange = exchange  # callable(gen) -> result, e.g. functools.partial(run_mpi, comm=...)
        self.dtype = index_dtype(config.num_samples, config.world_size)
        self.reset()

    def __deepcopy__(self, memo):  # a copy plans ahead: its own state, the same order and exchange
        new = copy.copy(self)
        new._own, new._res, new._held = self._own.copy(), self._res.copy(), self._held.copy()
        new._undo = None
        return new

    def reset(self) -> None:
        """Empty buffers: every home's samples owned as :func:`owner_of` says, none resident."""
        c = self.config
        self.block = -(-c.num_samples // c.world_size)
        self.home_lo = min(c.num_samples, self.rank * self.block)
        hi = min(c.num_samples, self.home_lo + self.block)
        idx = np.arange(self.home_lo, hi, dtype=self.dtype)
        self._own = owner_of(idx, c.world_size, c.batch_size, c.capacity)
        self._res = np.zeros(len(idx), bool)
        self._held = np.empty(0, self.dtype)  # samples this rank holds, sorted
        self._undo: tuple | None = None

    def nbytes(self) -> int:
        """Private bytes the planner keeps between plans (homes and the held set)."""
        return self._own.nbytes + self._res.nbytes + self._held.nbytes

    @property
    def _rebalancing(self) -> bool:
        return bool(self.rebalance and self.config.world_size > 1 and self.config.capacity)

    # -- driving -------------------------------------------------------------------------------
    def plan(self, epoch: int, start: int = 0) -> RankPlan:
        plan = self._drive(self.plan_steps(epoch, start))
        _give_back_freed_memory()
        return plan

    def rewind(self, plan: RankPlan, steps: int) -> None:
        self._drive(self.rewind_steps(plan, steps))

    def head(self, epoch: int, start: int = 0, lo: int = 0, hi: int | None = None) -> RankPlan | None:
        return self._drive(self.plan_head(epoch, start, lo, hi))

    def _drive(self, gen: Generator):
        if self.exchange is None:
            raise ConfigError("this ShardPlanner has no exchange (exchange=run_mpi over a communicator); "
                              "drive plan_steps of every rank with solar.exchange.run_together instead")
        return self.exchange(gen)

    def settle(self) -> None:
        """Forget the last plan's undo record: that plan will not be rewound (a simulation, a
        report), and its arrays go with the last reference its holder drops."""
        if self._undo is not None:
            self._undo[0].undo = None
        self._undo = None

    def holds(self, indices: np.ndarray, rank: int) -> np.ndarray:
        if rank != self.rank:
            raise ConfigError(f"rank {self.rank}'s planner knows its own buffer, not rank {rank}'s")
        idx = np.asarray(indices)
        at = np.minimum(np.searchsorted(self._held, idx), max(len(self._held) - 1, 0))
        return self._held[at] == idx if len(self._held) else np.zeros(len(idx), bool)

    # -- the epoch's positions -----------------------------------------------------------------
    def layout(self, epoch: int, start: int) -> Layout:
        c = self.config
        E, G, P = c.epoch_length, c.global_batch, c.world_size
        if start < 0 or start > E:
            raise ConfigError(f"resume position {start} is outside epoch {epoch} (0..{E})")
        n = E - start
        last = n % G
        length = pad_at = n
        if last and not (last % P == 0 and not c.drop_last_batch):
            if c.drop_last_batch:
                length = pad_at = n - last
            else:
                length = n + P - last % P
        return Layout(epoch, start, length, E, c.num_samples - start, pad_at)

    def samples_at(self, lay: Layout, p: np.ndarray) -> np.ndarray:
        """Sample at each planned position ``p`` (the Planner's ``_tail`` samples)."""
        o = np.where(p < lay.pad_at, lay.start + p, (p - lay.pad_at) % lay.order_length)
        return self.order.perm_at(lay.epoch, o % self.config.num_samples).astype(self.dtype, copy=False)

    def _share(self, n: int, unit: int = 1) -> tuple[int, int]:
        P, q = self.config.world_size, self.rank
        units = -(-n // unit)
        return min(n, units * q // P * unit), min(n, units * (q + 1) // P * unit)

    def _next_share(self, epoch: int) -> tuple[np.ndarray, np.ndarray] | None:
        """This rank's share of the next epoch's order (samples, positions), for their homes
        (rebalancing); None without rebalancing."""
        if not self._rebalancing:
            return None
        c = self.config
        npos = np.arange(*self._share(c.epoch_length), dtype=self.dtype)
        return self.order.perm_at(epoch + 1, npos % c.num_samples).astype(self.dtype, copy=False), npos

    def _home(self, samples: np.ndarray) -> np.ndarray:
        return samples // self.block

    def _rows(self, *cols) -> np.ndarray:
        """Records with one column per argument, in the plan's index dtype (each column cast as
        it is stored: no converted copy of it first)."""
        out = np.empty((len(cols[0]), len(cols)), self.dtype)
        for j, c in enumerate(cols):
            out[:, j] = c
        return out

    def _ask_homes(self, samples: np.ndarray, nxt: tuple | None = None):
        """(owner, resident) of ``samples`` from their homes: two exchanges. ``nxt``: this rank's
        share of the next epoch's order (samples, positions), delivered to the homes with the
        questions; then each home's first next-epoch position of its samples comes back too."""
        P = self.config.world_size
        ahead = nxt is not None
        cols = [np.full(len(samples), _ASK, np.int8), samples, np.zeros(len(samples), np.int8)]
        dest = self._home(samples)
        if nxt is not None:
            cols = [np.concatenate([a, b]) for a, b in zip(cols, (np.full(len(nxt[0]), _NEXT, np.int8), *nxt))]
            dest = np.concatenate([dest, self._home(nxt[0])])
        box = [post(cols, dest, P, self.dtype)]
        del cols, dest, nxt
        asked = yield box.pop()  # (nothing posted stays in the frame: NOTE [ Sharded planning ])
        rows = asked.rows
        ask = rows[:, 0] == _ASK
        local = rows[ask, 1] - self.home_lo
        source = np.repeat(np.arange(P), asked.counts)[ask]
        box = [Post(self._rows(self._own[local], self._res[local]), np.bincount(source, minlength=P))]
        first_next = None
        if ahead:
            first_next = np.full(len(self._own), -1, self.dtype)
            later = rows[~ask]
            # positions arrive ascending (by source, then as sent): the first occurrence wins
            first_next[later[::-1, 1] - self.home_lo] = later[::-1, 2]
            del later
        del asked, rows, ask, local, source
        back = yield box.pop()
        order = by_rank(self._home(samples), P)  # as the homes answered
        own = np.empty(len(samples), self._own.dtype)
        res = np.zeros(len(samples), bool)
        own[order], res[order] = back.rows[:, 0], back.rows[:, 1] != 0
        return own, res, first_next

    def _tell_homes(self, samples: np.ndarray, kind, rank=0):
        """Apply ``kind`` (``_K_*``, per sample or one for all) at the samples' homes: one exchange."""
        kinds = np.broadcast_to(np.asarray(kind), samples.shape)
        ranks = np.broadcast_to(np.asarray(rank), samples.shape)
        box = [post((samples, kinds, ranks), self._home(samples), self.config.world_size, self.dtype)]
        del samples, kinds, ranks
        got = yield box.pop()
        local, kinds, ranks = got.rows[:, 0] - self.home_lo, got.rows[:, 1], got.rows[:, 2]
        for k in (_K_KEEP, _K_ADOPT, _K_DROP, _K_RELEASE):
            m = kinds == k
            if not m.any():
                continue
            at = local[m]
            if k == _K_ADOPT:
                self._own[at] = ranks[m]
            elif k != _K_KEEP:
                self._own[at] = -1
            if k != _K_RELEASE:
                self._res[at] = k != _K_DROP

    # -- planning ------------------------------------------------------------------------------
    def plan_steps(self, epoch: int, start: int = 0):
        """Generator: this rank's :class:`RankPlan` of ``epoch`` from ``start`` (see the class)."""
        c = self.config
        P, G, q = c.world_size, c.global_batch, self.rank
        lay = self.layout(epoch, start)
        prepare = getattr(self.order, "prepare", None)  # a node's window: collective (NOTE [ One order per node ])
        if prepare is not None:
            prepare((epoch, epoch + 1) if self._rebalancing else (epoch,))
        lo, hi = self._share(lay.length, G)  # whole steps
        pos = np.arange(lo, hi, dtype=self.dtype)
        samples = self.samples_at(lay, pos)
        before = (self._own.copy(), self._res.copy(), self._held)
        own, res, first_next = yield from self._ask_homes(samples, self._next_share(epoch))
        rank = np.full(len(pos), -1, own.dtype)
        flags = np.zeros(len(pos), np.uint8)
        parts = lay.parts(G)
        for i, (a, b) in enumerate(parts):
            s, e = (int(np.clip(x - lo, 0, len(pos))) for x in (a, b))
            if i:  # a later part sees the keeps of the earlier ones (repeats: NOTE [ Resumed tail ])
                res[s:e] = (yield from self._ask_homes(samples[s:e]))[1]
            if e > s:
                r, h, k = assign_pinned(samples[s:e], G, P, own[s:e], res[s:e])
                rank[s:e], flags[s:e] = r, h * _HIT | k * _KEEP
            if i < len(parts) - 1:  # (the last part's keeps travel with the assignment)
                yield from self._tell_homes(samples[s:e][(flags[s:e] & _KEEP) != 0], _K_KEEP)
        del own, res
        # each assignment to the rank it names, each occurrence (with its keep) to its home
        n = len(pos)
        cols = (np.repeat(np.array([_RESULT, _SEEN], np.int8), n), np.concatenate([pos, samples]),
                np.concatenate([samples, pos]), np.concatenate([flags, rank]),
                np.concatenate([np.zeros(n, np.uint8), flags]))
        box = [post(cols, np.concatenate([rank, self._home(samples)]), P, self.dtype)]
        del cols, pos, samples, rank, flags
        got = yield box.pop()
        mine = got.rows[got.rows[:, 0] == _RESULT]
        seen = got.rows[got.rows[:, 0] == _SEEN, 1:]  # (sample, position, rank, flags)
        del got  # (a view would keep the whole receive buffer)
        self._res[seen[(seen[:, 3] & _KEEP) != 0, 0] - self.home_lo] = True
        plan = RankPlan(lay, G, P, q, mine[:, 1].copy(), mine[:, 2].copy(), mine[:, 3].astype(np.uint8))
        del mine
        plan.twins = self._twin_steps(lay)
        if self._rebalancing:
            box = [self._home_answers(seen, first_next)]
            del seen, first_next
            yield from self._rebalance(plan, box)
        else:
            del seen
        keep = (plan.flags & _KEEP) != 0
        self._held = _held_after(before[2], plan.samples[keep], plan.evict_sample)
        changed = np.flatnonzero((before[0] != self._own) | (before[1] != self._res)).astype(self.dtype)
        self._undo = (plan, changed, before[0][changed], before[1][changed])
        plan.undo = before[2]
        return plan

    def head_cuts(self, epoch: int, start: int = 0) -> list[int]:
        """The steps where the pieces of the epoch's head begin and end (NOTE [ First steps ] in
        solar/schedule.py): ``[0, first_steps, 4 * first_steps, ..., head]``, or ``[]`` where the
        epoch has no head. Local: the same on every rank without asking."""
        c = self.config
        G = c.global_batch
        lay = self.layout(epoch, start)
        head = min(c.head_steps * G, lay.parts(G)[0][1] if lay.length else 0) // G  # before any repeat
        if head == 0 or head * G >= lay.length:
            return []
        cuts = [0, min(head, max(1, c.first_steps))]
        while cuts[-1] < head:
            cuts.append(min(head, 4 * cuts[-1]))
        return cuts

    def plan_head(self, epoch: int, start: int = 0, lo: int = 0, hi: int | None = None):
        """Generator (collective): this rank's :class:`RankPlan` of steps ``lo`` to ``hi`` (the
        whole head by default) of the epoch's head (:meth:`head_cuts`), the same as
        :meth:`plan_steps` gives for them (NOTE [ First steps ] in solar/schedule.py), or None
        where the epoch has no head (decided alike on every rank, before any exchange). The plan
        lists those steps only (``iter_steps(rank, lo)``). Changes nothing: :meth:`plan_steps`
        still plans the whole epoch."""
        c = self.config
        P, G = c.world_size, c.global_batch
        lay = self.layout(epoch, start)
        cuts = self.head_cuts(epoch, start)
        if not cuts:
            return None
        hi = cuts[-1] if hi is None else min(hi, cuts[-1])
        prepare = getattr(self.order, "prepare", None)
        if prepare is not None:
            prepare((epoch,))
        a, b = self._share((hi - lo) * G, G)
        pos = np.arange(lo * G + a, lo * G + b, dtype=self.dtype)
        samples = self.samples_at(lay, pos)
        own, res, _ = yield from self._ask_homes(samples)
        rank, flags = np.zeros(len(pos), own.dtype), np.zeros(len(pos), np.uint8)
        if len(pos):
            rank, hit, keep = assign_pinned(samples, G, P, own, res)
            flags = hit * _HIT | keep * _KEEP
        box = [post((pos, samples, flags), rank, P, self.dtype)]
        del pos, samples, rank, flags, own, res
        mine = (yield box.pop()).rows
        plan = RankPlan(lay._replace(length=hi * G), G, P, self.rank, mine[:, 0].copy(), mine[:, 1].copy(),
                        mine[:, 2].astype(np.uint8))
        plan.twins = self._twin_steps(lay)
        return plan

    def _twin_steps(self, lay: Layout) -> np.ndarray:
        """``EpochPlan.twin_steps`` from the only positions a repeat can be at: the order's head
        (copied by the padding) and the padded tail, O(P) of them."""
        c = self.config
        G = c.global_batch
        out = np.full(lay.steps(G), -1, dtype=np.int64)
        copied = max(c.per_rank * c.world_size - c.num_samples, lay.length - lay.pad_at)
        head = np.arange(0, min(lay.length, max(0, copied - lay.start)))
        tail = np.arange(max(0, min(lay.first_dup, lay.pad_at)), lay.length)
        at = np.union1d(head, tail).astype(self.dtype)
        if not len(at):
            return out
        s = self.samples_at(lay, at)
        o = np.lexsort((at, s))
        s, at = s[o], at[o]
        same = np.flatnonzero(s[1:] == s[:-1])
        np.maximum.at(out, at[same + 1] // G, (at[same] // G).astype(np.int64))
        return out

    def _rebalance(self, plan: RankPlan, box: list[Post]):
        """NOTE [ Rebalancing with the next epoch's order ], for this rank's (next step, rank) cells:
        the homes' answers to the owners and readers (``box``: :meth:`_home_answers`) go out (one
        exchange), the swaps go back (another)."""
        told = yield box.pop()
        moves = self._swap(plan, told.rows)
        del told
        yield from self._tell_homes(moves[0], moves[1], self.rank)

    def _home_answers(self, seen: np.ndarray, first_next: np.ndarray) -> Post:
        """What this home tells each owner about its residents and each reader about its plain
        reads of unowned samples: ``(kind, sample, next step, position this epoch)``; ``seen``:
        every occurrence of its samples this epoch (sample, position, rank, flags)."""
        G, n = self.config.global_batch, len(self._own)
        local = seen[:, 0] - self.home_lo
        once = np.bincount(local, minlength=n) == 1
        last_pos = np.full(n, -1, self.dtype)
        last_pos[local] = seen[:, 1]  # the last occurrence (only once-seen samples are swapped)
        reader = np.full(n, -1, self.dtype)
        reader[local] = seen[:, 2]
        plain = np.zeros(n, bool)
        plain[local] = (seen[:, 3] & (_HIT | _KEEP)) == 0
        next_step = np.where(first_next >= 0, first_next // G, -1).astype(self.dtype, copy=False)
        res = np.flatnonzero(self._res & (next_step >= 0))
        read = np.flatnonzero(plain & once & (self._own < 0) & (next_step >= 0))
        at = np.concatenate([res, read])
        kind = np.concatenate([np.where(once[res], _RESIDENT, -_RESIDENT), np.full(len(read), _READ)])
        cols = (kind, at + self.home_lo, next_step[at], last_pos[at])
        return post(cols, np.concatenate([self._own[res], reader[read]]), self.config.world_size, self.dtype)

    def _swap(self, plan: RankPlan, told: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The swaps of this rank's cells: edits ``plan``; returns (samples, ``_K_*``) for the homes."""
        c = self.config
        G, q = c.global_batch, self.rank
        none = (np.empty(0, self.dtype), np.empty(0, self.dtype))
        res = told[np.abs(told[:, 0]) == _RESIDENT]
        # by sample, as the Planner's flatnonzero (np.take: numpy gathers rows of a 2-D array by
        # an index array one element at a time, several times slower)
        res = np.take(res, stable_argsort(res[:, 1]), axis=0)
        room = _quota_column(c.epoch_length, G, c.world_size, q)
        room -= np.bincount(res[:, 2], minlength=len(room))
        if room.min(initial=0) >= 0:
            return none
        this_step = np.where(res[:, 3] >= 0, res[:, 3] // G, -1)
        m = (room[res[:, 2]] < 0) & (res[:, 0] == _RESIDENT) & (this_step >= c.head_steps)  # NOTE [ First steps ]
        cand, cell, t_step, t_pos = res[m, 1], res[m, 2], this_step[m], res[m, 3]
        o = np.lexsort((t_step, cell))
        cand, cell, t_step, t_pos = cand[o], cell[o], t_step[o], t_pos[o]
        acc = grouped_accept(np.arange(len(cand)), cell, -np.minimum(room, 0))
        d, d_step, d_pos = cand[acc], t_step[acc], t_pos[acc]
        reads = told[told[:, 0] == _READ]
        reads = np.take(reads, stable_argsort(reads[:, 3]), axis=0)  # by position
        reads = reads[room[reads[:, 2]] > 0]
        if not len(reads) or not len(d):
            return none
        o = np.argsort(d_step, kind="stable")
        d, d_step, d_pos = d[o], d_step[o], d_pos[o]
        r_pos, r_sample, r_cell = reads[:, 3], reads[:, 1], reads[:, 2]
        r_step = r_pos // G
        # drop i takes the first unused read at or after its own step: j_i = max(earliest_i, j_{i-1} + 1)
        earliest = np.searchsorted(r_step, d_step, side="left")
        j = np.maximum.accumulate(earliest - np.arange(len(d))) + np.arange(len(d))
        m = j < len(r_pos)
        d, d_pos, j = d[m], d_pos[m], j[m]
        fits = grouped_accept(np.arange(len(j)), r_cell[j], room)
        d, d_pos, j = d[fits], d_pos[fits], j[fits]
        plan.flags[np.searchsorted(plan.pos, r_pos[j])] |= _KEEP
        at = np.minimum(np.searchsorted(plan.pos, d_pos), max(len(plan.pos) - 1, 0))
        loaded_now = (plan.pos[at] == d_pos) & ((plan.flags[at] & _KEEP) != 0) if len(plan.pos) else d_pos < 0
        plan.flags[at[loaded_now]] &= ~np.uint8(_KEEP)
        plan.evict_step = r_step[j][~loaded_now].astype(np.int64)
        plan.evict_sample = d[~loaded_now].astype(np.int64)
        plan.release_sample = d[loaded_now].astype(np.int64)
        plan.release_step = r_step[j][loaded_now].astype(np.int64)
        samples = np.concatenate([r_sample[j], d])
        return samples, np.concatenate([np.full(len(j), _K_ADOPT), np.full(len(d), _K_DROP)]).astype(self.dtype)

    def rewind_steps(self, plan: RankPlan, steps: int):
        """Generator (collective): make the residency what ``plan``'s first ``steps`` steps leave
        (``Planner.rewind``; every rank rewinds to the same ``steps``)."""
        if plan.undo is None or self._undo is None or self._undo[0] is not plan:
            raise ConfigError("this plan has no undo record: only the last plan made can be rewound, once")
        _, changed, own0, res0 = self._undo
        self._own[changed], self._res[changed] = own0, res0
        p = min(steps * plan.global_batch, plan.layout.length)
        kept = ((plan.flags & _KEEP) != 0) & (plan.pos < p)
        gone = plan.evict_step < steps
        released = plan.release_step < steps
        samples = np.concatenate([plan.samples[kept], plan.evict_sample[gone], plan.release_sample[released]])
        kinds = np.repeat([_K_ADOPT, _K_DROP, _K_RELEASE], [kept.sum(), gone.sum(), released.sum()])
        yield from self._tell_homes(samples.astype(self.dtype), kinds, self.rank)
        self._held = _held_after(plan.undo, plan.samples[kept], plan.evict_sample[gone])
        plan.undo, self._undo = None, None


def _held_after(held: np.ndarray, kept: np.ndarray, evicted: np.ndarray) -> np.ndarray:
    """The sorted set ``held | kept - evicted`` (a sort of the C + keeps samples, no hashing)."""
    out = np.concatenate([held, kept.astype(held.dtype, copy=False)])
    out.sort()
    if len(out):
        out = out[np.concatenate([[True], out[1:] != out[:-1]])]
    return out[~np.isin(out, evicted)] if len(evicted) else out


def _give_back_freed_memory() -> None:
    """Return the heap's free memory to the system (glibc ``malloc_trim``; elsewhere nothing).

    Why: a plan's exchanges allocate and free arrays of O(N/P) records several times; glibc
    keeps such freed blocks in the process's heap (its mmap threshold grows with them), so a
    rank would keep the planning peak resident between plans instead of what it holds."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _feistel(config: PlanConfig) -> bool:
    return config.order == "feistel" and config.shuffle


def _quota_column(n: int, G: int, P: int, rank: int) -> np.ndarray:
    """``step_quota(n, G, P)[:, rank]`` without the other ranks' columns."""
    S = -(-n // G)
    quota = np.full(S, G // P, dtype=np.int64)
    last = n - (S - 1) * G
    if S and last != G:
        quota[-1] = last // P + (rank < last % P)
    return quota
