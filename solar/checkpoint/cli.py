"""``solar-ckpt`` (also ``solar ckpt``): inspect, compare, check, restore and clean checkpoints.

Works without the training code: every command reads the root (or plain ``.pt`` / ``.safetensors``
files for ``diff``) on its own. Human output is tables; ``--json`` is for scripts. Exit codes: 0
success, 1 a check failed (``verify`` found corruption, ``diff --exit-code`` found differences), 2
bad input or an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from solar.errors import SolarError
from solar.fileio import write_atomic

__all__ = ["main", "configure", "run"]


def _bytes(n: float) -> str:
    from .diff import fmt_bytes

    return fmt_bytes(n)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    from .diff import table

    return table(head, rows)


def _emit(args, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2, default=str) if getattr(args, "json", False) else text)


def _ref(ref: str) -> tuple[str, int | None]:
    from .store import parse_ref

    return parse_ref(ref)


# -- commands --

def cmd_log(args) -> int:
    from solar.errors import CorruptDataError

    from .store import CheckpointStore

    store = CheckpointStore(args.root)
    rows, out = [], []
    total_logical = total_written = 0
    for step in store.steps():
        try:
            m = store.read_manifest(step)
        except CorruptDataError as exc:
            out.append({"step": step, "complete": False, "error": str(exc)})
            rows.append([step, "incomplete (ignored)", "", "", "", "", ""])
            continue
        written = int(m.stats.get("bytes_written", 0))
        total_logical += m.logical_bytes
        total_written += written
        ratio = m.logical_bytes / written if written else float("inf")
        out.append({"step": m.step, "complete": True, "created": m.created, "tensors": len(m.tensors),
                    "logical_bytes": m.logical_bytes, "bytes_written": written, "chunks": m.nchunks,
                    "chunks_written": m.stats.get("chunks_written"), "dedup_ratio": ratio, "root": m.root})
        rows.append([m.step, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)), len(m.tensors),
                     _bytes(m.logical_bytes), _bytes(written), f"{m.stats.get('chunks_written', '?')}/{m.nchunks}",
                     "inf" if ratio == float("inf") else f"{ratio:.1f}x"])
    summary = {"root": store.root, "versions": out, "logical_bytes": total_logical, "bytes_written": total_written,
               "dedup_ratio": total_logical / total_written if total_written else None}
    text = _table(["step", "created", "tensors", "logical", "written", "new chunks", "dedup"], rows)
    if total_written:
        text += f"\n{len(rows)} versions, {_bytes(total_logical)} logical, {_bytes(total_written)} written ({total_logical / total_written:.1f}x de-duplication)"
    elif not rows:
        text = f"no checkpoints in {store.root}"
    _emit(args, summary, text)
    return 0


def cmd_diff(args) -> int:
    from .diff import diff, format_report

    rep = diff(args.a, args.b, values=args.values, atol=args.atol, rtol=args.rtol)
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
    from .store import CheckpointStore

    root, step = _ref(args.ref)
    m = CheckpointStore(root).resolve(step)
    blob_users: dict[int, list[str]] = {}
    for t in m.tensors:
        blob_users.setdefault(t.blob, []).append(t.name)
    rows = []
    for t in m.tensors:
        shared = [n for n in blob_users[t.blob] if n != t.name]
        rows.append([t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", _bytes(t.nbytes), t.device,
                     m.blobs[t.blob].nchunks, ("shares storage with " + ", ".join(shared)) if shared else ""])
    leaves: list = []
    _skeleton_leaves(m.skeleton, "", leaves)
    payload = {"step": m.step, "root": m.root, "hash": m.hash, "chunk_size": m.chunk_size, "created": m.created,
               "parent": m.parent, "logical_bytes": m.logical_bytes, "chunks": m.nchunks, "stats": m.stats,
               "meta": m.meta, "tensors": [t.to_json() for t in m.tensors], "values": dict(leaves)}
    text = (f"step {m.step} of {root}: {len(m.tensors)} tensors, {_bytes(m.logical_bytes)} in {m.nchunks} chunks of "
            f"{_bytes(m.chunk_size)} ({m.hash}), Merkle root {m.root[:16]}..., parent {m.parent}\n")
    text += _table(["tensor", "dtype", "shape", "bytes", "device", "chunks", ""], rows)
    if leaves:
        text += "\n\nother entries:\n" + _table(["key", "value"], [[k, v if len(v) < 60 else v[:57] + "..."] for k, v in leaves])
    _emit(args, payload, text)
    return 0


def cmd_verify(args) -> int:
    from .verify import verify

    root, step = _ref(args.ref)
    rep = verify(root, step, progress=not args.json)
    payload = {"root": rep.root, "ok": rep.ok, "steps": rep.steps, "chunks_checked": rep.chunks_checked,
               "bytes_checked": rep.bytes_checked, "problems": rep.problems, "incomplete": rep.incomplete}
    lines = [f"ignored incomplete manifest of step {p['step']}: {p['detail']}" for p in rep.incomplete]
    for p in rep.problems:
        what = f"chunk {p['chunk']}" if p["kind"] == "chunk" else f"{p['kind']} of step {p.get('step')}"
        steps = p.get("steps", [p.get("step")])
        lines.append(f"CORRUPT {what}: {p['detail']}; steps {steps}; tensors: {', '.join(p['tensors']) or '-'}")
    status = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problems)"
    lines.append(f"verify {root}: {status}: {len(rep.steps)} versions, {rep.chunks_checked} chunks, {_bytes(rep.bytes_checked)} re-hashed")
    _emit(args, payload, "\n".join(lines))
    return 0 if rep.ok else 1




def _export_safetensors(reader, path: str) -> int:
    from safetensors.torch import save_file

    from .flatten import materialize

    from tqdm import tqdm

    m = reader.manifest
    buffers = {}
    tensors = {}
    for ref in tqdm(m.tensors, desc=f"export step {m.step}", unit="tensor", leave=False, disable=None):
        if ref.blob not in buffers:
            buffers[ref.blob] = reader.read_blob(ref.blob)
        (t,) = materialize([ref], buffers)
        tensors[ref.name] = t.detach().contiguous().clone()  # safetensors refuses shared or strided storage
    metadata = {"solar_step": str(m.step), "solar_root": m.root, "solar_skeleton": json.dumps(m.skeleton)}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return len(tensors)


def cmd_restore(args) -> int:
    import torch

    from .loader import Reader

    root, step = _ref(args.ref)
    reader = Reader(root, step)
    fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "pt")
    if fmt == "safetensors":
        n = _export_safetensors(reader, args.output)
        print(f"wrote {n} tensors of step {reader.manifest.step} to {args.output} (safetensors)")
        return 0
    state = reader.state_dict(map_location="cpu", progress=True)
    write_atomic(args.output, lambda tmp: torch.save(state, tmp))
    print(f"wrote step {reader.manifest.step} to {args.output} (torch.save)")
    return 0


def cmd_gc(args) -> int:
    from .collect import gc

    rep = gc(args.root, args.keep_last, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    payload = dict(rep.to_json(), dry_run=args.dry_run)
    _emit(args, payload, f"kept versions {rep.kept}; {verb} versions {rep.removed_versions}, "
                         f"{len(rep.removed_torn)} incomplete manifests and {rep.removed_chunks} unreferenced chunks")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    p = sub.add_parser("log", help="versions, bytes written per version, de-duplication ratio")
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_log)
    p = sub.add_parser("diff", help="compare ROOT@STEP, .pt or .safetensors checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true")
    p.add_argument("--values", action="store_true", help="load changed tensors and compare values")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.add_argument("--exit-code", action="store_true", help="exit 1 if the checkpoints differ")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("show", help="tensors and values of one version")
    p.add_argument("ref", metavar="ROOT@STEP")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("verify", help="recompute every hash; name corrupt chunks and the tensors they touch")
    p.add_argument("ref", metavar="ROOT[@STEP]")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)
    for name, help_ in (("restore", "write one version as a torch.save (.pt) or .safetensors file"),
                        ("export", "export one version (default format: safetensors)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("ref", metavar="ROOT@STEP")
        p.add_argument("-o", "--output", required=True)
        p.add_argument("--format", choices=["pt", "safetensors"], default="safetensors" if name == "export" else None)
        p.set_defaults(func=cmd_restore)
    p = sub.add_parser("gc", help="remove old versions and unreferenced chunks")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, default=None, metavar="K")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)


def run(args: argparse.Namespace) -> int:
    prog = "solar-ckpt"
    try:
        return int(args.func(args) or 0)
    except (SolarError, FileNotFoundError, ValueError) as exc:
        print(f"{prog} {args.ckpt_command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="solar-ckpt", description=(__doc__ or "").splitlines()[0])
    configure(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
