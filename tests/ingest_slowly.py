"""``python tests/ingest_slowly.py SECONDS ingest ARGS...``: the ``solar`` command line with every
batch of ``solar ingest`` taking SECONDS longer, so that a test can act while the run is under way
(SIGKILL one rank of ``mpirun -n 2``, fill its disk). The delay goes in through the library's
``ingest(on_batch_written=...)``; the command line itself has no such option."""

from __future__ import annotations

import functools
import sys
import time

import solar.cli.ingest as cli_ingest
from solar.cli import main


def _sleep(seconds: float, batch: int, committed: bool) -> None:
    time.sleep(seconds)


if __name__ == "__main__":
    delay = float(sys.argv[1])
    cli_ingest.ingest = functools.partial(cli_ingest.ingest, on_batch_written=functools.partial(_sleep, delay))
    sys.argv = ["solar", *sys.argv[2:]]
    sys.exit(main(sys.argv[1:]))
