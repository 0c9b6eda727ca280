"""Sharded planning with one rank failing between plans; run by tests/test_scale.py as
``mpirun -n P python tests/scale_job.py - POINT FAIL_RANK`` (the first argument is unused: the
launcher is tests/test_failfast.py's, which passes its data file there).

Every rank plans epochs 0..2 as the loader does: on the planning thread, over the planner's own
duplicate of SOLAR's private communicator (NOTE [ SOLAR's own MPI traffic ] in solar/dist.py), the
order in its node's shared window (``SOLAR_NODE_RANKS=2``: two "nodes" on 4 ranks). Before epoch 1, rank ``FAIL_RANK``:

* ``none``: does nothing (control: the job ends with 0, every rank prints ``done``).
* ``raise``: raises; the others are waiting in the plan's first exchange.
* ``exit``: ends with ``sys.exit(3)``, no exception.
* ``kill``: is killed by SIGKILL (the OOM killer).
"""

from __future__ import annotations

import functools
import os
import signal
import sys

from solar.dist import plan_comm, plan_executor, private_comm
from solar.exchange import run_mpi
from solar.nodeshare import NodeOrder
from solar.schedule import PlanConfig
from solar.shardplan import ShardPlanner


def main() -> None:
    point, fail_rank = sys.argv[2], int(sys.argv[3])
    comm = plan_comm(private_comm())
    P, me = comm.size, comm.rank == fail_rank
    c = PlanConfig(4000, P, 4, 4000 // 2 // P, seed=1, long_head=True)
    planning = plan_executor()
    order = planning.submit(NodeOrder, c, comm).result()
    planner = ShardPlanner(c, comm.rank, order, exchange=functools.partial(run_mpi, comm=comm))
    for e in range(3):
        if e == 1 and me:
            if point == "raise":
                raise RuntimeError(f"injected failure on rank {comm.rank} before planning epoch 1")
            if point == "exit":
                sys.exit(3)
            if point == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        planning.submit(planner.plan, e).result()
    planning.submit(order.close).result()
    print("done", flush=True)


if __name__ == "__main__":
    main()
