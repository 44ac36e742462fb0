"""The README and the guides in docs/: the measured figures are what scripts/results_tables.py renders
from docs/benchmarks.json (and prose outside the rendered blocks states no measured figure the file does not
hold), the README stays a short front door with the two Quickstart commands verbatim, every relative link
points at a file that exists, and no user-facing doc names an internal work label."""

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

# A measured figure in prose: a number with a unit of time, rate, size or ratio, or after τ / α / speed-up / top-1,
# or a test count. Design figures carry no such unit ("a chain of 3", "fan4", "12 prompts", "batch 1").
NUM = r"(?<![\w.`/-])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)"
UNITS = {"%": "%", "×": "x", "x": "x", "s": "s", "ms": "ms", "min": "min", "minute": "min", "minutes": "min",
         "seconds": "s", "tokens/s": "tokens/s", "MiB": "MiB", "MB": "MiB", "GB": "GB", "GiB": "GB",
         "passed": "passed", "skipped": "skipped", "failed": "failed"}
AFTER = re.compile(NUM + r"\s?(%|×|x\b|ms\b|s\b|min\b|minutes?\b|seconds\b|tokens/s|MiB|MB\b|GB\b|GiB|passed|skipped"
                   r"|failed)(?![\w-])")
BEFORE = re.compile(r"(τ|α|speed-up|top-1)[ :=]{1,3}(?:up to |of |from )?" + NUM)
WORDS = {"τ": "tau", "α": "alpha", "speed-up": "x", "top-1": "top-1"}
# which fields of a record hold a figure of each kind
FIELDS = {"tau": ("tau", "tau_evaluator", "t1_tau"), "alpha": ("alpha",), "x": ("speedup", "t1_speedup"),
          "min": ("total_min", "tests_min"), "s": ("setup_s", "serve_s", "prepare", "collect", "train", "evaluate",
                                                    "export"), "tokens/s": ("tokens_per_s", "collect_tokens_per_s",
                                                                            "plain_tokens_per_s"),
          "passed": ("passed",), "skipped": ("skipped",), "failed": ("failed",), "top-1": ("heldout_step0_top1",)}
UNRECORDED = re.compile(r"<!-- unrecorded:begin -->\n(.*?)<!-- unrecorded:end -->", re.S)
UNRECORDED_LABEL = "*Unrecorded history:"
# Not measurements, though they read like one (settings and limits the docs state), and the few figures still
# rendered from elsewhere; every entry says why.
DESIGN = {
    "README.md": ["7 minutes"],  # the time budgets of collection, training and evaluation (conf/pipeline.yaml)
    "docs/development.md": ["8 min", "1800 s"],  # gpu_check's budget; pytest's timeout (pyproject.toml)
}


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


def prose(text: str) -> str:
    """``text`` without its rendered blocks, its labelled unrecorded history, code blocks and inline code."""
    text = UNRECORDED.sub("", text)
    text = re.sub(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


TABLE_HEAD = re.compile(r"^\|.*(τ|α|tokens/s|tok/s|speed-up|MiB|ratio|\bs\b|\bmin\b).*\|\n\|[-| :]+\|\n((?:\|.*\|\n?)+)", re.M)


def figures(text: str) -> list[tuple[str, str, str]]:
    """(the words as written, kind, number) of every measured figure in ``text``; in a hand-written table whose
    header names a measure, every decimal figure (kind ``table``: such a table belongs in a rendered block)."""
    out = [(m.group(0), UNITS[m.group(2)], m.group(1)) for m in AFTER.finditer(text)]
    out += [(m.group(0), WORDS[m.group(1)], m.group(2)) for m in BEFORE.finditer(text)]
    for t in TABLE_HEAD.finditer(text):
        out += [(n, "table", n) for n in re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", t.group(2))]
    return out


def recorded_figures(data: dict) -> set[tuple[str, float]]:
    """(kind, value) of every figure the record holds, leaving out its unrecorded history: fields by name, and
    figures written in its text fields."""
    found: set[tuple[str, float]] = set()
    kind_of = {f: k for k, fields in FIELDS.items() for f in fields}

    def walk(x, key=None):
        if isinstance(x, dict):
            for k, v in x.items():
                if k != "unrecorded":
                    walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v, key)
        elif isinstance(x, (int, float)) and not isinstance(x, bool) and key in kind_of:
            found.add((kind_of[key], float(x)))
        elif isinstance(x, str):
            found.update((kind, float(n.replace(",", ""))) for _, kind, n in figures(x))
    walk(data)
    return found


def unrecorded_figures(text: str, held: set[tuple[str, float]], design: list[str] = ()) -> list[str]:
    """The measured figures of ``text``'s prose that ``held`` does not hold (at the precision written)."""
    bad = []
    for words, kind, n in figures(prose(text)):
        if any(words.strip() in d or d in words for d in design):
            continue
        value, nd = float(n.replace(",", "")), len(n.split(".")[1]) if "." in n else 0
        if not any(k == kind and round(v, nd) == value for k, v in held):
            bad.append(words)
    return bad


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_prose_states_only_recorded_figures(path):
    held = recorded_figures(_script().load())
    text = path.read_text(encoding="utf-8")
    name = str(path.relative_to(REPO))
    assert unrecorded_figures(text, held, DESIGN.get(name, [])) == [], \
        f"{name} states measured figures docs/benchmarks.json does not hold: record the run (specheads record FILE) " \
        "and render the figure (scripts/results_tables.py), or say it without the number"
    for block in UNRECORDED.findall(text):
        assert block.startswith(UNRECORDED_LABEL), f"{name}: an unrecorded-history block must open with its label"
    assert path != README or not UNRECORDED.search(text), "the README cites no unrecorded history"


def test_a_figure_without_a_record_is_caught():
    held = {("tau", 1.31), ("x", 0.81), ("min", 19.3), ("passed", 1190.0)}
    text = ("vLLM τ 1.35 against 1.34, 0.81× on 9 prompts; a chain of 3, 12 prompts, fan4; the run took 19.3 min "
            "and 25 minutes; 1190 passed, 3 failed; `took 9 s` in code\n<!-- results:begin -->\nτ 2.50\n"
            "<!-- results:end -->\n<!-- unrecorded:begin -->\n*Unrecorded history: x.* τ 1.90\n<!-- unrecorded:end -->\n")
    assert unrecorded_figures(text, held) == ["25 minutes", "3 failed", "τ 1.35"]
    assert unrecorded_figures("budgets of 6, 7 and 7 minutes", held, ["7 minutes"]) == []
    table = "| setting | ours tokens/s | ratio |\n|---|---|---|\n| fp32, TTT 3 | 916 | 2.11 |\n"
    assert unrecorded_figures(table, held) == ["2.11"]
    assert unrecorded_figures("| head | layout |\n|---|---|\n| EAGLE-3 | 1.5 |\n", held) == []


def test_records_have_commits_and_unrecorded_history_stays_apart():
    data = _script().load()
    for key in ("runs", "test_runs", "serve_runs", "export_checks"):
        for entry in data.get(key, []):
            assert entry.get("commit") and entry.get("date") and entry.get("machine"), (key, entry.get("date"))
    assert all(not r.get("commit") for key in ("runs", "test_runs") for r in data["unrecorded"][key])


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
        assert f"{main['date']}, commit `{main['commit'][:7]}`" in row


def test_readme_is_short_and_keeps_the_quickstart_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
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
