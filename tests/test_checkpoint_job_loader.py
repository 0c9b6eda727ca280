"""The loader's state in the same version as the model, on a single-process root:
``save(..., loader=)`` and ``load(..., loader=)`` (the job-wide form is in
tests/test_checkpoint_job_resume.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils.data as tud

import solar
from solar.checkpoint import CheckpointWriter, Reader, load
from solar.errors import CheckpointError


class Numbers(tud.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i


def _rest(loader) -> list[int]:
    return [int(v) for batch in loader for v in batch]


@pytest.mark.parametrize("kind", ["shuffle", "distributed"])
def test_a_loader_saved_with_the_version_resumes_where_it_was(tmp_path, kind):
    def make():
        if kind == "shuffle":  # passthrough mode: the state holds a torch RNG state (a tensor)
            return solar.DataLoader(Numbers(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
        sampler = tud.DistributedSampler(Numbers(), num_replicas=2, rank=1, seed=5)
        return solar.DataLoader(Numbers(), batch_size=4, sampler=sampler)

    want = _rest(make())
    loader = make()
    it = iter(loader)
    seen = [int(v) for batch in itertools.islice(it, 2) for v in batch]
    with CheckpointWriter(tmp_path / "ck", chunk_size=1024) as w:
        w.save({"w": torch.ones(3)}, 7, loader=loader, meta={"note": "kept"})
    del it
    fresh = make()
    state = load(tmp_path / "ck", loader=fresh)
    assert state["w"].equal(torch.ones(3))
    assert seen + _rest(fresh) == want
    reader = Reader(tmp_path / "ck")
    assert reader.manifest.meta["note"] == "kept" and reader.loader_state()["batch_size"] == 4


def test_loading_a_loader_from_a_version_saved_without_one_is_refused(tmp_path):
    with CheckpointWriter(tmp_path / "ck", chunk_size=1024) as w:
        w.save({"w": torch.ones(3)}, 1)
    assert Reader(tmp_path / "ck").loader_state() is None
    with pytest.raises(CheckpointError, match=r"step 1 of .* holds no loader state .*load it without loader="):
        load(tmp_path / "ck", loader=solar.DataLoader(Numbers(), batch_size=4))


def test_a_loader_without_state_dict_is_refused_naming_what_to_pass(tmp_path):
    from solar.errors import ConfigError

    with CheckpointWriter(tmp_path / "ck", chunk_size=1024) as w:
        with pytest.raises(ConfigError, match="loader= must be a solar.DataLoader"):
            w.save({"w": torch.ones(3)}, 1, loader=object())
