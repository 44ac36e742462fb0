"""Outcomes of the family tests as a support log: one JSON line per (family, stage, outcome).

A family test takes the ``support`` fixture (tests/families/conftest.py) and names what it covers with
``support(family, stage)``; where the library refuses the family with a one-line ``UserError``, the test
asserts the refusal and calls ``support.refused(message)``. After the test's call phase the line is
written, when ``SPECHEADS_SUPPORT_LOG=<path>`` is set, with outcome ``passed``, ``refused: <reason>`` or
``failed``. ``scripts/support_matrix.py`` runs the tests with it and renders docs/support_matrix.md.

Without the log, each such test that passes checks its own cell of docs/support_matrix.md (``doc_disagreement``,
tests/conftest.py): a passed stage must read ✓, a refused one the same refusal. Each test checks its own cell, so
every cell whose test ran is checked, whichever pytest-xdist worker ran it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ENV = "SPECHEADS_SUPPORT_LOG"
STAGES = ("prepare", "collect_store", "collect_online", "train_medusa1", "train_medusa2", "train_eagle1",
          "train_eagle3", "evaluate_tree", "evaluate_chain", "export_vllm", "export_sglang",
          "vl_prepare", "vl_collect", "vl_train_eagle3", "vl_evaluate", "vl_export_vllm")  # vl_: image stages


class SupportRecord:
    """What one test covers (family, stage) and, if the library refused it, the refusal's message."""

    def __init__(self):
        self.family: str | None = None
        self.stage: str | None = None
        self.refusal: str | None = None

    def __call__(self, family: str, stage: str) -> "SupportRecord":
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; known: {STAGES}")
        self.family, self.stage = family, stage
        return self

    def refused(self, message: str) -> None:
        self.refusal = " ".join(str(message).split())

    def outcome(self, passed: bool) -> str:
        if not passed:
            return "failed"
        return f"refused: {self.refusal}" if self.refusal else "passed"


def write_line(record: SupportRecord, passed: bool, test_id: str, path: str | None = None) -> None:
    """Keep the record's line for this session and append it to ``path`` (default: ``$SPECHEADS_SUPPORT_LOG``;
    no file when unset). Rendering reads the file: scripts/support_matrix.py."""
    if record.family is None:
        return
    line = {"family": record.family, "stage": record.stage, "outcome": record.outcome(passed), "test": test_id}
    path = path or os.environ.get(ENV)
    if not path:
        return
    with Path(path).open("a") as f:
        f.write(json.dumps(line) + "\n")


def renderer():
    """scripts/support_matrix.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("support_matrix", REPO / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_refusals(text: str) -> dict[str, str]:
    """The doc's matrix refusals: ``R<n>`` -> the reason listed for it."""
    matrix = text.split(renderer().REAL_HEADING)[0]
    return {m[1]: m[2].strip() for m in re.finditer(r"^- (R\d+): (.*)$", matrix, flags=re.M)}


@functools.cache
def _doc(path: Path) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    text = path.read_text(encoding="utf-8")
    return renderer().parse_doc(text)[0], parse_refusals(text)


def doc_disagreement(record: SupportRecord, doc: Path | None = None) -> str | None:
    """Why the doc's cell for this passed test's (family, stage) is not its outcome (✓, or the refusal with its
    reason), else None."""
    doc = doc or REPO / "docs" / "support_matrix.md"
    cells, refusals = _doc(doc)
    key, outcome = (record.family, record.stage), record.outcome(True)
    cell = cells.get(key)
    if outcome == "passed":
        ok = cell == "✓"
    else:
        ok = cell is not None and refusals.get(cell) == outcome.partition(":")[2].strip()
    if ok:
        return None
    return (f"{doc.name} says {cell!r} for {key}, but the test's outcome is {outcome!r} (refusals listed: {refusals}); "
            f"run python scripts/support_matrix.py")
