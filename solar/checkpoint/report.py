"""Text output of ``solar-ckpt``: byte sizes, left-aligned tables and the readable form of a diff."""

from __future__ import annotations

import json
from typing import Any

from .compare import DiffReport

__all__ = ["fmt_bytes", "table", "format_report", "increment_cells", "INCREMENT_HEAD"]

#: the columns of :func:`increment_cells`
INCREMENT_HEAD = ["changed elems", "as chunks", "as deltas"]


def increment_cells(inc: dict) -> list[str]:
    """The table cells of a :func:`~solar.checkpoint.deltastats.increment`."""
    changed = inc["elements_changed"]
    return ["" if changed is None else str(changed), fmt_bytes(inc["chunk_bytes"]), fmt_bytes(inc["delta_bytes"])]


def _increment_lines(rep: DiffReport) -> list[str]:
    if not rep.increments:
        return []
    rows = [[i["step"], *increment_cells(i)] for i in rep.increments]
    total = sum(i["chunk_bytes"] + i["delta_bytes"] for i in rep.increments)
    return [f"written by the saves after {rep.a} up to {rep.b}: {fmt_bytes(total)}",
            table(["step", *INCREMENT_HEAD], rows)]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def table(head: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns; short rows are padded."""
    rows = [list(r) + [""] * (len(head) - len(r)) for r in rows]
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows)


def _short(v: Any, width: int = 40) -> str:
    text = json.dumps(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def format_report(rep: DiffReport) -> str:
    """A readable table of a :class:`DiffReport`: tensors, then plain values."""
    lines = [f"--- {rep.a}" + (f" (tensors under {rep.prefix[0]!r})" if rep.prefix[0] else ""),
             f"+++ {rep.b}" + (f" (tensors under {rep.prefix[1]!r})" if rep.prefix[1] else "")]
    not_compared = f"plain values not compared: {rep.plain_note}"
    if rep.identical:
        if rep.plain_compared:
            lines.append(f"identical ({rep.unchanged} tensors, {rep.plain_unchanged} plain values)")
        else:
            lines.append(f"identical ({rep.unchanged} tensors; {not_compared})")
        return "\n".join(lines)
    if rep.added or rep.removed or rep.changed:
        lines += _tensor_lines(rep)
    else:
        lines.append(f"tensors identical ({rep.unchanged} tensors)")
    if rep.plain_added or rep.plain_removed or rep.plain_changed:
        rows = ([["added", e["name"], "", _short(e["value"])] for e in rep.plain_added]
                + [["removed", e["name"], _short(e["value"]), ""] for e in rep.plain_removed]
                + [["changed", e["name"], _short(e["a"]), _short(e["b"])] for e in rep.plain_changed])
        lines.append(table(["status", "plain value", "a", "b"], rows))
        lines.append(f"plain values: {len(rep.plain_added)} added, {len(rep.plain_removed)} removed, "
                     f"{len(rep.plain_changed)} changed, {rep.plain_unchanged} unchanged")
    elif rep.plain_compared:
        lines.append(f"plain values identical ({rep.plain_unchanged})")
    else:
        lines.append(not_compared)
    lines += _increment_lines(rep)
    return "\n".join(lines)


def _tensor_lines(rep: DiffReport) -> list[str]:
    lines = []
    head = ["status", "tensor", "chunks", "bytes", "detail"]
    if rep.values:
        head += ["max|Δ|", "max rel", "changed elems"]
    rows = [["added", n, "", "", ""] for n in rep.added] + [["removed", n, "", "", ""] for n in rep.removed]
    for e in rep.changed:
        detail = []
        if "dtype" in e:
            detail.append(f"dtype {e['dtype'][0]} -> {e['dtype'][1]}")
        if "shape" in e:
            detail.append(f"shape {e['shape'][0]} -> {e['shape'][1]}")
        row = ["changed", e["name"], f"{e['chunks']}/{e['total_chunks']}", fmt_bytes(e["bytes"]), ", ".join(detail)]
        if rep.values:
            row += ([f"{e['max_abs']:.3g}", f"{e['max_rel']:.3g}", f"{e['changed_elements']}/{e['elements']}"]
                    if "max_abs" in e else ["", "", ""])
        rows.append(row)
    lines.append(table(head, rows))
    lines.append(
        f"{len(rep.added)} added, {len(rep.removed)} removed, {len(rep.changed)} changed, {rep.unchanged} unchanged; "
        f"{rep.changed_chunks} changed chunks ({fmt_bytes(rep.changed_bytes)})"
    )
    return lines
