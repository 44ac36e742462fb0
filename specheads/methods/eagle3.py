"""EAGLE-3 as a training method: training-time test over ``ttt_steps`` with soft CE on the draft vocabulary.

The model (``specheads.models.eagle3.Eagle3Model``) is pure; this module picks the draft vocabulary,
holds the loss, held-out metrics, drafter factory and save. The engine runs ``loss`` inside
``TrainingModule.forward``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specheads.decoding.head_drafters import EagleDrafter
from specheads.methods.base import ARGMAX_KEY, FusedLayers, StepOutput
from specheads.methods.losses import column_logits, target_probs
from specheads.methods.ttt import TargetRows, summarize_steps, ttt_loss, unrolled_accuracy
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.vocab import build_draft_vocab, count_loss_tokens, coverage
from specheads.targets import Target, target_argmax

log = logging.getLogger(__name__)


def every_row(batch: dict, target: Target) -> torch.Tensor:
    """(B, T) the loss mask of ``loss_rows=all``: every real token, except a vision-language target's image tokens
    (never labels: the engine drafts after an image, never inside one)."""
    mask = batch["attention_mask"]
    if getattr(target, "vision_language", False):
        mask = mask * (batch["input_ids"] != target.config.image_token_id)
    return mask


class Eagle3Method(FusedLayers):
    """EAGLE-3 training: training-time test over ``ttt_steps`` steps, soft CE on the draft vocabulary.

    draft_vocab_size: draft vocabulary (capped at the target's); vocab_data: prepared dataset whose
    loss-masked token counts pick it (required unless ``build`` gets a model with its vocab set);
    vocab_max_samples: count at most this many conversations; vocab_rows: ids of the rows of
    ``vocab_data`` to count (the training rows: ``recipes/train.py`` sets them from its split, so
    held-out and evaluation chat rows never pick the vocabulary; None counts every row, with a
    warning); aux_layers: None = the default
    (2, N//2, N-3); ttt_steps / step_decay: unroll length and step-loss weights decay**i;
    target_chunk / head_chunk: rows per chunk for the target's and the drafter's logits;
    init_lm_head_from_target: start lm_head from the target's rows of the draft vocabulary;
    freeze_lm_head: keep lm_head fixed (only with ``init_lm_head_from_target``; vLLM speculators' recipe);
    feature_weight: weight of EAGLE-1's feature regression beside the soft CE (``ttt.ttt_loss``; 0 = off);
    init_layer_from_target: start the drafter as the target's decoder layer whose input is the highest
    fused feature (``aux_layers[-1]``): ``fc`` passes that feature through, the hidden half of q/k/v, o_proj,
    the MLP and the norms are that layer's, the token-embedding half of q/k/v keeps its random start, and
    ``norm`` is the target's final norm (an initialisation lever, docs/ablations.md);
    offpath_weight: loss weight of rows whose input token is not the target's own greedy choice there
    (``ttt.ttt_loss``; 1 = every row alike). Greedy drafting only ever feeds the target's choices;
    feature_noise: while training, the fused input ``h0`` gets uniform noise of ``feature_noise`` times its
    per-row RMS (EAGLE's feature noise, made relative; a regulariser over several epochs; 0 = off);
    loss_rows: ``assistant`` trains on the rows whose next token is an assistant token (``loss_mask``), ``all``
    on every non-padding row (prompts too: a store holds the target's features and argmax there as well, so
    the same collection yields more training rows; held-out metrics stay on assistant tokens, and the draft
    vocabulary is still counted on assistant tokens, what drafting predicts);
    fc_norm: an RMSNorm per fused feature before ``fc`` (EAGLE-3.1, vLLM's and speculators' ``fc_norm``);
    norm_before_fc / norm_before_residual / norm_output: speculators' normalisations of those names
    (``specheads.models.eagle3``), each off by default: one RMSNorm over the concatenated features before ``fc``;
    the draft layer's residual starting from the normed hidden state; the post-norm state fed back between steps;
    sliding_window: the draft layer attends to the keys of the last ``sliding_window`` positions before each chain's
    root (speculators' default draft layer: 2048; None = the whole context); qk_norm: Qwen3's per-head q/k RMSNorms
    in the draft layer (speculators' ``--draft-arch qwen3``);
    lk_weight: > 0 trains on ``(1 - w) * soft CE + w * -log sum_x min(p, q)`` per row, the acceptance objective of
    the LK losses (arXiv 2602.23881) against the target's distribution on the draft vocabulary (0 = soft CE alone).
    """

    name = "eagle3"
    # Image rows train as vLLM's EAGLE-3 draft reads them (docs/train.md): the token embedding at image slots, the
    # target's M-RoPE positions (the store's ``positions``; the draft config carries the target's mrope_section).
    trains_image_rows = True

    def __init__(self, draft_vocab_size: int = 32000, vocab_data: str | None = None,
                 vocab_max_samples: int | None = None, aux_layers=None, ttt_steps: int = 3,
                 step_decay: float = 0.8, target_chunk: int = 1024, head_chunk: int = 2048,
                 init_lm_head_from_target: bool = False, vocab_rows=None, freeze_lm_head: bool = False,
                 feature_weight: float = 0.0, init_layer_from_target: bool = False, offpath_weight: float = 1.0,
                 feature_noise: float = 0.0, loss_rows: str = "assistant", fc_norm: bool = False,
                 lk_weight: float = 0.0, norm_before_fc: bool = False, norm_before_residual: bool = False,
                 norm_output: bool = False, sliding_window: int | None = None, qk_norm: bool = False):
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if freeze_lm_head and not init_lm_head_from_target:
            raise ValueError("freeze_lm_head=true keeps a randomly initialised lm_head: set init_lm_head_from_target=true too")
        self.draft_vocab_size = draft_vocab_size
        self.vocab_data = vocab_data
        self.vocab_max_samples = vocab_max_samples
        self.vocab_rows = None if vocab_rows is None else [str(r) for r in vocab_rows]
        self.aux_layers = None if aux_layers is None else tuple(int(i) for i in aux_layers)
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.target_chunk, self.head_chunk = target_chunk, head_chunk
        self.init_lm_head_from_target = init_lm_head_from_target
        self.freeze_lm_head = freeze_lm_head
        if feature_weight < 0:
            raise ValueError(f"feature_weight must be >= 0, got {feature_weight}")
        self.feature_weight = feature_weight
        if not 0 <= offpath_weight <= 1:
            raise ValueError(f"offpath_weight must lie in [0, 1], got {offpath_weight}")
        self.offpath_weight = offpath_weight
        if not 0 <= lk_weight <= 1:
            raise ValueError(f"{self.name}: lk_weight must lie in [0, 1], got {lk_weight}")
        if lk_weight and offpath_weight != 1:
            raise ValueError(f"{self.name}: lk_weight mixes in an acceptance term that offpath_weight < 1 would "
                             f"distort (it scales the target's distribution): set one of them back "
                             f"(lk_weight={lk_weight}, offpath_weight={offpath_weight})")
        self.lk_weight = float(lk_weight)
        self.init_layer_from_target = init_layer_from_target
        if feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0, got {feature_noise}")
        self.feature_noise = feature_noise
        if loss_rows not in ("assistant", "all"):
            raise ValueError(f"loss_rows must be 'assistant' or 'all', got {loss_rows!r}")
        self.loss_rows = loss_rows
        self.fc_norm = bool(fc_norm)
        self.norms = {"norm_before_fc": bool(norm_before_fc), "norm_before_residual": bool(norm_before_residual),
                      "norm_output": bool(norm_output)}
        if sliding_window is not None and int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 (or null for full attention), got {sliding_window}")
        self.layer_options = {"sliding_window": None if sliding_window is None else int(sliding_window),
                              "qk_norm": bool(qk_norm)}

    def make_model(self, target: Target) -> Eagle3Model:
        """The untrained model for ``target`` (P-EAGLE builds its own), before the draft vocabulary is set."""
        return Eagle3Model(Eagle3Config.from_target(target, self.draft_vocab_size, self.feature_spec.aux_layers,
                                                    self.fc_norm, **self.norms, **self.layer_options))

    def build(self, target: Target) -> Eagle3Model:
        self.bind(target)
        model = self.make_model(target).to(target.device).attach(target)
        config = model.config
        if self.vocab_data is None:
            raise ValueError("Eagle3Method needs vocab_data (a prepared dataset) to pick the draft vocabulary: "
                             "set method.vocab_data=<path>")
        if self.vocab_rows is None:
            log.warning("draft vocabulary counted over every row of vocab_data (no vocab_rows given): rows "
                        "held out from training count too")
        counts = count_loss_tokens(self.vocab_data, target.vocab_size, self.vocab_max_samples, self.vocab_rows)
        if not int(counts.sum()):
            raise ValueError("Eagle3Method: no loss-masked token to count in vocab_data"
                             + (f" among its {len(self.vocab_rows)} vocab_rows (do their ids match the data's?)"
                                if self.vocab_rows is not None else ""))
        d2t, t2d = build_draft_vocab(counts, config.draft_vocab_size)
        log.info("draft vocabulary %d covers %.2f%% of loss tokens", config.draft_vocab_size, 100 * coverage(counts, t2d))
        model.set_draft_vocab(d2t.to(target.device), t2d.to(target.device))
        if self.init_lm_head_from_target:
            self._init_lm_head(model, target)
        if self.init_layer_from_target:
            self._init_layer(model, target)
        if self.freeze_lm_head:
            model.lm_head.weight.requires_grad_(False)
        return model

    @staticmethod
    def _init_lm_head(model: Eagle3Model, target: Target) -> None:
        ids = model.t2d.nonzero().squeeze(-1)
        with torch.no_grad():
            model.lm_head.weight.copy_(target.lm_head.weight.index_select(0, ids).to(model.lm_head.weight))

    @staticmethod
    def _init_layer(model: Eagle3Model, target: Target) -> None:
        aux = list(model.config.aux_layers)
        src, mid, H = target.layers[aux[-1]], model.midlayer, target.hidden_size
        pairs = [(mid.self_attn.o_proj, src.self_attn.o_proj), (mid.mlp.gate_proj, src.mlp.gate_proj),
                 (mid.mlp.up_proj, src.mlp.up_proj), (mid.mlp.down_proj, src.mlp.down_proj),
                 (mid.post_attention_layernorm, src.post_attention_layernorm), (mid.hidden_norm, src.input_layernorm),
                 (model.norm, target.decoder.norm)]
        if mid.self_attn.q_norm is not None and getattr(src.self_attn, "q_norm", None) is not None:
            pairs += [(mid.self_attn.q_norm, src.self_attn.q_norm), (mid.self_attn.k_norm, src.self_attn.k_norm)]
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                dst, w = getattr(mid.self_attn, name), getattr(src.self_attn, name)
                if dst.weight.shape != (w.weight.shape[0], 2 * H):
                    raise ValueError(f"init_layer_from_target: the target's layer {aux[-1]} {name} is "
                                     f"{tuple(w.weight.shape)}, the drafter's {tuple(dst.weight.shape)} (expected (out, 2H))")
                dst.weight[:, H:].copy_(w.weight)
                if dst.bias is not None and w.bias is not None:
                    dst.bias.copy_(w.bias)
            for dst, w in pairs:
                for pname, param in dst.named_parameters():
                    value = getattr(w, pname)
                    if param.shape != value.shape:
                        raise ValueError(f"init_layer_from_target: {pname} of the target's layer {aux[-1]} is "
                                         f"{tuple(value.shape)}, the drafter's {tuple(param.shape)}")
                    param.copy_(value)
            width = model.fc.weight.shape[1] // len(aux)
            model.fc.weight.zero_()
            model.fc.weight[:, (len(aux) - 1) * width:].copy_(torch.eye(H, width))

    # -- training
    def target_rows(self, model: Eagle3Model, batch: dict, target: Target) -> TargetRows:
        """The target's distribution (on the draft vocabulary) at rows ``s`` with ``ids[s+1]`` trained."""
        last = batch["hidden_last"]
        B, T, _ = last.shape
        need = torch.zeros(B, T, dtype=torch.bool, device=last.device)
        need[:, : T - 1] = (batch["loss_mask"][:, 1:] > 0) & (batch["attention_mask"][:, 1:] > 0)
        columns = model.t2d.nonzero().squeeze(-1)
        if ARGMAX_KEY in batch:  # stored with the features: only the draft vocabulary's logits are needed
            probs, _ = target_probs(column_logits(target, columns), last[need], None, self.target_chunk)
            argmax_rows = batch[ARGMAX_KEY][need]
        else:
            probs, argmax_rows = target_probs(target.logits, last[need], columns, self.target_chunk)
        argmax = torch.zeros(B, T, dtype=torch.long, device=last.device)
        argmax[need] = argmax_rows
        row_of = torch.full((B, T), -1, dtype=torch.long, device=last.device)
        row_of[need] = torch.arange(probs.shape[0], device=last.device)
        return TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)

    sequence_parallel = None  # a training.sequence_parallel.SequenceShard: this rank trains a slice of each row

    def loss(self, model: Eagle3Model, batch: dict, target: Target) -> StepOutput:
        if self.loss_rows == "all":
            batch = {**batch, "loss_mask": every_row(batch, target)}
        shard, own = self.sequence_parallel, None
        if shard is not None:  # this rank's positions and the ttt_steps + 1 after them
            batch, own = shard.local_batch(batch, self.ttt_steps + 1)
        rows = self.target_rows(model, batch, target)
        h0 = model.fuse(batch["hidden_aux"][:, :own])
        if self.feature_noise and model.training:
            scale = self.feature_noise * h0.detach().float().pow(2).mean(-1, keepdim=True).sqrt()
            h0 = h0 + (scale * (2 * torch.rand_like(scale.expand_as(h0)) - 1)).to(h0.dtype)
        loss, stats = ttt_loss(model, h0, batch, rows, self.ttt_steps, self.step_decay, self.head_chunk,
                               self.feature_weight, self.offpath_weight, self.lk_weight, shard)
        metrics = {}
        for i, s in enumerate(stats):
            metrics[f"step{i}_loss"] = float(s.loss)
            metrics[f"step{i}_acc"] = s.correct / s.total if s.total else 0.0
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: Eagle3Model, batch: dict, target: Target) -> dict[str, float]:
        """Per-step top-1 agreement with the target argmax on all assistant tokens (sums and counts)."""
        argmax = batch.get(ARGMAX_KEY)
        if argmax is None:
            argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
        return unrolled_accuracy(model, model.fuse(batch["hidden_aux"]), batch, argmax, self.ttt_steps, self.head_chunk)

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_estimate`` from the per-step accuracies (and ``tau_joint``)."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training)."""
        return EagleDrafter(model, shape, "eagle3")

    def save(self, model: Eagle3Model, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)

