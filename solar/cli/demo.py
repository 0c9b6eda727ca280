"""``solar demo``: the whole product in a few minutes (``make demo``). The options are parsed here;
the steps are the :mod:`solar.demo` package's (its docstring says what each does)."""

from __future__ import annotations

import argparse

from solar.demo import steps


def _at_least(lo: float, kind=int):
    """An argparse type: ``kind`` values >= ``lo``, else a one-line usage error (exit 2) while the
    arguments are parsed, before anything is written."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v >= lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo:g}, got {text}")
        return v
    return parse


def _fraction(text: str) -> float:
    v = _at_least(0.0, float)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"is a fraction of the dataset, 0..1, got {text}")
    return v


def _bound(text: str) -> float:
    v = _at_least(0.0, float)(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"is a relative error bound, between 0 and 1, got {text}")
    return v


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=_at_least(1), default=1024, help="training samples (default 1024)")
    parser.add_argument("--val-samples", type=_at_least(1), default=256,
                        help="held-out validation samples (default 256)")
    parser.add_argument("--size", type=_at_least(1), default=64, help="field edge length in pixels (default 64)")
    parser.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    parser.add_argument("--ranks", type=_at_least(1), default=2, help="MPI ranks of every step (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default 0)")
    parser.add_argument("--epochs", type=_at_least(0), default=3,
                        help="training epochs per run (default 3; 0 only builds the data)")
    parser.add_argument("--batch-size", type=_at_least(1), default=32, help="per-rank batch (default 32)")
    parser.add_argument("--buffer", type=_fraction, default=0.5,
                        help="SOLAR buffer, fraction of the dataset (default 0.5)")
    parser.add_argument("--bounds", type=_bound, nargs="+", default=[1e-2, 1e-3, 1e-4],
                        help="relative error bounds of the compressed copies (default 1e-2 1e-3 1e-4)")
    parser.add_argument("--seeds", type=_at_least(2), default=3,
                        help="seeds of the raw run, the yardstick of the validation loss (default 3)")
    parser.add_argument("--lr", type=_at_least(0.0, float), default=3e-3,
                        help="the surrogate's Adam learning rate (default 3e-3)")
    parser.add_argument("--ckpt-every", type=_at_least(1), default=4, help="steps between checkpoints (default 4)")
    parser.add_argument("--bandwidth", type=_at_least(0.0, float), default=200e6,
                        help="storage bytes/s of one rank (default 200e6; 0: unthrottled)")
    parser.add_argument("--latency", type=_at_least(0.0, float), default=1e-3,
                        help="seconds per storage request (default 1e-3)")
    parser.add_argument("--workers", type=_at_least(0), default=1, help="num_workers of torch's loader (default 1)")
    parser.add_argument("--decoder", choices=["auto", "reference", "cpu-kernel"], default=None,
                        help="codec decoder of the compressed runs (SOLAR_CODEC_DECODER; default: the "
                        "environment's, else auto: the numba cpu-kernel, compiled once per code kind and cached)")
    parser.add_argument("--no-progress", action="store_true", help="accepted for compatibility: the steps print "
                        "one line each")


def run(args: argparse.Namespace) -> int:
    return steps.run(args)
