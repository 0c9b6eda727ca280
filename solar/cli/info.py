"""``solar info``: versions and capabilities found in this process."""

from __future__ import annotations

import argparse
import json

from solar.capabilities import capabilities


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    caps = capabilities()
    if args.json:
        print(json.dumps(caps, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in caps)
    for key, value in caps.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        elif isinstance(value, dict):  # fsspec_protocols_missing: protocol -> what installs it
            value = "; ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        print(f"{key:<{width}}  {value}")
    return 0
