"""Export trained heads to the Hub folders vLLM and SGLang load (layouts per method x engine: docs/export.md)."""

from specheads.export.export import ExportError, check_tensors, export_head, load_eval_report, read_head
from specheads.export.layouts import ENGINES, METHODS, Layout, LayoutError, TargetInfo, build_layout, head_tensors

__all__ = ["ENGINES", "METHODS", "ExportError", "Layout", "LayoutError", "TargetInfo", "build_layout",
           "check_tensors", "export_head", "head_tensors", "load_eval_report", "read_head"]
