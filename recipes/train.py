"""Recipe: train a draft head (Medusa-1/2, EAGLE-1/3) with the shared engine.

    python recipes/train.py method=medusa1 prepared_dir=runs/default/prepared output_dir=runs/m1
    python recipes/train.py method=eagle3 features_dir=runs/x/features      (offline feature store)
    accelerate launch --config_file conf/launcher/deepspeed_zero2.yaml recipes/train.py method=medusa2 ...
    specheads train ...                                                      (same overrides)

Writes ``output_dir/{checkpoints/, head/, metrics.jsonl, train_summary.json}``; rerunning the same
command resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specheads.errors import ConfigError, check_output_folder, user_errors
from specheads.overrides import check_command_line
from specheads.hardware import Choice

from specheads.methods import build_method
from specheads.training.accelerator import limit_onednn_cache, make_accelerator
from specheads.training.batches import DatasetBatches, split_rows
from specheads.training.checkpoint import check_resume_settings, resume_checkpoint
from specheads.training.config import (OptimConfig, TrainConfig, check_data_source, check_settings,
                                       check_store_source)
from specheads.training.engine import train
from specheads.training import sequence_parallel

log = logging.getLogger("specheads.train")


# --------------------------------------------------------------------------- schemas (typos fail)


@dataclass
class DataSchema:
    max_tokens: Optional[int] = 4096
    batch_size: Optional[int] = None
    eval_samples: int = 64
    eval_max_tokens: Optional[int] = 8192
    max_length: Optional[int] = None
    pad_to_multiple_of: int = 64  # pad batch lengths to a multiple (a few recurring shapes: conf/train.yaml)
    epochs: Optional[float] = None  # passes over the training rows; sets train.max_steps


@dataclass
class LoopSchema:
    max_steps: int = 1000
    max_minutes: Optional[float] = None
    sequence_parallel: int = 1
    onednn_cache: Optional[int] = None
    free_target_layers: bool = True
    malloc_trim_every: int = 0
    grad_accum: int = 1
    max_grad_norm: Optional[float] = 1.0
    mixed_precision: str = "auto"
    deterministic: bool = True
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 200
    keep_checkpoints: int = 2
    async_checkpoint: str = "auto"
    resume: str = "auto"
    progress: bool = True
    measure_prompts: int = 4
    measure_k: int = 3
    measure_tokens: int = 32
    measure_fans: List[int] = field(default_factory=lambda: [2, 3, 4, 6])


@dataclass
class WandbSchema:
    mode: str = "offline"
    project: str = "specheads"
    name: Optional[str] = None


@dataclass
class OptimSchema:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"


@dataclass
class Medusa1Schema:
    name: str = "medusa1"
    num_heads: int = 5
    num_layers: int = 1
    fc_bias: bool = True
    loss_decay: float = 0.8
    top_k: int = 5
    train_lm_heads: bool = True
    labels: str = "data"


@dataclass
class Medusa2Schema(Medusa1Schema):
    name: str = "medusa2"
    adapter: str = "lora"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: Any = "all-linear"
    target_loss: str = "kl"
    target_weight: float = 1.0
    heads_weight: float = 1.0
    kl_temperature: float = 1.0
    heads_warmup_steps: int = 0


@dataclass
class TrainRecipeConfig:
    target: Any = MISSING
    method: Any = MISSING
    optim: OptimSchema = field(default_factory=OptimSchema)
    output_dir: str = MISSING
    prepared_dir: Optional[str] = None
    features_dir: Optional[str] = None
    seed: int = 0
    data: DataSchema = field(default_factory=DataSchema)
    train: LoopSchema = field(default_factory=LoopSchema)
    wandb: WandbSchema = field(default_factory=WandbSchema)


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (conf/train.yaml and conf/method|optim files extend them). The
    group schemas live under schema/, outside the groups a user picks from (method=..., optim=...)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainRecipeConfig)
    cs.store(group="schema/method", name="medusa1", node=Medusa1Schema)
    cs.store(group="schema/method", name="medusa2", node=Medusa2Schema)
    cs.store(group="schema/optim", name="adamw", node=OptimSchema)


register_configs()


# --------------------------------------------------------------------------- building


def to_configs(cfg: DictConfig) -> tuple[TrainConfig, OptimConfig, dict[str, Any]]:
    """Hydra config -> (engine loop config, optimizer config, method kwargs incl. name)."""
    loop = OmegaConf.to_container(cfg.train, resolve=True)
    tcfg = TrainConfig(output_dir=cfg.output_dir, seed=cfg.seed, wandb_mode=cfg.wandb.mode,
                       wandb_project=cfg.wandb.project, run_name=cfg.wandb.name,
                       micro_batch_size=cfg.data.batch_size or 1, **loop)
    ocfg = OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
    ocfg.betas = tuple(ocfg.betas)
    return tcfg, ocfg, OmegaConf.to_container(cfg.method, resolve=True)


def check_config(cfg: DictConfig) -> tuple[TrainConfig, OptimConfig, dict[str, Any]]:
    """``to_configs`` with every setting's range checked and the method built once from its settings (its
    constructor refuses what it cannot take), no file read and nothing loaded (``specheads run`` calls it before
    its first stage)."""
    tcfg, ocfg, mcfg = to_configs(cfg)
    check_settings(tcfg, ocfg, mcfg, OmegaConf.to_container(cfg.data, resolve=True))
    # the launch's world size too: a one-process run (``specheads run``'s train stage) is refused before any stage
    sequence_parallel.check_settings(tcfg.sequence_parallel, mcfg["name"], int(os.environ.get("WORLD_SIZE", "1")))
    build_method(**mcfg)
    return tcfg, ocfg, mcfg


def build_data(cfg: DictConfig, method, target) -> tuple[DatasetBatches, DatasetBatches | None]:
    """(train source, held-out source) from the feature store or the prepared set."""
    from specheads.data.features import FeatureDataset, TokenDataset
    from specheads.data.prepare import check_prepared_matches, load_prepared

    if cfg.features_dir:
        if method.feature_spec.online_only:
            raise ValueError(f"method {method.name} trains the target, so it needs online features: "
                             "unset features_dir and give prepared_dir")
        dataset = FeatureDataset(cfg.features_dir, spec=method.feature_spec, target=target)
    elif cfg.prepared_dir:
        rows, meta = load_prepared(cfg.prepared_dir)
        check_prepared_matches(meta, target)
        dataset = TokenDataset(rows)
    else:
        raise ValueError("give features_dir (offline store) or prepared_dir (online features)")
    # Hold out at most a tenth of a small set, so training keeps most of the data.
    n_eval = min(cfg.data.eval_samples, len(dataset) // 10)
    train_idx, eval_idx = split_rows(len(dataset), n_eval, cfg.seed)
    prepared_ids = _prepared_ids(cfg, dataset)
    train_idx, eval_idx = keep_chat_heldout_out(dataset, train_idx, eval_idx, prepared_ids)
    cut = cfg.data.max_length
    train_src = DatasetBatches(dataset, cfg.data.max_tokens, cfg.data.batch_size, True, cfg.seed, train_idx, cut,
                               cfg.data.pad_to_multiple_of)
    eval_src = DatasetBatches(dataset, cfg.data.eval_max_tokens, None, False, cfg.seed, eval_idx, cut) \
        if n_eval and eval_idx else None
    return train_src, eval_src


def _row_ids(dataset) -> list[str]:
    ids = dataset.ids if hasattr(dataset, "ids") else [str(x) for x in dataset.dataset["id"]] \
        if dataset.has_ids else [str(i) for i in range(len(dataset))]
    return list(map(str, ids))


def _prepared_dir(cfg: DictConfig, dataset) -> str | None:
    """The prepared set the rows come from (``prepared_dir``, or the one the feature store was collected from)."""
    return cfg.prepared_dir or ((getattr(dataset, "manifest", None) or {}).get("source") or {}).get("prepared_dir")


def _prepared_ids(cfg: DictConfig, dataset) -> list[str] | None:
    """The sample ids of the prepared set a feature store was collected from (the evaluator takes its chat
    slice from them), when it is there (None when the rows are the prepared set itself: its ids are the rows');
    warns when the prepared set was prepared before duplicate conversations were removed. A store collected
    within a time budget holds a subset of the prepared rows, whose own last 1% is not the evaluator's slice: the
    prepared set's ids count whether it is named by ``prepared_dir`` (as ``specheads run`` passes it) or by the
    store's manifest."""
    from specheads.data.prepare import load_prepared

    meta = _prepared_meta(cfg, dataset)
    if meta is not None and not meta.get("dedup"):
        log.warning("%s was prepared before duplicate conversations were removed: a training row may repeat a "
                    "prompt the evaluator scores; prepare it again (`specheads prepare overwrite=true`)",
                    _prepared_dir(cfg, dataset))
    if meta is None or getattr(dataset, "manifest", None) is None:  # no prepared set, or the rows are it
        return None
    return [str(x) for x in load_prepared(_prepared_dir(cfg, dataset))[0]["id"]]


def _prepared_meta(cfg: DictConfig, dataset) -> dict | None:
    from specheads.data.prepare import META_FILE

    path = _prepared_dir(cfg, dataset)
    return json.loads(Path(path, META_FILE).read_text()) if path and Path(path, META_FILE).exists() else None


def keep_chat_heldout_out(dataset, train_idx: list[int], eval_idx: list[int],
                          prepared_ids: list[str] | None = None) -> tuple[list[int], list[int]]:
    """Leave the evaluator's held-out chat slice (``chat_heldout_ids`` of the rows' ids, and of
    ``prepared_ids``, the prepared set they came from, whose slice the evaluator scores) out of training
    *and* out of the held-out rows: the chat domain of ``specheads evaluate`` is never trained on, and
    nothing measured on the held-out rows before scoring (the measured fans and chain reach the
    evaluator's shape choice reads, Medusa's tree calibration, the bigram baselines) reads a prompt it
    scores. Each chat's per-turn samples stay on one side: a training row whose chat has a held-out
    row is held out too."""
    from specheads.data.render import chat_id
    from specheads.evaluation.prompts import chat_heldout_ids

    ids = _row_ids(dataset)
    scored = {chat_id(x) for x in chat_heldout_ids(ids)}
    if prepared_ids is not None:
        scored |= {chat_id(x) for x in chat_heldout_ids(prepared_ids)}
    held = {chat_id(ids[i]) for i in eval_idx} - scored
    left_out = sum(chat_id(x) in scored for x in ids)
    moved = [i for i in train_idx if chat_id(ids[i]) in held]
    if left_out or moved:
        log.info("%d row(s) of the evaluator's chat slice left out of training and held-out rows; %d row(s) of "
                 "held-out chats (another turn of a held-out chat) moved out of training", left_out, len(moved))
    train = [i for i in train_idx if chat_id(ids[i]) not in held | scored]
    return train, sorted({i for i in eval_idx if chat_id(ids[i]) not in scored} | set(moved))


def split_record(cfg: DictConfig, train_src, eval_src) -> dict[str, Any]:
    """How the rows were split, for ``train_summary.json`` (the evaluator checks it before its shape
    choice reads the held-out acceptance, and reports it): rows in all, trained on, held out (their ids),
    and left out as the evaluator's chat slice (neither trained on nor read by any held-out measurement);
    the prepared set's duplicate counts (``specheads.data.dedup``), None when it was prepared without them."""
    dataset = train_src.dataset
    held = len(eval_src.indices) if eval_src is not None else 0
    dedup = (_prepared_meta(cfg, dataset) or {}).get("dedup")
    ids = _row_ids(dataset)
    return {"rows": len(dataset), "train_rows": len(train_src.indices), "heldout_rows": held,
            "evaluation_rows_left_out": len(dataset) - len(train_src.indices) - held,
            "heldout_excludes_evaluation": True,
            "heldout_ids": [ids[i] for i in (eval_src.indices if eval_src is not None else ())],
            "dedup": {k: v for k, v in dedup.items() if k != "examples"} if dedup else None}


def set_vocab_rows(method, cfg: DictConfig, train_src) -> None:
    """A method that picks a vocabulary from data (EAGLE-3's ``vocab_data``) counts the training rows
    only: when ``vocab_data`` is the prepared set the training rows come from (``prepared_dir``, or
    the one the feature store was collected from), it gets their ids as ``vocab_rows``, so held-out
    rows and the evaluator's chat rows never shape the draft vocabulary."""
    data = getattr(method, "vocab_data", None)
    if getattr(method, "vocab_rows", "unset") is not None or not isinstance(data, (str, Path)):
        return
    dataset = train_src.dataset
    sources = [cfg.prepared_dir, ((getattr(dataset, "manifest", None) or {}).get("source") or {}).get("prepared_dir")]
    if Path(data).resolve() not in {Path(s).resolve() for s in sources if s}:
        log.warning("vocab_data %s is not the training data; its rows are all counted for the draft vocabulary", data)
        return
    ids = dataset.ids if hasattr(dataset, "ids") else [str(x) for x in dataset.dataset["id"]] \
        if dataset.has_ids else [str(i) for i in range(len(dataset))]
    method.vocab_rows = [str(ids[i]) for i in train_src.indices]
    log.info("draft vocabulary counted over the %d training rows (%d rows held out)",
             len(method.vocab_rows), len(ids) - len(method.vocab_rows))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Compose -> build -> train; returns the train summary."""
    from specheads.targets import load_target

    tcfg, ocfg, mcfg = check_config(cfg)  # before any work
    check_output_folder(cfg.output_dir)
    check_data_source(cfg.features_dir, cfg.prepared_dir)
    check_resume(cfg, tcfg, mcfg)
    limit_onednn_cache(tcfg.onednn_cache)  # before anything computes in this process
    method = build_method(mcfg.pop("name"), **mcfg)
    if cfg.features_dir:
        check_store_source(cfg.features_dir, cfg.prepared_dir, method, target_config(cfg.target.name_or_path),
                           cfg.target.name_or_path)
    if tcfg.sequence_parallel > 1:  # the launch's world size, the drafter's heads (the target's)
        sequence_parallel.check_launch(tcfg.sequence_parallel, method.name, target_config(cfg.target.name_or_path),
                                       cfg.target.get("parallel", "none"))
    precision = training_precision(tcfg, cfg.target.name_or_path)
    acc = make_accelerator(tcfg, method)
    target_dtype = cfg.target.dtype
    if target_dtype == "auto" and acc.device.type == "cpu":  # the head's compute dtype: no float32/bfloat16 mix
        target_dtype = "bfloat16" if tcfg.mixed_precision == "bf16" else "float32"
    target = load_target(cfg.target.name_or_path, target_dtype, acc.device,
                         parallel=cfg.target.get("parallel", "none"), tp_size=cfg.target.get("tp_size") or None,
                         max_memory=cfg.target.get("max_memory") or None,
                         chat_template=cfg.target.get("chat_template"))
    if target_dtype != cfg.target.dtype:
        target.dtype_choice = Choice(target_dtype, f"auto: training precision {tcfg.mixed_precision}")
    if hasattr(method, "bind"):  # methods whose features depend on the target (EAGLE-3's layer ids)
        method.bind(target)
    train_src, eval_src = build_data(cfg, method, target)
    sequence_parallel.check_row_lengths(tcfg.sequence_parallel, train_src.lengths)
    if cfg.data.epochs:  # a sequence-parallel group reads one batch
        tcfg.max_steps = steps_for_epochs(cfg.data.epochs, len(train_src),
                                          acc.num_processes // tcfg.sequence_parallel, tcfg.grad_accum)
        log.info("data.epochs=%s: %d optimizer steps (%d batches per epoch)", cfg.data.epochs, tcfg.max_steps,
                 len(train_src))
    set_vocab_rows(method, cfg, train_src)
    summary = train(method, target, train_src, tcfg, ocfg, eval_src, acc, reload_target=_reloader(cfg, target, acc))
    if acc.is_main_process:
        from specheads.data.store import atomic_write_json

        summary["heldout_split"] = split_record(cfg, train_src, eval_src)
        summary["precision"] = {"mixed_precision": tcfg.mixed_precision, "target_dtype": str(target.dtype),
                                "choice": precision.record() if precision else None}
        summary["device"] = device_record(acc, target)
        if eval_src is not None:
            add_bigram_baselines(summary, train_src, eval_src, cfg)  # rewrites train_summary.json
        else:
            atomic_write_json(Path(cfg.output_dir) / "train_summary.json", summary)
    return summary


def check_resume(cfg: DictConfig, tcfg: TrainConfig, mcfg: dict[str, Any]) -> None:
    """Before the target loads: record what the run is built from (``tcfg.settings``: the method's settings, the
    target; each checkpoint keeps them), pick the checkpoint ``train.resume`` resumes from (auto: the newest intact
    one under output_dir/checkpoints, a corrupt newer one passed over with a warning) and pin ``tcfg.resume`` to it,
    and refuse one written with other settings, naming them."""
    tcfg.settings = {"method": dict(mcfg), "target": {"name_or_path": cfg.target.name_or_path}}
    folder = resume_checkpoint(Path(cfg.output_dir) / "checkpoints", tcfg.resume)
    if folder is None:
        return
    where = f"output_dir={cfg.output_dir}" if tcfg.resume == "auto" else f"train.resume={tcfg.resume}"
    check_resume_settings(folder, tcfg.settings, where)
    tcfg.resume = str(folder)


def target_config(name_or_path: str):
    """The target's ``transformers`` config, read before the target loads (None where it cannot be: the target's
    own load says why, later)."""
    from transformers import AutoConfig

    from specheads.targets import resolve_target_path

    try:
        return AutoConfig.from_pretrained(resolve_target_path(name_or_path))
    except (OSError, ValueError) as e:
        log.debug("cannot read the target's config before loading it: %s", e)
        return None


def device_record(acc, target) -> dict[str, str]:
    """Where the run computed, for ``train_summary.json``: the Accelerator's device (the trained module's), the
    target's, the distributed type and the machine (the GPU's name, else the CPU's), so a run that fell back to
    the CPU on a GPU machine says so (scripts/gpu_pipeline.py checks it)."""
    from specheads.hardware import machine_description

    return {"accelerator": str(acc.device), "target": str(target.device),
            "distributed_type": str(getattr(acc.distributed_type, "value", acc.distributed_type)),
            "machine": machine_description(acc.device)}


def training_precision(tcfg, target_name: str):
    """Resolve ``train.mixed_precision=auto`` for this machine (``hardware.choose_mixed_precision``: on a CPU
    a timed probe of the head's layer shapes, one process only; several processes decide by the CPU check so
    that they agree), in place; logs the choice with its figures and returns it (``hardware.Choice``)."""
    from transformers import AutoConfig

    from specheads.hardware import choose_mixed_precision, decoder_layer_shapes
    from specheads.targets import resolve_target_path

    if tcfg.mixed_precision != "auto":
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shapes = None
    if world == 1 and not torch.cuda.is_available():
        try:
            shapes = decoder_layer_shapes(AutoConfig.from_pretrained(resolve_target_path(target_name)))
        except (OSError, ValueError) as e:  # the target's own load says what is wrong with it, later
            log.warning("cannot read the target's config to time training precision (%s); deciding by the CPU", e)
    choice = choose_mixed_precision("auto", shapes, probe=world == 1)
    tcfg.mixed_precision = choice.value
    log.info("%s", choice.line("training precision"))
    return choice


def steps_for_epochs(epochs: float, batches_per_epoch: int, processes: int, grad_accum: int) -> int:
    """Optimizer steps for ``epochs`` passes: each step takes ``processes x grad_accum`` batches."""
    if epochs <= 0:
        raise ConfigError(f"data.epochs must be positive, got {epochs}")
    return max(1, math.ceil(epochs * batches_per_epoch / (processes * grad_accum)))


def _reloader(cfg: DictConfig, target, acc):
    """How to load the target again (``train(reload_target=)``): a whole target trained from a feature store
    (every batch carries its features), else None (the layers stay)."""
    if not cfg.features_dir or target.layout.mode != "none":
        return None
    from specheads.targets import load_target

    return lambda: load_target(cfg.target.name_or_path, target.dtype, acc.device,
                               chat_template=cfg.target.get("chat_template"))


def add_bigram_baselines(summary: dict[str, Any], train_src, eval_src, cfg: DictConfig) -> None:
    """Bigram baselines fitted on the same training rows, scored on the same held-out rows, beside the
    head's own accuracy against the data tokens; rewrites train_summary.json."""
    from specheads.data.store import atomic_write_json
    from specheads.training.baselines import bigram_report

    base = bigram_report(train_src.dataset, train_src.indices, eval_src.indices, max_length=cfg.data.max_length)
    summary["baselines"] = base
    ev = summary.get("eval") or {}
    head = ev.get("data0_acc", ev.get("head0_top1_acc"))
    if head is not None:
        summary["beats_bigram"] = bool(head > base["bigram_d1_acc"])
        log.info("held-out top-1 against the data: head %.4f vs bigram %.4f (same rows)", head, base["bigram_d1_acc"])
    atomic_write_json(Path(cfg.output_dir) / "train_summary.json", summary)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("train"):
        summary = run(cfg)
    from specheads.targets.parallel import end_process_group, leave_unless_first_rank

    end_process_group()
    leave_unless_first_rank()  # the main process alone reports (other ranks hold no final loss)
    print(json.dumps({k: summary[k] for k in ("method", "steps", "final_loss", "tau_estimate", "tokens_per_s",
                                             "head_dir")}, indent=1))


if __name__ == "__main__":
    check_command_line("train", "train", sys.argv[1:])  # a refused override: one line
    main()
