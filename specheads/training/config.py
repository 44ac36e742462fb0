"""Training settings as typed dataclasses (the recipe turns its Hydra config into these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.errors import ConfigError


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
    log_every: int = 10
    eval_every: int = 0  # 0: only after the last step
    save_every: int = 100  # 0: only after the last step
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto (latest checkpoint if any) | never | a checkpoint folder
    wandb_mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    wandb_project: str = "specheads"
    run_name: str | None = None
    progress: bool = True
    micro_batch_size: int = 1  # only told to DeepSpeed, which wants it in its config
    onednn_cache: int | None = None  # CPU: cap oneDNN's primitive cache (accelerator.limit_onednn_cache); None = default
    free_target_layers: bool = True  # offline: free the target's decoder layers while training (train(reload_target=))
    malloc_trim_every: int = 0  # CPU: give the C heap's free pages back every N optimizer steps (accelerator.trim_heap); 0 = never
    max_minutes: float | None = None  # time budget: stop (checkpoint, evaluate, save) once training took this long
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

    def __post_init__(self):
        if self.malloc_trim_every < 0:
            raise ConfigError(f"train.malloc_trim_every must be >= 0 (0 = never), got {self.malloc_trim_every}")
