"""A generic save/load-state check for loaders (modelled on torchdata's ``run_test_save_load_state``).

``check_save_load_state(make_loader, ...)`` iterates a fresh loader, saves its ``state_dict()``
after ``k`` batches of an epoch, finishes the epoch, then builds a *new* loader, loads the state
and checks that it yields exactly the remaining batches; and that the epoch after continues as in
the uninterrupted run. It runs for every ``k`` in ``midpoints`` (including 0 and the epoch's end),
and once more for a state saved after the epoch's ``for`` loop ended.

It compares one loader's batches one for one, which is the promise for a single rank. With P > 1
ranks a resumed run's buffers start empty, so which rank of a global batch gets which sample
may differ from the uninterrupted run; the global batches may not (docs/loader.md, "Resume"). Check
such a world as one loader whose batches are the global ones: tests/test_resume_matrix.py does so
for every storage backend x buffer tier, in one process and under ``mpirun``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["check_save_load_state", "batches_equal"]


def batches_equal(a: Any, b: Any) -> bool:
    """Structural equality of collated batches (tensors, tuples, lists, dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(batches_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(batches_equal(a[k], b[k]) for k in a)
    return a == b


def _epoch(loader: Any, epoch: int, set_epoch: bool) -> list:
    if set_epoch:
        loader.set_epoch(epoch)
    return list(loader)


def check_save_load_state(make_loader: Callable[[], Any], midpoints: Iterable[int] | None = None,
                          epoch: int = 1, set_epoch: bool = True,
                          equal: Callable[[Any, Any], bool] = batches_equal) -> int:
    """Assert resume correctness at every midpoint and after the loop; return how many save
    points were checked.

    Args:
        make_loader: builds a fresh loader (same arguments every time).
        midpoints: batches consumed before saving (default: every batch of the epoch, 0..len).
        epoch: the epoch in which to save.
        set_epoch: call ``loader.set_epoch(e)`` before each epoch (DistributedSampler style);
            otherwise each loader runs epochs ``0..epoch`` by iterating, and ``make_loader`` must
            make the orders reproducible (e.g. seeded generator).
    """
    torch.manual_seed(1234)
    ref_loader = make_loader()
    ref = [_epoch(ref_loader, e, set_epoch) for e in range(epoch + 2)]
    n = len(ref[epoch])
    checked = 0
    for k in (range(n + 1) if midpoints is None else midpoints):
        torch.manual_seed(1234)
        loader = make_loader()
        for e in range(epoch):
            _epoch(loader, e, set_epoch)
        if set_epoch:
            loader.set_epoch(epoch)
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = loader.state_dict()
        del it
        assert all(equal(x, y) for x, y in zip(head, ref[epoch][:k])), f"midpoint {k}: head differs"
        fresh = make_loader()
        fresh.load_state_dict(state)
        rest = list(fresh)
        want = ref[epoch][k:]
        assert len(rest) == len(want), f"midpoint {k}: resumed run gave {len(rest)} batches, expected {len(want)}"
        for j, (x, y) in enumerate(zip(rest, want)):
            assert equal(x, y), f"midpoint {k}: batch {k + j} of the resumed epoch differs"
        nxt = _epoch(fresh, epoch + 1, set_epoch)
        assert len(nxt) == len(ref[epoch + 1]) and all(equal(x, y) for x, y in zip(nxt, ref[epoch + 1])), \
            f"midpoint {k}: the epoch after the resumed one differs"
        checked += 1
    # the usual checkpoint point: after the for loop (StopIteration seen); the resumed loader's
    # next epoch must be the uninterrupted run's
    torch.manual_seed(1234)
    loader = make_loader()
    for e in range(epoch + 1):
        _epoch(loader, e, set_epoch)
    state = loader.state_dict()
    fresh = make_loader()
    fresh.load_state_dict(state)
    nxt = _epoch(fresh, epoch + 1, set_epoch)
    assert len(nxt) == len(ref[epoch + 1]) and all(equal(x, y) for x, y in zip(nxt, ref[epoch + 1])), \
        "saved after the epoch's loop: the next epoch differs from the uninterrupted run's"
    return checked + 1
