"""A training job that fails on one rank at a named point; run by tests/test_failfast.py as
``mpirun -n P python tests/fail_job.py DATA.h5 POINT [FAIL_RANK]``.

It is the README's loop (``DistributedSampler`` + ``solar.DataLoader`` over an ``H5Dataset``,
parallel HDF5 chosen by itself under mpirun). ``POINT`` names where rank ``FAIL_RANK`` fails:

* ``none``: no failure (control: the job must end with 0).
* ``break``: every rank leaves the loop at the same step and ends (control: 0, no abort).
* ``persistent-workers``: no failure, ``num_workers=2, persistent_workers=True``, and the script
  never closes its dataset (control: 0, no h5py teardown tracebacks).
* ``slow-end``: rank ``FAIL_RANK`` ends 8 s after the others (control: 0, nobody aborts).
* ``before-first-batch``: raises after building the loader, before its first batch.
* ``mid-epoch``: raises in the training loop at step 3 (a NaN check, CUDA OOM, an assert).
* ``exit-mid-epoch``: ``sys.exit(3)`` in the training loop at step 3 (no exception).
* ``early-end``: ends normally after epoch 0 while the others train epoch 1.
* ``read-ahead``: the loader's read-ahead fails with a bug (not a data error) on that rank.
* ``collective-read``: a collective read fails with a bug on that rank.
* ``worker``: a DataLoader worker (``num_workers=2``) fails at step 3.
* ``at-exit``: raises at the end of the script, after the loops.
* ``missing-file``: the file is missing on that rank (node-local staging missing on one node).
* ``disagree-batch``: that rank uses ``batch_size=16``, the others 8.
* ``disagree-seed``: that rank uses the sampler seed 1, the others 0.
"""

from __future__ import annotations

import sys
import time

import torch.utils.data as tud

import solar
from solar.dist import get_dist_info


def main() -> None:
    path, point = sys.argv[1], sys.argv[2]
    fail_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    info = get_dist_info()
    me = info.rank == fail_rank

    def fail(where: str) -> None:
        raise RuntimeError(f"injected failure on rank {info.rank} {where}")

    if point == "missing-file" and me:
        path = path + ".not-staged-here.h5"
    ds = solar.H5Dataset(path, fields=("x", "y"))
    if point == "read-ahead" and me:
        def broken(*a, **k):
            fail("in the read-ahead")
        ds.fetch_steps = broken
    if point == "collective-read" and me:
        backend = ds.backend
        read = backend._read_ranges
        calls = [0]

        def read_ranges(*a, **k):
            calls[0] += 1
            if calls[0] > 2:
                fail("inside a collective read")
            return read(*a, **k)
        backend._read_ranges = read_ranges
    batch = 16 if point == "disagree-batch" and me else 8
    seed = 1 if point == "disagree-seed" and me else 0
    sampler = tud.DistributedSampler(ds, num_replicas=info.world_size, rank=info.rank, seed=seed)
    collate = None
    workers = 0
    if point == "worker":
        workers = 2
        seen = [0]

        def collate(items):
            seen[0] += 1
            if me and seen[0] > 3:
                fail("in a DataLoader worker")
            return tud.default_collate(items)
    persistent = point == "persistent-workers"
    workers = 2 if persistent else workers
    loader = solar.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers, collate_fn=collate,
                              buffer=0.5, prefetch=2, persistent_workers=persistent)
    if point == "before-first-batch" and me:
        fail("before the first batch")
    epochs = 3
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            float(x.sum() + y.sum())
            if step == 3 and me and point == "mid-epoch":
                fail("in the training loop at step 3")
            if step == 3 and me and point == "exit-mid-epoch":
                print(f"rank {info.rank}: sys.exit(3) at step 3", file=sys.stderr, flush=True)
                sys.exit(3)
            if step == 3 and point == "break":
                break
        if point == "early-end" and me:
            print(f"rank {info.rank}: ends after epoch {epoch}", file=sys.stderr, flush=True)
            return
        if point == "break":
            break
    if point == "at-exit" and me:
        fail("at the end of the script")
    if point == "slow-end" and me:
        time.sleep(8)
    print(f"rank {info.rank}: done", flush=True)


if __name__ == "__main__":
    main()
