"""Medusa-1 and Medusa-2 as ``Method``s for the training engine.

Medusa-1: the target is frozen; heads train on its post-norm last hidden state (offline or online).
Loss = Σ_k decay^k · CE(head k at t, ids[t+k+2]) over labels with ``loss_mask == 1``; with
``labels=target`` the label is the target's own distribution of that token (soft CE, self-distillation).

Medusa-2: heads and target train together, the target through LoRA (peft) or full fine-tuning.
Its own predictions are kept by a self-distillation KL(original ‖ adapted) on the next token
(LoRA disabled = the original, so no second copy) or by its next-token CE. The first
``heads_warmup_steps`` steps train the heads alone on the (still original) target. Held-out
metrics add the target's drift: ``drift_kl`` (nats/token) and perplexity of the adapted and
original target on the held-out assistant tokens. ``save`` writes the heads and, in ``target/``
beside their files, the merged adapted target that must verify them.

The engine runs ``loss`` / ``evaluate`` inside ``TrainingModule.forward`` (``specheads.methods.base``),
so DDP/DeepSpeed/FSDP wrappers see every call.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specheads.decoding.drafters import TreeShape
from specheads.models.medusa import MedusaHeads, medusa_for_target
from specheads.targets import Target
from specheads.methods.losses import soft_cross_entropy, target_argmax, target_probs
from specheads.methods.base import FeatureSpec, StepOutput

ADAPTED_TARGET_DIR = "target"


def label_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T) bool: token j is a label that counts (assistant token, not padding)."""
    return (batch["loss_mask"] > 0) & (batch["attention_mask"] > 0)


@dataclass
class Teacher:
    """The frozen target's next-token distribution at chosen positions (self-distillation labels).

    probs: (N, V) float32, row ``row_of[b, p]`` = p_target(token p+1 | ids[..p]); row_of: (B, T) long, -1
    where not computed (positions whose next token is not a counted label)."""

    probs: torch.Tensor
    row_of: torch.Tensor


@torch.no_grad()
def teacher_rows(target: Target, hidden: torch.Tensor, labels_ok: torch.Tensor, chunk: int = 1024) -> Teacher:
    """The target's distribution at every position whose next token is a counted label."""
    pos = _next_token_positions(labels_ok)
    probs, _ = target_probs(target.logits, hidden[pos].to(target.dtype), None, chunk)
    row_of = torch.full(labels_ok.shape, -1, dtype=torch.long, device=hidden.device)
    row_of[pos] = torch.arange(probs.shape[0], device=hidden.device)
    return Teacher(probs, row_of)


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, labels_ok: torch.Tensor,
                decay: float, teacher: Teacher | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted Medusa loss. hidden (B, T, H), input_ids (B, T), labels_ok (B, T) bool.

    Head k at position t is trained where labels_ok[t+k+2]: against ids[t+k+2] (CE), or with a
    ``teacher`` against the target's distribution of that token after the data prefix (soft CE with
    row t+k+1; Medusa's self-distillation). Each head's loss is a mean over its labels. Returns
    (Σ_k decay^k loss_k, {head{k}_loss, head{k}_acc (top-1 against the data token)} detached).
    """
    T = input_ids.shape[1]
    hidden = hidden.to(heads.lm_heads[0].weight.dtype)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats: dict[str, torch.Tensor] = {}
    for k in range(heads.num_heads):
        s = k + 2
        if T <= s:
            break
        ok = labels_ok[:, s:]
        h, y = hidden[:, : T - s][ok], input_ids[:, s:][ok]
        if teacher is None:
            logits = heads.head_logits(h, k).float()
            loss_sum = F.cross_entropy(logits, y, reduction="sum")
            pred = logits.detach().argmax(-1)
        else:
            rows = teacher.row_of[:, s - 1: T - 1][ok]
            loss_sum, pred = soft_cross_entropy(functools.partial(heads.head_logits, k=k), h, teacher.probs[rows])
        ce = loss_sum / max(1, y.numel())
        total = total + (decay ** k) * ce
        stats[f"head{k}_loss"] = ce.detach()
        if y.numel():
            stats[f"head{k}_acc"] = (pred == y).float().mean()
    return total, stats


@torch.no_grad()
def head_counts(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, labels_ok: torch.Tensor,
                top_k: int, greedy_next: torch.Tensor | None = None) -> dict[str, float]:
    """Held-out sums per head: top-1 / top-k correct and totals, plus ``chain{k}``: positions where
    heads 0..k are all top-1 right, over positions where all their labels count.

    greedy_next: optional (B, T) long, ``greedy_next[:, j]`` = the target's argmax at ``j - 1`` (its
    greedy choice for token ``j`` after the data prefix). Adds ``head{k}_argmax``: head k's top-1 at
    ``t`` against ``greedy_next[:, t+k+2]``, the token greedy verification would compare it with
    (on data the target wrote itself this equals the data token)."""
    B, T = input_ids.shape
    hidden = hidden.to(heads.lm_heads[0].weight.dtype)
    out: dict[str, float] = {}
    chain_right = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    chain_ok = torch.ones_like(chain_right)
    for k in range(heads.num_heads):
        s = k + 2
        ok = torch.zeros_like(chain_ok)
        ok[:, : max(0, T - s)] = labels_ok[:, s:]
        right = torch.zeros_like(ok)
        out[f"head{k}_top{top_k}_correct"] = 0.0
        if greedy_next is not None:
            out[f"head{k}_argmax_correct"] = 0.0
            out[f"head{k}_argmax_total"] = float(ok.sum())
        if ok.any():
            logits = heads.head_logits(hidden[ok], k).float()
            pred = logits.argmax(-1)
            y = input_ids[:, s:][ok[:, : T - s]]
            right[ok] = pred == y
            kk = min(top_k, logits.shape[-1])
            out[f"head{k}_top{top_k}_correct"] = float((logits.topk(kk, -1).indices == y[:, None]).any(-1).sum())
            if greedy_next is not None:
                out[f"head{k}_argmax_correct"] = float((pred == greedy_next[:, s:][ok[:, : T - s]]).sum())
        out[f"head{k}_top1_correct"] = float(right.sum())
        out[f"head{k}_top1_total"] = out[f"head{k}_top{top_k}_total"] = float(ok.sum())
        chain_ok &= ok
        chain_right &= right
        out[f"chain{k}_correct"] = float((chain_right & chain_ok).sum())
        out[f"chain{k}_total"] = float(chain_ok.sum())
    return out


@torch.no_grad()
def greedy_next_tokens(target: Target, hidden: torch.Tensor, labels_ok: torch.Tensor) -> torch.Tensor:
    """(B, T) long: at each label ``j`` the target's argmax at ``j - 1`` (its greedy token ``j``), -1 elsewhere."""
    pos = _next_token_positions(labels_ok)
    out = torch.full(labels_ok.shape, -1, dtype=torch.long, device=hidden.device)
    out[:, 1:][labels_ok[:, 1:]] = target_argmax(target.logits, hidden[pos].to(target.dtype))
    return out


def _next_token_positions(labels_ok: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions t whose next token t+1 is a counted label."""
    pos = torch.zeros_like(labels_ok)
    pos[:, :-1] = labels_ok[:, 1:]
    return pos


# --------------------------------------------------------------------------- Medusa-1


class Medusa1Method:
    """Medusa-1: K heads on the frozen target's last hidden state."""

    name = "medusa1"
    feature_spec = FeatureSpec(need_last=True)

    def __init__(self, num_heads: int = 5, num_layers: int = 1, fc_bias: bool = True,
                 loss_decay: float = 0.8, top_k: int = 5, train_lm_heads: bool = True, labels: str = "data"):
        """labels: ``data`` trains head k on the dataset's token t+k+2 (CE); ``target`` on the frozen
        target's own distribution of that token after the data prefix (soft CE: self-distillation
        without regenerating the data; the target's LM head runs once more per position)."""
        if labels not in ("data", "target"):
            raise ValueError(f"medusa1 labels must be 'data' or 'target', got {labels!r}")
        self.num_heads, self.num_layers, self.fc_bias = num_heads, num_layers, fc_bias
        self.loss_decay, self.top_k = loss_decay, top_k
        self.train_lm_heads, self.labels = train_lm_heads, labels

    def build(self, target: Target) -> nn.Module:
        heads = medusa_for_target(target, self.num_heads, self.num_layers, self.fc_bias)
        # Frozen output layers (copies of the target's LM head): only the residual blocks learn, which
        # skips the largest weight gradients and optimizer state; the exported layout is unchanged.
        heads.lm_heads.requires_grad_(self.train_lm_heads)
        return heads

    def loss(self, model, batch, target) -> StepOutput:
        ok = label_mask(batch)
        teacher = teacher_rows(target, batch["hidden_last"], ok) if self.labels == "target" else None
        loss, stats = head_losses(model, batch["hidden_last"], batch["input_ids"], ok, self.loss_decay, teacher)
        return StepOutput(loss, {k: float(v) for k, v in stats.items()})

    @torch.no_grad()
    def evaluate(self, model, batch, target) -> dict[str, float]:
        hidden, ok = batch["hidden_last"], label_mask(batch)
        greedy_next = greedy_next_tokens(target, hidden, ok)
        out = head_counts(model, hidden, batch["input_ids"], ok, self.top_k, greedy_next)
        base = greedy_next[:, 1:][ok[:, 1:]] == batch["input_ids"][:, 1:][ok[:, 1:]]
        out["target_top1_correct"], out["target_top1_total"] = float(base.sum()), float(base.numel())
        return out

    def save(self, model, out_dir: str, target: Target) -> None:
        model.save_pretrained(out_dir)

    @staticmethod
    def drafter(model, shape):
        """The heads as the evaluator's drafter (measured acceptance during training); a chain is
        capped at the number of heads."""
        from specheads.decoding.head_drafters import MedusaDrafter

        heads = model
        return MedusaDrafter(heads, TreeShape("chain", k=min(shape.k, heads.config.num_heads)))


# --------------------------------------------------------------------------- Medusa-2


class Medusa2Model(nn.Module):
    """Adapted target (peft LoRA or full) + Medusa heads; ``forward`` returns losses or held-out sums.

    mode: ``warmup`` (heads only, target under no_grad), ``joint`` (heads + target-keeping loss),
    ``eval`` (held-out sums: head counts, drift KL, NLL of adapted and original target).
    """

    def __init__(self, lm: nn.Module, heads: MedusaHeads, method: "Medusa2Method", reference: nn.Module | None):
        super().__init__()
        self.lm, self.heads, self.cfg = lm, heads, method
        self._reference = [reference]  # a list keeps a full-fine-tune reference out of parameters()

    def base(self) -> nn.Module:
        """The causal LM (LoRA layers injected when adapter=lora)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def hidden(self, input_ids, attention_mask) -> torch.Tensor:
        """(B, T) -> (B, T, H) post-norm last hidden state of the adapted target."""
        return self.base().model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    @torch.no_grad()
    def reference_hidden(self, input_ids, attention_mask) -> torch.Tensor:
        """The original target's last hidden state (adapters disabled, or the frozen copy)."""
        ref = self._reference[0]
        if ref is not None:
            return ref.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        with self.lm.disable_adapter():
            return self.hidden(input_ids, attention_mask)

    def forward(self, input_ids, attention_mask, loss_mask, mode: str = "joint"):
        ok = (loss_mask > 0) & (attention_mask > 0)
        if mode == "warmup":
            with torch.no_grad():
                h = self.hidden(input_ids, attention_mask)
            return head_losses(self.heads, h, input_ids, ok, self.cfg.loss_decay)
        h = self.hidden(input_ids, attention_mask)
        if mode == "eval":
            out = head_counts(self.heads, h, input_ids, ok, self.cfg.top_k)
            out.update(self._drift_sums(h, input_ids, attention_mask, ok))
            return out
        loss, stats = head_losses(self.heads, h, input_ids, ok, self.cfg.loss_decay)
        keep = self._target_term(h, input_ids, attention_mask, ok)
        stats["target_loss"] = keep.detach()
        return self.cfg.heads_weight * loss + self.cfg.target_weight * keep, stats

    def _next_token_logits(self, h, input_ids, ok):
        pos = _next_token_positions(ok)
        return self.base().lm_head(h[pos]).float(), input_ids[:, 1:][ok[:, 1:]], pos  # (N, V), (N,), (B, T)

    def _target_term(self, h, input_ids, attention_mask, ok) -> torch.Tensor:
        logits, y, pos = self._next_token_logits(h, input_ids, ok)
        n = max(1, y.numel())
        if self.cfg.target_loss == "lm":
            return F.cross_entropy(logits, y, reduction="sum") / n
        ref = self.base().lm_head(self.reference_hidden(input_ids, attention_mask)[pos]).float()
        t = self.cfg.kl_temperature
        kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(ref / t, -1), log_target=True, reduction="sum")
        return kl * t * t / n

    @torch.no_grad()
    def _drift_sums(self, h, input_ids, attention_mask, ok) -> dict[str, float]:
        logits, y, pos = self._next_token_logits(h, input_ids, ok)
        ref = self.base().lm_head(self.reference_hidden(input_ids, attention_mask)[pos]).float()
        lp, lq = F.log_softmax(logits, -1), F.log_softmax(ref, -1)
        n = float(y.numel())
        return {
            "drift_kl_sum": float((lq.exp() * (lq - lp)).sum()), "drift_kl_count": n,
            "nll_sum": float(F.nll_loss(lp, y, reduction="sum")), "nll_count": n,
            "original_nll_sum": float(F.nll_loss(lq, y, reduction="sum")), "original_nll_count": n,
            "target_top1_correct": float((logits.argmax(-1) == y).sum()), "target_top1_total": n,
        }


class Medusa2Method:
    """Medusa-2: heads + target trained jointly (online only: the target's features change)."""

    name = "medusa2"
    feature_spec = FeatureSpec(aux_layers=(), need_last=False, online_only=True)
    find_unused_parameters = True  # the target's adapters get no gradient during the head warm-up

    def __init__(self, num_heads: int = 5, num_layers: int = 1, fc_bias: bool = True, loss_decay: float = 0.8,
                 top_k: int = 5, adapter: str = "lora", lora_r: int = 16, lora_alpha: int = 32,
                 lora_dropout: float = 0.0, lora_target_modules: str | list[str] = "all-linear",
                 target_loss: str = "kl", target_weight: float = 1.0, heads_weight: float = 1.0,
                 kl_temperature: float = 1.0, heads_warmup_steps: int = 0, train_lm_heads: bool = True,
                 labels: str = "data"):
        if labels != "data":
            raise ValueError(f"medusa2 trains its heads on the data tokens (labels=data), got labels={labels!r}: "
                             "the target they would distil from is itself being trained")
        if adapter not in ("lora", "full"):
            raise ValueError(f"medusa2 adapter must be 'lora' or 'full', got {adapter!r}")
        if target_loss not in ("kl", "lm"):
            raise ValueError(f"medusa2 target_loss must be 'kl' (self-distillation) or 'lm', got {target_loss!r}")
        self.num_heads, self.num_layers, self.fc_bias = num_heads, num_layers, fc_bias
        self.loss_decay, self.top_k, self.adapter = loss_decay, top_k, adapter
        self.lora = dict(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                         target_modules=lora_target_modules if isinstance(lora_target_modules, str)
                         else list(lora_target_modules))
        self.target_loss, self.target_weight, self.heads_weight = target_loss, target_weight, heads_weight
        self.kl_temperature, self.heads_warmup_steps = kl_temperature, heads_warmup_steps
        self.train_lm_heads = train_lm_heads
        self.step = 0

    def on_step_start(self, step: int) -> None:
        self.step = step

    def build(self, target: Target) -> nn.Module:
        """Injects LoRA into ``target.model`` in place (adapters on = adapted, off = original)."""
        heads = medusa_for_target(target, self.num_heads, self.num_layers, self.fc_bias)
        heads.lm_heads.requires_grad_(self.train_lm_heads)
        reference = None
        if self.adapter == "lora":
            from peft import LoraConfig, get_peft_model

            lm = get_peft_model(target.model, LoraConfig(bias="none", **self.lora))
        else:
            reference = copy.deepcopy(target.model).eval().requires_grad_(False)
            lm = target.model.requires_grad_(True)
        lm.get_output_embeddings().requires_grad_(False)  # the heads, not the target's LM head, are trained
        return Medusa2Model(lm, heads, self, reference).train()

    def loss(self, model, batch, target) -> StepOutput:
        mode = "warmup" if self.step < self.heads_warmup_steps else "joint"
        loss, stats = model(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], mode=mode)
        return StepOutput(loss, {k: float(v) for k, v in stats.items()})

    @torch.no_grad()
    def evaluate(self, model, batch, target) -> dict[str, float]:
        return model(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], mode="eval")

    @staticmethod
    def drafter(model, shape):
        """The heads as a drafter; ``target.model`` (adapted in place) verifies them."""
        from specheads.decoding.head_drafters import MedusaDrafter

        heads = model.heads
        return MedusaDrafter(heads, TreeShape("chain", k=min(shape.k, heads.config.num_heads)))

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        out = {}
        for key in ("nll", "original_nll"):
            if key in metrics:
                out[key.replace("nll", "ppl")] = math.exp(metrics[key])
        return out

    def save(self, model, out_dir: str, target: Target) -> None:
        """Heads into ``out_dir``; the merged adapted target (plain HF folder) into ``out_dir/target``."""
        m = model
        heads = m.heads
        heads.config.adapted_target = ADAPTED_TARGET_DIR
        heads.save_pretrained(out_dir)
        merged = copy.deepcopy(m.lm)
        merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
        merged.requires_grad_(False).save_pretrained(Path(out_dir) / ADAPTED_TARGET_DIR)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(Path(out_dir) / ADAPTED_TARGET_DIR)
