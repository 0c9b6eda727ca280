"""Codec benchmark: solar.codec side by side with SZ3 (pysz), ZFP (zfpy), hdf5plugin's SZ3 filter
and lz4/zstd on the raw bytes, on synthetic smooth and turbulent 3-D fields and on real data that
matplotlib ships.

Run: ``.venv/bin/python bench/codec/run.py [--rel 1e-3 1e-2 1e-4] [--n 128] [--device auto|cpu|cuda]
[--out results.json]``

Everything runs in one process, single-threaded (``torch.set_num_threads(1)``, SZ3 without
OpenMP) except the rows named "all threads" (solar's ``cpu-kernel`` over a mini-batch's blobs,
SZ3 with OpenMP), with the compressors interleaved and the best of ``--reps`` timings kept, so
ratios of speeds are meaningful even on a shared machine. Every solar decoder path runs side by
side (``auto``, the default, which is ``cpu-kernel`` where numba is installed; ``reference``;
``cpu-kernel``; compiled; ``--no-compiled`` leaves the last out), beside ebq/7's ``bitpack``
codes (the lossless stage a GPU unpacks itself: its ratio and CPU speed against zstd's), and the
overhead rows time one call on tiny blobs (1 and 1,024 values). Prints, per field and
compressor: ratio, max error / bound, PSNR, encode and decode MB/s (of original bytes,
1 MB = 1e6 B); then the targets: geometric-mean ratio vs SZ3 at each bound
and CPU decode speed vs pysz. With a CUDA device it also prints the GPU decode GB/s of
``solar.codec.decode_batch`` (``--device auto``, the default; ``--device cuda`` insists on it and
also decodes the mini-batch section on the GPU, ``--device cpu``
measures the CPU alone). Writes everything as JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ALL_THREADS = len(os.sched_getaffinity(0))
os.environ.setdefault("OMP_NUM_THREADS", str(ALL_THREADS))  # only the "all threads" SZ3 rows use OpenMP

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fields import all_fields  # noqa: E402

import solar.codec as sc  # noqa: E402
from solar.codec import paths  # noqa: E402


# --------------------------------------------------------------------------- compressors
class Compressor:
    """``compress(x, eb) -> bytes``; ``decompress(blob, like) -> np.ndarray``; lossless ignore eb."""

    name = "?"
    lossless = False
    requires: tuple[str, ...] = ()

    def available(self) -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) is not None for m in self.requires)


class Solar(Compressor):
    def __init__(self, lossless="zstd", predictor="auto", compile=False, decoder=None):
        self.cfg = {"id": "ebq", "lossless": lossless, "predictor": predictor}
        self.compile, self.decoder = compile, decoder
        extra = ("" if predictor == "auto" else ", " + predictor) + (", compiled" if compile else "")
        self.name = f"solar ebq ({lossless}{extra}{', ' + decoder if decoder else ''})"

    def compress(self, x, eb):
        return sc.encode(x, abs_error=eb, codec=self.cfg)

    def decompress(self, blob, like):
        return sc.decode(blob, compile=self.compile, decoder=self.decoder).numpy()

    def warmup(self, blob, like) -> float:
        """Seconds of the first decode: the one-time torch.compile of this shape (0 when eager)."""
        t = time.perf_counter()
        self.decompress(blob, like)
        return time.perf_counter() - t if self.compile else 0.0


class PySZ(Compressor):
    requires = ("pysz",)

    def __init__(self, openmp: bool = False):
        self.openmp = openmp
        self.name = f"SZ3 (pysz, OpenMP, all threads: {ALL_THREADS})" if openmp else "SZ3 (pysz)"

    def compress(self, x, eb):
        from pysz import sz, szConfig, szErrorBoundMode

        conf = szConfig()
        conf.errorBoundMode = szErrorBoundMode.ABS
        conf.absErrorBound = eb
        conf.openmp = self.openmp
        return bytes(sz.compress(x, conf)[0])

    def decompress(self, blob, like):
        from pysz import sz

        return sz.decompress(np.frombuffer(blob, np.uint8), like.dtype, like.shape)[0]


class ZFP(Compressor):
    name = "ZFP accuracy (zfpy)"
    requires = ("zfpy",)

    def compress(self, x, eb):
        import zfpy

        return zfpy.compress_numpy(x, tolerance=eb)

    def decompress(self, blob, like):
        import zfpy

        return zfpy.decompress_numpy(blob)


class H5SZ3(Compressor):
    """hdf5plugin's SZ3 filter through h5py: one chunk = the field, chunk cache off, in memory."""

    name = "SZ3 (hdf5plugin)"
    requires = ("h5py", "hdf5plugin")

    def compress(self, x, eb):
        import h5py
        import hdf5plugin

        bio = io.BytesIO()
        with h5py.File(bio, "w") as f:
            f.create_dataset("x", data=x, chunks=x.shape, compression=hdf5plugin.SZ3(absolute=eb))
        return bio.getvalue()

    def compressed_size(self, blob):
        import h5py

        with h5py.File(io.BytesIO(blob), "r") as f:
            return f["x"].id.get_storage_size()

    def decompress(self, blob, like):
        import h5py

        with h5py.File(io.BytesIO(blob), "r", rdcc_nbytes=0) as f:
            return f["x"][...]


class RawLossless(Compressor):
    lossless = True

    def __init__(self, kind):
        self.kind, self.name = kind, f"{kind} (lossless, raw bytes)"

    def compress(self, x, eb):
        if self.kind == "lz4":
            import lz4.block

            return lz4.block.compress(x.tobytes(), store_size=False)
        import zstandard

        return zstandard.ZstdCompressor(level=3).compress(x.tobytes())

    def decompress(self, blob, like):
        if self.kind == "lz4":
            import lz4.block

            raw = lz4.block.decompress(blob, uncompressed_size=like.nbytes)
        else:
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(blob)
        return np.frombuffer(raw, like.dtype).reshape(like.shape)


# --------------------------------------------------------------------------- measuring
def _best(fn, reps: int, budget: float = 1.0) -> tuple[object, float]:
    best, out, t_end = math.inf, None, time.perf_counter() + budget
    for i in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
        if i >= 2 and time.perf_counter() > t_end:
            break
    return out, best


def _interleaved(fns: dict, reps: int, budget: float = 1.0) -> tuple[dict, dict]:
    """Best time of each of ``fns``, timed round-robin (one call of each per round).

    Why round-robin: on a shared machine the CPU's speed drifts by tens of percent over seconds;
    timing compressor A for a second and then B for a second turns that drift into a false speed
    ratio, while interleaving exposes every decoder to the same conditions. Within a round each
    function runs twice and the second call is timed: otherwise a decoder's time would depend on
    whose buffers the previous one left in the caches (measured: up to 40% on a 0.5 MB field).
    At least ``reps`` rounds (fewer only past the time budget, never under 3); fast decoders get
    up to ``5 * reps`` rounds within the budget, so their best-of is as settled as a slow one's.
    """
    best = {k: math.inf for k in fns}
    out: dict = {}
    t_end = time.perf_counter() + 2 * budget * len(fns)
    i = 0
    while True:
        for k, fn in fns.items():
            fn()  # warm: this decoder's own buffers in the caches, as in a loop of decodes
            t = time.perf_counter()
            out[k] = fn()
            best[k] = min(best[k], time.perf_counter() - t)
        i += 1
        now = time.perf_counter()
        if (i >= 3 and now > t_end) or (i >= reps and (now > t_end or i >= 5 * reps)):
            return out, best


def psnr(x: np.ndarray, y: np.ndarray) -> float:
    rng = float(x.max()) - float(x.min())
    mse = float(np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 20 * math.log10(rng) - 10 * math.log10(mse)


def measure(comps: list, x: np.ndarray, eb: float, reps: int) -> list[dict]:
    """Each compressor's row for one field and bound; decodes timed interleaved (:func:`_interleaved`)."""
    blobs, t_enc, first = {}, {}, {}
    for c in comps:
        blobs[c.name], t_enc[c.name] = _best(lambda: c.compress(x, eb), max(1, reps // 2))
        first[c.name] = c.warmup(blobs[c.name], x) if hasattr(c, "warmup") else 0.0
    outs, t_dec = _interleaved({c.name: (lambda c=c: c.decompress(blobs[c.name], x)) for c in comps}, reps)
    rows = []
    for c in comps:
        y, blob = outs[c.name], blobs[c.name]
        size = c.compressed_size(blob) if hasattr(c, "compressed_size") else len(blob)
        err = float(np.max(np.abs(x.astype(np.float64) - np.asarray(y, np.float64).reshape(x.shape))))
        rows.append({"ratio": x.nbytes / size, "max_err_over_bound": err / eb if eb else 0.0, "psnr": psnr(x, y),
                     "enc_MBps": x.nbytes / t_enc[c.name] / 1e6, "dec_MBps": x.nbytes / t_dec[c.name] / 1e6,
                     "bound_ok": err <= eb, "compile_s": first[c.name]})
    return rows


def gpu_decode(x: np.ndarray, eb: float, batch: int = 16, reps: int = 10, decoder=None, codec=None) -> float | None:
    """GB/s of decode_batch on CUDA (original bytes, blobs from host memory: the whole decode,
    lossless stage included), or None without a GPU; ``decoder`` None is the default path
    (``triton`` where Triton imports)."""
    if not torch.cuda.is_available():
        return None
    blobs = [sc.encode(x, abs_error=eb, codec=codec)] * batch
    sc.decode_batch(blobs, device="cuda", decoder=decoder)
    torch.cuda.synchronize()

    def run():
        sc.decode_batch(blobs, device="cuda", decoder=decoder)
        torch.cuda.synchronize()

    _, t = _best(run, reps)
    return x.nbytes * batch / t / 1e9


def _cuda_timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` on CUDA (after one untimed call), synchronized around each call."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(max(3, reps)):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def gpu_batch_rows(fname: str, arr: np.ndarray, blobs: list, eb: float, want: torch.Tensor, rel: float,
                   reps: int) -> list[dict]:
    """``decode_batch(device="cuda")`` of one mini-batch, eager and compiled: GB/s of original bytes
    (blobs from host memory to the decoded tensor on the GPU) and a bit-for-bit check against the CPU."""
    rows = []
    for name, compile, dec in (("solar decode_batch (cuda)", False, None),
                               ("solar decode_batch (cuda, reference)", False, "reference"),
                               ("solar decode_batch (cuda, compiled)", True, None)):
        t0 = time.perf_counter()
        y = sc.decode_batch(blobs, device="cuda", compile=compile, decoder=dec)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        if y.device.type != "cuda" or not torch.equal(y.cpu(), want):
            raise SystemExit(f"{fname}: {name} differs from the CPU decoder")
        t = _cuda_timed(lambda c=compile, d=dec: sc.decode_batch(blobs, device="cuda", compile=c, decoder=d), reps)
        e = float(np.max(np.abs(y.cpu().numpy().astype(np.float64) - arr)))
        rows.append({"field": fname, "batch": len(blobs), "rel": rel, "compressor": name, "device": "cuda",
                     "ratio": arr.nbytes / sum(map(len, blobs)), "max_err_over_bound": e / eb,
                     "dec_MBps": arr.nbytes / t / 1e6, "dec_GBps": arr.nbytes / t / 1e9, "bound_ok": e <= eb,
                     "equal_to_cpu": True, "compile_s": first if compile else 0.0})
        print(f"{name:34s} {rows[-1]['ratio']:8.2f} {e / eb:7.4f} {arr.nbytes / t / 1e6:9.0f}"
              + (f"   (first call, compiling: {first:.1f} s)" if compile else ""))
    return rows


def batch_rows(reps: int, rel: float, sizes=(64, 128), batch: int = 64, gpu: bool = False) -> list[dict]:
    """The loader's case: a mini-batch of PtychoNN-like samples (``solar.synthetic``).

    solar decodes the whole batch with one ``decode_batch`` call (on the CPU, each blob through the
    one-blob fast path into its row of the result; elsewhere one sequence of tensor ops); the
    others decode sample by sample, as a training loop would have to. With ``gpu`` the batch
    is also decoded on CUDA (:func:`gpu_batch_rows`).
    """
    from solar.synthetic import ptycho_block

    rows = []
    comps = [c for c in (PySZ(), PySZ(openmp=True), ZFP()) if c.available()]
    for size in sizes:
        xs, ys = ptycho_block(0, batch, size=size)
        for fname, arr in ((f"ptycho x {size}x{size}", xs), (f"ptycho y {size}x{size}", ys)):
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            eb = rel * (float(arr.max()) - float(arr.min()))
            print(f"\n## batch of {batch}: {fname} {arr.shape[1:]} rel {rel:g}")
            print(f"{'decoder':34s} {'ratio':>8s} {'err/eb':>7s} {'dec MB/s':>9s}")
            blobs = [sc.encode(a, abs_error=eb) for a in arr]
            t0 = time.perf_counter()
            sc.decode_batch(blobs, compile=True)  # the one-time compile of this batch's shape
            first = time.perf_counter() - t0
            cbs = {c.name: [c.compress(a, eb) for a in arr] for c in comps}
            fns = {"solar decode_batch": lambda: sc.decode_batch(blobs),
                   "solar decode_batch (compiled)": lambda: sc.decode_batch(blobs, compile=True),
                   "solar decode, one by one": lambda: [sc.decode(b) for b in blobs],
                   "solar decode_batch (reference)": lambda: sc.decode_batch(blobs, decoder="reference")}
            if paths.kernel_available():
                fns["solar decode_batch (cpu-kernel)"] = lambda: sc.decode_batch(blobs, decoder="cpu-kernel")
                fns[f"solar decode_batch (cpu-kernel, all threads: {ALL_THREADS})"] = \
                    lambda: sc.decode_batch(blobs, decoder="cpu-kernel", threads=0)
            n_solar = len(fns)
            for c in comps:
                fns[f"{c.name}, one by one"] = lambda c=c: [c.decompress(b, a) for b, a in zip(cbs[c.name], arr)]
            outs, t = _interleaved(fns, reps)
            y = outs["solar decode_batch"]
            err = float(np.max(np.abs(y.numpy().astype(np.float64) - arr)))
            for k in list(fns)[1:n_solar]:
                yk = outs[k] if k != "solar decode, one by one" else torch.stack(outs[k])
                if not torch.equal(yk.view(torch.int32), y.view(torch.int32)):
                    raise SystemExit(f"{fname}: {k} differs from solar decode_batch")
            ratio = arr.nbytes / sum(map(len, blobs))
            cases = [(k, ratio, err, t[k]) for k in list(fns)[:n_solar]]
            for c in comps:
                cerr = max(float(np.max(np.abs(o.astype(np.float64) - a)))
                           for o, a in zip(outs[f"{c.name}, one by one"], arr))
                cases.append((f"{c.name}, one by one", arr.nbytes / sum(map(len, cbs[c.name])), cerr,
                              t[f"{c.name}, one by one"]))
            for name, r, e, t in cases:
                rows.append({"field": fname, "batch": batch, "rel": rel, "compressor": name, "ratio": r,
                             "max_err_over_bound": e / eb, "dec_MBps": arr.nbytes / t / 1e6, "bound_ok": e <= eb,
                             "compile_s": first if "compiled" in name else 0.0})
                print(f"{name:34s} {r:8.2f} {e / eb:7.4f} {arr.nbytes / t / 1e6:9.0f}"
                      + (f"   (first call, compiling: {first:.1f} s)" if "compiled" in name else ""))
            if gpu:
                rows += gpu_batch_rows(fname, arr, blobs, eb, y, rel, reps)
                bps = [sc.encode(a, abs_error=eb, codec={"id": "ebq", "lossless": "bitpack"}) for a in arr]
                rows += gpu_batch_rows(f"{fname} (bitpack)", arr, bps, eb, sc.decode_batch(bps), rel, reps)
    return rows


def overhead_rows(reps: int, calls: int = 300) -> list[dict]:
    """Microseconds per ``decode`` call of tiny float32 blobs (1 and 1,024 values) per solar decoder
    path, and per ``decompress`` call of pysz on the same values: the fixed cost of a call."""
    rng = np.random.default_rng(0)
    decoders = ["auto", "reference"] + (["cpu-kernel"] if paths.kernel_available() else [])
    rows = []
    print(f"\n## per-call overhead (target: a 1,024-value blob decodes in <= 15 us)\n{'decoder':34s} {'values':>7s} "
          f"{'us/call':>8s}")
    for n in (1, 1024):
        x = np.cumsum(rng.standard_normal(n)).astype(np.float32)
        eb = 1e-3 * (float(x.max()) - float(x.min())) or 1e-3
        blob = sc.encode(x, abs_error=eb)
        fns = {f"solar decode ({d})": (lambda d=d: sc.decode(blob, decoder=d)) for d in decoders}
        bp = sc.encode(x, abs_error=eb, codec={"id": "ebq", "lossless": "bitpack"})
        fns["solar decode (auto, bitpack)"] = lambda: sc.decode(bp)
        if PySZ().available():
            zb = PySZ().compress(x, eb)
            fns["SZ3 (pysz)"] = lambda: PySZ().decompress(zb, x)
        _, t = _interleaved({k: (lambda f=f: [f() for _ in range(calls)]) for k, f in fns.items()}, reps)
        for k in fns:
            rows.append({"overhead": True, "values": n, "compressor": k, "us_per_call": t[k] / calls * 1e6,
                         "bound_ok": True})
            print(f"{k:34s} {n:7d} {rows[-1]['us_per_call']:8.1f}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rel", type=float, nargs="+", default=[1e-3, 1e-2, 1e-4])
    ap.add_argument("--n", type=int, default=128, help="side of the synthetic 3-D fields")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fields", nargs="*", help="subset of field names")
    ap.add_argument("--no-batch", action="store_true", help="skip the mini-batch (loader) section")
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip the torch.compile-d decoder's rows (a cold inductor compile costs a minute)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="GPU decode figures: auto (when CUDA is there), cuda (required; also the mini-batch "
                         "section on the GPU), cpu (none); the CPU figures are always measured")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    use_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    torch.set_num_threads(1)

    solars = [Solar("zstd"), Solar("zstd", decoder="reference")]
    if paths.kernel_available():
        solars.append(Solar("zstd", decoder="cpu-kernel"))
    compiled = [] if args.no_compiled else [Solar("zstd", compile=True)]
    comps = [c for c in [*solars, *compiled, Solar("bitpack"), Solar("lz4"), PySZ(), H5SZ3(), ZFP(),
                         RawLossless("lz4"), RawLossless("zstd")] if c.available()]
    fields = all_fields(args.n)
    if args.fields:
        fields = {k: v for k, v in fields.items() if k in args.fields}
    rows = []
    for fname, x in fields.items():
        for rel in args.rel:
            eb = rel * (float(x.max()) - float(x.min()))
            print(f"\n## {fname} {x.shape} rel {rel:g} (abs {eb:.4g})")
            print(f"{'compressor':34s} {'ratio':>8s} {'err/eb':>7s} {'PSNR':>6s} {'enc MB/s':>9s} {'dec MB/s':>9s}")
            here = [c for c in comps if not (c.lossless and rel != args.rel[0])]
            for comp, r in zip(here, measure(here, x, eb, args.reps)):
                r.update(field=fname, shape=list(x.shape), rel=rel, compressor=comp.name)
                if comp.name in (SOLAR, SOLAR_BP) and use_gpu:  # 16 blobs: 134 MB at 128^3
                    r["gpu_dec_GBps"] = gpu_decode(x, eb, codec=comp.cfg)
                    r["gpu_dec_GBps_reference"] = gpu_decode(x, eb, decoder="reference", codec=comp.cfg)
                rows.append(r)
                gpu = f"  GPU {r['gpu_dec_GBps']:.1f} GB/s" if r.get("gpu_dec_GBps") else ""
                first = f"  (first decode, compiling: {r['compile_s']:.1f} s)" if r["compile_s"] else ""
                print(f"{comp.name:34s} {r['ratio']:8.2f} {r['max_err_over_bound']:7.4f} {r['psnr']:6.1f} "
                      f"{r['enc_MBps']:9.0f} {r['dec_MBps']:9.0f}{gpu}{first}")
    summary = summarize(rows, args.rel)
    if not args.no_batch:
        orows = overhead_rows(args.reps)
        rows += orows
        summary["overhead_us_per_call"] = {f"{r['compressor']}, {r['values']} values": r["us_per_call"]
                                           for r in orows}
    if not args.no_batch:
        brows = batch_rows(args.reps, args.rel[0], gpu=args.device == "cuda")
        rows += brows
        summary["batch"] = summarize_batches(brows)
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "all_threads": ALL_THREADS, "load_average": os.getloadavg(),
               "note": "shared 2-core machine; best-of-reps timings, contenders interleaved"}
    if use_gpu:
        machine["gpu"] = torch.cuda.get_device_name(0)
    Path(args.out).write_text(json.dumps({
        "machine": machine, "device": "cuda" if use_gpu else "cpu",
        "rows": rows, "summary": summary}, indent=1))
    print(f"\nwrote {args.out}")
    return 0 if all(r["bound_ok"] for r in rows) else 1


SOLAR, SOLAR_C, SZ3 = "solar ebq (zstd)", "solar ebq (zstd, compiled)", "SZ3 (pysz)"
SOLAR_BP = "solar ebq (bitpack)"
SOLAR_REF, SOLAR_K = "solar ebq (zstd, reference)", "solar ebq (zstd, cpu-kernel)"
SOLARS = (SOLAR, SOLAR_REF, SOLAR_K, SOLAR_C, SOLAR_BP)


def summarize(rows: list[dict], rels) -> dict:
    """Geometric means of solar / SZ3 (pysz): ratio and CPU decode speed, per bound."""
    out = {}
    print("\n## targets: solar ebq (zstd) vs SZ3 (pysz), geometric mean over fields")
    for rel in rels:
        pairs = {}
        for r in rows:
            if r["rel"] == rel and r["compressor"] in SOLARS + (SZ3,):
                pairs.setdefault(r["field"], {})[r["compressor"]] = r
        pairs = {f: p for f, p in pairs.items() if SOLAR in p and SZ3 in p}
        if not pairs:
            continue

        def gm(key, solar=SOLAR):
            vals = [p[solar][key] / p[SZ3][key] for p in pairs.values() if solar in p]
            return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

        out[str(rel)] = {"ratio_vs_sz3": gm("ratio"), "cpu_decode_speed_vs_pysz": gm("dec_MBps"),
                         "bitpack": {"ratio_vs_sz3": gm("ratio", SOLAR_BP), "cpu_decode_speed_vs_pysz":
                                     gm("dec_MBps", SOLAR_BP)},
                         "cpu_decode_speed_vs_pysz_compiled": gm("dec_MBps", SOLAR_C),
                         "cpu_decode_speed_vs_pysz_by_path": {k: gm("dec_MBps", k) for k in SOLARS},
                         "per_field_decode_vs_pysz": {f: {k: p[k]["dec_MBps"] / p[SZ3]["dec_MBps"]
                                                          for k in SOLARS if k in p}
                                                      for f, p in pairs.items()},
                         "bound_held": all(r["bound_ok"] for r in rows if r["rel"] == rel)}
        s = out[str(rel)]
        by = ", ".join(f"{k.removeprefix('solar ebq (').rstrip(')')} {v:.2f}x"
                       for k, v in s["cpu_decode_speed_vs_pysz_by_path"].items() if v == v)
        print(f"rel {rel:g}: ratio {s['ratio_vs_sz3']:.3f}x SZ3 (target >= 1.0), single-thread decode vs pysz "
              f"(target >= 3): {by}; bound held: {s['bound_held']}; bitpack: ratio "
              f"{s['bitpack']['ratio_vs_sz3']:.3f}x SZ3")
    return out


def summarize_batches(rows: list[dict]) -> dict:
    """Mini-batch decode (solar ``decode_batch``, eager and compiled) / pysz sample by sample."""
    by = {}
    for r in rows:
        by.setdefault(r["field"], {})[r["compressor"]] = r["dec_MBps"]
    out = {}
    sz1, szn = "SZ3 (pysz), one by one", f"SZ3 (pysz, OpenMP, all threads: {ALL_THREADS}), one by one"
    names = [(k, szn if "all threads" in k else sz1) for k in dict.fromkeys(k for d in by.values() for k in d)
             if k.startswith("solar")]
    for name, base in names:
        vals = {f: d[name] / d[base] for f, d in by.items() if name in d and base in d}
        if vals:
            out[name] = {"per_field_vs_pysz": vals, "against": base,
                         "geomean_vs_pysz": math.exp(sum(map(math.log, vals.values())) / len(vals))}
            print(f"batches: {name} {out[name]['geomean_vs_pysz']:.2f}x {base} (geometric mean over {len(vals)} "
                  "batches)")
    return out


if __name__ == "__main__":
    sys.exit(main())
