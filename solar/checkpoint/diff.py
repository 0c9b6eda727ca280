"""Diff two checkpoints: SOLAR versions (``ROOT@STEP``), ``torch.save``, safetensors or DCP checkpoints.

The names ``solar-ckpt diff`` and scripts use, in one place. The work is done, in data order, by
:mod:`~solar.checkpoint.sources` (each input as a table of tensor digests and plain values),
:mod:`~solar.checkpoint.compare` (the diff engine) and :mod:`~solar.checkpoint.report` (text).
"""

from __future__ import annotations

from .compare import DiffReport, diff
from .report import fmt_bytes, format_report, table
from .sources import TensorInfo, TensorTable, c_order_bytes, open_table, plain_values

__all__ = ["TensorInfo", "TensorTable", "open_table", "diff", "DiffReport", "format_report", "table", "fmt_bytes",
           "plain_values", "c_order_bytes"]
