"""Saving a step the root already holds (issue 24): replaced with a warning by default, as
torch.save and DCP (overwrite=True by default) replace what they write over; without one with
``overwrite=True``; refused with ``overwrite=False``."""

from __future__ import annotations

import warnings

import pytest
import torch

from solar.checkpoint import CheckpointWriter, list_versions, load
from solar.errors import ConfigError


def state(v: float) -> dict:
    return {"w": torch.full((1000,), v), "step": torch.tensor(int(v))}


def test_saving_an_existing_step_warns_and_replaces_it(tmp_path):
    root = tmp_path / "ck"
    with CheckpointWriter(root) as w:
        w.save(state(1), 5)
        with pytest.warns(UserWarning, match=r"step 5 already exists in .*ck: this save replaces it .*overwrite=True"):
            w.save(state(2), 5)
    assert list_versions(root) == [5] and load(root, 5)["w"].equal(state(2)["w"])
    with CheckpointWriter(root) as w:  # a reopened writer knows the root's steps
        with pytest.warns(UserWarning, match="step 5 already exists"):
            w.save(state(3), 5)
        w.save(state(4), 6)  # a new step: no warning
    assert load(root, 5)["w"].equal(state(3)["w"])


def test_overwrite_true_replaces_quietly_and_false_refuses(tmp_path):
    root = tmp_path / "ck"
    with CheckpointWriter(root) as w:
        w.save(state(1), 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            w.save(state(2), 0, overwrite=True)
        w.wait()
        with pytest.raises(ConfigError, match=r"step 0 already exists in .* and overwrite=False; save another step, "
                                              r"or pass overwrite=True"):
            w.save(state(3), 0, overwrite=False)
        w.save(state(4), 1, overwrite=False)  # a new step is fine
    assert load(root, 0)["w"].equal(state(2)["w"]) and list_versions(root) == [0, 1]
