"""Duplicate conversations: one key per conversation, duplicates dropped within a set and against the
evaluation prompts, so no prompt that is scored is also trained on (or read by a choice made before
scoring) under another id.

The key of a conversation is its first user turn, normalised (``prompt_key``): Unicode NFKC, casefolded,
every run of whitespace made one space, punctuation (any Unicode punctuation category) and whitespace
stripped at both ends. The first
user turn is the key because the evaluator's held-out chat prompt is the conversation up to its first
assistant turn: two chats with the same first user turn give the same scored prompt whatever their
answers (ShareGPT repeats prompts: 19 of its first 850 chats repeat an earlier one's, 12 of them
"continue"). System turns are not part of the key. Exact text after normalisation, not similarity:
"Explain X." and "explain  x" are one prompt, "Explain X briefly" is another.

The evaluation prompts a prepared set is checked against are every MT-bench question's first turn and
every HumanEval prompt (as the raw function stub and as the request the evaluator sends), whatever
subset an evaluation scores; the held-out chat slice comes from the prepared set itself, so removing
duplicates within the set keeps its prompts out of every other row.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

DEDUP_VERSION = 1  # recorded in a prepared set's metadata; a set without it was prepared before any dedup
KEY_RULE = ("first user turn, NFKC, casefolded, whitespace runs collapsed, punctuation and whitespace "
            "stripped at both ends")


def prompt_key(text: str) -> str:
    """The normalised form two prompts share when they are the same prompt (see the module doc)."""
    text = " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())
    start, end = 0, len(text)
    while start < end and _strippable(text[start]):
        start += 1
    while end > start and _strippable(text[end - 1]):
        end -= 1
    return text[start:end]


def _strippable(ch: str) -> bool:
    """Whitespace or punctuation (any Unicode punctuation category: ``.``, ``!``, ``«``, ``。``...)."""
    return ch.isspace() or unicodedata.category(ch).startswith("P")


def conversation_key(messages: Sequence[dict]) -> str:
    """``prompt_key`` of the first user turn of ``messages`` (role/content dicts); "" when there is none. A turn
    showing images adds their references: one question asked of two pictures is two prompts."""
    first = next((m for m in messages if m.get("role") == "user"), {})
    key = prompt_key(first.get("content") or "")
    return "\n".join([key, *map(str, first.get("images") or ())])


def benchmark_keys() -> dict[str, str]:
    """{key: evaluation prompt id} of every MT-bench question (its first turn) and every HumanEval prompt
    (its stub and the evaluator's request around it)."""
    from specheads.data.benchmarks import load_humaneval, load_mtbench

    keys: dict[str, str] = {}
    for p in load_mtbench(per_category=None, turns=(1,)):
        keys.setdefault(prompt_key(p.turns[0]), p.id)
    for p in load_humaneval(limit=None):
        keys.setdefault(prompt_key(p.turns[0]), p.id)
        stub = p.turns[0].split("```python\n", 1)[-1].removesuffix("```")
        keys.setdefault(prompt_key(stub), p.id)
    keys.pop("", None)
    return keys


@dataclass
class DedupReport:
    """What ``drop_duplicates`` removed: ``within`` conversations repeating an earlier one's key,
    ``of_evaluation`` conversations whose key is an evaluation prompt's; a few ids of each, with the
    id of what they repeat."""

    read: int = 0
    kept: int = 0
    within: int = 0
    of_evaluation: int = 0
    evaluation_prompts: int = 0
    examples: dict[str, list[list[str]]] = field(default_factory=lambda: {"within": [], "of_evaluation": []})

    def to_dict(self) -> dict:
        return {"version": DEDUP_VERSION, "key": KEY_RULE, "conversations_read": self.read,
                "conversations_kept": self.kept, "duplicates_within": self.within,
                "duplicates_of_evaluation_prompts": self.of_evaluation,
                "evaluation_prompts_checked": self.evaluation_prompts, "examples": self.examples}


def unique_conversations(convs: Iterable, evaluation: dict[str, str] | None = None,
                         report: DedupReport | None = None, examples: int = 5) -> Iterator:
    """The conversations (objects with ``id`` and ``messages``) whose key is neither an earlier one's nor an
    evaluation prompt's (``evaluation``: {key: prompt id}), in order, lazily; the first of a repeated prompt
    is kept. Counts go in ``report`` as they stream; memory holds one key per kept conversation."""
    report = report if report is not None else DedupReport()
    evaluation = evaluation or {}
    report.evaluation_prompts = len(evaluation)
    seen: dict[bytes, str] = {}  # a 16-byte digest per kept key: memory does not hold the prompts themselves
    for conv in convs:
        report.read += 1
        key = conversation_key(conv.messages)
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        if key in evaluation:
            report.of_evaluation += 1
            _example(report.examples["of_evaluation"], conv.id, evaluation[key], examples)
        elif digest in seen:
            report.within += 1
            _example(report.examples["within"], conv.id, seen[digest], examples)
        else:
            seen[digest] = conv.id
            report.kept += 1
            yield conv


def drop_duplicates(convs: Iterable, evaluation: dict[str, str] | None = None,
                    report: DedupReport | None = None, examples: int = 5) -> list:
    """``unique_conversations`` as a list."""
    return list(unique_conversations(convs, evaluation, report, examples))


def _example(bucket: list, dropped: str, kept: str, limit: int) -> None:
    if len(bucket) < limit:
        bucket.append([str(dropped), str(kept)])
