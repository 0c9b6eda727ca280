"""``solar bench NAME [ARGS...]``: run one of the benchmarks in the repository's ``bench/`` folder.

Benchmarks live outside the package (the library never imports them): each is
``bench/<name>/run.py``, runs SOLAR and its competitor side by side in one process, prints ratios
and writes JSON (``--out``). This command only finds and runs them, passing the remaining
arguments through, so ``solar bench loader --help`` shows the benchmark's own options.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import solar


def bench_dir() -> Path:
    """``bench/`` of the source checkout this package runs from (editable install)."""
    return Path(solar.__file__).resolve().parents[1] / "bench"


def available() -> list[str]:
    d = bench_dir()
    return sorted(p.parent.name for p in d.glob("*/run.py")) if d.is_dir() else []


def configure(parser: argparse.ArgumentParser) -> None:
    names = available()
    parser.add_argument("name", help=f"benchmark to run: {', '.join(names) or 'none found'}, or 'all'")
    rest = parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to bench/<name>/run.py")
    rest.required = False  # argparse marks a REMAINDER positional required; it may be empty


def run(args: argparse.Namespace) -> int:
    names = available()
    if not names:
        print(f"solar bench: no benchmarks found under {bench_dir()}; run from a source checkout "
              "(git clone + make setup)", file=sys.stderr)
        return 2
    chosen = names if args.name == "all" else [args.name]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"solar bench: unknown benchmark {unknown[0]!r}; choose one of: {', '.join(names)}, all",
              file=sys.stderr)
        return 2
    rc = 0
    for name in chosen:
        print(f"== bench/{name}", flush=True)
        script = bench_dir() / name / "run.py"
        rc |= subprocess.run([sys.executable, str(script), *_here(args.args)], cwd=bench_dir().parent).returncode
    return rc


def _here(argv: list[str]) -> list[str]:
    """``argv`` with a relative ``--out`` made absolute against the caller's directory: the
    benchmark runs in the checkout's root (its data paths are relative to it), but the JSON goes
    where the user asked for it."""
    out, after_out = [], False
    for a in argv:
        if after_out and not Path(a).is_absolute():
            a = str(Path.cwd() / a)
        elif a.startswith("--out=") and not Path(a[6:]).is_absolute():
            a = "--out=" + str(Path.cwd() / a[6:])
        out.append(a)
        after_out = a == "--out"
    return out
