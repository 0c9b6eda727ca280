"""Ingest benchmark: ``solar ingest`` serially and under ``mpirun -n P``, raw and compressed.

Run: ``.venv/bin/python bench/io/ingest.py [--samples 4096] [--np 2] [--rel-error 1e-3]
[--out bench/io/ingest_results.json]``

The input is the PtychoNN-like HDF5 file of ``bench/io/run.py`` (made if missing). Each
configuration runs ``solar ingest INPUT -o OUT --json`` as a subprocess (the way users launch it)
and reports the job's own wall time, input MB/s and the stored size. The machine is shared
(2 cores): compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

from solar.fileio import write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOLAR = os.path.join(os.path.dirname(sys.executable), "solar")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def run_ingest(src: str, out: str, ranks: int, extra: list[str]) -> dict:
    cmd = [SOLAR, "ingest", src, "-o", out, "--no-progress", "--json", "--overwrite", *extra]
    if ranks > 1:
        cmd = ["mpirun", "-n", str(ranks), "--bind-to", "none", *cmd]
    res = subprocess.run(cmd, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--np", type=int, default=2, help="MPI ranks for the parallel runs")
    ap.add_argument("--rel-error", type=float, default=1e-3)
    ap.add_argument("--data", default=os.path.join(ROOT, "out", "bench", "io.h5"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ingest_results.json"))
    args = ap.parse_args(argv)
    if not os.path.exists(args.data):
        from solar.synthetic import write_ptycho_h5

        os.makedirs(os.path.dirname(args.data), exist_ok=True)
        write_ptycho_h5(args.data, args.samples, args.size, progress=False)
    runs = {}
    with tempfile.TemporaryDirectory(dir=os.path.dirname(args.data)) as tmp:
        for label, extra in (("raw", []), (f"rel {args.rel_error:g}", ["--rel-error", str(args.rel_error)])):
            for ranks in (1, args.np):
                rep = run_ingest(args.data, os.path.join(tmp, "o.h5"), ranks, extra)
                key = f"{label}, {ranks} rank(s)"
                runs[key] = {"seconds": rep["seconds"], "input_MBps": rep["input_bytes"] / rep["seconds"] / 1e6,
                             "stored_MB": rep["stored_bytes"] / 1e6, "ratio": rep["ratio"]}
                print(f"{key:<22} {rep['seconds']:7.2f} s  {runs[key]['input_MBps']:8.1f} MB/s in  "
                      f"{runs[key]['stored_MB']:8.1f} MB stored (x{rep['ratio']:.1f})", flush=True)
    result = {"config": vars(args), "machine": platform.platform(), "runs": runs}
    write_text_atomic(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out} (shared 2-core machine: compare ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
