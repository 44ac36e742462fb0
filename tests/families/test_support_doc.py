"""docs/support_matrix.md is what scripts/support_matrix.py renders from the current family tests.

Three checks, none of which depends on which tests ran before in this process (pytest-xdist splits them over
workers at will): the doc was made from the family tests that exist now (their ids' digest, from a
``--collect-only`` run); it is, byte for byte, what the renderer writes for the cells it shows (so its prose, its
refusal list and its template sources are current); and each cell is the outcome of its tests, which every family
test that passes checks for its own cell (``support_log.doc_disagreement``, tests/conftest.py).
"""

from __future__ import annotations

import support_log
from support_log import SupportRecord, doc_disagreement, parse_refusals

_script = support_log.renderer


def test_doc_was_generated_from_the_current_family_tests():
    sm = _script()
    cells, digest = sm.parse_doc(sm.DOC.read_text())
    assert cells, f"{sm.DOC} holds no matrix; run python scripts/support_matrix.py"
    assert digest == sm.test_ids_digest(sm.collect_test_ids()), \
        "the family tests changed since docs/support_matrix.md was generated: run python scripts/support_matrix.py"


def test_doc_is_what_the_renderer_writes_for_its_cells():
    sm = _script()
    text = sm.DOC.read_text()
    cells, _ = sm.parse_doc(text)
    refusals = parse_refusals(text)
    outcomes = {key: {"✓": "passed", "✗": "failed"}.get(cell) or f"refused: {refusals.get(cell, '')}"
                for key, cell in cells.items() if cell != "—"}
    ids = [ln for ln in text.splitlines() if ln.startswith("<!-- test-ids:")]
    rendered = [ids[0] if ln.startswith("<!-- test-ids:") else ln for ln in sm.render(outcomes, []).splitlines()]
    assert rendered == text.splitlines(), "docs/support_matrix.md is not what scripts/support_matrix.py renders " \
                                          "for its own cells: run python scripts/support_matrix.py"


def test_a_cell_that_is_not_the_tests_outcome_is_reported(tmp_path):
    sm = _script()
    cells = {("llama", "collect_store"): "passed", ("llama", "export_vllm"): "refused: llama: no way",
             ("qwen3", "collect_store"): "failed"}
    doc = tmp_path / "matrix.md"
    doc.write_text(sm.render(cells, ["a::b"]))
    assert doc_disagreement(SupportRecord()("llama", "collect_store"), doc) is None
    refused = SupportRecord()("llama", "export_vllm")
    refused.refused("llama: no way")
    assert doc_disagreement(refused, doc) is None
    refused.refused("llama: another reason")
    assert "another reason" in doc_disagreement(refused, doc)
    assert "'R1'" in doc_disagreement(SupportRecord()("llama", "export_vllm"), doc)  # passes now, doc says refused
    assert "'✗'" in doc_disagreement(SupportRecord()("qwen3", "collect_store"), doc)
    assert "None" in doc_disagreement(SupportRecord()("phi3", "collect_store"), doc)  # no row at all


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
