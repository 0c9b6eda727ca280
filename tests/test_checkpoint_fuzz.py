"""Fuzzing of checkpoint manifests (issue 27): 10,000 mutated manifests, each with its checksum
recomputed so that it passes every integrity check, are decoded, loaded and (some) verified.
Each must load or fail with a SOLAR error (``CorruptDataError``, ``CheckpointError``), never
with another exception, an allocation beyond a small bound, or a hang.

The run happens in a child process whose address space is capped (``RLIMIT_AS``) a little above
what it holds after its imports, so a mutation that made a reader allocate by a size it read
fails there instead of taking the machine down; the child reports its Python allocation peak
(``tracemalloc``) and its resident-set growth, and the test bounds both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what the child runs; it prints one JSON line of figures
CHILD = r'''
import base64, copy, json, os, random, resource, struct, sys, traceback, tracemalloc, warnings
from fractions import Fraction

import torch
import xxhash

from solar.checkpoint import CheckpointWriter, load, verify
from solar.checkpoint.manifest import decode
from solar.errors import SolarError

ROOT, N, HEADROOM = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = torch.arange(1024, dtype=torch.float32)
state = {"model": {"w": base, "view": base[8:520].view(16, 32), "t": base[::3],
                   "h": torch.ones(600, dtype=torch.float16)},
         "optim": {"state": {0: {"step": torch.tensor(3)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
         "extra": {"frac": Fraction(1, 3), "raw": b"\x00\x01", "dt": torch.float32, "dev": torch.device("cpu"),
                   "size": torch.Size([2, 3]), "nan": float("nan"), "none": None}}
with CheckpointWriter(ROOT, chunk_size=1024) as wr:
    wr.save(state, 1)
path = os.path.join(ROOT, "manifests", f"{1:020d}")
with open(path, "rb") as f:
    good = f.read()
(hlen,) = struct.unpack_from("<Q", good, 16)
HEADER = json.loads(good[24:24 + hlen])
DIGESTS = good[24 + hlen:-24]

rng = random.Random(27)
INTERESTING = [0, 1, -1, 2, 7, 64, 1023, 1024, 1025, 4096, 2 ** 30, 2 ** 31, 2 ** 32 + 1, 2 ** 50, 2 ** 62, 2 ** 63,
               2 ** 64, -2 ** 63,
               0.5, 1e308, float("nan"), "", "x", "float32", "object", "xxh3_128", "cuda:0", "meta", None, True, False,
               [], {}, [1, 2], [-1], [2 ** 40, 2 ** 40], [0, 0], {"__tensor__": 99}, {"__tensor__": -1},
               {"__pickle__": "AAAA"}, {"__pickle__": base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()},
               {"__dtype__": "nope"}, {"__float__": "x"}, {"__bytes__": "!!"}, {"__dict__": [[1]]},
               {"__dict__": [[[1], 2]]}, {"__tuple__": 5}, {"__size__": ["a"]}, {"__device__": "nope:9"}]


def value():
    if rng.random() < 0.35:
        return rng.choice(INTERESTING)
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randrange(-5, 5000)
    if kind == 1:
        return rng.getrandbits(rng.choice((8, 16, 40, 70)))
    if kind == 2:
        return [rng.randrange(-2, 2 ** 20) for _ in range(rng.randrange(0, 5))]
    return copy.deepcopy(rng.choice(INTERESTING))


def containers(h):
    """Every (container, key) of the header, the skeleton included."""
    out, todo = [], [h]
    while todo:
        c = todo.pop()
        keys = list(c) if isinstance(c, dict) else range(len(c))
        for k in keys:
            out.append((c, k))
            if isinstance(c[k], (dict, list)):
                todo.append(c[k])
    return out


def mutate(h, digests):
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        if op < 0.1:  # the digest table: drop or add rows, or bytes
            cut = rng.randrange(0, len(digests) + 1)
            digests = digests[:cut] if rng.random() < 0.5 else digests + os.urandom(rng.choice((1, 16, 160)))
            continue
        c, k = rng.choice(containers(h))
        if op < 0.6:
            c[k] = value()
        elif op < 0.75 and isinstance(c, dict):
            del c[k]
        elif op < 0.85 and isinstance(c, dict):
            c[rng.choice(("evil", "__pickle__", "nbytes", "extra"))] = value()
        elif isinstance(c, list) and c:
            if rng.random() < 0.5:
                c.pop(rng.randrange(len(c)))
            else:
                c.append(copy.deepcopy(rng.choice(c)))
        else:
            c[k] = value()
    return h, digests


def encode(h, digests):
    head = json.dumps(h).encode()
    body = good[:16] + struct.pack("<Q", len(head)) + head + digests
    return body + xxhash.xxh3_128_digest(body) + b"SOLAREND"


def vm_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


load(ROOT, step=1)  # warm every import and cache the child will use
verify(ROOT, 1)
limit = (vm_kib("VmSize") << 10) + HEADROOM
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
counts, crashes = {"decoded": 0, "loaded": 0, "verified": 0, "refused": 0}, []
warnings.simplefilter("ignore")
for i in range(N):
    h, digests = mutate(copy.deepcopy(HEADER), DIGESTS)
    data = encode(h, digests)
    try:
        decode(data, "fuzz")
        counts["decoded"] += 1
        with open(path, "wb") as f:
            f.write(data)
        load(ROOT, step=1)
        counts["loaded"] += 1
        if i % 10 == 0:
            verify(ROOT, 1)
            counts["verified"] += 1
    except SolarError:
        counts["refused"] += 1
    except BaseException as exc:  # noqa: BLE001 - what the test is looking for
        at = traceback.extract_tb(exc.__traceback__)[-1]
        crashes.append(f"{i}: {type(exc).__name__}: {str(exc)[:200]} at {at.filename}:{at.lineno}")
_, peak = tracemalloc.get_traced_memory()
print(json.dumps(dict(counts, mutations=N, crashes=crashes[:5], ncrashes=len(crashes), tracemalloc_peak=peak,
                      rss_growth=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) << 10)))
'''

MUTATIONS = 10_000
HEADROOM = 1 << 30  # address space the child may add after its imports
PEAK_BOUND = 64 << 20  # Python allocations at any moment of the run
RSS_BOUND = 256 << 20


@pytest.mark.slow  # 10,000 loads and 1,000 verifies
def test_mutated_manifests_never_crash_allocate_or_hang(tmp_path):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "ck"), str(MUTATIONS),
                          str(HEADROOM)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    fig = json.loads(res.stdout.strip().splitlines()[-1])
    print(fig)
    assert fig["ncrashes"] == 0, "\n".join(fig["crashes"])
    assert fig["mutations"] == MUTATIONS and fig["refused"] + fig["loaded"] == MUTATIONS
    assert fig["loaded"] > 0 and fig["refused"] > MUTATIONS // 2  # both paths were exercised
    assert fig["tracemalloc_peak"] < PEAK_BOUND and fig["rss_growth"] < RSS_BOUND, fig
