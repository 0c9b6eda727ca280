"""A rank buffer that spills to node-local disk, beside the memory-only buffer and torch.

Run: ``.venv/bin/python bench/loader/spill.py [--samples 2048] [--size 64] [--epochs 3]
[--memory 0.25] [--disk 0.5] [--bandwidth 200e6] [--latency 1e-3] [--out bench/loader/spill.json]``

The PtychoNN-like file of ``bench/loader/run.py`` behind the same throttle (one rank's share of a
parallel file system: ``--bandwidth`` bytes/s and ``--latency`` s per request). Three loaders,
world size 1, batch 32, in this one process:

``torch``
    ``torch.utils.data.DataLoader`` over a per-sample h5py dataset, ``num_workers=2``.
``memory``
    ``solar.DataLoader`` with ``buffer=`` ``--memory`` of the dataset's bytes.
``spill``
    the same, plus ``spill=(tmpdir, --disk of the dataset's bytes)``: the buffer keeps the rest
    in files on this machine's local disk (here the page cache serves them; an NVMe drive reads
    at GB/s, still far above one rank's share of the shared file system).

Reported: steady epoch seconds (epochs >= 2), the hit rate after the fill epoch against its
bound ``min(1, buffer / dataset)``, storage calls and bytes; ratios torch/memory, torch/spill and
memory/spill. Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from run import report, run_epochs, steady, throttled  # noqa: E402  (bench/loader/run.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--memory", type=float, default=0.25, help="buffer in memory, fraction of the dataset's bytes")
    ap.add_argument("--disk", type=float, default=0.5, help="spill on disk, fraction of the dataset's bytes")
    ap.add_argument("--bandwidth", type=float, default=200e6)
    ap.add_argument("--latency", type=float, default=1e-3)
    ap.add_argument("--data", default="out/bench/loader.h5")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "spill.json"))
    a = ap.parse_args()

    import torch.utils.data as tud

    import solar
    from solar.io_backends.hdf5 import HDF5Backend
    from solar.synthetic import write_ptycho_h5
    from solar.testing.baselines import PerSampleH5

    if not os.path.exists(a.data):
        os.makedirs(os.path.dirname(a.data) or ".", exist_ok=True)
        write_ptycho_h5(a.data, a.samples, a.size, seed=0, progress=False)
    probe = solar.H5Dataset(a.data)
    total = int(probe.sample_nbytes().sum())
    n = len(probe)
    probe.close()
    spill_dir = tempfile.mkdtemp(prefix="solar-spill-bench-")
    rows = {}
    for side in ("torch", "memory", "spill"):
        if side == "torch":
            ds = PerSampleH5(throttled(HDF5Backend(a.data, direct_reads=False), a.bandwidth / 2, a.latency))
            loader = tud.DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True,
                                    sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=0))
        else:
            ds = solar.H5Dataset(a.data, backend=throttled(HDF5Backend(a.data), a.bandwidth / 4, a.latency),
                                 io_threads=4, sieve_bytes=int(a.latency * a.bandwidth / 4))
            spill = (spill_dir, int(a.disk * total)) if side == "spill" else None
            loader = solar.DataLoader(ds, batch_size=32, buffer=f"{int(a.memory * total)}B", spill=spill,
                                      sampler=tud.DistributedSampler(ds, num_replicas=1, rank=0, seed=0))
        times = run_epochs(loader, a.epochs)
        row = {"epoch_s": times, "steady_s": steady(times)}
        if side == "torch":
            row.update(calls=ds.calls, bytes=ds.bytes)
        else:
            st = ds.stats
            later = st.hits + st.misses - n
            row.update(calls=st.read_calls, bytes=st.bytes_in, hit_rate=st.hits / later if later > 0 else 0.0,
                       bound=min(1.0, a.memory + (a.disk if side == "spill" else 0.0)))
        rows[side] = row
        del loader
    os.rmdir(spill_dir)

    ratios = {"torch/memory": rows["torch"]["steady_s"] / rows["memory"]["steady_s"],
              "torch/spill": rows["torch"]["steady_s"] / rows["spill"]["steady_s"],
              "memory/spill": rows["memory"]["steady_s"] / rows["spill"]["steady_s"]}
    report(f"{n} samples, {total / 2**20:.1f} MiB; throttled {a.bandwidth / 1e6:.0f} MB/s, {a.latency * 1e3:.1f} "
           f"ms/request; buffer {a.memory:.0%} in memory, spill {a.disk:.0%} on local disk",
           rows, ratios, vars(a), a.out)


if __name__ == "__main__":
    main()
