"""The test suite's MPI / GPU / DALI split, made explicit.

* ``mpi`` tests run only under ``mpirun`` (``make test-mpi``); outside it they are skipped, and
  ``make test-unit`` deselects them. Under ``make test-mpi`` (``SOLAR_EXPECT_WORLD=N``) the session
  fails unless the world really has N ranks and h5py has MPI support, and a failing test aborts the
  whole MPI job instead of leaving the other ranks hanging in a collective.
* ``gpu`` tests are skipped without a CUDA device (never on this project's machines).
* ``dali`` tests are skipped without NVIDIA DALI, except under ``SOLAR_STRICT=1`` (``make test``),
  where a missing capability is a failure: a green CI must mean the tests ran.
"""

from __future__ import annotations

import os
import sys

import pytest

# Fixtures shared by several test modules, defined beside their helpers and imported here once, so
# every module in tests/ takes them as parameters (a module importing them itself would have each
# parameter shadow the import: pyflakes' F811).
from loader_helpers import h5path  # noqa: F401  (the 96-sample PtychoNN-like file)
from servers import http_root, place, s3_bucket, s3_root  # noqa: F401  (storage servers on 127.0.0.1)

STRICT = os.environ.get("SOLAR_STRICT") == "1"

# CI runs Hypothesis derandomized, so a green or red CI is reproducible; developers' runs keep
# exploring new examples (and keep found failures in .hypothesis/).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hyp_settings.load_profile("ci")
EXPECT_WORLD = int(os.environ.get("SOLAR_EXPECT_WORLD", "0") or 0)


def _under_mpirun() -> bool:
    from solar.dist import under_mpirun

    return under_mpirun()


def _world():
    from solar.dist import mpi_comm

    return mpi_comm()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not EXPECT_WORLD:
        return
    comm = _world()
    if comm is None:
        raise pytest.UsageError("SOLAR_EXPECT_WORLD is set but this is not an MPI run (mpi4py missing or no mpirun)")
    if comm.size != EXPECT_WORLD:
        raise pytest.UsageError(f"expected an MPI world of {EXPECT_WORLD} ranks, got {comm.size}")
    import h5py

    if not h5py.get_config().mpi:
        raise pytest.UsageError("h5py lacks MPI support; run `make setup` to build it against parallel HDF5")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    in_mpi = _under_mpirun()
    has_cuda = torch.cuda.is_available()
    from solar.capabilities import dali_available

    has_dali = dali_available()
    for item in items:
        if "mpi" in item.keywords and not in_mpi:
            item.add_marker(pytest.mark.skip(reason="needs mpirun; run `make test-mpi`"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "dali" in item.keywords and not has_dali:
            if STRICT:
                item.add_marker(pytest.mark.xfail(reason="DALI missing under SOLAR_STRICT", strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason="needs NVIDIA DALI: pip install 'solar-loader[dali]'"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if EXPECT_WORLD > 1 and report.failed and report.when == "call":
        comm = _world()
        if comm is not None and comm.size > 1:
            sys.stderr.write(f"\n[rank {comm.rank}] {item.nodeid} failed; aborting the MPI job so no rank hangs\n"
                             f"{report.longreprtext}\n")
            sys.stderr.flush()
            comm.Abort(1)


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD`` (mpi tests only)."""
    c = _world()
    if c is None:
        pytest.skip("needs mpirun")
    return c


@pytest.fixture
def shared_tmp(comm, tmp_path_factory):
    """A directory every rank sees (rank 0 creates it and broadcasts the path)."""
    path = str(tmp_path_factory.mktemp("shared")) if comm.rank == 0 else None
    return comm.bcast(path, root=0)
