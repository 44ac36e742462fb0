"""The README and the guides in docs/: the measured figures are what scripts/results_tables.py renders
from docs/benchmarks.json, and prose outside the rendered blocks states a measured figure only beside the record
that holds it (its commit, or an unrecorded entry's id: each figure, prompt count and dtype is checked against
that record alone); the README stays a short front door with the two Quickstart commands verbatim, every
relative link points at a file that exists, and no user-facing doc names an internal work label."""

from __future__ import annotations

import copy
import importlib.util
import itertools
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
# or a test count. Design figures carry no such unit ("a chain of 3", "fan4", "batch 1").
NUM = r"(?<![\w.`/-])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)"
UNITS = {"%": "%", "×": "x", "x": "x", "s": "s", "ms": "ms", "min": "min", "minute": "min", "minutes": "min",
         "seconds": "s", "tokens/s": "tokens/s", "MiB": "MiB", "MB": "MiB", "GB": "GB", "GiB": "GB",
         "passed": "passed", "skipped": "skipped", "failed": "failed"}
AFTER = re.compile(NUM + r"\s?(%|×|x\b|ms\b|s\b|min\b|minutes?\b|seconds\b|tokens/s|MiB|MB\b|GB\b|GiB|passed|skipped"
                   r"|failed)(?![\w-])")
BEFORE = re.compile(r"(τ|α|speed-up|top-1)[ :=]{1,3}(?:up to |of |from )?" + NUM)
WORDS = {"τ": "tau", "α": "alpha", "speed-up": "x", "top-1": "top-1"}
# which fields of a record hold a figure of each kind
FIELDS = {"tau": ("tau", "tau_evaluator", "t1_tau", "heldout_tau", "measured_tau_chain3"), "alpha": ("alpha",),
          "x": ("speedup", "t1_speedup"), "min": ("total_min", "tests_min"),
          "s": ("setup_s", "serve_s", "prepare", "collect", "train", "evaluate", "export", "wall_s", "seconds",
                "cpu_seconds"),
          "tokens/s": ("tokens_per_s", "collect_tokens_per_s", "plain_tokens_per_s"),
          "MiB": ("peak_anon_mb", "peak_rss_mb", "peak_anon_mib", "peak_rss_mib"), "GB": ("peak_rss_gb",),
          "passed": ("passed",), "skipped": ("skipped",), "failed": ("failed",),
          "top-1": ("heldout_step0_top1", "heldout_step1_top1")}
# The record a passage names: a commit (`64078bd`, or "commit 64078bd") or an unrecorded entry's id
# (record `dflash-eagle3-2026-12-02`).
REF = re.compile(r"`([0-9a-f]{7,40})`|\b[Cc]ommit ([0-9a-f]{7,40})\b|\b[Rr]ecord `([\w.-]+)`")
# A count a sentence naming a record states of it: "11 prompts", "742 chats"; "9 of 12 prompts" counts 9 (scored).
COUNT = re.compile(r"(?<![\w.,/-])(\d+(?:,\d{3})*)(?: of (?:the )?\d+(?:,\d{3})*)? (prompts|chats)\b")
COUNT_FIELDS = {"prompts": "prompts", "num_prompts": "prompts"}
DTYPE = re.compile(r"\b(float32|bfloat16|float16)\b(?! kernels)")
# how a record's own text names its target's dtype: "bfloat16 target", "target float32", "target in bfloat16"
DTYPE_TEXT = re.compile(r"\b(float32|bfloat16|float16) target\b|\btarget (?:in |at )?(float32|bfloat16|float16)\b")
# A table states measured figures when its header or a row's label names a measure, or it (or the paragraph
# before it) names a record.
MEASURE = re.compile(r"τ|α|tokens/s|tok/s|speed-up|MiB|ratio|\bs\b|\bmin\b")
BLOCK = re.compile(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", re.S)
UNRECORDED = re.compile(r"<!-- unrecorded:begin -->\n(.*?)<!-- unrecorded:end -->", re.S)
UNRECORDED_LABEL = "*Unrecorded history:"
# Not measurements, though they read like one (settings, limits and goals the docs state), matched as written
# (whole figures: "7 minutes" allows no "17 minutes"); every entry says why.
DESIGN = {
    "README.md": ["7 minutes"],  # the time budgets of collection, training and evaluation (conf/pipeline.yaml)
    "docs/ablations.md": ["25 minutes",  # the main job's budget without set-up
                          "1.3×", "speed-up of 1.3"],  # the goal the head was set
    "docs/benchmarks.md": ["τ of 2.2"],  # the goal the head was set
    # gpu_check's and the GPU smoke's budgets, gpu_suite's time cap, the CI time to keep under; pytest's timeout
    "docs/development.md": ["8 min", "8 minutes", "9 minutes", "25 minutes", "1800 s"],
    "docs/evaluate.md": ["7 minutes"],  # the main job's evaluation budget
    "docs/methods.md": ["7 minutes"],  # the main job's training and evaluation budgets
    "docs/scale.md": ["24 GiB"],  # the machine's memory, not a measurement
    "docs/serving.md": ["τ = 1"],  # the formula τ = 1 + Σ reach
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


def _code_free(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", text)


def units(text: str) -> list[tuple[str, str, bool]]:
    """(the text that names its records, the text, whether a table) of each paragraph and each table of
    ``text``'s prose: without its rendered blocks, its labelled unrecorded history and code blocks. A table's
    records are those it names and those the paragraph before it names."""
    text = UNRECORDED.sub("\n\n", text)
    text = BLOCK.sub("\n\n", text)
    text = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    out, before = [], ""
    for para in re.split(r"\n[ \t]*\n", text):
        for table, lines in itertools.groupby(para.split("\n"), key=lambda ln: ln.lstrip().startswith("|")):
            chunk = "\n".join(lines)
            if chunk.strip():
                out.append((chunk + "\n" + before if table else chunk, chunk, table))
                before = before if table else chunk
    return out


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences, list items and table rows."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z*(\[`])|\n(?=[ \t]*(?:[-*+] |\d+\. |\|))", text)


def figures(text: str) -> list[tuple[str, str, str]]:
    """(the words as written, kind, number) of every measured figure in ``text``."""
    out = [(m.group(0), UNITS[m.group(2)], m.group(1)) for m in AFTER.finditer(text)]
    return out + [(m.group(0), WORDS[m.group(1)], m.group(2)) for m in BEFORE.finditer(text)]


def table_figures(table: str, names_a_record: bool) -> list[str]:
    """The figures of a hand-written table that states measured figures: every decimal, and every cell after the
    row's label that is a whole number; [] for any other table (a layout, versions)."""
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table.splitlines()]
    body = [r for r in rows[2:] if r]
    if not (names_a_record or MEASURE.search(" ".join(rows[0])) or any(MEASURE.search(r[0]) for r in body)):
        return []
    out = []
    for r in body:
        out += re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", " | ".join(r))
        out += [c for c in r[1:] if re.fullmatch(r"\d+(?:,\d{3})*", c)]
    return out


def _walk(x, key=None):
    """(field name, value) of every number and string under ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, k)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v, key)
    elif isinstance(x, (int, float, str)) and not isinstance(x, bool):
        yield key, x


def entries(data: dict) -> list[dict]:
    """Every record of docs/benchmarks.json: the recorded entries (each with its commit) and the unrecorded ones."""
    found = [e for v in data.values() if isinstance(v, list) for e in v if isinstance(e, dict)]
    return found + [e for v in (data.get("unrecorded") or {}).values() if isinstance(v, list) for e in v
                    if isinstance(e, dict)]


def named_records(text: str, records: list[dict]) -> list[dict]:
    """The records ``text`` names: by commit (every entry measured at it) or by id."""
    out: list[dict] = []
    for m in REF.finditer(text):
        commit, rid = m.group(1) or m.group(2), m.group(3)
        out += [e for e in records if ((commit and (e.get("commit") or "").startswith(commit))
                                        or (rid and e.get("id") == rid)) and not any(e is o for o in out)]
    return out


def recorded_figures(records: list[dict]) -> set[tuple[str, float]]:
    """(kind, value) of every figure ``records`` hold: fields by name, and figures written in their text."""
    kind_of = {f: k for k, fields in FIELDS.items() for f in fields}
    found: set[tuple[str, float]] = set()
    for key, x in _walk(records):
        if isinstance(x, str):
            found.update((kind, float(n.replace(",", ""))) for _, kind, n in figures(x))
        elif key in kind_of:
            found.add((kind_of[key], float(x)))
    return found


def recorded_numbers(records: list[dict]) -> set[float]:
    """Every number ``records`` hold, in any field or written in their text."""
    return {float(x) for _, x in _walk(records) if not isinstance(x, str)} | \
           {float(n.replace(",", "")) for _, x in _walk(records) if isinstance(x, str) for n in re.findall(NUM, x)}


def recorded_counts(records: list[dict]) -> set[tuple[str, int]]:
    """(noun, count) of what ``records`` say they ran on: prompt fields, and counts written in their text."""
    found = {(COUNT_FIELDS[k], int(x)) for k, x in _walk(records) if k in COUNT_FIELDS and isinstance(x, int)}
    return found | {(m.group(2), int(m.group(1).replace(",", ""))) for _, x in _walk(records) if isinstance(x, str)
                    for m in COUNT.finditer(x)}


def recorded_dtypes(records: list[dict]) -> set[str]:
    """The dtypes ``records`` name: their dtype fields, and a target's dtype as their text words it."""
    found = {x.removeprefix("torch.") for k, x in _walk(records) if isinstance(x, str) and k and "dtype" in k}
    return found | {m.group(1) or m.group(2) for _, x in _walk(records) if isinstance(x, str)
                    for m in DTYPE_TEXT.finditer(x)}


def _held(n: str, values) -> bool:
    """Whether a figure written as ``n`` is one of ``values`` at the precision written."""
    value, nd = float(n.replace(",", "")), len(n.split(".")[1]) if "." in n else 0
    return any(round(v, nd) == value for v in values)


def unbacked_figures(text: str, data: dict, design: list[str] = ()) -> list[str]:
    """What ``text``'s prose states that the record it names does not hold: each measured figure of a paragraph
    or table against the records that paragraph (or table) names, none named holding none; each prompt count and
    dtype of a sentence that names a record against that record. ``design``: figures that are settings, as written."""
    records, bad = entries(data), []
    for refs, chunk, table in units(text):
        named = named_records(refs, records)
        held = recorded_figures(named)
        plain = _code_free(chunk)
        for words, kind, n in figures(plain):
            if words.strip() not in design and not _held(n, [v for k, v in held if k == kind]):
                bad.append(words)
        if table:
            numbers = recorded_numbers(named)
            bad += [n for n in table_figures(plain, bool(named)) if not _held(n, numbers)]
        for sentence in sentences(chunk):
            own = named_records(sentence, records)
            if not own:
                continue
            counts, dtypes = recorded_counts(own), recorded_dtypes(own)
            plain = _code_free(sentence)
            bad += [m.group(0) for m in COUNT.finditer(plain)
                    if (m.group(2), int(m.group(1).replace(",", ""))) not in counts]
            bad += [m.group(1) for m in DTYPE.finditer(plain) if m.group(1) not in dtypes]
    return bad


def stale_blocks(path: Path, text: str, data: dict) -> list[str]:
    """The rendered blocks of ``text`` (the file at ``path``) that differ from what scripts/results_tables.py
    renders from ``data``."""
    rt = _script()
    return [name for name, content in rt.blocks(data).get(path, {}).items()
            if rt.render(text, name, content, path) != text]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_prose_states_only_recorded_figures(path):
    text = path.read_text(encoding="utf-8")
    name = str(path.relative_to(REPO))
    assert unbacked_figures(text, _script().load(), DESIGN.get(name, [])) == [], \
        f"{name} states figures, prompt counts or dtypes that the record its passage names does not hold (or names " \
        "no record): record the run (specheads record FILE) and render the figure (scripts/results_tables.py), " \
        "name the record beside it (commit `abc1234`, or record `id`), or say it without the number"
    for block in UNRECORDED.findall(text):
        assert block.startswith(UNRECORDED_LABEL), f"{name}: an unrecorded-history block must open with its label"
    assert path != README or not UNRECORDED.search(text), "the README cites no unrecorded history"


SHA_A, SHA_B = "aaaaaaa" + "0" * 33, "bbbbbbb" + "0" * 33
PLANTED = {"runs": [{"kind": "main_job", "commit": SHA_A, "date": "2099-01-01", "machine": "m", "total_min": 19.3,
                     "eval_set": "11 prompts, 32 new tokens, batch 1", "target_dtype": "bfloat16",
                     "what": "lossless exact on 11 of 12 prompts; float32 16 vs bfloat16 1 rows",
                     "methods": [{"method": "eagle3", "tau": 1.31, "speedup": 0.81}]},
                    {"kind": "main_job", "commit": SHA_B, "date": "2099-01-02", "machine": "m", "total_min": 25.0,
                     "eval_set": "12 prompts, 32 new tokens, batch 1", "what": "float32 target, 742 chats",
                     "methods": [{"method": "eagle3", "tau": 1.35, "speedup": 1.02}]}],
           "test_runs": [{"commit": SHA_A, "date": "2099-01-01", "machine": "m", "passed": 1190, "failed": 0}],
           "unrecorded": {"runs": [{"id": "old-run", "commit": None, "train": {"eagle3": {"tokens_per_s": 3759}},
                                    "methods": [{"method": "dflash", "tau": 1.2, "speedup": 0.51}]}]}}


def test_a_figure_is_backed_only_by_the_record_its_passage_names():
    text = ("Commit `aaaaaaa`: vLLM τ 1.35 against 1.34, 0.81× on 9 prompts; a chain of 3, fan4; the run took "
            "19.3 min and 25 minutes; 1190 passed, 3 failed; `took 9 s` in code\n<!-- results:begin -->\nτ 2.50\n"
            "<!-- results:end -->\n<!-- unrecorded:begin -->\n*Unrecorded history: x.* τ 1.90\n<!-- unrecorded:end -->\n")
    # τ 1.35 is commit bbbbbbb's, not the named one's; 25 minutes, 3 failed and 9 prompts are no record's
    assert unbacked_figures(text, PLANTED) == ["25 minutes", "3 failed", "τ 1.35", "9 prompts"]
    assert unbacked_figures(text.replace("`aaaaaaa`", "`aaaaaaa` and commit bbbbbbb"), PLANTED) == \
        ["3 failed", "9 prompts"]  # bbbbbbb's run took 25 minutes
    # a figure that some record holds, in a passage naming none, is not backed
    assert unbacked_figures("The head reached τ 1.31 and 0.81×.", PLANTED) == ["0.81×", "τ 1.31"]
    assert unbacked_figures("The head reached τ 1.31 and 0.81× (commit `aaaaaaa`).", PLANTED) == []
    # each paragraph is scoped to its own records
    assert unbacked_figures("Commit `aaaaaaa`: τ 1.31.\n\nτ 1.35 on another day.", PLANTED) == ["τ 1.35"]
    # an unrecorded entry is named by its id
    assert unbacked_figures("DFlash τ 1.20, 0.51× (record `old-run`).", PLANTED) == []
    assert unbacked_figures("DFlash τ 1.20, 0.52× (record `old-run`).", PLANTED) == ["0.52×"]


def test_design_figures_are_matched_whole():
    assert unbacked_figures("budgets of 6, 7 and 7 minutes", PLANTED, ["7 minutes"]) == []
    assert unbacked_figures("budgets of 6, 17 and 7 minutes", PLANTED, ["7 minutes"]) == []  # "17" has no unit
    assert unbacked_figures("a budget of 17 minutes", PLANTED, ["7 minutes"]) == ["17 minutes"]
    assert unbacked_figures("a budget of 7 minutes", PLANTED, ["17 minutes"]) == ["7 minutes"]


def test_a_wrong_prompt_count_or_dtype_beside_a_record_is_caught():
    right = "The rows of commit `aaaaaaa` scored 11 prompts with the target in bfloat16."
    assert unbacked_figures(right, PLANTED) == []
    assert unbacked_figures(right.replace("11 prompts", "12 prompts"), PLANTED) == ["12 prompts"]
    assert unbacked_figures(right.replace("bfloat16", "float32"), PLANTED) == ["float32"]
    assert unbacked_figures(right.replace("11 prompts", "11 of the 12 prompts"), PLANTED) == []
    # the other record's count and dtype back only a sentence naming it
    assert unbacked_figures(right.replace("aaaaaaa", "bbbbbbb"), PLANTED) == ["11 prompts", "bfloat16"]
    assert unbacked_figures("Commit `bbbbbbb`: 12 prompts, a float32 target, 742 chats.", PLANTED) == []
    assert unbacked_figures("Commit `bbbbbbb`: 743 chats, on a CPU with no bfloat16 kernels.", PLANTED) == \
        ["743 chats"]
    # a sentence naming no record states counts and dtypes freely (a design: "all 12 on a fast CPU")
    assert unbacked_figures("The set has 12 prompts; the target runs in float32 or bfloat16.", PLANTED) == []


def test_a_hand_written_table_is_checked_against_its_record():
    # found by a measure in its header, or in a row's label, or by the record it (or the paragraph before it) names
    table = "| setting | ours tokens/s | ratio |\n|---|---|---|\n| fp32, TTT 3 | 916 | 2.11 |\n"
    assert unbacked_figures(table, PLANTED) == ["2.11", "916"]
    rows = "| | EAGLE-3 | DFlash |\n|---|---|---|\n| training tokens/s | 3759 | 3307 |\n| τ | 1.31 | 1.20 |\n"
    assert unbacked_figures(rows, PLANTED) == ["3759", "3307", "1.31", "1.20"]
    assert unbacked_figures("Record `old-run`:\n\n" + rows, PLANTED) == ["3307", "1.31"]
    assert unbacked_figures("| head | layout |\n|---|---|\n| EAGLE-3 | 1.5 |\n", PLANTED) == []  # a layout
    assert unbacked_figures("Commit `aaaaaaa`:\n| head | τ |\n|---|---|\n| EAGLE-3 | 1.5 |\n", PLANTED) == ["1.5"]


def test_a_wrong_prompt_count_or_dtype_in_the_readme_is_caught():
    """The README's results state, per run, the prompts it scored and its target's dtype as its record says
    (rendered); a copy with either changed is caught, and so is the same claim written by hand beside the record."""
    rt = _script()
    data, text = rt.load(), README.read_text(encoding="utf-8")
    assert stale_blocks(README, text, data) == []
    main = rt.latest_main_job(data)
    commit, dtype = main["commit"][:7], main["target_dtype"]
    count = re.match(r"\d+ prompts", main["eval_set"]).group(0)
    wrong_count, wrong_dtype = ("12 prompts" if count != "12 prompts" else "10 prompts"), \
        ("float32" if dtype != "float32" else "bfloat16")
    line = next(ln for ln in text.splitlines() if f"commit `{commit}`" in ln and count in ln)
    assert dtype in line
    for wrong in (line.replace(count, wrong_count), line.replace(dtype, wrong_dtype)):
        assert stale_blocks(README, text.replace(line, wrong), data) == ["results-set"]
    design = DESIGN["README.md"]
    claim = f"\nThe EAGLE-3 rows (commit `{commit}`) scored {count}, the SmolLM2-135M target in {dtype}.\n"
    assert unbacked_figures(text + claim, data, design) == []
    assert unbacked_figures(text + claim.replace(count, wrong_count), data, design) == [wrong_count]
    assert unbacked_figures(text + claim.replace(dtype, wrong_dtype), data, design) == [wrong_dtype]
    # the sentence the README stated before its results named their records
    old = (f"\nThe main job's evaluation set (commit `{commit}`: {wrong_count}; 32 new tokens; batch 1), the "
           f"SmolLM2-135M target in {wrong_dtype}.\n")
    assert unbacked_figures(text + old, data, design) == [wrong_count, wrong_dtype]


def test_the_results_state_each_runs_prompts_and_dtype_from_its_record():
    rt = _script()
    data = copy.deepcopy(rt.load())
    main = rt.latest_main_job(data)
    before = rt.results_set(data)
    assert f"commit `{main['commit'][:7]}` ({main['date']}): {main['eval_set']}; target in {main['target_dtype']}" \
        in before
    main["eval_set"], main["target_dtype"] = "7 prompts, 32 new tokens, batch 1", "float16"
    assert "7 prompts, 32 new tokens, batch 1; target in float16" in rt.results_set(data)
    del main["target_dtype"]
    assert "target dtype not recorded" in rt.results_set(data)


def test_the_dflash_guide_renders_its_unrecorded_record_labelled():
    rt = _script()
    data = copy.deepcopy(rt.load())
    text = rt.dflash_vs_eagle3(data)
    assert text.startswith(f"*Unrecorded history (record `{rt.DFLASH_RECORD}`")
    entry = next(r for r in data["unrecorded"]["runs"] if r.get("id") == rt.DFLASH_RECORD)
    assert not entry["commit"] and "| training tokens/s | 3759 | 3307 |" in text
    entry["train"]["eagle3"]["tokens_per_s"] = 3760
    assert "| training tokens/s | 3760 | 3307 |" in rt.dflash_vs_eagle3(data)


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
