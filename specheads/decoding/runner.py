"""A causal LM with a KV cache that scores draft trees in one forward and keeps only accepted entries.

The cache holds *committed* entries (tokens of the sequence) followed by *scratch* entries
(draft-tree nodes fed since the last commit). Every forward appends scratch entries; each new
entry names its parent (an earlier scratch entry or ``-1`` = the end of the committed context),
attends to all valid committed entries plus its scratch ancestors and itself, and sits at
position ``parent position + 1``. ``commit`` keeps a chosen list of scratch entries per row
(the accepted path) and drops the rest; ``discard`` drops all scratch entries.

Rows of a batch may commit different numbers of entries; the shorter rows get *holes* (slots
marked invalid in ``valid`` and masked out of attention), so one forward serves the whole batch.

The mask goes to the Hugging Face model as a 4D float additive mask ``(B, 1, q, kv)``, which
transformers returns as-is for eager and SDPA attention; positions go as explicit
``position_ids``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from specheads.targets import capture_layer_inputs


@dataclass
class ForwardOutput:
    """logits: (B, q, V) or None; hidden_last: (B, q, H) post-norm; hidden_aux: (B, q, k*H) or None."""

    logits: torch.Tensor | None
    hidden_last: torch.Tensor
    hidden_aux: torch.Tensor | None


class TargetRunner:
    """KV-cached tree forwards over a Hugging Face causal LM (``model.model`` + ``lm_head``).

    model: a ``*ForCausalLM``; aux_layers: decoder-layer inputs to return (see ``specheads.targets``).
    ``forward_calls`` counts model forwards (one per ``forward``, whatever the batch size).
    """

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...] = ()):
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.aux_layers = tuple(aux_layers)
        self.forward_calls = 0
        self.batch_size = 0
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept either.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ state
    def reset(self, batch_size: int) -> None:
        """Empty cache for ``batch_size`` rows."""
        from transformers import DynamicCache

        self.batch_size = batch_size
        self.cache = DynamicCache(config=self.model.config)
        dev = self.device
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=dev)
        self.num_tokens = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.scratch_anc = torch.zeros(batch_size, 0, 0, dtype=torch.bool, device=dev)
        self.scratch_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=dev)
        self.scratch_live = torch.zeros(batch_size, 0, dtype=torch.bool, device=dev)

    @property
    def committed_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def scratch_size(self) -> int:
        return self.scratch_pos.shape[1]

    def _cache_len(self) -> int:
        return self.cache.get_seq_length() if len(self.cache.layers) else 0

    # ------------------------------------------------------------------ forward
    def _extend_tree(self, parents: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add q scratch entries. parents (B, q): scratch index or -1; live (B, q): real (not padding).

        Returns positions (B, q) and the ancestor-or-self rows (B, q, s+q) of the new entries.
        """
        B, q = parents.shape
        s = self.scratch_size
        anc = torch.zeros(B, s + q, s + q, dtype=torch.bool, device=parents.device)
        anc[:, :s, :s] = self.scratch_anc
        pos = torch.cat([self.scratch_pos, torch.zeros(B, q, dtype=torch.long, device=parents.device)], 1)
        rows = torch.arange(B, device=parents.device)
        for j in range(q):
            p = parents[:, j]
            has = p >= 0
            if (p >= s + j).any():
                raise ValueError(f"scratch entry {s + j} names parent {int(p.max())}, which is not earlier")
            pc = p.clamp(min=0)
            anc[:, s + j] = anc[rows, pc] & has[:, None]
            anc[:, s + j, s + j] = True
            pos[:, s + j] = torch.where(has, pos[rows, pc] + 1, self.num_tokens)
        self.scratch_anc = anc
        self.scratch_pos = pos
        self.scratch_live = torch.cat([self.scratch_live, live], 1)
        return pos[:, s:], anc[:, s:, :]

    def _attention_mask(self, new_anc: torch.Tensor) -> torch.Tensor:
        """(B, 1, q, kv) additive float mask: committed valid slots + scratch ancestors."""
        B, q, _ = new_anc.shape
        allowed = torch.cat([self.valid[:, None, :].expand(B, q, -1), new_anc], dim=2)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, parents: torch.Tensor, live: torch.Tensor | None = None,
                logits: bool = True, logits_at: torch.Tensor | None = None) -> ForwardOutput:
        """Feed q scratch entries per row in one model forward.

        tokens (B, q) long; parents (B, q) long (scratch index, earlier or in this call, or -1);
        live (B, q) bool marks real entries (padding is computed but never attended to by others).
        logits_at: optional (B, r) indices into the q new entries: logits only there (B, r, V).
        """
        if tokens.shape != parents.shape or tokens.shape[0] != self.batch_size:
            raise ValueError(f"tokens {tuple(tokens.shape)} / parents {tuple(parents.shape)} "
                             f"do not match the batch size {self.batch_size}")
        if live is None:
            live = torch.ones_like(tokens, dtype=torch.bool)
        pos, anc = self._extend_tree(parents, live)
        mask = self._attention_mask(anc)
        with capture_layer_inputs(self.decoder.layers, self.aux_layers) as captured:
            out = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=pos,
                               use_cache=True, **{self._cache_kw: self.cache})
        self.forward_calls += 1
        last = out.last_hidden_state
        aux = torch.cat([captured[i] for i in self.aux_layers], -1) if self.aux_layers else None
        lg = None
        if logits:
            sel = last if logits_at is None else last.gather(
                1, logits_at[..., None].expand(-1, -1, last.shape[-1]))
            lg = self.lm_head(sel)
        return ForwardOutput(lg, last, aux)

    def forward_chain(self, tokens: list[list[int]], **kw) -> ForwardOutput:
        """Feed per-row token lists as chains after the current scratch tail (or the context).

        Rows may differ in length (right padding, marked not live). Chains start at the committed
        context when the scratch is empty, else after each row's last live scratch entry.
        """
        B = self.batch_size
        q = max(len(t) for t in tokens)
        if q == 0:
            raise ValueError("forward_chain got no tokens for any row")
        s = self.scratch_size
        tok = torch.zeros(B, q, dtype=torch.long, device=self.device)
        par = torch.full((B, q), -1, dtype=torch.long, device=self.device)
        live = torch.zeros(B, q, dtype=torch.bool, device=self.device)
        for b, t in enumerate(tokens):
            start = self._last_live(b)
            tok[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            live[b, : len(t)] = True
            for j in range(q):
                par[b, j] = (start if j == 0 else s + j - 1) if j < max(len(t), 1) else -1
        return self.forward(tok, par, live, **kw)

    def _last_live(self, b: int) -> int:
        idx = torch.nonzero(self.scratch_live[b]).flatten()
        return int(idx[-1]) if len(idx) else -1

    # ------------------------------------------------------------------ keep / drop
    def commit(self, keep: list[list[int]]) -> None:
        """Keep, per row, these scratch entries (in order, a root-to-leaf path) and drop the rest."""
        B, s, c = self.batch_size, self.scratch_size, self.committed_slots
        if len(keep) != B:
            raise ValueError(f"commit got {len(keep)} rows, the batch has {B}")
        for b, k in enumerate(keep):
            if any(not 0 <= i < s for i in k):
                raise ValueError(f"row {b}: commit indices {k} outside the {s} scratch entries")
        m = max((len(k) for k in keep), default=0)
        if all(list(k) == list(range(m)) for k in keep):
            self.cache.crop(-(s - m)) if s > m else None
        else:
            idx = torch.zeros(B, m, dtype=torch.long, device=self.device)
            for b, k in enumerate(keep):
                row = list(k) + [0] * (m - len(k))
                idx[b] = torch.tensor(row, dtype=torch.long) + c
            self._gather_tail(c, idx)
        lens = torch.tensor([len(k) for k in keep], device=self.device)
        self.valid = torch.cat([self.valid, torch.arange(m, device=self.device)[None] < lens[:, None]], 1)
        self.num_tokens = self.num_tokens + lens
        self._clear_scratch()

    def discard(self) -> None:
        """Drop every scratch entry (back to the committed context)."""
        s = self.scratch_size
        if s:
            self.cache.crop(-s)
        self._clear_scratch()

    def _gather_tail(self, c: int, idx: torch.Tensor) -> None:
        """Replace cache slots [c:] by slots ``idx`` (B, m) of the same layer tensors."""
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                g = t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                setattr(layer, name, torch.cat([t[:, :, :c], g], 2))

    def _clear_scratch(self) -> None:
        B, dev = self.batch_size, self.device
        self.scratch_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)
        self.scratch_pos = torch.zeros(B, 0, dtype=torch.long, device=dev)
        self.scratch_live = torch.zeros(B, 0, dtype=torch.bool, device=dev)

    # ------------------------------------------------------------------ convenience
    def prefill(self, prompts: list[list[int]]) -> ForwardOutput:
        """Commit ``prompt[:-1]`` for every row (the last prompt token stays pending, see generate.py).

        Returns the forward's hidden states for those positions (right padded), no logits.
        """
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every prompt needs at least 2 tokens (the last one is fed by the first step)")
        self.reset(len(prompts))
        out = self.forward_chain([list(p[:-1]) for p in prompts], logits=False)
        self.commit([list(range(len(p) - 1)) for p in prompts])
        return out
