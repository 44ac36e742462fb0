"""Recipe: evaluate drafters on a target with real (tree) speculative decoding.

    python recipes/evaluate.py [head_method=eagle3 head_dir=runs/x/train] [eval=full] [output_dir=...]
    python recipes/evaluate.py head_method=dflash head_dir=runs/dflash   (the block as a chain, and a tree)
    specheads evaluate ...            (same overrides)
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm import tqdm

from specheads.decoding.drafters import TreeShape
from specheads.errors import user_errors
from specheads.progress import evaluation_steps
from specheads.evaluation.benchmarks import BenchmarkSpec, load_benchmarks
from specheads.evaluation.report import write_report
from specheads.evaluation.suite import EvalConfig, ServingProfiles, evaluate, plan_methods, verifier_for
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
    paired: bool = True
    grouped_attention: bool = True


ConfigStore.instance().store(name="evaluate_schema", node=EvaluateSchema)


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("evaluate"):
        run(cfg)


def run(cfg: DictConfig) -> dict:
    # oneDNN keeps 1024 kernels by default: a bfloat16 target verifying many token counts needs more
    # (30 layers x 7 weights x n), or every forward rebuilds them (issue 13: 75 vs 52 ms per token).
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    max_new = ev.pop("max_new_tokens")
    repeats = ev.pop("repeats")
    ev["mtbench_turns"] = tuple(ev["mtbench_turns"])
    if ev["chat"] != 0 and not ev["chat_dir"]:
        log.warning("no eval.chat_dir given: the chat domain is left out")
    methods = plan_methods(cfg.head_method, cfg.head_dir, list(cfg.baselines), cfg.chain_k,
                           TreeShape("dynamic", **cfg.tree), ServingProfiles(**cfg.serving),
                           cfg.early_exit_layers, cfg.ngram_max, cfg.two_model,
                           OmegaConf.to_container(cfg.medusa_choices) if cfg.medusa_choices else None,
                           cfg.medusa_tree_nodes, cfg.verify, allow_empty=bool(cfg.heads),
                           lookahead=OmegaConf.to_container(cfg.lookahead), head_shape=cfg.head_shape,
                           head_ngram=cfg.head_ngram, head_ngram_extend=cfg.head_ngram_extend,
                           head_ngram_extend_len=cfg.head_ngram_extend_len, head_ngram_table=cfg.head_ngram_table,
                           head_ngram_table_tokens=cfg.head_ngram_table_tokens)
    for name, path in (cfg.heads or {}).items():  # more heads in the same report (one plain pass for all)
        if name == cfg.head_method:
            raise ValueError(f"heads.{name} repeats head_method={name}: give each drafter family once")
        methods[:0] = plan_methods(name, path, [], cfg.chain_k, TreeShape("dynamic", **cfg.tree),
                                   ServingProfiles(**cfg.serving), medusa_choices=(
                                       OmegaConf.to_container(cfg.medusa_choices) if cfg.medusa_choices else None),
                                   medusa_tree_nodes=cfg.medusa_tree_nodes, verify=cfg.verify, allow_empty=True,
                                   head_shape=cfg.head_shape if name in ("eagle1", "eagle3") else "tree",
                                   ngram_max=cfg.ngram_max, head_ngram=cfg.head_ngram,
                                   head_ngram_extend=cfg.head_ngram_extend,
                                   head_ngram_extend_len=cfg.head_ngram_extend_len,
                                   head_ngram_table=cfg.head_ngram_table,
                                   head_ngram_table_tokens=cfg.head_ngram_table_tokens)
    ecfg = EvalConfig(methods, BenchmarkSpec(**ev), max_new, tuple(cfg.temperatures), tuple(cfg.batch_sizes),
                      cfg.batch_prompts, cfg.seed, repeats=repeats,
                      exact_forward=cfg.exact_forward, cpu_linears=cfg.cpu_linears, paired=cfg.paired,
                      grouped_attention=cfg.grouped_attention,
                      chat_template_kwargs=OmegaConf.to_container(cfg.target.chat_template_kwargs, resolve=True)
                      if cfg.target.get("chat_template_kwargs") else {})
    target_path = cfg.target.name_or_path
    adapted = verifier_for(cfg.head_method, cfg.head_dir)
    for name, path in (cfg.heads or {}).items():
        other = verifier_for(name, path)
        if other and other != adapted:
            raise ValueError(f"heads.{name} ({path}) is a Medusa-2 head verified by its own adapted target; "
                             f"evaluate it on its own (head_method=medusa head_dir={path})")
    if adapted:
        log.info("Medusa-2 head: its adapted target %s is the verifier (plain decoding and the lossless check "
                 "run on it; the original %s is not used)", adapted, target_path)
        target_path = adapted
    log.info("loading the target %s (%s)", target_path, cfg.target.dtype)
    target = load_target(target_path, cfg.target.dtype, cfg.target.device)
    total = evaluation_steps(len(load_benchmarks(ecfg.benchmarks)), ecfg.methods, ecfg.temperatures, ecfg.repeats,
                             ecfg.paired, ecfg.batch_sizes, ecfg.batch_prompts)
    with tqdm(desc="evaluate", unit="step", total=total, dynamic_ncols=True) as bar:
        report = evaluate(target, ecfg, progress=lambda msg: (bar.set_postfix_str(msg), bar.update(1)),
                          checkpoint=lambda partial: write_report(partial, cfg.output_dir))
    paths = write_report(report, cfg.output_dir)
    print(open(paths["markdown"]).read())
    print(f"report -> {paths['json']}, {paths['markdown']}")
    return report


if __name__ == "__main__":
    main()
