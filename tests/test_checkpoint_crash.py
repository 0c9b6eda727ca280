"""Reliability: SIGKILL a saving process at random moments, again and again.

A "zygote" process imports torch once and forks one saver per cycle, so a cycle costs
milliseconds instead of a Python start-up; the test SIGKILLs the saver after a random 0-200 ms (longer on a machine
where one save takes longer than 50 ms)
(while it is hashing, writing chunks, committing a manifest or collecting garbage), then checks
that the newest committed version loads bit-exact and that ``verify`` passes. Every sixth cycle
kills a full ``gc`` instead, which must never leave a manifest whose chunks are gone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

STATE_SRC = '''
import torch

def make_state(step):
    """The state saved at ``step``: a function of the step alone, so any version can be checked."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96 * 1024, generator=g)
    i = (step * 7919) % (w.numel() - 64)
    w[i:i + 64] = float(step)
    emb = torch.zeros(512, 64)
    emb[step % 512] = step
    return {"model": {"w": w, "w_tied": w, "emb": emb}, "optim": {"step": step, "m": w * 0.5}, "note": f"s{step}"}
'''

ZYGOTE_SRC = '''
import os, random, signal, sys, time
from solar.checkpoint import CheckpointWriter, gc, list_versions
root = sys.argv[1]
# how long one save takes on this machine now: the kill delays scale with it, so a loaded CI
# machine still kills savers in the middle of their saves, not always before the first commits.
# Timed in a child: a save starts threads, and a process must not fork after that.
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        CheckpointWriter(root + "-calibrate", chunk_size=16 * 1024).save(make_state(0), 0)
    finally:
        os._exit(0)
os.waitpid(pid, 0)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed savers
print("ready", time.perf_counter() - t0, flush=True)
for line in sys.stdin:
    job, seed = line.split()
    seed = int(seed)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            rng = random.Random(seed)
            if job == "gc":  # a full collection (lists every chunk), killed part-way
                gc(root, keep_last=rng.choice([1, 2]))
                os._exit(0)
            writer = CheckpointWriter(root, chunk_size=16 * 1024, keep_last=rng.choice([None, 2, 3]))
            versions = list_versions(root)
            step = versions[-1] + 1 if versions else 0
            while True:
                writer.save(make_state(step), step, blocking=rng.random() < 0.5)
                step += 1
        except BaseException as exc:
            print("saver failed:", repr(exc), file=sys.stderr, flush=True)
            code = 1
        finally:
            os._exit(code)
    print(pid, flush=True)
'''


def _gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.005)
    raise AssertionError(f"saver {pid} did not die after SIGKILL")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_while_saving_never_loses_the_last_committed_version(tmp_path):
    from solar.checkpoint import list_versions, load, verify

    ns: dict = {}
    exec(STATE_SRC, ns)
    make_state = ns["make_state"]
    root = tmp_path / "ck"
    zygote = subprocess.Popen([sys.executable, "-c", STATE_SRC + ZYGOTE_SRC, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    rng = random.Random(1234)
    kills, with_temporaries, last = 0, 0, -1
    try:
        ready, save_s = zygote.stdout.readline().split()
        assert ready == "ready"
        save_window = max(0.2, 4 * float(save_s))
        for cycle in range(60):
            job = "gc" if cycle % 6 == 5 else "save"
            zygote.stdin.write(f"{job} {cycle}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.0, save_window if job == "save" else 0.02))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # a small gc can finish first; a saver loops until killed
                assert job == "gc", f"saver {pid} exited before it was killed (its error is on stderr)"
                continue
            kills += 1
            _gone(pid)
            with_temporaries += any(".tmp-" in n for _d, _s, files in os.walk(root) for n in files)
            versions = list_versions(root)
            if not versions:
                continue
            assert versions[-1] >= last, "the newest committed version disappeared"
            last = versions[-1]
            got = load(root)
            want = make_state(last)
            for key in ("w", "w_tied", "emb"):
                assert got["model"][key].numpy().tobytes() == want["model"][key].numpy().tobytes(), (cycle, last, key)
            assert got["model"]["w"].data_ptr() == got["model"]["w_tied"].data_ptr()
            assert got["optim"]["m"].equal(want["optim"]["m"]) and got["note"] == f"s{last}"
            rep = verify(root)
            assert rep.ok, rep.problems
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    assert kills >= 50
    assert last > 10, "the savers barely committed anything; the test did not exercise increments"
    print(f"{kills} SIGKILLs, newest step {last}, {with_temporaries} kills left torn temporaries behind")
