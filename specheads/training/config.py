"""Training settings as typed dataclasses (the recipe turns its Hydra config into these), and the checks
every setting and input of a training run passes before any work (``check_settings``, ``check_store_source``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from specheads.data.features import sample_lengths
from specheads.data.prepare import META_FILE, load_prepared
from specheads.data.store import FeatureSpec, StoreError, StoreMismatchError, read_manifest
from specheads.errors import ConfigError, InputNotFoundError
from specheads.ranges import check_choice, check_number


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stops without saving."""


# --------------------------------------------------------------------------- configuration


@dataclass
class OptimConfig:
    """AdamW + warm-up/cosine schedule. Weight decay applies to matrices only (not biases/norms)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"


@dataclass
class TrainConfig:
    """How long and how to train; steps are optimizer steps (``grad_accum`` micro-batches each)."""

    output_dir: str
    max_steps: int = 1000
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where the GPU has it)
    seed: int = 0
    deterministic: bool = True
    log_every: int = 10  # sample memory and log to wandb every N steps (metrics.jsonl has every step)
    eval_every: int = 0  # 0: only after the last step
    save_every: int = 100  # 0: only after the last step
    keep_checkpoints: int = 2  # the newest N checkpoints are kept; 0 keeps all
    async_checkpoint: str = "auto"  # auto | always | never: write checkpoints in a background thread (checkpoint.py)
    resume: str = "auto"  # auto (the newest intact checkpoint, if any) | never | a checkpoint folder
    wandb_mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    wandb_project: str = "specheads"
    run_name: str | None = None
    progress: bool = True
    micro_batch_size: int = 1  # only told to DeepSpeed, which wants it in its config
    onednn_cache: int | None = None  # CPU: cap oneDNN's primitive cache (accelerator.limit_onednn_cache); None = default
    free_target_layers: bool = True  # offline: free the target's decoder layers while training (train(reload_target=))
    malloc_trim_every: int = 0  # CPU: give the C heap's free pages back every N optimizer steps (accelerator.trim_heap); 0 = never
    max_minutes: float | None = None  # time budget: stop (checkpoint, evaluate, save) once training took this long
    sequence_parallel: int = 1  # processes per row: each trains a slice of it (training/sequence_parallel.py)
    # Measured acceptance at each held-out evaluation: decode this many held-out prompts with the head
    # (greedy, top-1 chain of measure_k drafts, measure_tokens new tokens); 0 turns it off. The
    # prompts are decoded again with a fan of each width in measure_fans (the w best first drafts,
    # verified as a tree; heads that draft trees only): the evaluator's shape choice reads both.
    measure_prompts: int = 4
    measure_k: int = 3
    measure_tokens: int = 32
    # Widths up to 6: with prepacked CPU linear layers a forward over 7 tokens costs ~1.2 one-token
    # forwards, and a fan's τ still grows with its width (a TTT-2 quickstart head: 1.49, 1.56, 1.61, 1.65
    # for w = 2, 3, 4, 6); a few seconds of decoding per width at the end of training.
    measure_fans: tuple[int, ...] = field(default_factory=lambda: (2, 3, 4, 6))
    # What the run is built from (the method's settings, the target: the recipe sets it): recorded in each
    # checkpoint, so that a resume with other ones is refused by name (checkpoint.check_resume_settings).
    settings: dict[str, Any] | None = None

    def __post_init__(self):
        if self.malloc_trim_every < 0:
            raise ConfigError(f"train.malloc_trim_every must be >= 0 (0 = never), got {self.malloc_trim_every}")


# --------------------------------------------------------------------------- checks before any work

SCHEDULES = ("cosine", "constant")
MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
WANDB_MODES = ("offline", "online", "disabled")
ASYNC_CHECKPOINT = ("auto", "always", "never")

# method settings (conf/method/*.yaml) with a range, whichever methods have them; "?" = null allowed
METHOD_RULES = {
    "num_heads": ">= 1", "num_layers": ">= 1", "loss_decay": "> 0", "top_k": ">= 1", "lora_r": ">= 1",
    "lora_alpha": "> 0", "lora_dropout": "in [0, 1)", "target_weight": ">= 0", "heads_weight": ">= 0",
    "kl_temperature": "> 0", "heads_warmup_steps": ">= 0", "draft_vocab_size": ">= 1", "vocab_max_samples": "?>= 1",
    "ttt_steps": ">= 1", "step_decay": "> 0", "target_chunk": ">= 1", "head_chunk": ">= 1", "feature_weight": ">= 0",
    "offpath_weight": "in [0, 1]", "feature_noise": ">= 0", "ce_weight": ">= 0", "eval_steps": "?>= 1",
    "block_size": ">= 2", "anchors": ">= 1", "eval_anchors": "?>= 1", "gamma": "> 0", "lk_weight": "in [0, 1]",
}
DATA_RULES = {"max_tokens": "?>= 1", "batch_size": "?>= 1", "eval_samples": ">= 0", "eval_max_tokens": "?>= 1",
              "max_length": "?>= 2", "pad_to_multiple_of": ">= 1", "epochs": "?> 0"}
# Counts that must be integers: a float there fails or goes wrong later (range(), slicing, tensor sizes, a step
# count never reached exactly, DeepSpeed's micro-batch size). Other counts (warmup_steps, log_every, max_tokens...)
# only meet comparisons, where a float does what it says.
INTEGER_SETTINGS = frozenset({
    "train.max_steps", "train.grad_accum", "train.sequence_parallel", "train.keep_checkpoints", "train.onednn_cache",
    "train.measure_k", "train.measure_fans", "data.batch_size", "data.eval_samples", "data.max_length", "data.pad_to_multiple_of",
    *(f"method.{name}" for name in ("num_heads", "num_layers", "top_k", "lora_r", "draft_vocab_size", "ttt_steps",
                                    "target_chunk", "head_chunk", "eval_steps", "block_size", "anchors",
                                    "eval_anchors")),
})


def _check(setting: str, value: Any, rule: str) -> None:
    check_number(setting, value, rule, integer=setting in INTEGER_SETTINGS)


def check_settings(train: TrainConfig, optim: OptimConfig, method: Mapping[str, Any], data: Mapping[str, Any]) -> None:
    """Every numeric and named setting of a training run in its range (one ``ConfigError`` naming the
    setting as the user writes it: ``optim.lr``, ``train.max_steps``, ``data.batch_size``,
    ``method.num_heads``...), and ``train.resume``'s folder, before the target loads."""
    for name, rule in (("lr", "> 0"), ("weight_decay", ">= 0"), ("eps", "> 0"), ("warmup_steps", ">= 0"),
                       ("min_lr_ratio", "in [0, 1]")):
        _check(f"optim.{name}", getattr(optim, name), rule)
    if len(optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(optim.betas)}: give two numbers in [0, 1), e.g. [0.9, 0.95]")
    for beta in optim.betas:
        _check("optim.betas", beta, "in [0, 1)")
    check_choice("optim.schedule", optim.schedule, SCHEDULES)
    for name, rule in (("max_steps", ">= 1"), ("grad_accum", ">= 1"), ("max_grad_norm", "?> 0"),
                       ("log_every", ">= 1"), ("eval_every", ">= 0"), ("save_every", ">= 0"),
                       ("keep_checkpoints", ">= 0"),
                       ("max_minutes", "?> 0"), ("sequence_parallel", ">= 1"), ("onednn_cache", "?>= 1"),
                       ("malloc_trim_every", ">= 0"),
                       ("measure_prompts", ">= 0"), ("measure_k", ">= 1"), ("measure_tokens", ">= 1")):
        _check(f"train.{name}", getattr(train, name), rule)
    for width in train.measure_fans:
        _check("train.measure_fans", width, ">= 1")
    check_choice("train.mixed_precision", train.mixed_precision, MIXED_PRECISION)
    check_choice("wandb.mode", train.wandb_mode, WANDB_MODES)
    check_choice("train.async_checkpoint", train.async_checkpoint, ASYNC_CHECKPOINT)
    if train.resume not in ("auto", "never") and not Path(train.resume).is_dir():
        raise InputNotFoundError(f"train.resume={train.resume}: no such checkpoint folder; use auto (the latest "
                                 f"under output_dir/checkpoints), never, or a step_* folder there")
    for name, rule in DATA_RULES.items():
        if name in data:
            _check(f"data.{name}", data[name], rule)
    for name, rule in METHOD_RULES.items():
        if name in method:
            _check(f"method.{name}", method[name], rule)


def check_data_source(features_dir: str | None, prepared_dir: str | None) -> None:
    """Refuse, before the target loads, a training run with no data: neither ``features_dir`` (which wins) nor
    ``prepared_dir`` given, or the one read missing, a file, or (``prepared_dir``) a folder that holds no prepared
    set. A feature store's own checks are ``check_store_source``'s."""
    if features_dir:
        setting, value, what, make = "features_dir", features_dir, "feature store", "specheads collect"
    elif prepared_dir:
        setting, value, what, make = "prepared_dir", prepared_dir, "prepared set", "specheads prepare"
    else:
        raise ConfigError("no training data: give features_dir=<a feature store from `specheads collect`> or "
                          "prepared_dir=<a prepared set from `specheads prepare`>")
    path = Path(value).expanduser()
    if not path.exists():
        raise InputNotFoundError(f"{setting}={value}: no such folder; give the folder of a {what} "
                                 f"(`{make} output_dir=...` makes one)")
    if not path.is_dir():
        raise InputNotFoundError(f"{setting}={value} is a file: give the folder of a {what} "
                                 f"(`{make} output_dir=...` makes one)")
    if not features_dir and not (path / META_FILE).is_file():
        raise InputNotFoundError(f"prepared_dir={value} holds no prepared set (no {META_FILE}): give the output_dir "
                                 f"of a `specheads prepare` run, or run `specheads prepare output_dir={value}`")


def check_store_source(features_dir: str | None, prepared_dir: str | None, method=None,
                       target_config=None, target_name: str | None = None) -> None:
    """Refuse a ``features_dir`` for a ``method`` that trains the target (it needs online features), a
    ``features_dir`` that holds no finished store, a store collected from a target of another hidden size or
    depth than ``target_config`` (the target's ``transformers`` config, read before the target loads; the
    loaded target's config hash and tokenizer are checked against the store once it is loaded), and, when
    ``prepared_dir`` is a prepared set too, a store collected from other data (the trainer looks the store's
    row ids up in the prepared set: the evaluator's chat slice, EAGLE-3's draft vocabulary): the sample ids
    and lengths the store recorded must be the prepared set's."""
    if not features_dir:
        return
    spec = getattr(type(method), "feature_spec", None)  # declared on the class by methods that train the target
    if isinstance(spec, FeatureSpec) and spec.online_only:
        raise ConfigError(f"method {method.name} trains the target, so it needs online features: unset features_dir "
                          f"and give prepared_dir")
    try:
        manifest = read_manifest(Path(features_dir))
    except StoreMismatchError:
        raise
    except StoreError as e:
        raise InputNotFoundError(f"features_dir={features_dir}: {e}") from None
    if target_config is not None:
        _check_store_target(features_dir, manifest, target_config, target_name)
    if not prepared_dir or not (Path(prepared_dir) / META_FILE).is_file():
        return
    stored = {i: n for shard in manifest.get("shards", []) for i, n in zip(shard["ids"], shard["lengths"])}
    dataset, _ = load_prepared(prepared_dir)
    prepared = dict(zip(map(str, dataset["id"]), sample_lengths(dataset)))
    if stored == prepared:
        return
    if (manifest.get("source") or {}).get("budget") and all(prepared.get(i) == n for i, n in stored.items()):
        return  # a time budget's store holds the set's first rows (or those a cut at its deadline kept), by design
    source = (manifest.get("source") or {}).get("prepared_dir")
    differ = sum(prepared.get(i) != n for i, n in stored.items())
    where = f"prepared_dir={source}" if source else "the prepared set it was collected from"
    raise StoreMismatchError(
        f"features_dir={features_dir} was collected from other data than prepared_dir={prepared_dir} "
        f"(store: {len(stored)} samples, {sum(stored.values())} tokens; prepared set: {len(prepared)} samples, "
        f"{sum(prepared.values())} tokens; {differ} of the store's samples missing there or of another length); "
        f"pass {where}, or collect the store again from this prepared set (`specheads collect prepared_dir={prepared_dir} output_dir=<new folder>`)")


def _check_store_target(features_dir: str, manifest: Mapping[str, Any], config, target_name: str | None) -> None:
    """Refuse a store whose recorded hidden size or layer count is not the target's (``config``, its text part
    for a multimodal model): features of another model. Where either side does not say, nothing is refused here."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    store = (manifest.get("hidden_size"), manifest.get("num_layers"))
    target = (getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None))
    if None in store or None in target or store == target:
        return
    raise StoreMismatchError(
        f"features_dir={features_dir} was collected from target '{manifest.get('target')}' (hidden size {store[0]}, "
        f"{store[1]} layers), not from target.name_or_path={target_name} (hidden size {target[0]}, {target[1]} "
        f"layers): collect features with this target (`specheads collect target.name_or_path={target_name} "
        f"output_dir=<new folder>`), or train with the store's target")
