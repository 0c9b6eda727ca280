"""``solar-ckpt`` (also ``solar ckpt``): inspect, compare, check, restore and clean checkpoints.

Works without the training code: every command reads the root (or plain ``.pt`` / ``.safetensors``
files for ``diff``) on its own. Human output is tables; ``--json`` is for scripts. Exit codes: 0
success, 1 a check failed (``verify`` found corruption, ``diff --exit-code`` found differences), 2
bad input or an error (including the environment: a root ``gc`` or ``verify --repair`` cannot write),
always as one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
from tqdm import tqdm

from solar.errors import CheckpointError, InputError, SolarError
from solar.fileio import write_atomic

from .collect import gc
from .repack import repack
from .compare import diff
from .deltastats import increment
from .flatten import DTYPES, materialize
from .jobreport import job_log, job_show, stored_bytes, totals_line
from .jobstore import JobStore, is_job_root
from .reader import Reader
from .reshard import whole_state, whole_tensors
from .sources import load_dcp
from .writer import CheckpointWriter
from .report import INCREMENT_HEAD, fmt_bytes, format_report, increment_cells, table
from .store import CheckpointStore, parse_ref
from .verify import verify

__all__ = ["main", "configure", "run"]


def _strict(obj: Any) -> Any:
    """``obj`` with non-finite floats as ``None``: JSON has no Infinity or NaN (``json.dumps`` would
    write them anyway, and strict parsers reject them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _emit(args, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(_strict(payload), indent=2, default=str, allow_nan=False))
    else:
        print(text)


# -- commands --

def cmd_log(args) -> int:
    store = CheckpointStore(args.root)
    if is_job_root(store):
        _emit(args, *job_log(JobStore(store), args.rank))
        return 0
    rows, out = [], []
    total_logical = total_written = 0
    # versions a keep_last writer removes while this runs are left out, not reported as missing
    listed = store.listed_manifests()
    damaged = dict(listed.damaged)
    manifests = {m.step: m for m in listed.good}
    for step in sorted(damaged.keys() | manifests.keys()):
        if step in damaged:
            out.append({"step": step, "complete": False, "error": str(damaged[step])})
            rows.append([step, "incomplete (ignored)", "", "", "", "", ""])
            continue
        m = manifests[step]
        written = int(m.stats.get("bytes_written", 0))
        total_logical += m.logical_bytes
        total_written += written
        # nothing new written means an infinite ratio; JSON has no Infinity (json.dumps would emit an
        # invalid token that strict parsers reject), so --json says null and the table says "inf"
        ratio = m.logical_bytes / written if written else None
        out.append({"step": m.step, "complete": True, "created": m.created, "tensors": len(m.tensors),
                    "logical_bytes": m.logical_bytes, "bytes_written": written, "chunks": m.nchunks,
                    "chunks_written": m.stats.get("chunks_written"),
                    "chunks_rewritten": m.stats.get("chunks_rewritten", 0), "dedup_ratio": ratio, "root": m.root,
                    **increment(m.stats)})
        rows.append([m.step, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)), len(m.tensors),
                     fmt_bytes(m.logical_bytes), fmt_bytes(written),
                     f"{m.stats.get('chunks_written', '?')}/{m.nchunks}",
                     "inf" if ratio is None else f"{ratio:.1f}x", *increment_cells(increment(m.stats))])
    stored = stored_bytes(store)  # what the root holds now, not what every save once wrote
    base = stored if stored is not None else total_written
    summary = {"root": store.root, "versions": out, "logical_bytes": total_logical, "bytes_written": total_written,
               "stored_bytes": stored, "dedup_ratio": total_logical / base if base else None}
    text = table(["step", "created", "tensors", "logical", "written", "new chunks", "dedup", *INCREMENT_HEAD], rows)
    unreadable = f" (+{len(damaged)} unreadable manifests)" if damaged else ""
    if total_written:
        text += "\n" + totals_line(len(manifests), total_logical, total_written, stored, unreadable)
    elif not rows:
        store.require_root()  # the parent of a root (a mistyped path) is an error, not an empty log
        text = f"no checkpoints in {store.root}"
    _emit(args, summary, text)
    return 0


def _check_safetensors_input(path: str) -> None:
    """Read the header of a ``.safetensors`` input so a damaged one is reported by name.

    The safetensors reader raises its own ``SafetensorError`` (no built-in base, no file name), which
    would otherwise escape as a traceback with exit 1, the code that means "checkpoints differ".
    """
    if not (str(path).endswith(".safetensors") and os.path.isfile(path)):
        return
    # safetensors is an optional dependency (the `safetensors` extra); only its inputs reach here
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except SafetensorError as exc:
        raise InputError(f"{path}: cannot read as a .safetensors file ({exc}); the file is damaged or not "
                         f"safetensors: re-export or re-download it, or compare a .pt, ROOT@STEP or DCP "
                         f"checkpoint") from exc


def cmd_diff(args) -> int:
    for ref in (args.a, args.b):
        _check_safetensors_input(ref)
    rep = diff(args.a, args.b, values=args.values, atol=args.atol, rtol=args.rtol, trust_pickle=args.trust_pickle,
               prefix=args.prefix, rank=args.rank)
    _emit(args, rep.to_json(), format_report(rep))
    return 1 if args.exit_code and not rep.identical else 0


def _skeleton_leaves(obj: Any, path: str, out: list) -> None:
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            _skeleton_leaves(v, f"{path}.{i}" if path else str(i), out)
    elif isinstance(obj, dict):
        if len(obj) == 1 and next(iter(obj)) in ("__dict__", "__odict__"):
            for k, v in next(iter(obj.values())):
                _skeleton_leaves(v, f"{path}.{k}" if path else str(k), out)
        elif len(obj) == 1 and next(iter(obj)) == "__tuple__":
            _skeleton_leaves(obj["__tuple__"], path, out)
        elif len(obj) == 1 and next(iter(obj)).startswith("__") and next(iter(obj)) != "__tensor__":
            out.append((path, json.dumps(obj)))
        elif "__tensor__" not in obj:
            for k, v in obj.items():
                _skeleton_leaves(v, f"{path}.{k}" if path else str(k), out)
    else:
        out.append((path, json.dumps(obj)))


def cmd_show(args) -> int:
    root, step = parse_ref(args.ref)
    store = CheckpointStore(root)
    if is_job_root(store) and args.rank is None:
        _jm, payload, text = job_show(JobStore(store), step)
        _emit(args, payload, text)
        return 0
    m = Reader(root, step, store=store, rank=args.rank).manifest
    blob_users: dict[int, list[str]] = {}
    for t in m.tensors:
        blob_users.setdefault(t.blob, []).append(t.name)
    rows = []
    for t in m.tensors:
        shared = [n for n in blob_users[t.blob] if n != t.name]
        rows.append([t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", fmt_bytes(t.nbytes), t.device,
                     m.blobs[t.blob].nchunks, ("shares storage with " + ", ".join(shared)) if shared else ""])
    leaves: list = []
    _skeleton_leaves(m.skeleton, "", leaves)
    payload = {"step": m.step, "root": m.root, "hash": m.hash, "chunk_size": m.chunk_size, "created": m.created,
               "parent": m.parent, "logical_bytes": m.logical_bytes, "chunks": m.nchunks, "stats": m.stats,
               "meta": m.meta, "tensors": [t.to_json() for t in m.tensors], "values": dict(leaves)}
    text = (f"step {m.step} of {root}: {len(m.tensors)} tensors, {fmt_bytes(m.logical_bytes)} in {m.nchunks} chunks of "
            f"{fmt_bytes(m.chunk_size)} ({m.hash}), Merkle root {m.root[:16]}..., parent {m.parent}\n")
    text += table(["tensor", "dtype", "shape", "bytes", "device", "chunks", ""], rows)
    if leaves:
        short = [[k, v if len(v) < 60 else v[:57] + "..."] for k, v in leaves]
        text += "\n\nother entries:\n" + table(["key", "value"], short)
    _emit(args, payload, text)
    return 0


def cmd_verify(args) -> int:
    root, step = parse_ref(args.ref)
    rep = verify(root, step, progress=not args.json, repair=args.repair)
    payload = {"root": rep.root, "ok": rep.ok, "steps": rep.steps, "chunks_checked": rep.chunks_checked,
               "bytes_checked": rep.bytes_checked, "problems": rep.problems, "incomplete": rep.incomplete,
               "removed_chunks": rep.removed_chunks, "marked_chunks": rep.marked_chunks, "skipped": rep.skipped}
    lines = [f"ignored incomplete manifest of step {p['step']}: {p['detail']}" for p in rep.incomplete]
    lines += [f"skipped step {s}: removed while being verified (a writer's keep_last retention or a gc); "
              "nothing is corrupt" for s in rep.skipped]
    for p in rep.problems:
        what = f"chunk {p['chunk']}" if p["kind"] == "chunk" else f"{p['kind']} of step {p.get('step')}"
        steps = p.get("steps", [p.get("step")])
        lines.append(f"CORRUPT {what}: {p['detail']}; steps {steps}; tensors: {', '.join(p['tensors']) or '-'}")
    if rep.marked_chunks:
        lines.append(f"repair: deleted {len(rep.removed_chunks)} damaged chunks and marked "
                     f"{len(rep.marked_chunks)} damaged or missing ones; the next writer's save that "
                     "produces their bytes rewrites them (until then the steps above cannot be loaded)")
    status = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problems)"
    lines.append(f"verify {root}: {status}: {len(rep.steps)} versions, {rep.chunks_checked} chunks, "
                 f"{fmt_bytes(rep.bytes_checked)} re-hashed")
    _emit(args, payload, "\n".join(lines))
    return 0 if rep.ok else 1


def _check_output(path: str) -> None:
    """Fail before reading anything if ``path`` cannot become a file.

    Otherwise torch.save, safetensors and the atomic rename each fail in their own way (RuntimeError,
    SafetensorError, IsADirectoryError) only after the whole version was read, as a traceback.
    """
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise InputError(f"output {path} is a directory; give a file path such as "
                         f"{os.path.join(path, 'checkpoint.pt')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise InputError(f"output {path}: {parent} {what}; create the directory (mkdir -p {parent}) "
                         "or choose another -o path")
    if not os.access(parent, os.W_OK):
        raise InputError(f"output {path}: directory {parent} is not writable; fix its permissions "
                         "or choose another -o path")


def _write_output(path: str, write) -> None:
    """``write_atomic`` with failures of the write itself (disk full, I/O error) named by path."""
    # safetensors is an optional dependency (the `safetensors` extra); its writer raises its own error type
    from safetensors import SafetensorError

    try:
        write_atomic(path, write)
    except (OSError, RuntimeError, SafetensorError) as exc:  # torch.save reports I/O as RuntimeError
        raise CheckpointError(f"cannot write {path} ({exc}); check free space and permissions there; "
                              f"nothing was written") from exc


def _safetensors_dtypes() -> set:
    """The torch dtypes this safetensors version can write (complex32 and complex128 are not among them)."""
    # safetensors is an optional dependency (the `safetensors` extra), needed only to export
    import safetensors.torch as st

    sizes = getattr(st, "_SIZE", None)  # save_file looks dtypes up in this table (a KeyError otherwise)
    if isinstance(sizes, dict):
        return {d for d in sizes if d is not None}
    return {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
            torch.int16, torch.int8, torch.uint8, torch.bool}


def _export_safetensors(reader, path: str, whole_root: str | None = None) -> int:
    # safetensors is an optional dependency (the `safetensors` extra), needed only to export
    from safetensors.torch import save_file

    m = reader.manifest
    supported = _safetensors_dtypes()
    for ref in m.tensors:  # before reading any chunk: safetensors would fail with a bare KeyError
        if DTYPES[ref.dtype] not in supported:
            raise InputError(f"cannot export step {m.step} to {path}: tensor {ref.name!r} has dtype {ref.dtype}, "
                             f"which safetensors cannot store; restore it as a .pt file instead "
                             f"(-o FILE.pt or --format pt keeps every dtype), or cast the tensor before saving")
    buffers = {}
    tensors = {}
    if whole_root is not None:  # a job root: rank 0's tensors with every sharded one reassembled
        whole = whole_tensors(whole_root, m.step)
        tensors = {ref.name: t.detach().contiguous().clone() for ref, t in zip(whole.manifest.tensors, whole.tensors)}
    for ref in tqdm(m.tensors if whole_root is None else [], desc=f"export step {m.step}", unit="tensor", leave=False,
                    disable=None):
        if ref.blob not in buffers:
            buffers[ref.blob] = reader.read_blob(ref.blob)
        (t,) = materialize([ref], buffers)
        tensors[ref.name] = t.detach().contiguous().clone()  # safetensors refuses shared or strided storage
    metadata = {"solar_step": str(m.step), "solar_root": m.root, "solar_skeleton": json.dumps(m.skeleton)}
    if whole_root is not None:
        metadata["solar_job_world_size"] = str(reader.jobs.read_global(m.step).world_size)
    _write_output(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return len(tensors)


_PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # what torch.save files are usually called


def _output_format(args) -> str:
    """The format to write ``args.output`` in, refusing a name that says the other format.

    ``restore`` picks it from the extension; ``export`` writes safetensors. Writing safetensors
    bytes under a ``.pt`` name (or a torch.save pickle under ``.safetensors``) would produce a file that
    ``torch.load`` and ``diff`` reject with confusing errors, so a contradiction between the
    name and the format is an error before anything is read. ``--format`` with an unusual name
    (``model.bin --format safetensors``) is allowed: that choice is explicit.
    """
    path = str(args.output)
    lower = path.lower()
    if args.format is None:
        if args.ckpt_command == "export" and not lower.endswith(".safetensors"):
            raise InputError(f"export writes safetensors, but output {path} does not end in .safetensors; name it "
                             f"FILE.safetensors (or pass --format safetensors to keep this name), or write a "
                             f"torch.save file with `solar-ckpt restore {args.ref} -o {path}`")
        return "safetensors" if lower.endswith(".safetensors") else "pt"
    if args.format == "safetensors" and lower.endswith(_PT_SUFFIXES):
        raise InputError(f"output {path} is named like a torch.save file but --format safetensors was given "
                         f"(torch.load could not read it); name it FILE.safetensors, or drop --format to "
                         f"write a torch.save file (`solar-ckpt restore {args.ref} -o {path}`)")
    if args.format == "pt" and lower.endswith(".safetensors"):
        raise InputError(f"output {path} is named like a safetensors file but --format pt was given "
                         f"(safetensors readers could not read it); name it FILE.pt, or drop --format")
    return args.format


def _export_dcp(state: Any, path: str) -> None:
    """Write ``state`` as a torch.distributed.checkpoint directory (one process)."""
    # torch.distributed.checkpoint is imported only for --format dcp: it is large
    import torch.distributed.checkpoint as dcp

    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise InputError(f"output {path} exists; --format dcp writes a new directory: give another -o path")
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=path, no_dist=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot write the DCP directory {path} ({exc}); check free space and permissions") \
            from exc


def cmd_restore(args) -> int:
    if args.format == "dcp":
        root, step = parse_ref(args.ref)
        reader = Reader(root, step, rank=args.rank if args.rank is not None else _first_rank(root))
        state = _state_of(reader, root, args)
        _export_dcp(state, args.output)
        print(f"wrote step {reader.manifest.step} to {args.output} (torch.distributed.checkpoint)")
        return 0
    _check_output(args.output)
    fmt = _output_format(args)
    root, step = parse_ref(args.ref)
    reader = Reader(root, step, rank=args.rank if args.rank is not None else _first_rank(root))
    if fmt == "safetensors":
        whole = root if reader.jobs is not None and args.rank is None else None  # the whole job, shards reassembled
        n = reader.retry_if_removed(lambda: _export_safetensors(reader, args.output, whole))
        print(f"wrote {n} tensors of step {reader.manifest.step} to {args.output} (safetensors)")
        return 0
    state = _state_of(reader, root, args)
    _write_output(args.output, lambda tmp: torch.save(state, tmp))
    print(f"wrote step {reader.manifest.step} to {args.output} (torch.save)")
    return 0


def _state_of(reader: Reader, root: str, args) -> Any:
    """What restore writes: on a job root without --rank the whole job, shards reassembled."""
    if reader.jobs is not None and args.rank is None:
        return whole_state(root, reader.manifest.step, weights_only=not args.trust_pickle)
    return reader.state_dict(map_location="cpu", progress=True, weights_only=not args.trust_pickle)


def _first_rank(root: str) -> int | None:
    """Rank 0 on a job root (whose whole state restore reassembles), None on a single root."""
    return 0 if is_job_root(CheckpointStore(root)) else None


def cmd_import(args) -> int:
    """A torch.distributed.checkpoint directory as one version of a (single-process) root."""
    if not os.path.isfile(os.path.join(args.dcp, ".metadata")):
        raise InputError(f"{args.dcp} is not a torch.distributed.checkpoint directory (it has no .metadata)")
    state = load_dcp(args.dcp, args.trust_pickle)
    with CheckpointWriter(args.root, chunk_size=args.chunk_size) as w:
        res = w.save(state, args.step, meta={"imported_from": os.path.abspath(args.dcp)}).result()
    _emit(args, {"root": res.root, "step": res.step, "logical_bytes": res.logical_bytes,
                 "bytes_written": res.bytes_written},
          f"imported {args.dcp} as step {res.step} of {res.root}: {fmt_bytes(res.logical_bytes)}, "
          f"{fmt_bytes(res.bytes_written)} written")
    return 0


def cmd_gc(args) -> int:
    rep = gc(args.root, args.keep_last, dry_run=args.dry_run)
    # then the packs the kept versions use only partly (solar/checkpoint/repack.py)
    packs = repack(args.root, dry_run=args.dry_run) if not args.no_repack else None
    verb = "would remove" if args.dry_run else "removed"
    payload = dict(rep.to_json(), dry_run=args.dry_run, repack=packs.to_json() if packs else None)
    repacked = (f"; {'would repack' if args.dry_run else 'repacked'} {len(packs.packs_rewritten)} partly dead packs "
                f"({fmt_bytes(max(packs.bytes_freed, 0))} freed)" if packs and packs.packs_rewritten else "")
    _emit(args, payload, f"kept versions {rep.kept}; {verb} versions {rep.removed_versions}, "
                         f"{len(rep.removed_torn)} incomplete manifests and {rep.removed_chunks} unreferenced chunks"
                         f"{repacked}")
    return 0


def _rank_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="on a job root (written with CheckpointWriter(root, comm=...)): rank R's state alone "
                        "(default: the version across all ranks)")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    p = sub.add_parser("log", help="versions, bytes written per version, de-duplication ratio")
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    _rank_option(p)
    p.set_defaults(func=cmd_log)
    p = sub.add_parser("diff", help="compare ROOT@STEP, .pt or .safetensors checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true")
    p.add_argument("--values", action="store_true", help="load changed tensors and compare values")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.add_argument("--exit-code", action="store_true",
                   help="exit 1 if the checkpoints differ (tensors or plain values)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="load .pt/DCP inputs with weights_only=False, for files whose state holds other objects "
                        "(numpy arrays ...); only for files you trust: unpickling can run arbitrary code")
    p.add_argument("--prefix", default=None, metavar="PREFIX",
                   help="compare the tensors under this name prefix of one side (e.g. ema.) with the other side's; "
                        "default: found automatically, an error if two prefixes match equally well; '' compares "
                        "names as they are")
    _rank_option(p)
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("show", help="tensors and values of one version")
    p.add_argument("ref", metavar="ROOT@STEP")
    p.add_argument("--json", action="store_true")
    _rank_option(p)
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("verify", help="recompute every hash; name corrupt chunks and the tensors they touch")
    p.add_argument("ref", metavar="ROOT[@STEP]")
    p.add_argument("--json", action="store_true")
    p.add_argument("--repair", action="store_true",
                   help="delete damaged chunks and mark them and missing ones, so the next writer's saves "
                        "rewrite them (takes the writer lock)")
    p.set_defaults(func=cmd_verify)
    for name, help_, fmt_help in (
            ("restore", "write one version as a torch.save (.pt) or .safetensors file",
             "default: from the extension of -o (.safetensors: safetensors, anything else: torch.save)"),
            ("export", "export one version as a .safetensors file",
             "default: safetensors, and -o must end in .safetensors (use `restore -o FILE.pt` for torch.save)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("ref", metavar="ROOT@STEP")
        p.add_argument("-o", "--output", required=True)
        # no argparse default: an explicit --format is told apart from the default (see _output_format)
        p.add_argument("--format", choices=["pt", "safetensors", "dcp"], default=None,
                       help=fmt_help + "; dcp: a torch.distributed.checkpoint directory (-o names a new directory)")
        p.add_argument("--trust-pickle", action="store_true",
                       help="unpickle the version's non-tensor objects with the full unpickler, not only through "
                            "the allow-list of safe globals; only for a root you trust: unpickling can run "
                            "arbitrary code")
        _rank_option(p)
        p.set_defaults(func=cmd_restore)
    p = sub.add_parser("import", help="save a torch.distributed.checkpoint directory as a version of ROOT")
    p.add_argument("dcp", metavar="DCP_DIR")
    p.add_argument("root")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=1 << 20)
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-pickle", action="store_true",
                   help="unpickle the directory's non-tensor objects with the full unpickler; only for files you "
                        "trust: unpickling can run arbitrary code")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser("gc", help="remove old versions and unreferenced chunks")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, default=None, metavar="K")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--no-repack", action="store_true",
                   help="leave packs whose chunks are partly dead as they are (by default a pack at least a quarter "
                        "dead is rewritten with its live chunks only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)


def run(args: argparse.Namespace) -> int:
    prog = "solar-ckpt"
    try:
        return int(args.func(args) or 0)
    except (SolarError, FileNotFoundError, ValueError) as exc:
        print(f"{prog} {args.ckpt_command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # an environment error (permissions, read-only or full file system, I/O error) is "an
        # error", exit 2: a traceback with exit 1 would read as "a check failed"
        print(f"{prog} {args.ckpt_command}: error: {exc}; check that the checkpoint root and its files are "
              "readable (and writable for gc and verify --repair)", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="solar-ckpt", description=(__doc__ or "").splitlines()[0])
    configure(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
