# The two commands of the README: `make demo` and `make test`. Each runs the shared, idempotent
# set-up step first (Debian packages, .venv, torch CPU wheel, h5py built against parallel HDF5).
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
NP ?= 2
# OpenMPI as root, more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup test test-unit test-mpi demo bench clean docs

setup:
	@bash scripts/setup.sh

# Lint first; the MPI suite runs on 2 ranks and again on 3: some MPI-IO bugs only show with 3 or
# more (NOTE [ No sieving in collective reads ] in solar/reads.py).
test: setup
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory test-unit
	@$(MAKE) --no-print-directory test-mpi
	@$(MAKE) --no-print-directory test-mpi NP=3

# Unit tests (everything not marked `mpi`); SOLAR_STRICT turns "capability missing" skips into failures.
test-unit:
	SOLAR_STRICT=1 $(PY) -m pytest -m "not mpi" tests

# MPI tests under a real `mpirun -n $(NP)`; fails if nothing ran or the world is not $(NP) ranks.
test-mpi:
	SOLAR_STRICT=1 SOLAR_EXPECT_WORLD=$(NP) timeout -k 15 1200 \
	  mpirun -n $(NP) --bind-to none bash scripts/mpi-pytest.sh -m mpi tests

# Lint: ruff (pycodestyle errors and warnings, pyflakes: [tool.ruff] in pyproject.toml) and
# codespell ([tool.codespell]) over the whole tree; both come with the test extra `make setup` installs.
.PHONY: lint
lint:
	$(PY) -m ruff check .
	$(VENV)/bin/codespell

# The guide (docs/*.md) and the API reference from the docstrings (docs/reference/), built into
# out/site with warnings as errors; tests/test_docs_site.py builds it in `make test` and renders it
# in headless Chromium.
docs: setup
	$(PY) -m mkdocs build --strict

# The demo's set-up leaves out the tests' nginx and chromium (SOLAR_SETUP=demo in scripts/setup.sh).
demo:
	@SOLAR_SETUP=demo bash scripts/setup.sh
	$(VENV)/bin/solar demo

bench: setup
	$(VENV)/bin/solar bench all

clean:
	rm -rf .pytest_cache build *.egg-info .mpi-logs

# The GPU check (issue 21; bench/gpu/README.md). gpu-wheels, where there is network: the wheels SOLAR
# needs beyond a GPU machine's python3 (torch, triton, numba, h5py, mpi4py, xxhash, fsspec) into the
# git-ignored .gpu-wheels/. gpu-check, on the GPU machine (`carry` .gpu-wheels): installs them without
# network, runs the gpu tests, bench/codec and the compressed bench/loader on CUDA in at most 8 minutes
# and writes bench/gpu/results.json; without CUDA the same steps run on the CPU.
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	@PYTHON=$(if $(wildcard $(PY)),$(PY),python3) bash scripts/gpu-check.sh --download

gpu-check:
	@bash scripts/gpu-check.sh
