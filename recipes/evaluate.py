"""Recipe: evaluate drafters on a target with real (tree) speculative decoding.

    python recipes/evaluate.py [head_dir=runs/x/train] [eval=full] [output_dir=...]   (the head's kind read from
    its folder; head_method=eagle3, or train's names medusa1/medusa2, only confirms it)
    python recipes/evaluate.py head_method=dflash head_dir=runs/dflash   (the block as a chain, and a tree)
    python recipes/evaluate.py head_dir=downloads/eagle3-head target.name_or_path=<its target>   (a head trained
    elsewhere: speculators', EAGLE-3 / SpecForge, z-lab DFlash, FasterDecoding Medusa, EAGLE-1; docs/evaluate.md)
    specheads evaluate ...            (same overrides)
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm import tqdm

from specheads import families
from specheads.decoding.drafters import TreeShape
from specheads.decoding.exact import ExactDecodeCalls
from specheads.errors import ConfigError, check_output_folder, user_errors
from specheads.overrides import check_command_line
from specheads.progress import evaluation_steps
from specheads.evaluation.inputs import (check_auto_shape, check_draft_model, check_medusa_choices,
                                        check_methods_fit, check_ngram_table, target_facts_from_config)
from specheads.evaluation.prompts import BenchmarkSpec, check_benchmark_files, load_benchmarks
from specheads.evaluation.report import write_report
from specheads.evaluation.resume import EvalResume
from specheads.ranges import check_number
from specheads.evaluation.suite import EvalConfig, ServingProfiles, evaluate, plan_methods
from specheads.export.foreign import FORMATS, read_foreign_head
from specheads.heads import HEAD_DIR_HINT, head_kind, head_source, verifier_for
from specheads.export.target import target_info
from specheads.targets import load_target

log = logging.getLogger("specheads.evaluate")


@dataclass
class EvalSetSchema:
    mtbench_per_category: Optional[int] = 1
    mtbench_turns: list = field(default_factory=lambda: [1, 2])
    humaneval: Optional[int] = 2
    chat: Optional[int] = 2
    chat_dir: Optional[str] = None
    jsonl: Optional[str] = None
    jsonl_limit: Optional[int] = None
    max_new_tokens: int = 32
    repeats: int = 3  # timed batch-1 decode passes per speed figure (after a warm-up): median and range
    max_minutes: Optional[float] = None  # a time budget: every domain first (docs/evaluate.md)


@dataclass
class TreeSchema:
    depth: int = 5
    topk: int = 4
    total_tokens: int = 24


@dataclass
class LookaheadSchema:
    window: int = 5
    ngram: int = 4
    guesses: int = 5


@dataclass
class EvaluateSchema:
    target: Any = MISSING
    eval: EvalSetSchema = field(default_factory=EvalSetSchema)
    output_dir: str = MISSING
    head_method: Optional[str] = None
    head_dir: Optional[str] = None
    heads: Dict[str, str] = field(default_factory=dict)
    baselines: list = field(default_factory=lambda: ["ngram", "early_exit"])
    two_model: Optional[str] = None
    chain_k: int = 4
    early_exit_layers: int = 8
    ngram_max: int = 3
    lookahead: LookaheadSchema = field(default_factory=LookaheadSchema)
    tree: TreeSchema = field(default_factory=TreeSchema)
    head_shape: str = "tree"
    head_ngram: int = 0
    head_ngram_extend: int = 0
    head_ngram_extend_len: int = 2
    head_ngram_table: Optional[str] = None
    head_ngram_table_tokens: int = 1000000
    dspark_threshold: float = 0.5
    medusa_choices: Optional[list] = None
    medusa_tree_nodes: int = 24
    serving: ServingProfiles = field(default_factory=ServingProfiles)
    verify: str = "auto"
    temperatures: list = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list = field(default_factory=lambda: [1, 4])
    batch_prompts: int = 8
    seed: int = 0
    threads: Optional[int] = None
    exact_forward: str = "auto"
    cpu_linears: str = "auto"
    cpu_threads: Any = "auto"
    paired: bool = True
    grouped_attention: bool = True
    resume: bool = True


ConfigStore.instance().store(name="evaluate_schema", node=EvaluateSchema)


# The names `specheads train` gives its methods, as the evaluator's drafter families (Medusa-1 and -2 heads are
# both drafted as Medusa; a Medusa-2 head brings its adapted target).
HEAD_ALIASES = families.aliases()


def check_foreign_heads(heads: dict[str, str | None], target: str) -> None:
    """Read every head trained elsewhere (``{setting: folder}``) against the target's config, before the target
    loads: its format, sizes, aux layers and each tensor by name (``specheads.export.foreign``)."""
    foreign = {setting: path for setting, path in heads.items() if path and head_source(path) != "specheads"}
    if not foreign:
        return
    info, _ = target_info(target, {})
    for setting, path in foreign.items():
        head = read_foreign_head(path, info)
        sizes = {k: head.config[k] for k in ("aux_layers", "draft_vocab_size", "block_size", "num_depths", "num_heads",
                                              "num_hidden_layers", "markov_rank") if k in head.config}
        log.info("%s=%s: a %s head in %s (%s)", setting, path, head.method, FORMATS[head.format],
                 ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sizes.items()))


def resolve_head(head_method: str | None, head_dir: str | None, method_setting: str = "head_method",
                 dir_setting: str = "head_dir") -> str | None:
    """The drafter family to evaluate ``head_dir`` as: read from the folder (``head_kind``); ``head_method``,
    when given, only confirms it (train's names medusa1/medusa2 count as medusa). None without a head."""
    if not head_dir:
        if head_method:
            raise ConfigError(f"{method_setting}={head_method} needs {dir_setting}: {HEAD_DIR_HINT}")
        return None
    kind = head_kind(head_dir, dir_setting)
    if head_method is None:
        return kind
    want = HEAD_ALIASES.get(str(head_method))
    if want is None:
        raise ConfigError(f"{method_setting}={head_method}: use one of {', '.join(HEAD_ALIASES)}, or leave it out: "
                          f"the kind of head is read from {dir_setting}")
    if want != kind:
        raise ConfigError(f"{method_setting}={head_method}, but {dir_setting}={head_dir} holds a head of kind {kind} (its "
                          f"config.json); leave {method_setting} out (the kind is read from the folder) or give a "
                          f"{want} head's folder")
    return kind


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("evaluate"):
        run(cfg)


def method_settings(cfg: DictConfig) -> dict[str, Any]:
    """``plan_methods``' drafting settings from the recipe's."""
    return dict(chain_k=cfg.chain_k, tree=TreeShape("dynamic", **cfg.tree), serving=ServingProfiles(**cfg.serving),
                early_exit_layers=cfg.early_exit_layers, ngram_max=cfg.ngram_max, two_model=cfg.two_model,
                medusa_choices=OmegaConf.to_container(cfg.medusa_choices) if cfg.medusa_choices else None,
                medusa_tree_nodes=cfg.medusa_tree_nodes, verify=cfg.verify,
                lookahead=OmegaConf.to_container(cfg.lookahead), head_shape=cfg.head_shape,
                head_ngram=cfg.head_ngram, head_ngram_extend=cfg.head_ngram_extend,
                head_ngram_extend_len=cfg.head_ngram_extend_len, head_ngram_table=cfg.head_ngram_table,
                head_ngram_table_tokens=cfg.head_ngram_table_tokens, dspark_threshold=cfg.dspark_threshold)


def eval_config(cfg: DictConfig, methods: list) -> EvalConfig:
    """The evaluation's settings (``EvalConfig`` checks each one's range when built)."""
    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    max_new, repeats, max_minutes = ev.pop("max_new_tokens"), ev.pop("repeats"), ev.pop("max_minutes", None)
    ev["mtbench_turns"] = tuple(ev["mtbench_turns"])
    return EvalConfig(methods, BenchmarkSpec(**ev), max_new, tuple(cfg.temperatures), tuple(cfg.batch_sizes),
                      cfg.batch_prompts, cfg.seed, repeats=repeats, max_minutes=max_minutes,
                      exact_forward=cfg.exact_forward, cpu_linears=cfg.cpu_linears, cpu_threads=cfg.cpu_threads,
                      paired=cfg.paired, grouped_attention=cfg.grouped_attention,
                      chat_template_kwargs=OmegaConf.to_container(cfg.target.chat_template_kwargs, resolve=True)
                      if cfg.target.get("chat_template_kwargs") else {})


def check_config(cfg: DictConfig) -> None:
    """Every setting's range, with no file read and nothing loaded (``specheads run`` calls it before its first
    stage; the head folders are checked when the stage starts)."""
    check_number("threads", cfg.threads, "?>= 1", integer=True, note="null = torch's default")
    eval_config(cfg, plan_methods(None, None, list(cfg.baselines), **method_settings(cfg), allow_empty=True))


def check_inputs(cfg: DictConfig, ecfg: EvalConfig, settings: dict[str, str]) -> list:
    """What the methods and the evaluation set read, before the target loads: the prompt files (read here: a
    malformed line is named), the two-model baseline's model, the n-gram table's corpus, ``medusa_choices``
    against each Medusa head, and an automatic shape's training-time measures. Returns the prompts."""
    check_benchmark_files(ecfg.benchmarks)
    prompts = load_benchmarks(ecfg.benchmarks)
    if any(m.drafter == "two_model" for m in ecfg.methods):
        check_draft_model(cfg.two_model)
    if any(m.ngram_table for m in ecfg.methods):
        check_ngram_table(cfg.head_ngram_table)
    for m in ecfg.methods:
        if m.shape.kind == "static" and m.shape.choices and m.head_dir:  # Medusa's tree, given
            check_medusa_choices(settings.get(m.head_dir, "head_dir"), m.head_dir, m.shape.choices)
    for path in {m.head_dir for m in ecfg.methods if m.auto_shape}:
        check_auto_shape(settings.get(path, "head_dir"), path, prompts)
    return prompts


def run(cfg: DictConfig) -> dict:
    # oneDNN keeps 1024 kernels by default: a bfloat16 target verifying many token counts needs more
    # (30 layers x 7 weights x n), or every forward rebuilds them (measured: 75 vs 52 ms per token).
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
    check_output_folder(cfg.output_dir)
    # every head folder is checked, and its kind read, before the target loads or anything decodes
    head_method = resolve_head(cfg.head_method, cfg.head_dir)
    heads = {}
    for name, path in (cfg.heads or {}).items():  # more heads in the same report (one plain pass for all)
        kind = resolve_head(name, path, f"heads.{name}", f"heads.{name}")
        if kind == head_method or kind in heads.values():
            raise ConfigError(f"heads.{name} ({path}) is a second {kind} head: give each drafter family once")
        heads[name] = (kind, path)
    check_foreign_heads({"head_dir": cfg.head_dir, **{f"heads.{n}": p for n, (_, p) in heads.items()}},
                        cfg.target.name_or_path)
    check_number("threads", cfg.threads, "?>= 1", integer=True, note="null = torch's default")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.eval.chat != 0 and not cfg.eval.chat_dir:
        log.warning("no eval.chat_dir given: the chat domain is left out")
    methods = plan_methods(head_method, cfg.head_dir, list(cfg.baselines), **method_settings(cfg),
                           allow_empty=bool(cfg.heads))
    for kind, path in heads.values():
        methods[:0] = plan_methods(kind, path, [], **{**method_settings(cfg), "head_shape": (
            cfg.head_shape if families.family(kind).choose_shape else "tree")}, allow_empty=True)
    ecfg = eval_config(cfg, methods)
    target_path = cfg.target.name_or_path
    adapted = verifier_for(head_method, cfg.head_dir)
    for name, (kind, path) in heads.items():
        other = verifier_for(kind, path)
        if other and other != adapted:
            raise ConfigError(f"heads.{name} ({path}) is a Medusa-2 head verified by its own adapted target; "
                             f"evaluate it on its own (head_method=medusa head_dir={path})")
    if adapted:
        log.info("Medusa-2 head: its adapted target %s is the verifier (plain decoding and the lossless check "
                 "run on it; the original %s is not used)", adapted, target_path)
        target_path = adapted
    settings = {cfg.head_dir: "head_dir", **{path: f"heads.{name}" for name, (_, path) in heads.items()}}
    prompts = check_inputs(cfg, ecfg, settings)
    facts = target_facts_from_config(target_path)
    if facts is not None:
        check_methods_fit(methods, facts, settings)
    log.info("loading the target %s (%s)", target_path, cfg.target.dtype)
    # dtype auto on a CPU: timed as decoding will run (exact forwards pad small calls to a row floor per dtype)
    rows = 4 if cfg.exact_forward == "off" else ExactDecodeCalls(tokens=4)
    target = load_target(target_path, cfg.target.dtype, cfg.target.device, probe_rows=rows,
                         chat_template=cfg.target.get("chat_template"))

    def steps(prompts: int) -> int:
        # with an exact pass unless it is off (``auto`` on a GPU has none: evaluate resizes the bar once it knows)
        return evaluation_steps(prompts, ecfg.methods, ecfg.temperatures, ecfg.repeats, ecfg.paired, ecfg.batch_sizes,
                                ecfg.batch_prompts, exact=ecfg.exact_forward != "off")

    with tqdm(desc="evaluate", unit="step", total=steps(len(prompts)),
              dynamic_ncols=True) as bar:
        def resized(total: int) -> None:  # the budget's plan: the steps it will take
            bar.total = total
            bar.refresh()

        resume = EvalResume(cfg.output_dir)
        if not cfg.resume:
            resume.clear()
        report = evaluate(target, ecfg, progress=lambda msg: (bar.set_postfix_str(msg), bar.update(1)),
                          checkpoint=lambda partial: write_report(partial, cfg.output_dir), resized=resized,
                          head_settings=settings, resume=resume)
    paths = write_report(report, cfg.output_dir)
    resume.clear()  # finished: nothing to take up
    print(open(paths["markdown"]).read())
    print(f"report -> {paths['json']}, {paths['markdown']}")
    return report


if __name__ == "__main__":
    check_command_line("evaluate", "evaluate", sys.argv[1:])  # a refused override: one line
    main()
