"""`solar demo`: writes the dataset, trains with both loaders, prints the side-by-side table."""

from __future__ import annotations

import re

from solar.cli import main


def test_demo_trains_with_both_loaders_and_prints_the_table(tmp_path, capsys):
    rc = main(["demo", "--samples", "40", "--size", "16", "--out", str(tmp_path), "--ranks", "1", "--epochs", "2",
               "--batch-size", "8", "--latency", "1e-4", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "match" in out and "MISMATCH" not in out
    for label in ("epoch 0 time (s)", "steady epoch", "samples/s", "storage MiB read", "storage requests",
                  "final loss"):
        assert label in out
    torch_calls, solar_calls = map(int, re.search(r"storage requests\s+(\d+)\s+(\d+)", out).groups())
    assert torch_calls == 2 * 40 * 2  # per-sample reads: 2 fields x 40 samples x 2 epochs
    assert solar_calls < torch_calls
    hit = float(re.search(r"hit rate after fill\s+-\s+([0-9.]+)", out).group(1))
    assert hit == 0.5  # the pinned half of the data hits in epoch 2: the bound min(1, 0.5)
    losses = re.search(r"final loss\s+([0-9.]+)\s+([0-9.]+)", out).groups()
    assert losses[0] == losses[1]  # same init, same global batches: same training
