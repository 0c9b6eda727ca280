"""``solar-ckpt log`` and ``show`` on a job root: one row per version across ranks (sums over the
ranks' parts), or one rank's detail with ``--rank``."""

from __future__ import annotations

import os
import time
from typing import Any

from solar.errors import CorruptDataError

from .jobstore import JobManifest, JobStore
from .report import fmt_bytes, table
from .store import CheckpointStore

__all__ = ["job_log", "job_show", "stored_bytes", "totals_line"]


def stored_bytes(store: CheckpointStore) -> int | None:
    """The bytes the root holds now (chunks, packs, deltas, manifests, parts): what ``log`` reports
    after a ``gc`` removed versions, rather than the sum of what every save once wrote. ``None``
    for a remote root (listing every object's size would cost a request per object there)."""
    if store.local_dir is None:
        return None
    total = 0
    for d, dirs, files in os.walk(store.local_dir):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        total += sum(os.lstat(os.path.join(d, f)).st_size for f in files if not f.startswith("."))
    return total


def totals_line(versions: int, logical: int, written: int, stored: int | None, note: str = "") -> str:
    """``log``'s last line: what the listed versions hold and what the root stores for them."""
    if stored is None:  # remote: the saves' own counts, which gc does not lower
        return (f"{versions} versions{note}, {fmt_bytes(logical)} logical, {fmt_bytes(written)} written by their saves "
                f"({logical / max(written, 1):.1f}x de-duplication)")
    return (f"{versions} versions{note}, {fmt_bytes(logical)} logical, {fmt_bytes(stored)} stored "
            f"({logical / max(stored, 1):.1f}x de-duplication); their saves wrote {fmt_bytes(written)}")


def _created(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def job_log(jobs: JobStore, rank: int | None) -> tuple[dict, str]:
    """``log``'s payload and table for a job root."""
    rows, out = [], []
    logical_total = written_total = 0
    for step in jobs.steps():
        try:
            jm = jobs.read_global(step)
            parts = [jobs.part(jm, r) for r in ([rank] if rank is not None else range(jm.world_size))]
        except CorruptDataError as exc:
            out.append({"step": step, "complete": False, "error": str(exc)})
            rows.append([step, "incomplete (ignored)", "", "", "", "", "", ""])
            continue
        logical = sum(p.logical_bytes for p in parts)
        written = sum(int(p.stats.get("bytes_written", 0)) for p in parts)
        new = sum(int(p.stats.get("chunks_written", 0)) for p in parts)
        chunks = sum(p.nchunks for p in parts)
        logical_total += logical
        written_total += written
        ratio = logical / written if written else None
        out.append({"step": step, "complete": True, "created": jm.created, "world_size": jm.world_size,
                    "tensors": sum(len(p.tensors) for p in parts), "logical_bytes": logical, "bytes_written": written,
                    "chunks": chunks, "chunks_written": new, "dedup_ratio": ratio, "root": jm.root})
        rows.append([step, _created(jm.created), jm.world_size, sum(len(p.tensors) for p in parts),
                     fmt_bytes(logical), fmt_bytes(written), f"{new}/{chunks}",
                     "inf" if ratio is None else f"{ratio:.1f}x"])
    uncommitted = sorted(set(jobs.part_steps()) - set(jobs.steps()))
    stored = stored_bytes(jobs.store)
    base = stored if stored is not None else written_total
    payload = {"root": jobs.root, "job": True, "rank": rank, "versions": out, "logical_bytes": logical_total,
               "bytes_written": written_total, "stored_bytes": stored, "uncommitted_parts": uncommitted,
               "dedup_ratio": logical_total / base if base else None}
    if not rows:
        return payload, f"no checkpoints in job root {jobs.root}"
    who = f"rank {rank}" if rank is not None else "all ranks"
    text = table(["step", "created", "ranks", "tensors", "logical", "written", "new chunks", "dedup"], rows)
    text += f"\njob root, {who}: " + totals_line(len(out), logical_total, written_total, stored)
    if uncommitted:
        text += f"; parts of uncommitted saves (gc removes them): steps {uncommitted}"
    return payload, text


def job_show(jobs: JobStore, step: int | None) -> tuple[JobManifest, dict, str]:
    """``show``'s summary of a job version: one row per rank's part."""
    jm = jobs.resolve(step)
    rows, ranks = [], []
    for r in range(jm.world_size):
        p = jobs.part(jm, r)
        ranks.append({"rank": r, "tensors": len(p.tensors), "logical_bytes": p.logical_bytes, "chunks": p.nchunks,
                      "bytes_written": p.stats.get("bytes_written", 0), "root": p.root,
                      "loader_state": "solar.loader" in p.meta})
        rows.append([r, len(p.tensors), fmt_bytes(p.logical_bytes), p.nchunks,
                     fmt_bytes(int(p.stats.get("bytes_written", 0))), p.root[:16] + "...",
                     "yes" if "solar.loader" in p.meta else ""])
    payload: dict[str, Any] = {"step": jm.step, "job": True, "world_size": jm.world_size, "root": jm.root,
                               "hash": jm.hash, "chunk_size": jm.chunk_size, "created": jm.created,
                               "parent": jm.parent, "features": jm.features, "ranks": ranks}
    text = (f"step {jm.step} of job root {jobs.root}: {jm.world_size} ranks, chunks of {fmt_bytes(jm.chunk_size)} "
            f"({jm.hash}), root {jm.root[:16]}..., parent {jm.parent}; `--rank R` shows one rank's tensors\n")
    text += table(["rank", "tensors", "logical", "chunks", "written", "part root", "loader"], rows)
    return jm, payload, text
