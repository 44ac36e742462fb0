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

Held-out metrics score the heads against the target's greedy token after the data prefix (what
greedy verification compares a draft with): ``chain{k}`` (heads 0..k all right, the training-time
τ estimate) and ``head{k}_rank{r}`` (head k's rank-r candidate is that token). The latter calibrate
the static Medusa tree on held-out *training* rows: ``save`` writes it as ``medusa_tree.json``
beside the heads (``write_medusa_tree``), and the evaluator and the export use that file, so the
tree is never fitted on the prompts being scored.

The engine runs ``loss`` / ``evaluate`` inside ``TrainingModule.forward`` (``specheads.methods.base``),
so DDP/DeepSpeed/FSDP wrappers see every call.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specheads.decoding.drafters import TreeShape
from specheads.decoding.head_drafters import MedusaDrafter
from specheads.decoding.tree import choices_from_accuracies, normalize_choices
from specheads.errors import ConfigError
from specheads.models.medusa import MedusaHeads, medusa_for_target
from specheads.targets import Target, logit_softcap, output_logits, target_argmax
from specheads.methods.losses import linear_cross_entropy, logit_chunk_rows, soft_cross_entropy, target_probs
from specheads.methods.base import FeatureSpec, StepOutput

ADAPTED_TARGET_DIR = "target"
TREE_FILE = "medusa_tree.json"
TREE_FORMAT = "specheads.medusa_tree/1"
TREE_RANKS = 8  # candidates per head whose held-out accuracy is measured (the tree's widest fan-out)
TREE_NODES = 24  # nodes of the saved tree (evaluate's medusa_tree_nodes default)
# The fallback when a head carries no calibrated tree: Medusa's tree-building rule applied to fixed
# prior accuracies (head d's top-1 PRIOR_TOP1[d], rank r a further PRIOR_RANK_DECAY**r), shaped like
# the paper's default trees (widest at depth 1, mostly rank-0 paths deeper). Fitted to no data at all.
PRIOR_TOP1 = (0.60, 0.40, 0.30, 0.25, 0.20)
PRIOR_RANK_DECAY = 0.45

log = logging.getLogger(__name__)


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
        if teacher is None:  # the head's (N, V) logits are never held whole
            out = heads.lm_heads[k]
            loss_sum, pred = linear_cross_entropy(heads.head_hidden(h, k), out.weight, y, out.bias)
        else:
            rows = teacher.row_of[:, s - 1: T - 1][ok]
            loss_sum, pred = soft_cross_entropy(functools.partial(heads.head_logits, k=k), h, teacher.probs,
                                                index=rows)  # the labels gathered a chunk at a time, never copied
        ce = loss_sum / max(1, y.numel())
        total = total + (decay ** k) * ce
        stats[f"head{k}_loss"] = ce.detach()
        if y.numel():
            stats[f"head{k}_acc"] = (pred == y).float().mean()
    return total, stats


@torch.no_grad()
def head_counts(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, labels_ok: torch.Tensor,
                top_k: int, greedy_next: torch.Tensor | None = None, ranks: int = 0) -> dict[str, float]:
    """Held-out sums per head: top-1 / top-k correct against the data token and totals, plus
    ``chain{k}``: positions where heads 0..k are all top-1 right, over positions where all their labels count.

    greedy_next: optional (B, T) long, ``greedy_next[:, j]`` = the target's argmax at ``j - 1`` (its
    greedy choice for token ``j`` after the data prefix). Adds ``head{k}_argmax``: head k's top-1 at
    ``t`` against ``greedy_next[:, t+k+2]``, the token greedy verification would compare it with
    (on data the target wrote itself this equals the data token); ``chain{k}`` is then scored against
    these greedy tokens too (so the τ estimate has the basis EAGLE's ``joint{k}`` has), and with
    ``ranks`` > 0 ``head{k}_rank{r}`` (r < ranks): head k's rank-r candidate is the greedy token (the
    per-rank accuracies Medusa builds its static tree from). Without ``greedy_next`` the chain is
    scored against the data tokens."""
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
        greedy_right = torch.zeros_like(ok)
        out[f"head{k}_top{top_k}_correct"] = 0.0
        n_ok = float(ok.sum())
        if greedy_next is not None:
            out[f"head{k}_argmax_correct"] = 0.0
            out[f"head{k}_argmax_total"] = n_ok
            for r in range(ranks):
                out[f"head{k}_rank{r}_correct"] = 0.0
                out[f"head{k}_rank{r}_total"] = n_ok
        if ok.any():
            logits = heads.head_logits(hidden[ok], k).float()
            pred = logits.argmax(-1)
            y = input_ids[:, s:][ok[:, : T - s]]
            right[ok] = pred == y
            kk = min(top_k, logits.shape[-1])
            out[f"head{k}_top{top_k}_correct"] = float((logits.topk(kk, -1).indices == y[:, None]).any(-1).sum())
            if greedy_next is not None:
                g = greedy_next[:, s:][ok[:, : T - s]]
                greedy_right[ok] = pred == g
                out[f"head{k}_argmax_correct"] = float(greedy_right.sum())
                if ranks:
                    rr = min(ranks, logits.shape[-1])
                    hits = (logits.topk(rr, -1).indices == g[:, None]).sum(0)
                    for r in range(rr):
                        out[f"head{k}_rank{r}_correct"] = float(hits[r])
        out[f"head{k}_top1_correct"] = float(right.sum())
        out[f"head{k}_top1_total"] = out[f"head{k}_top{top_k}_total"] = n_ok
        chain_ok &= ok
        chain_right &= greedy_right if greedy_next is not None else right
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


def greedy_from_logits(logits: torch.Tensor, labels_ok: torch.Tensor) -> torch.Tensor:
    """``greedy_next_tokens`` from next-token logits already computed at ``_next_token_positions``."""
    out = torch.full(labels_ok.shape, -1, dtype=torch.long, device=labels_ok.device)
    out[:, 1:][labels_ok[:, 1:]] = logits.argmax(-1)
    return out


# --------------------------------------------------------------------------- the static tree


def rank_accuracy(metrics: dict[str, float], num_heads: int, ranks: int) -> list[list[float]] | None:
    """acc[k][r] = held-out ``head{k}_rank{r}_acc`` (NaN, from heads with no counted label, as 0);
    None when the metrics hold no rank accuracies."""
    if "head0_rank0_acc" not in metrics:
        return None
    acc = []
    for k in range(num_heads):
        row = [metrics.get(f"head{k}_rank{r}_acc", 0.0) for r in range(ranks)]
        acc.append([a if a == a else 0.0 for a in row])
    return acc


def write_medusa_tree(head_dir: str | os.PathLike, acc: Sequence[Sequence[float]], num_nodes: int = TREE_NODES,
                      calibrated_on: str = "held-out training rows") -> dict:
    """``medusa_tree.json`` beside the heads: the per-head rank accuracies and the tree of
    ``num_nodes`` choices they give (``choices_from_accuracies``, Medusa's rule)."""
    acc = [[float(a) for a in row] for row in acc]
    tree = {"format": TREE_FORMAT, "calibrated_on": calibrated_on,
            "basis": "head k's rank-r candidate equals the target's greedy token k+2 ahead (after the data prefix)",
            "rank_accuracy": acc, "num_nodes": num_nodes,
            "medusa_choices": [list(c) for c in choices_from_accuracies(acc, num_nodes)]}
    path = Path(head_dir) / TREE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(tree, indent=1) + "\n")
    os.replace(tmp, path)
    return tree


def read_medusa_tree(head_dir: str | os.PathLike) -> dict | None:
    """The head's ``medusa_tree.json``, or None when it has none."""
    path = Path(head_dir) / TREE_FILE
    if not path.is_file():
        return None
    tree = json.loads(path.read_text())
    if tree.get("format") != TREE_FORMAT or not (tree.get("rank_accuracy") or tree.get("medusa_choices")):
        raise ValueError(f"{path} is not a {TREE_FORMAT} file (needs rank_accuracy or medusa_choices)")
    return tree


def default_choices(num_heads: int, num_nodes: int = TREE_NODES) -> list[tuple[int, ...]]:
    """The uncalibrated fallback tree: Medusa's rule on the fixed prior accuracies (``PRIOR_TOP1``)."""
    top1 = [PRIOR_TOP1[min(d, len(PRIOR_TOP1) - 1)] for d in range(num_heads)]
    acc = [[a * PRIOR_RANK_DECAY ** r for r in range(TREE_RANKS)] for a in top1]
    return choices_from_accuracies(acc, num_nodes)


def tree_for_head(head_dir: str | os.PathLike, num_heads: int, num_nodes: int) -> tuple[list[tuple[int, ...]], str]:
    """(static tree choices, where they come from) for a saved head, fitted on nothing being scored:
    the head's training-time calibration (``medusa_tree.json``: rebuilt at ``num_nodes`` from its rank
    accuracies), else the uncalibrated default (``default_choices``, with a warning)."""
    tree = read_medusa_tree(head_dir)
    if tree is None:
        log.warning("Medusa head %s has no %s (a training-time tree calibration): using the uncalibrated "
                    "default tree. Retrain with held-out rows (data.eval_samples > 0) to calibrate it, or "
                    "pass medusa_choices.", head_dir, TREE_FILE)
        return default_choices(num_heads, num_nodes), "default (uncalibrated prior)"
    where = f"{TREE_FILE} ({tree.get('calibrated_on', 'training time')})"
    if tree.get("rank_accuracy"):
        acc = tree["rank_accuracy"][:num_heads]
        return choices_from_accuracies(acc, num_nodes), where
    choices = [tuple(c) for c in tree["medusa_choices"] if len(c) <= num_heads]
    return normalize_choices(choices), where


def save_tree(method, out_dir: str) -> None:
    """``medusa_tree.json`` from the method's latest held-out rank accuracies (none without held-out rows)."""
    if method.tree_accuracy is None:
        log.warning("no held-out evaluation ran, so %s is not written: the evaluator will use the "
                    "uncalibrated default tree for this head (train with data.eval_samples > 0)", TREE_FILE)
        return
    write_medusa_tree(out_dir, method.tree_accuracy, method.tree_nodes)


# --------------------------------------------------------------------------- Medusa-1


class Medusa1Method:
    """Medusa-1: K heads on the frozen target's last hidden state."""

    name = "medusa1"
    feature_spec = FeatureSpec(need_last=True)

    def __init__(self, num_heads: int = 5, num_layers: int = 1, fc_bias: bool = True,
                 loss_decay: float = 0.8, top_k: int = 5, train_lm_heads: bool = True, labels: str = "data",
                 tree_ranks: int = TREE_RANKS, tree_nodes: int = TREE_NODES):
        """labels: ``data`` trains head k on the dataset's token t+k+2 (CE); ``target`` on the frozen
        target's own distribution of that token after the data prefix (soft CE: self-distillation
        without regenerating the data; the target's LM head runs once more per position).
        tree_ranks / tree_nodes: candidates per head measured on the held-out rows, and nodes of the
        static tree saved from them (``medusa_tree.json``)."""
        if labels not in ("data", "target"):
            raise ValueError(f"medusa1 labels must be 'data' or 'target', got {labels!r}")
        self.num_heads, self.num_layers, self.fc_bias = num_heads, num_layers, fc_bias
        self.loss_decay, self.top_k = loss_decay, top_k
        self.train_lm_heads, self.labels = train_lm_heads, labels
        self.tree_ranks, self.tree_nodes = tree_ranks, tree_nodes
        self.tree_accuracy: list[list[float]] | None = None  # from the latest held-out evaluation

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
        out = head_counts(model, hidden, batch["input_ids"], ok, self.top_k, greedy_next, self.tree_ranks)
        base = greedy_next[:, 1:][ok[:, 1:]] == batch["input_ids"][:, 1:][ok[:, 1:]]
        out["target_top1_correct"], out["target_top1_total"] = float(base.sum()), float(base.numel())
        return out

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: keeps the held-out rank accuracies for ``save``'s tree; marks the τ basis."""
        self.tree_accuracy = rank_accuracy(metrics, self.num_heads, self.tree_ranks) or self.tree_accuracy
        return {"tau_vs_target_greedy": 1.0}

    def save(self, model, out_dir: str, target: Target) -> None:
        model.save_pretrained(out_dir)
        save_tree(self, out_dir)

    @staticmethod
    def drafter(model, shape):
        """The heads as the evaluator's drafter (measured acceptance during training); a chain is
        capped at the number of heads."""
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
            logits, y, pos = self._next_token_logits(h, input_ids, ok)
            greedy_next = greedy_from_logits(logits, ok)  # the adapted target's greedy tokens
            out = head_counts(self.heads, h, input_ids, ok, self.cfg.top_k, greedy_next, self.cfg.tree_ranks)
            out.update(self._drift_sums(h, input_ids, attention_mask, ok, (logits, y, pos)))
            return out
        loss, stats = head_losses(self.heads, h, input_ids, ok, self.cfg.loss_decay)
        keep = self._target_term(h, input_ids, attention_mask, ok)
        stats["target_loss"] = keep.detach()
        return self.cfg.heads_weight * loss + self.cfg.target_weight * keep, stats

    def _next_token_logits(self, h, input_ids, ok):
        pos = _next_token_positions(ok)
        return self._logits(h[pos]), input_ids[:, 1:][ok[:, 1:]], pos  # (N, V), (N,), (B, T)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The (adapted) target's float32 logits, soft-capped like its own forward (``output_logits``)."""
        base = self.base()
        return output_logits(base.config, base.lm_head, h).float()

    def _target_term(self, h, input_ids, attention_mask, ok) -> torch.Tensor:
        """The target-keeping loss, a mean over next-token labels: the CE (``lm``) or t^2 KL(original || adapted) at
        temperature t (``kl``), rows in chunks so that no (N, V) logits are held."""
        pos, y = _next_token_positions(ok), input_ids[:, 1:][ok[:, 1:]]
        n = max(1, y.numel())
        if self.cfg.target_loss == "kl":
            t = self.cfg.kl_temperature
            return self._kl_sum(h[pos], self.reference_hidden(input_ids, attention_mask)[pos]) * t * t / n
        base = self.base()
        if not isinstance(base.lm_head, nn.Linear):  # peft wraps an LM head that lora_target_modules names
            return F.cross_entropy(self._logits(h[pos]), y, reduction="sum") / n
        head = base.lm_head
        loss_sum, _ = linear_cross_entropy(h[pos], head.weight, y, head.bias, softcap=logit_softcap(base.config))
        return loss_sum / n

    def _kl_sum(self, h: torch.Tensor, ref_h: torch.Tensor) -> torch.Tensor:
        """Sum over rows of KL(original || adapted) at the KL temperature, from (N, H) adapted and original
        post-norm states, ``logit_chunk_rows`` rows at a time; past one chunk, a chunk's logits are recomputed in
        the backward pass instead of being kept."""
        chunk = logit_chunk_rows(self.heads.config.vocab_size)
        if h.shape[0] <= chunk:
            return self._kl_chunk(h, ref_h)
        total, grad = h.new_zeros((), dtype=torch.float32), torch.is_grad_enabled()
        for s in range(0, h.shape[0], chunk):
            rows = (h[s:s + chunk], ref_h[s:s + chunk])
            total = total + (checkpoint(self._kl_chunk, *rows, use_reentrant=False) if grad else self._kl_chunk(*rows))
        return total

    def _kl_chunk(self, h: torch.Tensor, ref_h: torch.Tensor) -> torch.Tensor:
        t = self.cfg.kl_temperature
        with torch.no_grad():
            ref = F.log_softmax(self._logits(ref_h) / t, -1)
        return F.kl_div(F.log_softmax(self._logits(h) / t, -1), ref, log_target=True, reduction="sum")

    @torch.no_grad()
    def _drift_sums(self, h, input_ids, attention_mask, ok, next_logits=None) -> dict[str, float]:
        logits, y, pos = next_logits or self._next_token_logits(h, input_ids, ok)
        ref = self._logits(self.reference_hidden(input_ids, attention_mask)[pos])
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
                 labels: str = "data", tree_ranks: int = TREE_RANKS, tree_nodes: int = TREE_NODES):
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
        self.tree_ranks, self.tree_nodes = tree_ranks, tree_nodes
        self.tree_accuracy: list[list[float]] | None = None  # from the latest held-out evaluation
        self.step = 0

    def on_step_start(self, step: int) -> None:
        self.step = step

    def build(self, target: Target) -> nn.Module:
        """Injects LoRA into ``target.model`` in place (adapters on = adapted, off = original)."""
        if target.layout.tp_size > 1:
            raise ConfigError("medusa2 trains the target itself, which a tensor-parallel target (target.parallel=tp) "
                              "cannot do here: use target.parallel=none or device_map, or FSDP / DeepSpeed ZeRO-3 "
                              "(conf/launcher/) to shard it")
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
        heads = model.heads
        return MedusaDrafter(heads, TreeShape("chain", k=min(shape.k, heads.config.num_heads)))

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        out = {"tau_vs_target_greedy": 1.0}
        for key in ("nll", "original_nll"):
            if key in metrics:
                out[key.replace("nll", "ppl")] = math.exp(metrics[key])
        self.tree_accuracy = rank_accuracy(metrics, self.num_heads, self.tree_ranks) or self.tree_accuracy
        return out

    def save(self, model, out_dir: str, target: Target) -> None:
        """Heads into ``out_dir``; the merged adapted target (plain HF folder) into ``out_dir/target``."""
        m = model
        heads = m.heads
        heads.config.adapted_target = ADAPTED_TARGET_DIR
        heads.save_pretrained(out_dir)
        save_tree(self, out_dir)
        merged = copy.deepcopy(m.lm)
        merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
        merged.requires_grad_(False).save_pretrained(Path(out_dir) / ADAPTED_TARGET_DIR)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(Path(out_dir) / ADAPTED_TARGET_DIR)
