"""Reliability: SIGKILL a saving process at random moments, again and again.

The harness (tests/ckpt_zygote.py) forks one saver per cycle and SIGKILLs it while it is hashing,
writing chunks, committing a manifest or collecting garbage; after each kill the newest committed
version must load bit-exact and ``verify`` pass. Every sixth cycle kills a full ``gc`` instead,
which must never leave a manifest whose chunks are gone.
"""

from __future__ import annotations

import os

import pytest

from ckpt_zygote import kill_cycles

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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_while_saving_never_loses_the_last_committed_version(tmp_path):
    from solar.checkpoint import load, verify

    ns: dict = {}
    exec(STATE_SRC, ns)
    make_state = ns["make_state"]
    root = tmp_path / "ck"
    torn = []

    def check(cycle: int, last: int | None) -> None:
        torn.append(any(".tmp-" in n for _d, _s, files in os.walk(root) for n in files))
        if last is None:
            return
        got = load(root)
        want = make_state(last)
        for key in ("w", "w_tied", "emb"):
            assert got["model"][key].numpy().tobytes() == want["model"][key].numpy().tobytes(), (cycle, last, key)
        assert got["model"]["w"].data_ptr() == got["model"]["w_tied"].data_ptr()
        assert got["optim"]["m"].equal(want["optim"]["m"]) and got["note"] == f"s{last}"
        rep = verify(root)
        assert rep.ok, rep.problems

    kills, last = kill_cycles(root, STATE_SRC, seed=1234, writer="keep_last=rng.choice([None, 2, 3])", check=check)
    assert kills >= 50
    assert last > 10, "the savers barely committed anything; the test did not exercise increments"
    print(f"{kills} SIGKILLs, newest step {last}, {sum(torn)} kills left torn temporaries behind")
