"""The SOLAR schedule: which rank gets which sample of each global mini-batch, and what each rank keeps.

The global order it starts from (DistributedSampler's) is :mod:`solar.order`'s
(NOTE [ Global order ] there).

A plan is a pure function of ``(N, P, b, C, seed, epoch, shuffle, drop_last)`` plus the buffers'
contents when the run started (empty), so every rank computes the same plan without talking to
the others (no MPI, no storage). Epochs are planned one at a time in O(N) time and memory; no
E x N list exists anywhere.

NOTE [ Pinned residency: why the bound is reached ]
    With a fresh permutation every epoch, any policy hits at most ``min(1, P*C/N)`` of the
    accesses (every reuse crosses one epoch boundary, when at most ``P*C`` samples are resident).
    The ``solar`` policy reaches it: sample ``i < P*C`` is *owned* by one rank, a pure function
    of ``i`` (:func:`owner_of`); the owner keeps it from the first time it reads it, forever.
    In every step each rank first takes its resident owned samples (hits), then its owned samples
    not yet resident (read once, then kept), up to its ``b`` slots; everything else (including the
    rare overflow when a rank owns more than ``b`` of a step's samples) fills the free slots in
    sample-index order, so adjacent indices land on the same rank and coalesce into longer range
    reads. Owners are laid out in blocks of ``b`` consecutive indices (``(i // b) % P``), so with
    ``shuffle=False`` every step of the owned prefix is perfectly balanced and contiguous.
    Residency never needs the future order, which is also why the dataset can decide hits online
    ("is it in my buffer?") and keeps ("do I own it?") and always agree with the plan.

NOTE [ Rebalancing with the next epoch's order ]
    A fixed owner per sample loses the hits a rank cannot take because more than ``b`` of its
    residents fall in one step (a binomial tail: large for small ``b`` or ``P*C/N`` near 1). The
    plan knows the next epoch's order, so while planning epoch ``e`` it finds the residents that
    would overflow in epoch ``e+1`` and swaps each for a sample its owner *reads anyway* in epoch
    ``e`` (a plain miss, at or after the dropped sample's last use in ``e``) that lands in a step of
    ``e+1`` where that rank has room: the owner evicts one and keeps the other. Capacity never
    grows, no hit of epoch ``e`` is lost, and the plan lists the evictions so each rank's buffer
    follows them exactly. If the next epoch turns out different, nothing becomes invalid.

NOTE [ First steps ]
    An epoch's plan needs the whole epoch (the rebalancing pairs residents with reads anywhere in
    it, by the next epoch's order): with a sharded plan at N = 2e7 that is seconds before the
    first batch wherever no plan was made ahead (the first epoch, a resumed run). The assignment
    itself is step-local (:func:`assign_pinned`): a step needs only the owners and residency of
    its own samples, as the epoch starts. So the rebalancing leaves the epoch's first
    :attr:`PlanConfig.head_steps` steps alone (it drops residents used from that step on; each
    drop's adoption is at or after its step): the plan of those steps is the pinned one, and
    ``ShardPlanner.plan_head`` makes any run of them with three exchanges of O(steps * G / P)
    records, without the next epoch's order.

    A sharded plan's head (``long_head``) is an eighth of the epoch, in pieces each four times
    the last; the first (:attr:`PlanConfig.first_steps`) covers the loader's first two passes
    (NOTE [ First batch ] in solar/passes.py). The planning thread makes the pieces, then the
    whole plan, while the loader trains (solar/firststeps.py): the first batch waits for the
    first piece, a later step only where an eighth of the epoch trains faster than the plan is
    made. Rebalancing then works on seven eighths of the epoch (the hit rate keeps its bound:
    tests/test_scale_firststeps.py). Otherwise the head is the first piece alone.

NOTE [ Resumed tail ]
    A run resumed with another world size ``P`` (or per-rank batch) continues from a global
    position saved under the old ``G``, so its last step may hold a count of positions that ``P``
    does not divide, or fewer than ``P``: some rank would get an empty batch (torch's collate
    raises, the other ranks wait forever in their next collective). DistributedSampler never
    yields unequal per-rank counts, so neither does the plan: the last step is padded to a
    multiple of ``P`` with the epoch's head, as DistributedSampler pads an epoch, or, with
    DataLoader's ``drop_last=True``, dropped, as every rank's batch in it is partial. Without a
    change of world size or batch the last step is already whole and nothing changes.

:class:`Planner` plans the ``solar`` policy; the baselines (``policy="lru"``/``"fifo"``) are
simulated by :class:`solar.testing.baselines.BaselinePlanner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from solar.errors import ConfigError
from solar.order import epoch_positions, global_order, index_dtype, sampler_num_samples  # noqa: F401 (re-exported)
from solar.ownership import capacity_for_bytes, owner_of  # noqa: F401 (re-exported)
from solar.permute import FeistelOrder

__all__ = ["PlanConfig", "EpochPlan", "Planner", "global_order", "index_dtype", "sampler_num_samples",
           "epoch_positions", "owner_of", "capacity_for_bytes", "POLICIES"]

POLICIES = ("solar", "lru", "fifo")
#: samples per rank in the first piece of an epoch's head (NOTE [ First steps ])
HEAD_SAMPLES = 96
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class PlanConfig:
    """Everything a plan depends on.

    Args:
        num_samples: N, the dataset length.
        world_size: P, number of ranks.
        batch_size: b, samples per rank per step.
        capacity: C, samples each rank's buffer may keep.
        seed: the DistributedSampler seed (the order of epoch e uses ``seed + e``).
        shuffle: DistributedSampler's ``shuffle``.
        drop_last: DistributedSampler's ``drop_last`` (truncate instead of padding).
        drop_last_batch: DataLoader's ``drop_last`` (drop each rank's last partial batch).
        policy: ``"solar"`` (pinned residency + remap every step; :class:`Planner`), or the
            baselines ``"lru"`` and ``"fifo"`` (:class:`solar.testing.baselines.BaselinePlanner`).
        order: ``"torch"`` (DistributedSampler's), or ``"feistel"``: not torch's order, one no
            rank materializes (NOTE [ Feistel order ] in solar/permute.py).
        long_head: the head is an eighth of the epoch (a sharded plan's: NOTE [ First steps ]).
    """

    num_samples: int
    world_size: int = 1
    batch_size: int = 1
    capacity: int = 0
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    drop_last_batch: bool = False
    policy: str = "solar"
    order: str = "torch"
    long_head: bool = False

    def __post_init__(self) -> None:
        N, P, b, C = self.num_samples, self.world_size, self.batch_size, self.capacity
        for name, value in (("num_samples", N), ("world_size", P), ("batch_size", b)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(C, (int, np.integer)) or C < 0:
            raise ConfigError(f"buffer capacity must be >= 0 samples per rank, got {C!r}; "
                              "pass 0 to disable the buffer")
        # plans index int64 arrays with these, and torch seeds its generator with seed + epoch
        for name, value in (("num_samples", N), ("world_size", P), ("batch_size", b), ("buffer capacity", C)):
            if value > INT64_MAX:
                raise ConfigError(f"{name} must be at most 2**63-1 (int64), got {value}; use a realistic size")
        seed = self.seed
        if not isinstance(seed, (int, np.integer)) or not -INT64_MAX - 1 <= seed <= INT64_MAX:
            raise ConfigError(f"seed must be an integer in [-2**63, 2**63-1] (int64, so that seed + epoch stays within "
                              f"what torch.Generator.manual_seed accepts), got {seed!r}; use a smaller seed")
        if self.policy not in POLICIES or self.order not in ("torch", "feistel"):
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)} (got {self.policy!r}) and order "
                              f"'torch' or 'feistel' (got {self.order!r})")
        if self.drop_last and N < P:
            raise ConfigError(f"drop_last=True with {N} samples and world size {P} leaves no sample; "
                              "use fewer ranks or drop_last=False")
        if self.per_rank < b:
            what = ("and drop_last=True would drop them all" if self.drop_last_batch else
                    "so the batch is larger than the dataset and every step would be one partial batch")
            raise ConfigError(f"each of {P} rank(s) gets {self.per_rank} samples per epoch (N={N}), fewer than "
                              f"batch_size={b}, {what}; use batch_size <= {self.per_rank}")

    @property
    def per_rank(self) -> int:
        return sampler_num_samples(self.num_samples, self.world_size, self.drop_last)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    @property
    def epoch_length(self) -> int:
        """Positions of the global order an epoch consumes (after DataLoader's drop_last)."""
        return epoch_positions(self.per_rank, self.world_size, self.batch_size, self.drop_last_batch)

    def steps_per_epoch(self) -> int:
        n = self.per_rank
        return n // self.batch_size if self.drop_last_batch else -(-n // self.batch_size)

    @property
    def first_steps(self) -> int:  # the head's first piece: the first two passes (NOTE [ First steps ])
        return min(max(3, HEAD_SAMPLES // self.batch_size), self.steps_per_epoch() // 8)

    @property
    def head_steps(self) -> int:  # the first steps of an epoch the rebalancing leaves alone
        return self.steps_per_epoch() // 8 if self.long_head else self.first_steps

    @property
    def bound(self) -> float:
        """The physical hit-rate limit for fresh permutations: ``min(1, P*C/N)``."""
        return min(1.0, self.world_size * self.capacity / self.num_samples)


@dataclass
class EpochPlan:
    """One epoch's assignment, from global position ``start`` on (``start > 0`` after a resume).

    Arrays are indexed by position ``p - start`` in the epoch's global order; steps are
    consecutive runs of ``G`` positions from ``start``.
    """

    epoch: int
    start: int
    global_batch: int
    world_size: int
    samples: np.ndarray  # sample index per position
    rank: np.ndarray  # assigned rank per position
    hit: np.ndarray  # bool: served from that rank's buffer
    keep: np.ndarray  # bool: read and kept in that rank's buffer
    #: evictions: at step ``evict_step[i]`` rank ``evict_rank[i]`` drops ``evict_sample[i]`` (before
    #: that step's keeps); only the solar policy's rebalancing evicts
    evict_step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    evict_rank: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    evict_sample: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    #: samples the rebalancing released when they were first read this epoch (not kept; no
    #: evict), and the step of the adoption that takes over each one's ownership
    release_sample: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    release_step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    #: the planner state this plan changed, as it was before: (samples, resident, owner)
    undo: tuple | None = field(default=None, repr=False)
    _by_rank: dict = field(default_factory=dict, repr=False)

    @property
    def num_steps(self) -> int:
        return -(-len(self.samples) // self.global_batch)

    @property
    def misses(self) -> int:
        return int(len(self.hit) - self.hit.sum())

    @property
    def hit_rate(self) -> float:
        return float(self.hit.mean()) if len(self.hit) else 0.0

    def step_slice(self, k: int) -> slice:
        return slice(k * self.global_batch, min((k + 1) * self.global_batch, len(self.samples)))

    def rank_steps(self, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s batches (sample indices, global-order order), one array per step."""
        if not self.num_steps:
            return []
        if rank not in self._by_rank:
            pos = np.flatnonzero(self.rank == rank)
            bounds = np.searchsorted(pos, np.arange(1, self.num_steps) * self.global_batch)
            self._by_rank[rank] = [self.samples[p] for p in np.split(pos, bounds)]
        return self._by_rank[rank]

    def rank_actions(self, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per step, what ``rank``'s buffer does: ``(samples it holds after reading, samples to evict)``.

        The first array is the step's keeps *and* its planned hits: a planned hit the buffer
        does not have after all (a put the byte budget refused, an eviction by read-ahead past
        an early stop) is then read and put back, instead of being read again every epoch.
        """
        pos = np.flatnonzero((self.rank == rank) & (self.keep | self.hit))
        cuts = np.arange(1, self.num_steps) * self.global_batch
        keeps = np.split(self.samples[pos], np.searchsorted(pos, cuts)) if self.num_steps else []
        mine = np.flatnonzero(self.evict_rank == rank)
        mine = mine[np.argsort(self.evict_step[mine], kind="stable")]
        evicts = np.split(self.evict_sample[mine], np.searchsorted(self.evict_step[mine], np.arange(1, self.num_steps)))
        # a hit may be the step's eviction (served first, then dropped): not held afterwards
        return [(np.setdiff1d(k, e) if len(e) else k, e) for k, e in zip(keeps, evicts)]

    def twin_steps(self) -> np.ndarray:
        """Per step, the latest step at or before it that holds one of its samples again (-1: none).

        A sample appears more than once in an epoch only through DistributedSampler's padding
        (the head of the order repeated at the tail). A pass over steps ``k0..k1`` reads some
        sample twice, possibly on two ranks, iff ``twin_steps()[k0:k1 + 1].max() >= k0``.
        """
        out = np.full(self.num_steps, -1, dtype=np.int64)
        s = self.samples
        if not len(s):
            return out
        # Only the few positions holding a repeated sample are sorted (an argsort of all N would
        # dominate planning): a scatter finds each sample's first position (the last write of a
        # reversed scatter wins), the positions that are not it are the repeats.
        pos = np.arange(len(s), dtype=index_dtype(len(s)))
        first = np.empty(int(s.max()) + 1, dtype=pos.dtype)
        first[s[::-1]] = pos[::-1]
        again = first[s] != pos
        if not again.any():
            return out
        repeated = np.zeros(len(first), dtype=bool)
        repeated[s[again]] = True
        cand = np.flatnonzero(repeated[s])  # every position of a repeated sample, in order
        order = cand[np.argsort(s[cand], kind="stable")]  # equal samples stay in position order
        same = np.flatnonzero(s[order][1:] == s[order][:-1])
        np.maximum.at(out, order[same + 1] // self.global_batch, order[same] // self.global_batch)
        return out

    def read_calls(self) -> int:
        """Coalesced range reads this epoch needs: runs of consecutive indices per (step, rank)."""
        miss = np.flatnonzero(~self.hit)
        if not len(miss):
            return 0
        key = (miss // self.global_batch) * self.world_size + self.rank[miss]
        s = self.samples[miss]
        o = np.lexsort((s, key))
        key, s = key[o], s[o]
        new = np.ones(len(s), dtype=bool)
        new[1:] = (key[1:] != key[:-1]) | (s[1:] > s[:-1] + 1)
        return int(new.sum())

    def to_dump(self) -> dict:
        """``{"epoch": e, "steps": [[[[index, hit], ...] per rank] per step]}`` for ``solar plan --dump``."""
        steps = []
        for k in range(self.num_steps):
            sl = self.step_slice(k)
            r, s, h = self.rank[sl], self.samples[sl], self.hit[sl]
            o = np.argsort(r, kind="stable")  # group by rank once (a mask per rank would be O(G * P))
            cut = np.searchsorted(r[o], np.arange(self.world_size + 1))
            pairs = list(zip(s[o].tolist(), h[o].tolist()))
            steps.append([[[i, bool(x)] for i, x in pairs[a:b]] for a, b in zip(cut[:-1], cut[1:])])
        return {"epoch": self.epoch, "steps": steps}


def step_quota(n: int, G: int, P: int) -> np.ndarray:
    """Per (step, rank) slot counts for ``n`` positions in steps of ``G``: ``b`` each, and the
    last partial step split as evenly as possible (equal unless a resume changed the world size)."""
    S = -(-n // G)
    quota = np.full((S, P), G // P, dtype=np.int64)
    last = n - (S - 1) * G
    if S and last != G:
        quota[-1] = last // P
        quota[-1, : last % P] += 1
    return quota


def grouped_accept(items: np.ndarray, key: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Mask over ``items`` (in priority order): per ``key``, the first ``free[key]`` are accepted."""
    o = np.argsort(key, kind="stable")
    k = key[o]
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(len(k)), 0))
    ok = np.zeros(len(k), dtype=bool)
    ok[o] = (np.arange(len(k)) - start) < free[k]
    return ok


def stable_argsort(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")``, faster where the keys are distinct, as they mostly
    are where it is used: numpy sorts wide integers stably by a merge sort, several times slower
    on shuffled keys than its introsort, and an unstable sort of distinct keys gives the same
    order. Equal keys (checked after the sort, in O(n)) fall back to the stable sort."""
    o = np.argsort(key)
    s = key[o]
    if len(s) > 1 and (s[1:] == s[:-1]).any():
        return np.argsort(key, kind="stable")
    return o


def _by_cell(key: np.ndarray, resident: np.ndarray, cells: int) -> np.ndarray:
    """``np.lexsort((~resident, key))`` (``key`` < ``cells``): one sort of distinct int64 keys
    (cell, resident first, index) where they fit, instead of two stable passes."""
    n = len(key)
    if 2 * cells * n >= 1 << 62:
        return np.lexsort((~resident, key))
    wide = key.astype(np.int64) * 2 + ~resident
    wide *= n
    wide += np.arange(n, dtype=np.int64)
    return np.argsort(wide)


def assign_pinned(samples: np.ndarray, G: int, P: int, owner: np.ndarray, resident: np.ndarray):
    """Per position of a run of whole steps (the last may be partial): (rank, hit, keep), from
    each sample's ``owner`` and whether it is ``resident`` there. Step-local, so any run of steps
    gets what the whole epoch gets for them (NOTE [ Sharded planning ] in solar/shardplan.py).
    See NOTE [ Pinned residency: why the bound is reached ]."""
    n = len(samples)
    step = np.arange(n, dtype=samples.dtype) // G
    quota = step_quota(n, G, P)
    own = owner
    rank = np.full(n, -1, dtype=owner.dtype)
    hit = np.zeros(n, dtype=bool)
    keep = np.zeros(n, dtype=bool)
    dt = samples.dtype
    cand = np.flatnonzero(own >= 0).astype(dt)  # narrowed at once: arrays of up to n entries
    if len(cand):
        res = resident[cand]
        key = step[cand] * P + own[cand]
        o = _by_cell(key, res, quota.size)  # per (step, owner): resident first, then by position
        cand, key, res = cand[o], key[o], res[o]
        del o
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        at = np.arange(len(key), dtype=dt)
        start = np.maximum.accumulate(np.where(first, at, 0))
        del first
        ok = (at - start) < quota.reshape(-1)[key]
        del at, start
        acc = cand[ok]
        rank[acc] = own[acc]
        hit[acc] = res[ok]
        keep[acc] = ~res[ok]
        taken = np.bincount(key[ok], minlength=quota.size)
    else:
        taken = np.zeros(quota.size, dtype=np.int64)
    free = quota.reshape(-1) - taken
    left = np.flatnonzero(rank < 0).astype(dt)
    key = step[left].astype(np.int64) * (int(samples.max(initial=0)) + 1) + samples[left]  # int64: no overflow
    left = left[stable_argsort(key)]  # index order per step
    del key
    rank[left] = np.repeat(np.tile(np.arange(P, dtype=rank.dtype), len(quota)), free)
    return rank, hit, keep


class Planner:
    """Plans epochs one after the other from an empty buffer, carrying each rank's residency.

    Args:
        config: the :class:`PlanConfig`.

    Plans are meant to be executed in the order they are made (any epochs, e.g. the same epoch
    twice): each continues from the residency the previous ones left. A new planner starts
    from empty buffers, which is what a freshly started or resumed process has.
    """

    #: move ownership with the next epoch's order (NOTE [ Rebalancing with the next epoch's order ]);
    #: off = plain pinning
    rebalance: bool = True
    #: the policies this class plans (the baselines' simulator plans the others)
    policies: tuple[str, ...] = ("solar",)

    def __init__(self, config: PlanConfig) -> None:
        if config.policy not in self.policies:
            raise ConfigError(f"Planner plans policy 'solar', not {config.policy!r}; the baselines 'lru' and 'fifo' "
                              "are simulated by solar.testing.baselines.BaselinePlanner")
        self.config = config
        self._order_cache: tuple[int, np.ndarray] | None = None  # the last epoch's order (see order())
        self.reset()

    def owners(self, indices: np.ndarray) -> np.ndarray:
        """Current owner (keeper) of each index, -1 for none. Starts as :func:`owner_of`; the
        rebalancing moves ownership between samples (see NOTE [ Rebalancing with the next epoch's order ])."""
        return self._owner[np.asarray(indices, dtype=np.int64)]

    def order(self, epoch: int) -> np.ndarray:
        c = self.config
        cached = self._order_cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        perm = FeistelOrder(c.num_samples, c.seed).perm(epoch) if c.order == "feistel" and c.shuffle else None
        out = global_order(c.num_samples, c.world_size, c.seed, epoch, c.shuffle, c.drop_last, perm)[: c.epoch_length]
        self._order_cache = (epoch, out)  # the rebalancing reads epoch e+1, which is planned next
        return out

    def plan(self, epoch: int, start: int = 0) -> EpochPlan:
        """The plan of ``epoch`` from global position ``start``; updates the residency."""
        c = self.config
        if start < 0 or start > c.epoch_length:
            raise ConfigError(f"resume position {start} is outside epoch {epoch} (0..{c.epoch_length})")
        samples, self._first_dup, self._pad_at = self._tail(epoch, start)
        return self._plan_epoch(epoch, start, samples)

    def _plan_epoch(self, epoch: int, start: int, samples: np.ndarray) -> EpochPlan:
        """The plan of ``samples``, positions ``start..`` of ``epoch`` (from :meth:`_tail`)."""
        c = self.config
        G, P = c.global_batch, c.world_size
        res0, own0 = self._resident.copy(), self._owner.copy()
        rank, hit, keep = self._plan_pinned(samples, G, P)
        plan = EpochPlan(epoch, start, G, P, samples, rank, hit, keep)
        if self.rebalance and P > 1 and c.capacity:
            self._rebalance(plan, self.order(epoch + 1))
        changed = np.flatnonzero((res0 != self._resident) | (own0 != self._owner))
        plan.undo = (changed, res0[changed], own0[changed])  # O(changes), not O(N), is kept
        return plan

    def _tail(self, epoch: int, start: int) -> tuple[np.ndarray, int, int]:
        """Positions ``start..`` of the epoch, with the last step evened out (NOTE [ Resumed tail ]);
        the offset of DistributedSampler's own padding in it, and of the padding added here.
        Either may repeat a sample of an earlier step (see :meth:`_plan_pinned`)."""
        c = self.config
        order = self.order(epoch)
        samples = order[start:]
        first_dup = c.num_samples - start  # DistributedSampler's own padding starts there
        last = len(samples) % c.global_batch
        if not last or (last % c.world_size == 0 and not c.drop_last_batch):
            return samples, first_dup, len(samples)
        if c.drop_last_batch:
            return samples[: len(samples) - last], first_dup, len(samples) - last
        pad = np.resize(order, c.world_size - last % c.world_size)
        return np.concatenate([samples, pad]), first_dup, len(samples)

    def _rebalance(self, plan: EpochPlan, nxt: np.ndarray) -> None:
        """See NOTE [ Rebalancing with the next epoch's order ]; edits ``plan`` and the residency."""
        c = self.config
        N, P, G = c.num_samples, c.world_size, c.global_batch
        samples = plan.samples
        dt = index_dtype(N, P)
        next_step = np.full(N, -1, dtype=dt)  # step of each sample's first occurrence in the next epoch
        next_step[nxt[::-1]] = np.arange(len(nxt) - 1, -1, -1, dtype=dt) // G
        room = step_quota(len(nxt), G, P).reshape(-1).copy()
        res = np.flatnonzero(self._resident & (next_step >= 0)).astype(dt)
        cell = next_step[res] * P + self._owner[res]
        room -= np.bincount(cell, minlength=room.size)
        if room.min(initial=0) >= 0:
            return  # nothing would overflow next epoch
        once = np.bincount(samples, minlength=N) == 1  # appears once this epoch (no padding repeat)
        first_pos = np.full(N, -1, dtype=dt)
        first_pos[samples] = np.arange(len(samples), dtype=dt)  # position of each (once-appearing) sample
        this_step = np.where(first_pos >= 0, first_pos // G, -1)  # and its step, this epoch
        # drop candidates: residents of overflowing next-epoch cells, earliest used this epoch first
        # (after the head)
        cand = res[(room[cell] < 0) & once[res] & (this_step[res] >= c.head_steps)]  # NOTE [ First steps ]
        drop_cell = next_step[cand] * P + self._owner[cand]
        o = np.lexsort((this_step[cand], drop_cell))
        cand, drop_cell = cand[o], drop_cell[o]
        drops = cand[grouped_accept(np.arange(len(cand)), drop_cell, -np.minimum(room, 0))]
        # adoption candidates: plain reads this epoch of unowned samples, landing next epoch in a
        # (step, rank) cell with room
        pos = np.flatnonzero(~plan.hit & ~plan.keep).astype(dt)
        read_sample = samples[pos]
        ok = (self._owner[read_sample] < 0) & once[read_sample] & (next_step[read_sample] >= 0)
        pos, read_sample = pos[ok], read_sample[ok]
        read_cell = next_step[read_sample] * P + plan.rank[pos]
        ok = room[read_cell] > 0
        pos, read_sample, read_cell = pos[ok], read_sample[ok], read_cell[ok]
        ev_step, ev_rank, ev_sample, rel, rel_step = [], [], [], [], []
        by_rank = np.argsort(plan.rank[pos], kind="stable")  # positions stay ascending within a rank
        pos, read_sample, read_cell = pos[by_rank], read_sample[by_rank], read_cell[by_rank]
        bounds = np.searchsorted(plan.rank[pos], np.arange(P + 1))
        drop_owner = self._owner[drops]
        for r in np.unique(drop_owner).tolist():
            d = drops[drop_owner == r]
            r_pos, r_sample, r_cell = (a[bounds[r]:bounds[r + 1]] for a in (pos, read_sample, read_cell))
            if not len(r_pos):
                continue
            d = d[np.argsort(this_step[d], kind="stable")]
            r_step = r_pos // G
            # drop i takes the first unused read at or after its own step: j_i = max(earliest_i, j_{i-1} + 1)
            earliest = np.searchsorted(r_step, this_step[d], side="left")
            j = np.maximum.accumulate(earliest - np.arange(len(d))) + np.arange(len(d))
            m = j < len(r_pos)
            d, j = d[m], j[m]
            fits = grouped_accept(np.arange(len(j)), r_cell[j], room)
            d, j = d[fits], j[fits]
            room -= np.bincount(r_cell[j], minlength=room.size)
            plan.keep[r_pos[j]] = True
            self._owner[r_sample[j]] = r
            self._resident[r_sample[j]] = True
            self._owner[d] = -1
            self._resident[d] = False
            # a dropped sample first loaded this epoch is simply not kept; the others are evicted
            loaded_now = plan.keep[first_pos[d]]
            plan.keep[first_pos[d[loaded_now]]] = False
            ev_step.append(r_step[j][~loaded_now])
            ev_rank.append(np.full(int((~loaded_now).sum()), r, dtype=np.int64))
            ev_sample.append(d[~loaded_now])
            rel.append(d[loaded_now])
            rel_step.append(r_step[j][loaded_now])
        if ev_step:
            plan.evict_step = np.concatenate(ev_step)
            plan.evict_rank = np.concatenate(ev_rank)
            plan.evict_sample = np.concatenate(ev_sample)
            plan.release_sample = np.concatenate(rel)
            plan.release_step = np.concatenate(rel_step)

    def holds(self, indices: np.ndarray, rank: int) -> np.ndarray:
        """Whether ``rank``'s buffer holds each index, as far as the plans made so far go."""
        idx = np.asarray(indices, dtype=np.int64)
        ok = (idx >= 0) & (idx < len(self._resident))
        out = np.zeros(len(idx), dtype=bool)
        out[ok] = self._resident[idx[ok]] & (self._owner[idx[ok]] == rank)
        return out

    def rewind(self, plan: EpochPlan, steps: int) -> None:
        """Make the residency what ``plan`` leaves after its first ``steps`` steps only.

        For an iteration stopped early (NOTE [ Early stop ] in solar/sampler.py): :meth:`plan`
        applied the whole epoch's keeps, evictions and ownership moves at once; this undoes them
        (``plan.undo``) and re-applies those of the executed steps. ``plan`` must be the last
        plan made. Every rank must rewind to the same ``steps``: plans stay identical across
        ranks only if their planners are.
        """
        if plan.undo is None:
            raise ConfigError("this plan has no undo record (only the solar policy's plans do)")
        idx, res, own = plan.undo
        self._resident[idx], self._owner[idx] = res, own
        p = min(steps * plan.global_batch, len(plan.samples))
        kept = np.flatnonzero(plan.keep[:p])
        self._resident[plan.samples[kept]] = True
        self._owner[plan.samples[kept]] = plan.rank[kept]  # adoptions move ownership; pins keep it
        gone = plan.evict_sample[plan.evict_step < steps]
        self._resident[gone], self._owner[gone] = False, -1
        # a release hands its ownership to an adoption: undone together (one without the other
        # would leave a slot nobody owns, and the rebalancing only ever swaps, so it never returns)
        self._owner[plan.release_sample[plan.release_step < steps]] = -1
        plan.undo = None  # applied: a second rewind would start from the rewound state

    def reset(self) -> None:
        """Forget residency (buffers emptied, e.g. a new process)."""
        c = self.config
        self._resident = np.zeros(c.num_samples, dtype=bool)  # resident on its owner
        self._owner = owner_of(np.arange(c.num_samples, dtype=index_dtype(c.num_samples, c.world_size)), c.world_size,
                               c.batch_size, c.capacity)

    def _plan_pinned(self, samples: np.ndarray, G: int, P: int):
        own = self.owners(samples)
        # Padding repeats the epoch's head at its tail (N % P != 0; and a resumed tail's own
        # padding, which can repeat that one); those duplicates can be hits of samples kept
        # earlier in the same epoch, so the steps holding them are planned after those keeps.
        n = len(samples)
        cuts = sorted({0, n} | {(d // G) * G for d in (self._first_dup, self._pad_at) if 0 <= d < n})
        parts = list(zip(cuts[:-1], cuts[1:]))
        out = [np.empty(len(samples), dtype=self._owner.dtype), np.zeros(len(samples), bool),
               np.zeros(len(samples), bool)]
        for lo, hi in parts:
            if hi <= lo:
                continue
            r, h, k = assign_pinned(samples[lo:hi], G, P, own[lo:hi], self._resident[samples[lo:hi]])
            out[0][lo:hi], out[1][lo:hi], out[2][lo:hi] = r, h, k
            self._resident[samples[lo:hi][k]] = True
        return tuple(out)
