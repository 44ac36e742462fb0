"""Batched generation over a preallocated (static) KV cache, for answer regeneration.

Hugging Face ``generate`` grows its cache by concatenation and runs a stack of logits processors each
step; on a CPU that left the bf16 SmolLM2 target at ~130 tokens/s for 48 rows. This loop writes keys
and values in place (``transformers.StaticCache``), keeps one (rows, length) padding mask and per-row
positions, and stops as soon as every row has produced the end-of-turn token. Prompts are left-padded;
each row's positions count its own tokens only, so a padded row computes what it would alone.

Greedy rows take the argmax of the float32 logits; sampled rows draw from the temperature-scaled,
top-p-filtered distribution with a seeded generator.
"""

from __future__ import annotations

import inspect

import torch

from specheads.errors import UserError


def _next_tokens(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def generate_static(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | list[int], pad_token_id: int,
                    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[tuple[list[int], bool]]:
    """(generated ids up to, not including, ``eos_token_id`` (one id or several stop ids); finished) per prompt.

    ``finished`` is False when a row reached ``max_new_tokens`` without the end-of-turn token.
    """
    from transformers import StaticCache

    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("batched generation needs at least one prompt, and no empty prompt")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    rows, width = len(prompts), max(map(len, prompts))
    total = width + max_new_tokens
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, total), dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        mask[r, width - len(p): width] = 1
    lengths = mask.sum(-1)  # tokens of each row so far: the next token's position
    positions = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    stops = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    cache = StaticCache(config=model.config, max_cache_len=total)
    cache_kw = _cache_argument(model)
    out = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions, **{cache_kw: cache},
                use_cache=True, cache_position=torch.arange(width, device=device),
                # an index tensor, not logits_to_keep=1: the int slice leaves a strided (rows, 1, H) view that CPU
                # matmul turns into a batched product over a copy of the LM head per row (11 of 20 s in a profile)
                logits_to_keep=torch.tensor([width - 1], device=device))
    generated = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    active = torch.arange(rows, device=device)  # original row of each row still in the batch
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        nxt = _next_tokens(out.logits[:, -1], temperature, top_p, gen)
        generated[active, step] = nxt
        ended = torch.isin(nxt, stops)
        finished[active[ended]] = True
        if bool(finished.all()) or step + 1 == max_new_tokens:  # rows still in the batch may have ended earlier
            break
        keep = ~finished[active]
        if int((~keep).sum()) * 4 >= len(active) and _compact(cache, keep):
            # finished rows leave the batch and its cache: they would cost as much as live ones
            active, nxt, mask, lengths = active[keep], nxt[keep], mask[keep], lengths[keep]
        mask[:, width + step] = 1
        out = model(input_ids=nxt[:, None], attention_mask=mask[:, : width + step + 1],
                    position_ids=(lengths + step)[:, None], **{cache_kw: cache}, use_cache=True,
                    cache_position=torch.tensor([width + step], device=device))
    answers, stop_set = [], set(stops.tolist())
    for row, ok in zip(generated.tolist(), finished.tolist()):
        answers.append((row[: next(i for i, t in enumerate(row) if t in stop_set)], True) if ok else (row, False))
    return answers


def _cache_argument(model) -> str:
    """The forward's name for the cache: ``cache`` in newer transformers (which deprecates the old name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _compact(cache, keep: torch.Tensor) -> bool:
    """Keep only the ``keep`` rows of a static cache's layers; False (nothing changed) if the cache does not
    expose its per-layer key and value tensors."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(la, "keys") and hasattr(la, "values") for la in layers):
        return False
    for la in layers:
        la.keys, la.values = la.keys[keep], la.values[keep]
        if hasattr(la, "batch_size"):
            la.batch_size = la.keys.shape[0]
    return True
