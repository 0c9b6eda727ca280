"""An independent checker for ``solar plan --dump`` files (and :class:`solar.schedule.EpochPlan`).

It trusts nothing the planner computed except the dump itself: the claims are the per-step,
per-rank lists of ``[index, hit]``. A hit on rank r at step t claims that r accessed the sample at
some earlier step and kept it since; so r must keep it over the whole interval from its last
access before t up to t. At every step boundary, the number of such intervals open on a rank is
the least number of samples it must be keeping; that may never exceed the capacity ``C``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_dump", "PlanViolation"]


class PlanViolation(AssertionError):
    """A dumped plan breaks an invariant; the message names the epoch, step, rank and sample."""


def check_dump(dump: dict[str, Any], capacity: int, batch_size: int | None = None) -> dict[str, int]:
    """Verify a dump; return ``{"accesses", "hits", "max_kept"}``. Raises :class:`PlanViolation`.

    Checks: every step gives every rank the same number of samples (``batch_size`` when given,
    except a shorter last step), every hit was accessed earlier by the same rank, and no rank
    ever has to keep more than ``capacity`` samples.
    """
    last: dict[tuple[int, int], int] = {}  # (rank, sample) -> global step of last access
    opens: dict[int, set[tuple[int, int, int]]] = {}  # rank -> (sample, from, to): keep over [from, to)
    t = 0
    accesses = hits = 0
    for ep in dump["epochs"]:
        steps = ep["steps"]
        for k, step in enumerate(steps):
            sizes = {len(r) for r in step}
            if len(sizes) != 1:
                raise PlanViolation(f"epoch {ep['epoch']} step {k}: ranks get different batch sizes {sorted(sizes)}")
            if batch_size is not None and k < len(steps) - 1 and sizes != {batch_size}:
                raise PlanViolation(f"epoch {ep['epoch']} step {k}: ranks get {sizes.pop()} samples, not {batch_size}")
            for rank, items in enumerate(step):
                for index, hit in items:
                    accesses += 1
                    prev = last.get((rank, index))
                    if hit:
                        hits += 1
                        if prev is None or prev >= t:
                            raise PlanViolation(f"epoch {ep['epoch']} step {k} rank {rank}: sample {index} is "
                                                "claimed as a hit but this rank never accessed it before")
                        opens.setdefault(rank, set()).add((index, prev, t))
            for rank, items in enumerate(step):
                for index, _ in items:
                    last[(rank, index)] = t
            t += 1
    max_kept = 0
    for rank, intervals in opens.items():
        # kept after step s: intervals with start <= s < end
        events: dict[int, int] = {}
        for _, a, b in intervals:
            events[a] = events.get(a, 0) + 1
            events[b] = events.get(b, 0) - 1
        level = 0
        for s in sorted(events):
            level += events[s]
            max_kept = max(max_kept, level)
            if level > capacity:
                raise PlanViolation(f"rank {rank} must keep {level} samples after global step {s}, "
                                    f"more than its capacity {capacity}")
    return {"accesses": accesses, "hits": hits, "max_kept": max_kept}
