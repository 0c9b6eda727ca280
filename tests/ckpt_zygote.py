"""The SIGKILL harness of the checkpoint crash tests (tests/test_checkpoint_crash.py and
tests/test_checkpoint_delta_crash.py).

A "zygote" process imports torch once and forks one saver per cycle, so a cycle costs
milliseconds instead of a Python start-up. The test SIGKILLs the saver after a random delay
scaled to how long one save takes on this machine now (so a loaded CI machine still kills savers
in the middle of their saves, not always before the first commits), then checks the root. Every
sixth cycle kills a full ``gc`` instead, which must never leave a manifest whose chunks are gone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Callable

_ZYGOTE = '''
import os, random, signal, sys, time
from solar.checkpoint import CheckpointWriter, gc, list_versions
root = sys.argv[1]
# Timed in a child: a save starts threads, and a process must not fork after that.
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        with CheckpointWriter(root + "-calibrate", chunk_size=16 * 1024, **{options}) as w:
            for s in range({calibrate_saves}):
                w.save(make_state(s), s)
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
            writer = CheckpointWriter(root, chunk_size=16 * 1024, {writer})
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


def gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.005)
    raise AssertionError(f"saver {pid} did not die after SIGKILL")


def kill_cycles(root, state_src: str, *, seed: int, writer: str, options: str = "{}", calibrate_saves: int = 1,
                window: tuple[float, float] = (0.2, 4.0), cycles: int = 60,
                check: Callable[[int, int | None], None]) -> tuple[int, int]:
    """Run ``cycles`` saver (or gc) kills on ``root``; return (kills, newest committed step).

    ``state_src`` defines ``make_state(step)``; ``writer`` is the rest of the savers'
    ``CheckpointWriter(root, chunk_size=16 KiB, ...)`` call (``rng``, seeded per cycle, may pick
    options); ``options`` the calibrating writer's. A saver is killed within ``max(window[0],
    window[1] * one save's time)``. After each kill the newest version never goes backwards, and
    ``check(cycle, newest step or None)`` checks the root.
    """
    from solar.checkpoint import list_versions

    src = state_src + _ZYGOTE.format(writer=writer, options=options, calibrate_saves=calibrate_saves)
    zygote = subprocess.Popen([sys.executable, "-c", src, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    rng = random.Random(seed)
    kills, last = 0, -1
    try:
        ready, save_s = zygote.stdout.readline().split()
        assert ready == "ready"
        save_window = max(window[0], window[1] * float(save_s))
        for cycle in range(cycles):
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
            gone(pid)
            versions = list_versions(root)
            if versions:
                assert versions[-1] >= last, "the newest committed version disappeared"
                last = versions[-1]
            check(cycle, versions[-1] if versions else None)
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    return kills, last
