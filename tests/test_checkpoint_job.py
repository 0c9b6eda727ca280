"""One checkpoint for the whole job (``CheckpointWriter(root, comm=...)``), under a real ``mpirun``
(``-n 2`` and ``-n 3``): every rank saves into one root, one global manifest commits each
version, a chunk several ranks hold is stored once, bad input and a failing rank are refused on
every rank before anything commits, and a single-process root and a job root refuse each other."""

from __future__ import annotations

import os

import pytest
import torch

from solar.checkpoint import CheckpointWriter, list_versions, load
from solar.checkpoint.host import HASH_FIRST_MIN_CHUNK
from solar.checkpoint.jobstore import JobStore
from solar.checkpoint.store import CheckpointStore
from solar.errors import CheckpointError, ConfigError, InputError

pytestmark = pytest.mark.mpi

CHUNK = 4096


def state(step: int, rank: int) -> dict:
    """A state with a replicated part (the same on every rank) and a rank's own part."""
    rep = torch.arange(8 * CHUNK, dtype=torch.float32) / 3 + step
    own = torch.arange(2 * CHUNK, dtype=torch.float32) * (rank + 2) + step
    return {"model": {"rep": rep, "own": own}, "optim": {"step": torch.tensor(step)}, "epoch": step // 2}


def same(a: dict, b: dict) -> bool:
    return all(a["model"][k].numpy().tobytes() == b["model"][k].numpy().tobytes() for k in ("rep", "own")) \
        and a["optim"]["step"].item() == b["optim"]["step"].item() and a["epoch"] == b["epoch"]


def chunk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(os.path.join(root, "chunks")) for f in fs)


def test_every_rank_commits_one_version_and_loads_its_own_state(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        futures = [w.save(state(s, comm.rank), s) for s in range(3)]  # async, several queued
        results = [f.result() for f in futures]
    assert [r.step for r in results] == [0, 1, 2]
    assert list_versions(root) == [0, 1, 2]
    for s in range(3):
        assert same(load(root, s, rank=comm.rank), state(s, comm.rank))
    assert same(load(root, comm=comm), state(2, comm.rank))
    # replicated tensors stored once: the first version's chunks are one copy of `rep` and one
    # `own` per rank (plus the small `step` tensors), not one `rep` per rank
    comm.barrier()
    rep_bytes, own_bytes = 8 * CHUNK * 4, 2 * CHUNK * 4
    total = chunk_bytes(root)
    assert total < 3 * (rep_bytes + comm.size * own_bytes) + comm.size * 3 * 64, total
    written = comm.allreduce(results[0].bytes_written)
    assert rep_bytes + comm.size * own_bytes <= written < 2 * rep_bytes + comm.size * own_bytes
    comm.barrier()


def test_any_rank_of_the_job_reads_any_rank_and_refuses_without_one(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        w.save(state(5, comm.rank), 5, blocking=True)
    other = (comm.rank + 1) % comm.size
    assert same(load(root, rank=other), state(5, other))
    with pytest.raises(CheckpointError, match=rf"job root; step 5 was saved by {comm.size} ranks: pass rank="):
        load(root)
    with pytest.raises(CheckpointError, match=f"no rank {comm.size}"):
        load(root, rank=comm.size)
    comm.barrier()


def test_a_rank_with_another_step_is_refused_on_every_rank_before_anything_commits(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    w = CheckpointWriter(root, comm=comm, chunk_size=CHUNK)
    w.save(state(0, comm.rank), 0, blocking=True)
    step = 7 if comm.rank == comm.size - 1 else 1
    with pytest.raises(ConfigError, match=rf"rank 0 saves step 1 but rank {comm.size - 1} step 7"):
        w.save(state(step, comm.rank), step).result()  # the agreement fails the future, before anything is written
    comm.barrier()
    assert list_versions(root) == [0]
    w.save(state(1, comm.rank), 1, blocking=True)  # the writer goes on
    w.close()
    assert list_versions(root) == [0, 1]


def test_state_keys_that_disagree_are_refused_naming_the_rank_and_the_key(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        s = state(0, comm.rank)
        if comm.rank == 1:
            s["model"]["extra"] = torch.ones(3)
        with pytest.raises(ConfigError, match=r"rank 1's state for step 0 has key 'model.extra' that rank 0's lacks"):
            w.save(s, 0).result()
        s = state(0, comm.rank)
        if comm.rank == comm.size - 1:
            del s["model"]["own"]
        with pytest.raises(ConfigError, match=rf"rank {comm.size - 1}'s state for step 0 lacks key 'model.own'"):
            w.save(s, 0).result()
    comm.barrier()
    assert list_versions(root) == [] and chunk_bytes(root) == 0


def test_a_state_one_rank_cannot_save_fails_every_rank_with_that_ranks_error(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        s = state(0, comm.rank)
        if comm.rank == 1:
            s["model"]["own"] = s["model"]["own"].to_sparse()
        want = "layout" if comm.rank == 1 else r"rank 1 cannot save step 0: InputError: tensor 'model.own' has layout"
        with pytest.raises((CheckpointError, InputError), match=want):
            w.save(s, 0).result()  # rank 1's save() raises; the others' futures fail
    assert list_versions(root) == []


def test_saves_after_a_rank_refused_its_own_state_commit_on_every_rank(comm, shared_tmp):
    """A rank whose save() raised on its own thread still takes part in that save's agreement, so
    the ranks' later saves stay paired: each commits, on every rank."""
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        bad = comm.rank == comm.size - 1
        f = None
        with pytest.raises((CheckpointError, ConfigError), match=r"step must be|cannot save step"):
            f = w.save(state(0, comm.rank), -1 if bad else 0)
            f.result()
        futures = [w.save(state(s, comm.rank), s) for s in (1, 2)]
        assert [f.result().step for f in futures] == [1, 2]
    assert list_versions(root) == [1, 2] and same(load(root, rank=comm.rank), state(2, comm.rank))


def test_save_returns_before_the_other_ranks_have_called_it(comm, shared_tmp):
    """The agreement runs in the background: rank r's save() returns while rank r+1 has not called
    save() yet (each waits in a barrier for the rank before it). Were the agreement on the caller's
    thread, rank 0 would wait in it for rank 1, which waits in the barrier for rank 0: a hang."""
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        fut = None
        for r in range(comm.size):
            if comm.rank == r:
                fut = w.save(state(0, comm.rank), 0)
            comm.barrier()
        assert fut.result().step == 0
    assert same(load(root, rank=comm.rank), state(0, comm.rank))


def test_a_rank_failing_mid_save_fails_every_future_and_commits_nothing(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")

    def hook(point: str, step: int) -> None:
        if point == "after-chunks" and step == 1 and comm.rank == comm.size - 1:
            raise OSError(28, "No space left on device (injected)")

    w = CheckpointWriter(root, comm=comm, chunk_size=CHUNK, on_commit_point=hook)
    w.save(state(0, comm.rank), 0, blocking=True)
    fut = w.save(state(1, comm.rank), 1)
    with pytest.raises((OSError, CheckpointError), match="No space left on device"):
        fut.result()
    if comm.rank != comm.size - 1:
        want = rf"rank {comm.size - 1} failed writing its chunks of step 1"
        with pytest.raises(CheckpointError, match=want):
            fut.result()
    comm.barrier()
    assert list_versions(root) == [0]
    assert 1 not in JobStore(CheckpointStore(root)).part_steps()  # each rank removed its part
    w.save(state(2, comm.rank), 2, blocking=True)
    w.close()
    assert list_versions(root) == [0, 2] and same(load(root, rank=comm.rank), state(2, comm.rank))


def test_keep_last_retention_keeps_every_rank_loadable(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, keep_last=2) as w:
        for s in range(5):
            w.save(state(s, comm.rank), s)
        w.wait()
        assert {step for step, _rank, _digest in w.jobs._refs} <= {3, 4}  # removed versions are forgotten
    comm.barrier()
    assert list_versions(root) == [3, 4]
    assert sorted(JobStore(CheckpointStore(root)).part_steps()) == [3, 4]
    for s in (3, 4):
        for r in range(comm.size):
            assert same(load(root, s, rank=r), state(s, r))
    # reopening continues from the newest version, on every rank
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, keep_last=2) as w:
        res = w.save(state(4, comm.rank), 5).result()
    assert res.bytes_written == 0 and res.chunks_unchanged == res.chunks_total
    comm.barrier()


def test_single_process_and_job_roots_refuse_each_other(comm, shared_tmp):
    single, job = os.path.join(shared_tmp, "single"), os.path.join(shared_tmp, "job")
    if comm.rank == 0:
        with CheckpointWriter(single, chunk_size=CHUNK) as w:
            w.save(state(0, 0), 0)
    comm.barrier()
    with pytest.raises(CheckpointError, match="single-process CheckpointWriter"):
        CheckpointWriter(single, comm=comm)
    with CheckpointWriter(job, comm=comm, chunk_size=CHUNK) as w:
        w.save(state(0, comm.rank), 0)
    if comm.rank == 0:
        with pytest.raises(CheckpointError, match=r"is a job root.*comm=MPI.COMM_WORLD"):
            CheckpointWriter(job)
    comm.barrier()


def test_a_second_job_on_a_root_in_use_is_refused_on_every_rank(comm, shared_tmp):
    from solar.errors import CheckpointLockedError

    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK):
        with pytest.raises((CheckpointLockedError, CheckpointError), match="locked"):
            CheckpointWriter(root, comm=comm)
    comm.barrier()


def test_a_torch_distributed_gloo_group_works_as_comm(comm, shared_tmp):
    import torch.distributed as dist

    from ckpt_shard import init_gloo

    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    init_gloo(comm)
    try:
        root = os.path.join(shared_tmp, "job")
        with CheckpointWriter(root, comm=dist.group.WORLD, chunk_size=CHUNK, keep_last=1) as w:
            for s in range(2):
                w.save(state(s, comm.rank), s)
        assert same(load(root, comm="torch"), state(1, comm.rank))
    finally:
        dist.destroy_process_group()


def test_solar_ckpt_sees_one_version_across_ranks_and_one_rank_with_rank(comm, shared_tmp, capsys, tmp_path):
    import json

    from solar.checkpoint.cli import main

    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:
        for s in range(2):
            w.save(state(s, comm.rank), s)
    comm.barrier()
    if comm.rank == 0:
        def run(*argv) -> tuple[int, dict | str]:
            capsys.readouterr()
            code = main(list(argv))
            out = capsys.readouterr().out
            return code, json.loads(out) if "--json" in argv else out

        code, log = run("log", root, "--json")
        assert code == 0 and [v["step"] for v in log["versions"]] == [0, 1]
        assert all(v["world_size"] == comm.size for v in log["versions"])
        one = run("log", root, "--json", "--rank", "1")[1]
        assert one["versions"][1]["logical_bytes"] < log["versions"][1]["logical_bytes"]
        shown = run("show", f"{root}@1", "--json")[1]
        assert [r["rank"] for r in shown["ranks"]] == list(range(comm.size))
        tensors = [t["name"] for t in run("show", f"{root}@1", "--json", "--rank", "1")[1]["tensors"]]
        assert tensors == ["model.rep", "model.own", "optim.step"]
        changed = run("diff", f"{root}@0", f"{root}@1", "--json")[1]["changed"]
        assert {"rank 0/model.own", f"rank {comm.size - 1}/model.rep"} <= {c["name"] for c in changed}
        changed = run("diff", f"{root}@0", f"{root}@1", "--json", "--rank", "1")[1]["changed"]
        assert {c["name"] for c in changed} == {"model.rep", "model.own", "optim.step"}
        assert run("verify", root, "--json")[0] == 0
        out = str(tmp_path / "r1.pt")
        assert run("restore", f"{root}@1", "--rank", "1", "-o", out)[0] == 0
        assert same(torch.load(out), state(1, 1))
        # a damaged chunk of rank 1's own tensor is named with its rank
        part = JobStore(CheckpointStore(root)).part(JobStore(CheckpointStore(root)).read_global(1), 1)
        ref = next(t for t in part.tensors if t.name == "model.own")
        digest = part.blob_digests(ref.blob)[0].tobytes().hex()
        loc = part.locations.get(bytes.fromhex(digest))  # packed (the job writer's default) or a file
        path = os.path.join(root, "packs", loc.pack[:2], loc.pack) if loc else os.path.join(root, "chunks",
                                                                                          digest[:2], digest)
        data = bytearray(open(path, "rb").read())
        data[loc.offset if loc else 0] ^= 1
        open(path, "wb").write(bytes(data))
        code, rep = run("verify", root, "--json")
        assert code == 1 and rep["problems"][0]["tensors"] == ["rank 1/model.own"]
        assert rep["problems"][0]["steps"] == [1]
        assert run("gc", root, "--keep-last", "1", "--json")[1]["kept"] == [1]
        assert list_versions(root) == [1]
    comm.barrier()


def test_a_job_save_of_many_small_tensors_makes_one_pack_per_rank_at_most(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")

    def small(step: int) -> dict:
        g = torch.Generator().manual_seed(comm.rank)
        out = {f"layer{i}.bias": torch.randn(16, generator=g) for i in range(150)}
        out["layer3.bias"] += step
        return out

    def count(sub: str) -> int:
        return sum(len(fs) for _d, _s, fs in os.walk(os.path.join(root, sub)))

    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK) as w:  # pack=True is the job writer's default
        w.save(small(0), 0, blocking=True)
        comm.barrier()
        assert count("packs") <= comm.size and count("chunks") == 0
        w.save(small(1), 1, blocking=True)
        comm.barrier()
        assert count("packs") <= 2 * comm.size
    for s in (0, 1):
        got = load(root, s, rank=comm.rank)
        assert all(got[k].equal(v) for k, v in small(s).items())
    comm.barrier()


def test_lazy_saves_commit_one_version_for_the_job(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job")
    with CheckpointWriter(root, comm=comm, chunk_size=CHUNK, max_in_flight=2) as w:
        for s in range(3):
            st = state(s, comm.rank)
            fut = w.save(st, s, lazy=True)
            w.wait_staged()  # the copy is done: the state may change now
            st["model"]["own"].add_(1000)
        assert fut.result().step == 2
    assert list_versions(root) == [0, 1, 2]
    assert same(load(root, comm=comm), state(2, comm.rank))


def test_loading_a_version_saved_by_another_world_size_is_refused_on_every_rank(comm, shared_tmp):
    from mpi4py import MPI

    root = os.path.join(shared_tmp, "job")
    sub = comm.Split(0 if comm.rank == 0 else MPI.UNDEFINED)
    if comm.rank == 0:  # a one-rank job saved this root
        with CheckpointWriter(root, comm=sub, chunk_size=CHUNK) as w:
            w.save(state(3, 0), 3)
        sub.Free()
    comm.barrier()
    with pytest.raises(CheckpointError, match=rf"step 3 of .* was saved by 1 ranks and this job has {comm.size}.*"
                                              r"load_into"):
        load(root, comm=comm)
    assert same(load(root, rank=0), state(3, 0))  # rank 0's state, from any rank


def test_a_job_save_copies_only_what_changed_and_loads_exactly(comm, shared_tmp):
    root = os.path.join(shared_tmp, "job-staged")
    cs = HASH_FIRST_MIN_CHUNK
    st = {"rep": torch.arange(4 * cs // 4, dtype=torch.float32),
          "own": torch.arange(4 * cs // 4, dtype=torch.float32) * (comm.rank + 2)}
    want0 = {k: v.clone() for k, v in st.items()}
    with CheckpointWriter(root, comm=comm, chunk_size=cs) as w:
        first = w.save(st, 0).result()
        if comm.rank == comm.size - 1:
            st["own"][5] = -1.0  # one chunk of this rank's own tensor; nothing else changes
        second = w.save(st, 1).result()
    assert first.bytes_staged == 8 * cs
    assert second.bytes_staged == (cs if comm.rank == comm.size - 1 else 0)
    for step, want in ((0, want0), (1, st)):
        got = load(root, step, rank=comm.rank)
        assert all(torch.equal(got[k], v) for k, v in want.items()), step
    comm.barrier()
