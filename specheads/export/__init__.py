"""Export trained heads to the folders vLLM, SGLang, speculators and TGI load (layouts per method x engine:
docs/export.md), and load an export back (``load_exported``)."""

from specheads.export.checks import ExportError, check_tensors, read_head
from specheads.export.export import export_head
from specheads.export.layouts import ENGINES, METHODS, Layout, LayoutError, TargetInfo, build_layout, head_tensors
from specheads.export.reload import exported_head_state, load_exported
from specheads.export.run_records import find_eval_report, load_eval_report
from specheads.export.target import target_origin

__all__ = ["ENGINES", "METHODS", "ExportError", "Layout", "LayoutError", "TargetInfo", "build_layout",
           "check_tensors", "export_head", "exported_head_state", "find_eval_report", "head_tensors",
           "load_eval_report", "load_exported", "read_head", "target_origin"]
