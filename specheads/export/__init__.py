"""Export trained heads to the folders vLLM, SGLang, speculators and TGI load (layouts per method x engine:
docs/export.md), load an export back (``load_exported``), and read an EAGLE-3 head trained elsewhere
(``load_foreign_head``: speculators' or the original EAGLE-3 / SpecForge format)."""

from specheads.export.checks import ExportError, check_tensors, read_head
from specheads.export.export import export_head
from specheads.export.foreign import ForeignHeadError, load_foreign_head, read_foreign_head
from specheads.export.layouts import ENGINES, METHODS, Layout, LayoutError, TargetInfo, build_layout, head_tensors
from specheads.export.reload import exported_head_state, load_exported
from specheads.export.run_records import find_eval_report, load_eval_report
from specheads.export.target import target_origin

__all__ = ["ENGINES", "METHODS", "ExportError", "ForeignHeadError", "Layout", "LayoutError", "TargetInfo",
           "build_layout", "check_tensors", "export_head", "exported_head_state", "find_eval_report", "head_tensors",
           "load_eval_report", "load_exported", "load_foreign_head", "read_foreign_head", "read_head", "target_origin"]
