"""Repack (``solar-ckpt gc``): a pack whose chunks are partly dead is rewritten with its live chunks
only, every kept version pointed at the new pack, and the old one deleted; killed at any named
point, every kept version still loads with the same bytes, and the next gc leaves nothing stray.
Single-process and job roots; de-duplication, verify and keep_last keep working after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from solar.checkpoint import CheckpointWriter, gc, load, verify
from solar.checkpoint.jobstore import JobStore, is_job_root
from solar.checkpoint.pack import pack_names, packs_of
from solar.checkpoint.repack import REPACK_POINTS, repack
from solar.checkpoint.store import CheckpointStore

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_repack import CHUNK, state  # noqa: E402

HELPER = os.path.join(os.path.dirname(__file__), "ckpt_repack.py")


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, HELPER, *argv], capture_output=True, text=True, timeout=300)


def same(a: dict, b: dict) -> bool:
    return (a["small"].keys() == b["small"].keys() and all(a["small"][k].equal(v) for k, v in b["small"].items())
            and a["big"].equal(b["big"]) and a["step"].equal(b["step"]))


def loaded(root: str, step: int) -> dict:
    return load(root, step, rank=0) if is_job_root(CheckpointStore(root)) else load(root, step)


def used_packs(root: str) -> set[str]:
    store = CheckpointStore(root)
    if is_job_root(store):
        jobs = JobStore(store)
        return packs_of([jobs.part(jm, r) for jm in jobs.valid() for r in range(jm.world_size)])
    return packs_of(store.valid_manifests(warn=False))


def pack_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(os.path.join(root, "packs")) for f in fs)


@pytest.fixture(params=["single", "job"])
def made(request, tmp_path) -> str:
    root = str(tmp_path / request.param)
    proc = run("make", root, request.param)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_gc_repacks_a_partly_dead_pack_and_every_version_reads_the_same(made):
    before = pack_bytes(made)
    assert set(pack_names(CheckpointStore(made))) == used_packs(made)  # gc left the partly dead packs whole
    rep = repack(made)
    assert rep.packs_rewritten and rep.versions_rewritten == [2, 3] and rep.bytes_freed > 0
    assert pack_bytes(made) == before - rep.bytes_freed
    assert set(pack_names(CheckpointStore(made))) == used_packs(made)
    assert not set(rep.packs_rewritten) & used_packs(made)
    for s in (2, 3):
        assert same(loaded(made, s), state(s))
    assert verify(made).ok
    assert repack(made).packs_rewritten == []  # nothing left to compact


def test_saves_after_a_repack_deduplicate_against_the_new_packs(tmp_path):
    root = str(tmp_path / "ck")
    assert run("make", root, "single").returncode == 0
    repack(root)
    with CheckpointWriter(root, chunk_size=CHUNK, pack=1 << 20, keep_last=2) as w:
        again = w.save(state(3), 4).result()
        assert again.bytes_written == 0  # every chunk found where the repack put it
        w.save(state(5), 5)
    assert same(load(root, 4), state(3)) and same(load(root, 5), state(5)) and verify(root).ok


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", REPACK_POINTS)
def test_a_repack_killed_at_a_named_point_loses_nothing(made, point):
    proc = run("repack", made, point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    for s in (2, 3):  # every kept version reads the same bytes, from the old packs or the new
        assert same(loaded(made, s), state(s)), (point, s)
    assert verify(made).ok
    # the next gc finishes the job and leaves only packs (and parts) the versions use
    gc(made)
    assert run("repack", made, "none").returncode == 0
    assert set(pack_names(CheckpointStore(made))) == used_packs(made)
    store = CheckpointStore(made)
    if is_job_root(store):
        jobs = JobStore(store)
        assert {s: jobs.part_gens(s) for s in jobs.versions()} == {jm.step: {0: [jm.parts[0].gen]}
                                                                   for jm in jobs.valid()}
    for s in (2, 3):
        assert same(loaded(made, s), state(s))
    assert verify(made).ok
