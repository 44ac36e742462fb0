"""Every evaluation setting in its range before any work: one ``ConfigError`` naming the setting as the user
writes it (``temperatures``, ``eval.max_new_tokens``, ``tree.depth``...) and the values it takes, raised before
the target loads (``EvalConfig`` checks itself when built; ``plan_methods`` checks the drafting settings)."""

from __future__ import annotations

from specheads.errors import ConfigError
from specheads.ranges import check_choice, check_number, check_numbers

VERIFY_RULES = ("auto", "chain", "tree", "typical")


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
