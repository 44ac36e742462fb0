"""The README and the guides in docs/: the measurement tables are what scripts/results_tables.py renders
from docs/benchmarks.json, the README stays a short front door with the two Quickstart commands verbatim,
every relative link points at a file that exists, and no user-facing doc names an internal work label."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
USER_FACING = [README, *DOCS, REPO / "docs" / "benchmarks.json"]
QUICKSTART = ("bash scripts/setup.sh && .venv/bin/specheads run", "bash scripts/setup.sh && .venv/bin/python -m pytest")
# Internal labels: issue numbers, work-session labels ("S14", "sessions S4-S15", "session 11").
INTERNAL = [re.compile(p, re.I) for p in (r"\bissues?\s*#?\d+", r"\bthe issue\b", r"\bsessions?\b")] + \
           [re.compile(r"\bS\d{1,2}\b")]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _script():
    spec = importlib.util.spec_from_file_location("results_tables", REPO / "scripts" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def internal_labels(text: str) -> list[str]:
    return [m.group(0) for p in INTERNAL for m in p.finditer(text)]


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor in the same file
        if not (path.parent / target.split("#")[0]).exists():
            bad.append(target)
    return bad


def test_tables_are_rendered_from_benchmarks_json():
    rt = _script()
    for path, (old, new) in rt.rendered(rt.load()).items():
        assert old == new, f"{path.relative_to(REPO)}'s tables differ from docs/benchmarks.json: run " \
                           "python scripts/results_tables.py"


def test_a_changed_figure_changes_the_rendered_tables():
    rt = _script()
    data = rt.load()
    main = rt.latest_main_job(data)
    changed = copy.deepcopy(data)
    rt.latest_main_job(changed)["methods"][0]["tau"] = main["methods"][0]["tau"] + 0.5
    assert rt.results_table(changed) != rt.results_table(data)
    assert rt.history_table(changed) != rt.history_table(data)
    text = "a\n<!-- results:begin -->\nold\n<!-- results:end -->\nb\n"
    assert rt.render(text, "results", "new") == "a\n<!-- results:begin -->\nnew\n<!-- results:end -->\nb\n"
    with pytest.raises(SystemExit):
        rt.render("no markers here", "results", "new")


def test_the_engines_figures_sit_on_the_row_of_the_method_it_served():
    rt = _script()
    data = copy.deepcopy(rt.load())
    main = rt.latest_main_job(data)
    main["served"] = {"engine": "vLLM 0.32.0", "method": main["methods"][-1]["method"], "tau": 1.37, "speedup": 0.8,
                      "identical": "12/12"}
    rows = rt.results_table(data).splitlines()[2:]
    cells = [r for r in rows if "τ 1.37, 0.80×, identical 12/12 (vLLM 0.32.0)" in r]
    assert len(cells) == 1 and cells[0].startswith(f"| {rt.METHOD_NAMES[main['methods'][-1]['method']]} |")


def test_results_table_rows_name_their_run():
    rt = _script()
    data = rt.load()
    rows = [r for r in rt.results_table(data).splitlines()[2:]]
    main = rt.latest_main_job(data)
    assert len(rows) >= len(main["methods"])
    for row in rows[: len(main["methods"])]:
        assert f"{main['date']}, commit `{main['commit']}`" in row


def test_readme_is_short_and_keeps_the_quickstart_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    for command in QUICKSTART:
        assert command in text, f"README.md lost the Quickstart command {command!r} (.ci/run and users rely on it)"
    assert QUICKSTART[1] in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_point_at_files(path):
    assert broken_links(path) == [], f"{path.relative_to(REPO)} links to missing files"


def test_broken_link_is_caught(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("x")
    doc.write_text("[ok](b.md#part) [web](https://example.org) [here](#top) [gone](docs/missing.md)")
    assert broken_links(doc) == ["docs/missing.md"]


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: p.name)
def test_no_internal_labels(path):
    assert internal_labels(path.read_text(encoding="utf-8")) == [], \
        f"{path.relative_to(REPO)} names internal work labels: describe what was measured instead"


def test_internal_labels_are_caught():
    planted = "as issue 13 asked; measured in S14; over the sessions S4-S15; see issue #7; the bug the issue measured"
    assert internal_labels(planted) == ["issue 13", "issue #7", "the issue", "sessions", "S14", "S4", "S15"]
    assert internal_labels("SmolLM2, TTT 3, fp32, EAGLE-3, S3 bucket-free text: SGLang 0.5.23") == ["S3"]
    assert internal_labels("SmolLM2, TTT 3, fp32, EAGLE-3, SGLang 0.5.23, SHA-256") == []
