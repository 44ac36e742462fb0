"""Every evaluation setting in its range before any work: one ``ConfigError`` naming the setting as the user
writes it (``temperatures``, ``eval.max_new_tokens``, ``tree.depth``...) and the values it takes, raised before
the target loads (``EvalConfig`` checks itself when built; ``plan_methods`` checks the drafting settings)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from specheads.errors import ConfigError

VERIFY_RULES = ("auto", "chain", "tree", "typical")
_RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, ">= 2": lambda v: v >= 2}


def check_number(setting: str, value: Any, rule: str, integer: bool = False, note: str = "") -> None:
    """Refuse ``value`` unless it is a finite number (an integer with ``integer``) obeying ``rule`` (a key of
    ``_RULES``; a leading "?" lets null through); ``note`` says what the setting means in the message."""
    if not (value is None and rule.startswith("?")) and not _obeys(value, rule.lstrip("?"), integer):
        raise ConfigError(f"{setting}={value} is out of range: {_allowed(rule, integer, note)}")


def check_numbers(setting: str, values: Iterable, rule: str, integer: bool = False, note: str = "",
                  allow_empty: bool = True) -> None:
    """``check_number`` on each item of a list setting, which must not repeat an item."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{setting}={values}: give a list, e.g. {setting}=[1]")
    values = list(values)
    shown = "[" + ", ".join(map(str, values)) + "]"
    if not values and not allow_empty:
        raise ConfigError(f"{setting}=[] is empty: {_allowed(rule, integer, note)}, at least one")
    for v in values:
        if not _obeys(v, rule, integer):
            raise ConfigError(f"{setting}={shown}: {v} is out of range: {_allowed(rule, integer, note)}")
    if len(set(values)) < len(values):
        raise ConfigError(f"{setting}={shown} repeats a value: give each once")


def _obeys(value: Any, rule: str, integer: bool) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and (isinstance(value, int) or not integer) and _RULES[rule](value)


def _allowed(rule: str, integer: bool, note: str) -> str:
    """What a setting takes: ``give an integer >= 1 (or null); <note>``."""
    kind = "an integer" if integer else "a finite number"
    return (f"give {kind} {rule.lstrip('?')}" + (" (or null)" if rule.startswith("?") else "")
            + (f"; {note}" if note else ""))


def check_choice(setting: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{setting}={value}: use one of {', '.join(map(str, choices))}")


def check_eval_config(cfg) -> None:
    """An ``EvalConfig``'s settings (and its benchmark set's), under the recipe's names."""
    check_numbers("temperatures", cfg.temperatures, ">= 0", note="0 = greedy, 1 = the target's own distribution",
                  allow_empty=False)
    check_number("eval.max_new_tokens", cfg.max_new_tokens, ">= 1", integer=True)
    check_numbers("batch_sizes", cfg.batch_sizes, ">= 1", integer=True, note="1 = batch-1 decoding only")
    check_number("batch_prompts", cfg.batch_prompts, ">= 1", integer=True)
    check_number("eval.repeats", cfg.repeats, ">= 1", integer=True, note="timed passes per speed figure")
    check_number("eval.max_minutes", cfg.max_minutes, "?> 0", note="null evaluates everything")
    check_numbers("recommend_ks", cfg.recommend_ks, ">= 1", integer=True, allow_empty=False)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError(f"seed={cfg.seed}: give an integer")
    if cfg.cpu_threads != "auto":
        check_number("cpu_threads", cfg.cpu_threads, ">= 1", integer=True, note="or auto (measured)")
    from specheads.decoding.cpu_linears import CPU_LINEAR_MODES
    from specheads.decoding.exact import EXACT_MODES

    check_choice("exact_forward", cfg.exact_forward, tuple(EXACT_MODES))
    check_choice("cpu_linears", cfg.cpu_linears, tuple(CPU_LINEAR_MODES))
    check_benchmarks(cfg.benchmarks)


def check_benchmarks(spec) -> None:
    """A ``BenchmarkSpec``: counts >= 0 or null (all), MT-bench turns among 1 and 2."""
    for name in ("mtbench_per_category", "humaneval", "chat", "jsonl_limit"):
        check_number(f"eval.{name}", getattr(spec, name), "?>= 0", integer=True, note="null = all, 0 = none")
    turns = list(spec.mtbench_turns)
    if not turns or any(t not in (1, 2) or isinstance(t, bool) for t in turns) or len(set(turns)) < len(turns):
        raise ConfigError(f"eval.mtbench_turns={turns}: give [1], [2] or [1, 2] (MT-bench's two turns)")


def check_method_settings(chain_k: int, tree, serving, early_exit_layers: int, ngram_max: int, verify: str,
                          lookahead: dict | None, medusa_choices, medusa_tree_nodes: int, head_ngram: int,
                          head_ngram_extend: int, head_ngram_extend_len: int, head_ngram_table_tokens: int) -> None:
    """``plan_methods``' drafting settings: chain and tree shapes, serving profiles, baselines, lookup branch."""
    check_number("chain_k", chain_k, ">= 1", integer=True, note="draft tokens per step of the baselines' chains")
    for name in ("depth", "topk", "total_tokens"):
        check_number(f"tree.{name}", getattr(tree, name), ">= 1", integer=True)
    check_number("serving.vllm_num_speculative_tokens", serving.vllm_num_speculative_tokens, ">= 1", integer=True)
    check_number("serving.sglang_steps", serving.sglang_steps, ">= 1", integer=True)
    check_number("serving.sglang_topk", serving.sglang_topk, ">= 1", integer=True)
    check_number("serving.sglang_num_draft_tokens", serving.sglang_num_draft_tokens, ">= 2", integer=True,
                 note="the root counts")
    check_number("early_exit_layers", early_exit_layers, ">= 1", integer=True)
    check_number("ngram_max", ngram_max, ">= 1", integer=True)
    check_choice("verify", verify, VERIFY_RULES)
    la = lookahead or {}
    for name, rule in (("window", ">= 1"), ("ngram", ">= 2"), ("guesses", ">= 1")):
        if name in la:
            check_number(f"lookahead.{name}", la[name], rule, integer=True)
    check_number("medusa_tree_nodes", medusa_tree_nodes, ">= 1", integer=True)
    for path in medusa_choices or ():
        if not isinstance(path, (list, tuple)) or not path or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path):
            raise ConfigError(f"medusa_choices: {path} is no tree path: give lists of ranks >= 0, e.g. [[0], [1], [0, 0]]")
    paths = {tuple(path) for path in medusa_choices or ()}
    for path in sorted(paths, key=len):
        if len(path) > 1 and path[:-1] not in paths:
            raise ConfigError(f"medusa_choices: the path {list(path)} lacks its parent {list(path[:-1])}: a tree holds "
                              "every prefix of each of its paths, e.g. [[0], [1], [0, 0]]")
    check_number("head_ngram", head_ngram, ">= 0", integer=True, note="0 = no prompt-lookup branch")
    check_number("head_ngram_extend", head_ngram_extend, ">= 0", integer=True)
    check_number("head_ngram_extend_len", head_ngram_extend_len, ">= 1", integer=True)
    check_number("head_ngram_table_tokens", head_ngram_table_tokens, ">= 1", integer=True)
