"""The package's shape as the architecture asks for it (docs/architecture.md): functions short enough to read as
one step each, and the evaluator's driver kept to its job (its helpers live in their own modules)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specheads"
MAX_FUNCTION_LINES = 60
MAX_SUITE_LINES = 500


def test_no_function_in_the_package_is_longer_than_sixty_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split into named steps: " + "; ".join(long)


def test_the_evaluators_driver_stays_under_five_hundred_lines():
    lines = len((PACKAGE / "evaluation" / "suite.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_SUITE_LINES, f"specheads/evaluation/suite.py has {lines} lines: move a concern to its own module"
