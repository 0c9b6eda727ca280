"""The ``solar`` command line: one entry point, one module per subcommand.

Each subcommand lives in ``solar/cli/<name>.py`` and defines ``configure(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs, so ``solar --help``
and ``solar info`` stay fast and never initialize MPI or import torch needlessly.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from solar import __version__
from solar.errors import SolarError

__all__ = ["main", "SUBCOMMANDS"]

#: name -> (module, one-line help). A new subcommand is one module plus one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("solar.cli.info", "print versions and capabilities found (MPI, parallel HDF5, DALI, CUDA, fsspec)"),
    "demo": ("solar.cli.demo", "the main job: build a synthetic dataset, train with SOLAR and torch, compare"),
    "plan": ("solar.cli.plan", "compute a SOLAR schedule and report its hit rate against the bound"),
    "ingest": ("solar.cli.ingest", "build a (compressed) SOLAR HDF5 dataset, in parallel under mpirun"),
    "bench": ("solar.cli.bench", "run the benchmarks in bench/ (loader, io, codec, checkpoint, plan)"),
    "ckpt": ("solar.checkpoint.cli", "incremental checkpoints: log, diff, show, verify, restore, export, gc"),
}


def _load(module: str):
    return importlib.import_module(module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="solar", description="SOLAR: fast data loading and I/O for distributed deep learning on scientific data.")
    parser.add_argument("--version", action="version", version=f"solar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # handles --help/--version and unknown commands
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_ = SUBCOMMANDS[name]
    try:
        module = _load(module_name)
    except ImportError as exc:
        print(f"solar {name}: unavailable ({exc}); run `make test` or reinstall with the needed extra", file=sys.stderr)
        return 2
    sub = argparse.ArgumentParser(prog=f"solar {name}", description=help_)
    module.configure(sub)
    args = sub.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"solar {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `solar ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except SolarError as exc:  # SOLAR's own errors say what to do: one line, not a traceback
        print(f"solar {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
