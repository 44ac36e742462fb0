"""docs/support_matrix.md is what scripts/support_matrix.py renders from the current family tests.

Two checks: the doc was made from the family tests that exist now (their ids' digest, from a
``--collect-only`` run), and, when the family tests ran earlier in this session (``pytest tests/families``),
every (family, stage) they logged has the doc's cell (✓, ✗ or R).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import support_log

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("support_matrix", REPO / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_was_generated_from_the_current_family_tests():
    sm = _script()
    cells, digest = sm.parse_doc(sm.DOC.read_text())
    assert cells, f"{sm.DOC} holds no matrix; run python scripts/support_matrix.py"
    assert digest == sm.test_ids_digest(sm.collect_test_ids()), \
        "the family tests changed since docs/support_matrix.md was generated: run python scripts/support_matrix.py"


def test_doc_agrees_with_this_sessions_outcomes():
    if not support_log.SESSION:
        pytest.skip("no family test ran before this one in this session (run pytest tests/families)")
    sm = _script()
    doc, _ = sm.parse_doc(sm.DOC.read_text())
    outcomes: dict[tuple[str, str], str] = {}
    for line in support_log.SESSION:
        key = (line["family"], line["stage"])
        if outcomes.get(key, "passed") == "passed":
            outcomes[key] = line["outcome"]
    wrong = {key: (doc.get(key), out) for key, out in outcomes.items() if not str(doc.get(key)).startswith(sm.symbol(out))}
    assert not wrong, f"docs/support_matrix.md disagrees with this run (doc cell, outcome): {wrong}; " \
                      "run python scripts/support_matrix.py"


def test_render_round_trips_every_outcome():
    sm = _script()
    cells = {("llama", "collect_store"): "passed", ("llama", "export_vllm"): "failed",
             ("gemma2", "evaluate_tree"): "refused: gemma2: no way", ("chat:qwen3", "prepare"): "passed"}
    doc, digest = sm.parse_doc(sm.render(cells, ["a::b"]))
    assert doc[("llama", "collect_store")] == "✓" and doc[("llama", "export_vllm")] == "✗"
    assert doc[("gemma2", "evaluate_tree")] == "R1" and doc[("chat:qwen3", "prepare")] == "✓"
    assert doc[("llama", "export_sglang")] == "—" and digest == sm.test_ids_digest(["a::b"])


def test_the_real_weights_section_is_rendered_from_its_record():
    sm = _script()
    section = sm.render_real(sm.load_real())
    assert section and sm.REAL_HEADING in section
    assert sm.DOC.read_text().endswith(section), \
        "docs/support_matrix.md's real-weights section differs from docs/real_weights.json: run " \
        "python scripts/support_matrix.py --log <a support log> (or render_real into the doc)"


def test_an_engines_refusal_is_quoted_once_and_numbered():
    sm = _script()
    data = {"about": "a", "engine": "vLLM 0.32.0", "heads": ["eagle3", "eagle1", "dflash"], "runs": [
        {"family": "gemma3_text", "model": "g", "stages": "all", "date": "d", "source": "docs/serving.md",
         "served": {"eagle3": {"outcome": "refused", "note": "RuntimeError: no EAGLE3 interface"},
                    "eagle1": {"outcome": "served", "note": "τ 1.1"},
                    "dflash": {"outcome": "refused", "note": "RuntimeError: no EAGLE3 interface"}}}]}
    text = sm.render_real(data)
    assert "| gemma3_text | g | all | E1 | ✓ (τ 1.1) | E1 | d, [serving](serving.md) |" in text
    assert text.count("no EAGLE3 interface") == 1 and "- E1: RuntimeError: no EAGLE3 interface" in text
    assert sm.parse_doc(sm.render({("llama", "collect_store"): "passed"}, ["a::b"]))[0] == {
        ("llama", "collect_store"): "✓", **{("llama", s): "—" for s in list(sm.COLUMNS)[1:]}}
