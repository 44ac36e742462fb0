"""The methods an evaluation runs (``plan_methods``): the head's own rows, its serving profiles, its prompt-lookup
branch and the baselines.

Each head family plans its own rows (``Family.rows`` in ``specheads/families.py`` names its function here, called
with a ``HeadPlan``); what every family shares (the lookup branch, vLLM's profile row, the baselines) is planned
once below.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specheads.decoding.drafters import TreeShape
from specheads.errors import ConfigError
from specheads.evaluation.settings import check_method_settings
from specheads.evaluation.spec import MethodSpec
from specheads.export.foreign import FORMATS
from specheads.families import NAMES, find, load
from specheads.heads import dflash_block_size, dspark_block_size, head_source, mtp_steps, peagle_depths


@dataclass
class ServingProfiles:
    """What each serving engine does with an exported head: vLLM drafts EAGLE and Medusa as a top-1
    chain of ``num_speculative_tokens``; SGLang grows an EAGLE tree of ``steps`` levels, ``topk``
    per expansion, verifying ``num_draft_tokens`` tokens (the root included, so the tree has one fewer)."""

    vllm_num_speculative_tokens: int = 3
    sglang_steps: int = 5
    sglang_topk: int = 4
    sglang_num_draft_tokens: int = 8
    engines: list = field(default_factory=lambda: ["vllm", "sglang"])  # the profiles to run


@dataclass
class HeadPlan:
    """What a family's rows are planned from: the family (``method``), the head folder and the drafting settings."""

    method: str
    head_dir: str
    verify: str
    tree: TreeShape
    serving: ServingProfiles
    head_shape: str = "tree"
    medusa_choices: list | None = None
    medusa_tree_nodes: int = 24
    dspark_threshold: float = 0.5


def plan_methods(method: str | None, head_dir: str | None, baselines=("ngram", "early_exit"),
                 chain_k: int = 4, tree: TreeShape | None = None, serving: ServingProfiles | None = None,
                 early_exit_layers: int = 8, ngram_max: int = 3, two_model: str | None = None,
                 medusa_choices=None, medusa_tree_nodes: int = 24, verify: str = "auto",
                 allow_empty: bool = False, lookahead: dict | None = None,
                 head_shape: str = "tree", head_ngram: int = 0, head_ngram_extend: int = 0,
                 head_ngram_extend_len: int = 2, head_ngram_table: str | None = None,
                 head_ngram_table_tokens: int = 1_000_000, dspark_threshold: float = 0.5) -> list[MethodSpec]:
    """The method list for an evaluation: the head's own shape, its serving profiles, and baselines.

    DFlash (``dflash``, B read from the head's config): the block drafted as a chain of B-1 (``dflash-chain{B-1}``,
    what the reference and the engines draft) and a tree of per-slot candidates (``dflash-tree``: ``tree`` with
    its depth capped at B-1; ``DFlashDrafter``); no serving profile rows. DSpark (``dspark``): the block as a
    chain of B-1 with every draft verified (``dspark-chain{B-1}``) and as its confidence head schedules it
    (``dspark-sched{t}``: the drafts whose survival reaches ``dspark_threshold``); ``DSparkDrafter``.
    head_shape: ``tree`` (the EAGLE-2 dynamic ``tree``) or ``auto`` (EAGLE: the chain this machine's
    verify cost curve and the head's held-out acceptance favour, chosen at evaluation: ``shape_choice``);
    lookahead: {window, ngram, guesses} of the lookahead baseline (default 5, 4, 5); head_ngram > 0: the
    head's own shape once more with the prompt lookup's chain of ``head_ngram`` tokens grafted onto its
    trees (``PromptLookupBranch``), right after it; with ``head_ngram_extend`` > 0 its best first drafts are
    continued too (``head_ngram_extend_len`` tokens from the prompt lookup or ``head_ngram_table``'s n-grams)."""
    if head_shape not in ("tree", "auto"):
        raise ConfigError(f"head_shape={head_shape}: use tree or auto")
    tree = tree or TreeShape("dynamic", depth=5, topk=4, total_tokens=24)
    serving = serving or ServingProfiles()
    check_method_settings(chain_k, tree, serving, early_exit_layers, ngram_max, verify, lookahead, medusa_choices,
                          medusa_tree_nodes, head_ngram, head_ngram_extend, head_ngram_extend_len,
                          head_ngram_table_tokens)
    unknown = set(serving.engines) - {"vllm", "sglang"}
    if unknown:
        raise ConfigError(f"serving.engines: unknown profile(s) {sorted(unknown)}; use vllm and/or sglang")
    out: list[MethodSpec] = []
    if method:
        plan = HeadPlan(method, head_dir, verify, tree, serving, head_shape, medusa_choices, medusa_tree_nodes,
                        dspark_threshold)
        out = head_rows(plan)
        if head_ngram:
            own = out[0]
            name = f"{own.name}+ngram{head_ngram}" + (f"+x{head_ngram_extend}" if head_ngram_extend else "")
            out.insert(1, replace(own, name=name, ngram_branch=head_ngram, ngram_max=ngram_max,
                                  ngram_extend=head_ngram_extend, ngram_extend_len=head_ngram_extend_len,
                                  ngram_table=head_ngram_table if head_ngram_extend else None,
                                  ngram_table_tokens=head_ngram_table_tokens))
        if "vllm" in serving.engines and find(method).vllm_profile:
            vllm = TreeShape("chain", k=serving.vllm_num_speculative_tokens)
            out.append(MethodSpec(f"{method}-vllm", method, vllm, verify, head_dir=head_dir, profile="vllm"))
    out += baseline_rows(baselines, chain_k, verify, ngram_max, lookahead, early_exit_layers, two_model)
    if not out and not allow_empty:
        raise ConfigError("nothing to evaluate: give method + head_dir, or baselines")
    return out


def head_rows(plan: HeadPlan) -> list[MethodSpec]:
    """The head's own rows (and its SGLang profile row), planned by its family (``Family.rows``)."""
    if not plan.head_dir:
        raise ConfigError(f"method={plan.method} needs head_dir (a trained head or training output folder)")
    fam = find(plan.method)
    source = head_source(plan.head_dir)
    if plan.head_shape == "auto" and source != "specheads":
        raise ConfigError(f"head_shape=auto chooses the shape from the acceptance measured at training "
                          f"(train_summary.json), which {plan.head_dir} does not have (a head trained elsewhere, "
                          f"in {FORMATS[source]}): set head_shape=tree")
    if fam is None or fam.name != plan.method:
        raise ConfigError(f"method '{plan.method}': use {', '.join(NAMES)} (or none for baselines only)")
    return load(fam.rows)(plan)


# ------------------------------------------------------------------ each family's rows (``Family.rows``)


def medusa_rows(p: HeadPlan) -> list[MethodSpec]:
    """Medusa's static tree (the choices given, else the head's calibrated tree, chosen when it is built)."""
    static = TreeShape("static", choices=tuple(map(tuple, p.medusa_choices)) if p.medusa_choices else None)
    return [MethodSpec("medusa-tree", "medusa", static, p.verify, head_dir=p.head_dir,
                       medusa_tree_nodes=p.medusa_tree_nodes)]


def eagle_rows(p: HeadPlan) -> list[MethodSpec]:
    """EAGLE's dynamic tree (or with ``head_shape=auto`` the chain or fan chosen at evaluation), then SGLang's."""
    m = p.method
    if p.head_shape == "auto":
        out = [MethodSpec(f"{m}-auto", m, TreeShape("chain", k=1), p.verify, head_dir=p.head_dir, auto_shape=True)]
    else:
        out = [MethodSpec(f"{m}-tree", m, p.tree, p.verify, head_dir=p.head_dir)]
    if "sglang" in p.serving.engines:
        s = p.serving
        sgl = TreeShape("dynamic", depth=s.sglang_steps, topk=s.sglang_topk, total_tokens=s.sglang_num_draft_tokens - 1)
        out.append(MethodSpec(f"{m}-sglang", m, sgl, p.verify, head_dir=p.head_dir, profile="sglang"))
    return out


def dflash_rows(p: HeadPlan) -> list[MethodSpec]:
    """One block per step: its chain and its tree (head_shape=auto chooses nothing)."""
    B = dflash_block_size(p.head_dir)
    return [MethodSpec(f"dflash-chain{B - 1}", "dflash", TreeShape("chain", k=B - 1), p.verify, head_dir=p.head_dir),
            MethodSpec("dflash-tree", "dflash", replace(p.tree, depth=min(p.tree.depth, B - 1)), p.verify,
                       head_dir=p.head_dir)]


def peagle_rows(p: HeadPlan) -> list[MethodSpec]:
    """One forward drafts a chain of K."""
    K = peagle_depths(p.head_dir)
    return [MethodSpec(f"peagle-chain{K}", "peagle", TreeShape("chain", k=K), p.verify, head_dir=p.head_dir)]


def mtp_rows(p: HeadPlan) -> list[MethodSpec]:
    """The chain of the K steps it was trained for: what vLLM's mtp method drafts."""
    K = mtp_steps(p.head_dir)
    return [MethodSpec(f"mtp-chain{K}", "mtp", TreeShape("chain", k=K), p.verify, head_dir=p.head_dir)]


def dspark_rows(p: HeadPlan) -> list[MethodSpec]:
    """The block as a chain, every draft verified, then as the confidence head schedules it."""
    chain = TreeShape("chain", k=dspark_block_size(p.head_dir) - 1)
    return [MethodSpec(f"dspark-chain{chain.k}", "dspark", chain, p.verify, head_dir=p.head_dir),
            MethodSpec(f"dspark-sched{p.dspark_threshold:g}", "dspark", chain, p.verify, head_dir=p.head_dir,
                       confidence_threshold=p.dspark_threshold)]


def domino_rows(p: HeadPlan) -> list[MethodSpec]:
    """The block as a chain of B-1, corrected left to right."""
    chain = TreeShape("chain", k=dflash_block_size(p.head_dir, "domino") - 1)
    return [MethodSpec(f"domino-chain{chain.k}", "domino", chain, p.verify, head_dir=p.head_dir)]


# ------------------------------------------------------------------ the baselines


def baseline_rows(baselines, chain_k: int, verify: str, ngram_max: int, lookahead: dict | None,
                  early_exit_layers: int, two_model: str | None) -> list[MethodSpec]:
    """One row per baseline, in the order given."""
    out = []
    chain = TreeShape("chain", k=chain_k)
    for b in baselines or ():
        if b == "ngram":
            out.append(MethodSpec(f"ngram-chain{chain_k}", "ngram", chain, verify, ngram_max=ngram_max))
        elif b == "lookahead":
            la = {"window": 5, "ngram": 4, "guesses": 5, **(lookahead or {})}
            W, N, G = int(la["window"]), int(la["ngram"]), int(la["guesses"])
            trie = TreeShape("dynamic", depth=N - 1, topk=max(G, 1), total_tokens=max(G, 1) * (N - 1))
            out.append(MethodSpec(f"lookahead-W{W}N{N}G{G}", "lookahead", trie, verify, lookahead=(W, N, G)))
        elif b == "suffix":  # suffix decoding: a chain of at most chain_k, as vLLM drafts it
            out.append(MethodSpec(f"suffix-chain{chain_k}", "suffix", chain, verify))
        elif b == "early_exit":
            out.append(MethodSpec(f"early_exit{early_exit_layers}-chain{chain_k}", "early_exit", chain, verify,
                                  early_exit_layers=early_exit_layers))
        elif b == "two_model":
            if not two_model:
                raise ConfigError("baselines=[two_model] needs two_model=<a smaller model sharing the target's "
                                  "tokenizer> (a folder, .gguf file or hub id)")
            out.append(MethodSpec(f"two_model-chain{chain_k}", "two_model", chain, verify, draft_model=two_model))
        else:
            raise ConfigError(f"baseline '{b}': use ngram, lookahead, suffix, early_exit or two_model")
    return out
