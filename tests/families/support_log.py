"""Outcomes of the family tests as a support log: one JSON line per (family, stage, outcome).

A family test takes the ``support`` fixture (tests/families/conftest.py) and names what it covers with
``support(family, stage)``; where the library refuses the family with a one-line ``UserError``, the test
asserts the refusal and calls ``support.refused(message)``. After the test's call phase the line is
written, when ``SPECHEADS_SUPPORT_LOG=<path>`` is set, with outcome ``passed``, ``refused: <reason>`` or
``failed``. ``scripts/support_matrix.py`` runs the tests with it and renders docs/support_matrix.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "SPECHEADS_SUPPORT_LOG"
STAGES = ("prepare", "collect_store", "collect_online", "train_medusa1", "train_medusa2", "train_eagle1",
          "train_eagle3", "evaluate_tree", "evaluate_chain", "export_vllm", "export_sglang")


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


SESSION: list[dict] = []  # this pytest session's lines, for test_support_doc.py (logged or not)


def write_line(record: SupportRecord, passed: bool, test_id: str, path: str | None = None) -> None:
    """Keep the record's line for this session and append it to ``path`` (default: ``$SPECHEADS_SUPPORT_LOG``;
    no file when unset). Rendering reads the file: scripts/support_matrix.py."""
    if record.family is None:
        return
    line = {"family": record.family, "stage": record.stage, "outcome": record.outcome(passed), "test": test_id}
    SESSION.append(line)
    path = path or os.environ.get(ENV)
    if not path:
        return
    with Path(path).open("a") as f:
        f.write(json.dumps(line) + "\n")
