"""The decoder layer shared by the EAGLE-1 and EAGLE-3 drafters, and the caches it attends over.

``DraftDecoderLayer`` is a Llama decoder layer (RMSNorm, RoPE with the target's rope settings,
grouped-query attention, SwiGLU MLP) with two differences that drafting needs:

* attention takes an explicit boolean mask ``(B, q, kv)`` (True = may attend) and explicit
  position ids, so the evaluator can draft trees (a node attends to its ancestors only);
* keys and values live in a plain ``KVCache`` that can be cropped and index-selected, so the
  accepted branch of a tree can be kept and the rest dropped.

The same layer runs the training-time test (``specheads.methods.ttt``) through an
``UnrollCache``: step 0 of the unroll attends causally to itself, and step ``i`` additionally
attends, at each position ``t``, to the keys that steps ``1..i`` produced at that same ``t``.
On a CPU that attention (``unrolled_attention``) is ``ttt_attention.fused_unrolled_attention``: flash attention
over the step-0 keys and one score per position for each later step's diagonal key, merged by log-sum-exp, with an
exact backward and no T x T tensor (its module says by how much that saves; ``scripts/bench/ttt_memory.py``).
Elsewhere (CUDA) it is ``dense_unrolled_attention``, one fused ``scaled_dot_product_attention`` over the ``(i+1)T`` keys of
the steps so far with an additive ``T x (i+1)T`` mask (causal block, then ``i`` diagonal blocks): the fused kernel
never holds the ``(B, heads, T, (i+1)T)`` scores, which an explicit softmax kept for the backward pass (CPU, bf16
autocast, 4 x 512 tokens, SmolLM2 heads, a 3-step unroll: 81 vs 319 MiB for forward + backward; 16 rows without
gradients: 78 vs 436 MiB), but the mask is T² itself.

Two options of the draft layer as vLLM speculators 0.9 trains them (both off unless the config sets them):

* a sliding window (config ``sliding_window`` W and ``layer_types``: layer ``i`` slides where
  ``layer_types[i] == "sliding_attention"``, as transformers' and vLLM's configs say it): a query keeps the keys
  whose position ``p`` has ``p > a - W``, where ``a`` is its anchor, the position of the verified token its
  draft chain starts from. In the training-time test that is the step-0 key ``j`` of query ``t`` with
  ``t - W < j <= t`` (the keys of later steps, on the diagonal, always stay), speculators' ``eagle3/attention.py``
  mask ``kv_idx > q_idx - sliding_window``; when drafting, a tree node's anchor is the root (its ancestors are
  always inside) and a verified token is its own anchor. The caller passes that rule as ``window_mask`` (see
  ``window_mask``); without it a sliding layer counts positions as the cache's order (a plain causal cache).
* Qwen3's per-head query/key RMSNorms (config ``qk_norm``): ``self_attn.q_norm`` / ``self_attn.k_norm``, (head_dim,)
  each, applied to every head's query and key before RoPE, as transformers' ``Qwen3Attention`` does.

Parameter names follow the Llama / vLLM layout: ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k}_norm``
(``qk_norm``) and, for EAGLE-3, ``hidden_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn

from specheads.models import ttt_attention

# The drafters copy the target's RoPE settings through `config.rope_parameters`, a field that first
# appeared in transformers 5.0; 4.x ignores it (its Llama reads rope_theta / rope_scaling), so a draft
# would silently train and serve with other RoPE settings than its target. Refuse such a version.
MIN_TRANSFORMERS = "5.0"


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``ImportError`` when ``transformers`` (or ``version``) predates ``rope_parameters``."""
    version = transformers.__version__ if version is None else version
    if Version(Version(version).base_version) < Version(MIN_TRANSFORMERS):  # 5.0.0rc1, 5.1.0.dev0 pass
        raise ImportError(f"specheads needs transformers>={MIN_TRANSFORMERS} (found {version}): the draft heads copy "
                          "the target's RoPE settings through `config.rope_parameters`, which older versions "
                          f"ignore. Upgrade with: pip install 'transformers>={MIN_TRANSFORMERS}'")


check_transformers_version()

from transformers.activations import ACT2FN  # noqa: E402  (after the version check: 4.x must fail above)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

RMSNorm = LlamaRMSNorm
RotaryEmbedding = LlamaRotaryEmbedding

_COPIED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "hidden_act", "vocab_size", "bos_token_id",
                  "eos_token_id", "pad_token_id")


MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # a vision-language target's M-RoPE settings (models.mrope)


def draft_fields_from_target(target_config, mrope: bool = True) -> dict:
    """The Llama-layer fields a drafter copies from its target (sizes, norm eps, rope settings); a multimodal
    target's from its language model's config (``text_config``). ``mrope=False`` drops its M-RoPE settings
    (``MROPE_KEYS``) for a drafter that trains at 1-D positions and that vLLM refuses with M-RoPE (drafts with extra
    input slots: DFlash, P-EAGLE); vLLM hands a draft without them the temporal positions."""
    if hasattr(target_config, "get_text_config"):
        target_config = target_config.get_text_config()
    fields = {k: getattr(target_config, k) for k in _COPIED_FIELDS if getattr(target_config, k, None) is not None}
    if getattr(target_config, "head_dim", None) is None:
        fields["head_dim"] = target_config.hidden_size // target_config.num_attention_heads
    check_transformers_version()
    rope = getattr(target_config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    if all(isinstance(v, dict) for v in rope.values()):
        # RoPE per layer type (Gemma-3: local and global bases): the draft layer attends to the whole context
        # like the target's full-attention layers, and an engine's Llama config takes one set of parameters.
        rope = rope.get("full_attention") or next(iter(rope.values()))
    fields["rope_parameters"] = {k: v for k, v in rope.items() if mrope or k not in MROPE_KEYS}
    return fields


def fusion_linear(config) -> nn.Linear:
    """``fc`` of a drafter that fuses target layers (EAGLE-3, DFlash): (H, len(aux_layers) * H_target), no bias."""
    H = config.hidden_size
    return nn.Linear(len(config.aux_layers or (0, 0, 0)) * (config.target_hidden_size or H), H, bias=False)


class KVCache:
    """Keys and values of a drafter's layers, each ``(B, n_kv_heads, S, head_dim)``.

    ``update`` appends; ``crop``, ``select`` and ``select_batch`` edit the cache in place (and
    return it) so a tree drafter can keep the accepted path. All layers always hold the same ``S``.
    """

    def __init__(self, num_layers: int = 1):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    @property
    def batch_size(self) -> int | None:
        return None if self.keys[0] is None else self.keys[0].shape[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, n_kv, q, D)`` keys/values of one layer; return the whole ``(B, n_kv, S+q, D)``."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            if self.keys[layer].shape[0] != k.shape[0]:
                raise ValueError(f"KVCache holds batch {self.keys[layer].shape[0]} but got keys for batch {k.shape[0]}")
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, length: int) -> "KVCache":
        """Keep the first ``length`` positions."""
        if length < 0:
            raise ValueError(f"KVCache.crop: length must be >= 0, got {length}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]
        return self

    def select(self, index: torch.Tensor) -> "KVCache":
        """Keep the positions ``index`` in that order: ``(S',)`` for every row or ``(B, S')`` per row."""
        n = len(self)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"KVCache.select: indices must lie in [0, {n}), got [{int(index.min())}, {int(index.max())}]")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None:
                continue
            if index.dim() == 1:
                self.keys[i], self.values[i] = k.index_select(2, index), v.index_select(2, index)
            elif index.dim() == 2:
                idx = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                self.keys[i], self.values[i] = k.gather(2, idx), v.gather(2, idx)
            else:
                raise ValueError(f"KVCache.select: index must be (S',) or (B, S'), got {tuple(index.shape)}")
        return self

    def select_batch(self, index: torch.Tensor) -> "KVCache":
        """Keep (or repeat) the batch rows ``index`` ``(B',)``."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k.index_select(0, index), v.index_select(0, index)
        return self

    def clone(self) -> "KVCache":
        c = KVCache(len(self.keys))
        c.keys = [None if k is None else k.clone() for k in self.keys]
        c.values = [None if v is None else v.clone() for v in self.values]
        return c


class UnrollCache:
    """Keys/values of a training-time-test unroll over a whole sequence (see the module docstring).

    Per layer a list of ``(B, n_kv, T, D)`` tensors, one per unrolled step: entry 0 is attended
    causally, entries ``1..i`` only on the diagonal (position ``t`` sees its own ``t``).
    """

    def __init__(self, num_layers: int = 1):
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    @property
    def steps(self) -> int:
        return len(self.keys[0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """Append this step's (B, n_kv, T, D) keys/values to ``layer``'s and return its queries' (B, nh, T, D)
        ``unrolled_attention`` (a sequence-parallel cache attends over the whole row from a slice of it)."""
        self.keys[layer].append(k)
        self.values[layer].append(v)
        return unrolled_attention(q, self.keys[layer], self.values[layer], scale, window)


def layer_window(config, layer: int) -> int | None:
    """The sliding window W of draft layer ``layer`` (None: it attends to the whole context): ``config.sliding_window``
    where ``config.layer_types[layer]`` is ``"sliding_attention"``."""
    types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
    if not types or window is None or layer >= len(types) or types[layer] != "sliding_attention":
        return None
    if int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return int(window)


def window_mask(anchor: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(B, q, kv) bool: key ``k`` lies within the window of query ``i``, ``key_pos[k] > anchor[i] - window``.

    anchor: (B, q) each query's anchor position (module docstring); key_pos: (B, kv) each key's position."""
    return key_pos[:, None, :] > anchor[:, :, None] - window


def unroll_mask(T: int, steps: int, dtype: torch.dtype, device, window: int | None = None) -> torch.Tensor:
    """(T, steps * T) additive mask of step ``steps - 1`` of an unroll: 0 where position ``t`` may attend
    (keys ``<= t`` of step 0, and ``> t - window`` with a window; key ``t`` of every later step), -inf elsewhere."""
    idx = torch.arange(T, device=device)
    causal = idx[None, :] <= idx[:, None]
    if window is not None:
        causal &= idx[None, :] > idx[:, None] - window
    allowed = torch.cat([causal] + [torch.eye(T, dtype=torch.bool, device=device)] * (steps - 1), dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of step ``len(keys) - 1`` of an unroll.

    q: (B, nh, T, D); keys/values: lists of (B, nkv, T, D), entry 0 causal (within ``window`` of the query's own
    position if given), the rest diagonal. Returns (B, nh, T, D).
    Step 0 without a window is plain causal attention (scaled_dot_product_attention), except for CPU training with
    grouped heads; CPU tensors go to ``ttt_attention.fused_unrolled_attention`` (no T x T tensor, forward or
    backward; its backward uses every core where the kernel's own, handed grouped heads, would not); the rest
    (CUDA) to ``dense_unrolled_attention``.
    """
    nh, T, nkv = q.shape[1], q.shape[2], keys[0].shape[1]
    fused = ttt_attention.supported(q, keys, values)
    causal = len(keys) == 1 and (window is None or window >= T)  # step 0 is plain causal attention
    if causal and not (fused and nh != nkv and _needs_grad(q, keys[0], values[0])):
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scale,
                                              enable_gqa=nh != nkv)
    if fused:
        return ttt_attention.fused_unrolled_attention(q, keys, values, scale, window)
    return dense_unrolled_attention(q, keys, values, scale, window)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def dense_unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                             scale: float, window: int | None = None) -> torch.Tensor:
    """``unrolled_attention`` as one fused attention over the concatenated keys under ``unroll_mask``: a
    (T, steps * T) mask, memory and time in T². The reference of the tests, and the path of CUDA tensors.
    """
    nh, nkv = q.shape[1], keys[0].shape[1]
    mask = unroll_mask(q.shape[2], len(keys), q.dtype, q.device, window)
    k, v, gqa = torch.cat(keys, dim=2), torch.cat(values, dim=2), nh != nkv
    if gqa and q.device.type != "cpu":  # CUDA's memory-efficient kernel takes a mask, not unequal head counts
        k, v, gqa = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class AttentionPattern:
    """An attention rule over one packed sequence, passed to a draft layer as its ``attn_mask`` in place of a (B, q,
    q) mask (P-EAGLE's ``peagle.ParallelLayout``): ``attend`` computes the attention, with no q x q tensor where it
    can (the CPU) and through the mask it stands for elsewhere."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """q: (B, heads, q, D), k/v: (B, kv_heads, q, D) after RoPE; window: the layer's sliding window or None ->
        (B, heads, q, D)."""
        raise NotImplementedError


class DraftAttention(nn.Module):
    """Grouped-query self-attention with RoPE; q/k/v read an input of ``input_size`` features. ``layer`` (the
    layer's index among the draft's) picks its sliding window (``layer_window``); ``config.qk_norm`` adds Qwen3's
    per-head ``q_norm`` / ``k_norm`` before RoPE."""

    def __init__(self, config, input_size: int, layer: int = 0):
        super().__init__()
        self.window = layer_window(config, layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        qk_norm = getattr(config, "qk_norm", False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                attn_mask: torch.Tensor | None, cache: KVCache | UnrollCache | None,
                window_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, q, input_size); cos/sin: (B, q, D); attn_mask / window_mask: (B, q, kv) bool or None -> (B, q, H)."""
        B, q_len, _ = x.shape
        q = self.q_proj(x).view(B, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, q_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: each head's query and key normed before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.o_proj(self.attend(q, k, v, layer, attn_mask, cache, window_mask))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, attn_mask: torch.Tensor | None,
               cache: KVCache | UnrollCache | None, window_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q: (B, heads, q, D), k/v: (B, kv_heads, q, D) after RoPE -> (B, q, heads * D), through the cache.

        window_mask: (B, q, kv) bool, the keys within each query's window (``window_mask()``); read by a
        sliding-window layer only, required with an explicit ``attn_mask`` (a tree's keys are not in position order).
        attn_mask may be an ``AttentionPattern`` (no cache, no window_mask); None with no cache before these keys is
        causal attention, through ``unrolled_attention`` (no q x q mask).
        """
        B, q_len = q.shape[0], q.shape[2]
        scale = self.head_dim ** -0.5
        if isinstance(attn_mask, AttentionPattern):
            if cache is not None or window_mask is not None:
                raise ValueError("an AttentionPattern is the whole attention rule: pass no cache and no window_mask")
            out = attn_mask.attend(q, k, v, scale, self.window)
        elif isinstance(cache, UnrollCache):
            if attn_mask is not None:
                raise ValueError("an UnrollCache defines its own attention pattern; pass attn_mask=None")
            out = cache.attend(layer, q, k, v, scale, self.window)
        else:
            # this layer's own length: with several layers, layer 0 has already appended the new keys
            past = 0 if cache is None or cache.keys[layer] is None else cache.keys[layer].shape[2]
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if attn_mask is None and window_mask is None and not past:  # causal (EAGLE-1's training): no (q, q) mask
                out = unrolled_attention(q, [k], [v], scale, self.window)
            else:
                mask = _check_mask(attn_mask, B, q_len, past, q.device)
                if self.window is not None:
                    mask = mask & self._window(window_mask, attn_mask, q_len, past, q.device)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                                     enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(B, q_len, -1)

    def _window(self, given: torch.Tensor | None, attn_mask: torch.Tensor | None, q_len: int, past: int,
                device) -> torch.Tensor:
        """(B or 1, q, past+q) bool: the keys within this layer's window."""
        if given is not None:
            if given.dtype != torch.bool or given.dim() != 3 or given.shape[1:] != (q_len, past + q_len):
                raise ValueError(f"window_mask must be a bool tensor (B, q={q_len}, kv={past + q_len}); got "
                                 f"{given.dtype} {tuple(given.shape)}")
            return given
        if attn_mask is not None:
            raise ValueError(f"this draft layer has a sliding window ({self.window}): with an explicit attn_mask, pass "
                             "window_mask (the keys' positions are not the cache's order)")
        pos = torch.arange(past + q_len, device=device)[None]
        return window_mask(pos[:, past:], pos, self.window)


def _check_mask(attn_mask: torch.Tensor | None, batch: int, q_len: int, past: int, device) -> torch.Tensor:
    """Validate a (B, q, past+q) bool mask, or build the default: all of the cache, causal among the new."""
    kv = past + q_len
    if attn_mask is None:
        return causal_mask(q_len, past, device=device).expand(batch, -1, -1)
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 3 or attn_mask.shape[1:] != (q_len, kv) \
            or attn_mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attn_mask must be a bool tensor of shape (B={batch}, q={q_len}, kv={kv}) (kv = cached {past} + new {q_len}); "
            f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
    return attn_mask


def causal_mask(q_len: int, past: int = 0, device=None) -> torch.Tensor:
    """(1, q, past+q) bool: every new query sees the whole cache and the new entries up to itself."""
    m = torch.ones(q_len, past + q_len, dtype=torch.bool, device=device)
    return m.tril(diagonal=past)[None]


class DraftMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer for a drafter.

    Two input styles:
    * EAGLE-1 (``embeds_input=False``): attention reads the (fused) hidden state, through
      ``input_layernorm`` unless ``input_layernorm=False`` (vLLM/SGLang drop it in layer 0).
    * EAGLE-3 (``embeds_input=True``): attention reads ``[input_layernorm(embeds); hidden_norm(hidden)]``
      (2H features); the residual stream is the un-normed hidden, or ``hidden_norm(hidden)`` with
      ``norm_before_residual`` (speculators' and vLLM's option of that name); ``hidden_after_input_norm``: the hidden
      half reads ``hidden_norm(input_layernorm(hidden))`` (NVIDIA ModelOpt 0.47's HF EAGLE-3, whose decoder layer norms
      its input before the attention hook applies ``hidden_norm``; the engines apply ``hidden_norm`` alone).
    The output is the pre-norm residual stream ``hidden + attn + mlp`` (B, q, H).
    """

    def __init__(self, config, layer: int = 0, embeds_input: bool = False, input_layernorm: bool = True,
                 norm_before_residual: bool = False, hidden_after_input_norm: bool = False):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        if (norm_before_residual or hidden_after_input_norm) and not embeds_input:
            raise ValueError("norm_before_residual and hidden_after_input_norm apply to the EAGLE-3 style layer "
                             "(embeds_input=True)")
        self.layer = layer
        self.embeds_input = embeds_input
        self.norm_before_residual = norm_before_residual
        self.hidden_after_input_norm = hidden_after_input_norm
        self.self_attn = DraftAttention(config, 2 * H if embeds_input else H, layer)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(H, eps) if (input_layernorm or embeds_input) else None
        self.hidden_norm = RMSNorm(H, eps) if embeds_input else None
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: KVCache | UnrollCache | None = None,
                embeds: torch.Tensor | None = None, window_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: (B, q, H); embeds: (B, q, H) for the EAGLE-3 style -> (B, q, H) pre-norm output.
        window_mask: see ``DraftAttention.attend`` (read by a sliding-window layer only)."""
        if self.embeds_input:
            if embeds is None:
                raise ValueError("this layer reads [embeds; hidden]: pass embeds")
            normed = self.hidden_norm(self.input_layernorm(hidden) if self.hidden_after_input_norm else hidden)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
            if self.norm_before_residual:
                hidden = normed
        else:
            x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        h = hidden + self.self_attn(x, cos, sin, self.layer, attn_mask, cache, window_mask)
        return h + self.mlp(self.post_attention_layernorm(h))
