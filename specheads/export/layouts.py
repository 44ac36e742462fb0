"""What each serving engine loads, per head method: ``config.json`` and the weight names and shapes.

The facts (read from the loaders themselves; table and sources in docs/export.md):

* **vLLM** (0.33 wheel): EAGLE-1 loads ``EagleLlamaForCausalLM`` (``fc`` has no bias, layer 0 has no
  ``input_layernorm``, embedding and LM head come from the target; an ``lm_head`` or an unknown key in
  the file is a load error); EAGLE-3 loads ``LlamaForCausalLMEagle3`` (``midlayer.*`` is read as
  ``layers.0.*``; ``d2t`` becomes ``draft_id_to_target_id`` and exists only when
  ``draft_vocab_size < vocab_size``, so a ``d2t`` for a full-size draft vocabulary is a load error;
  ``t2d`` is skipped); ``eagle_config.eagle_aux_hidden_state_layer_ids`` are layer *inputs* (our
  convention) and the target concatenates them in ascending order. Medusa (``MedusaModel``,
  ``method: medusa``) is not in the 0.33 wheel; the layout is the one of the releases that ship
  ``models/medusa.py``.
* **SGLang** (0.5.23): EAGLE-1 loads ``LlamaForCausalLMEagle`` whose ``fc`` is an ``nn.Linear`` *with*
  bias (so a zero bias is written: an absent one would stay randomly initialised); EAGLE-3 loads
  ``LlamaForCausalLMEagle3`` (``d2t`` -> hot token ids, ``t2d`` skipped, ``midlayer`` -> ``layers.0``);
  its ``eagle_aux_hidden_state_layer_ids`` count layer *outputs*: id ``v`` captures the input of
  layer ``v + 1``, so ours are written minus one. SGLang has no Medusa loader.

Everything here works on plain dicts (``config.json`` contents) so it can be checked without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("medusa", "eagle1", "eagle3")
ENGINES = ("vllm", "sglang")
FLOAT = "float"  # any floating dtype, the same for every float tensor of a file

_MODEL_TYPES = {"medusa": "medusa", "specheads_eagle1": "eagle1", "specheads_eagle3": "eagle3"}
_ARCHITECTURES = {
    ("medusa", "vllm"): "MedusaModel",
    ("eagle1", "vllm"): "EagleLlamaForCausalLM",
    ("eagle1", "sglang"): "LlamaForCausalLMEagle",
    ("eagle3", "vllm"): "LlamaForCausalLMEagle3",
    ("eagle3", "sglang"): "LlamaForCausalLMEagle3",
}
_LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "vocab_size",
                 "bos_token_id", "eos_token_id", "pad_token_id")


class LayoutError(ValueError):
    """A head that no engine layout can represent, or an engine that cannot load a method."""


@dataclass(frozen=True)
class TensorSpec:
    """shape, and dtype: ``"float"`` (the file's float dtype), ``"int64"`` or ``"bool"``."""

    shape: tuple[int, ...]
    dtype: str = FLOAT


@dataclass(frozen=True)
class Rule:
    """How one exported tensor is made from the head's tensors.

    source: the head tensor's name, or None for zeros of the target spec's shape;
    chunk_order: for ``fc.weight`` of EAGLE-3, the order in which the equal column blocks (one per
    aux layer) are taken, so the blocks follow ascending layer ids as the engines concatenate them.
    """

    source: str | None
    chunk_order: tuple[int, ...] | None = None


@dataclass
class Layout:
    """One method x engine: the ``config.json`` to write and every tensor of ``model.safetensors``."""

    method: str
    engine: str
    config: dict
    tensors: dict[str, TensorSpec]
    rules: dict[str, Rule]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TargetInfo:
    """What the layouts need to know about the target (read from its config)."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int | None = None


# --------------------------------------------------------------------------- the head side


def method_of(head_config: dict) -> str:
    """The method of a saved head folder's ``config.json`` (by ``model_type``)."""
    mt = head_config.get("model_type")
    if mt not in _MODEL_TYPES:
        raise LayoutError(f"config.json has model_type {mt!r}; a specheads head folder has one of "
                          f"{sorted(_MODEL_TYPES)} (is this the train output's head/ folder?)")
    return _MODEL_TYPES[mt]


def _need(cfg: dict, *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise LayoutError(f"head config.json lacks {missing}")


def _attention_layer(cfg: dict, prefix: str, in_features: int, input_norm: bool, hidden_norm: bool) -> dict:
    """Names -> specs of one Llama decoder layer with q/k/v reading ``in_features``."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    out = {
        f"{prefix}.self_attn.q_proj.weight": TensorSpec((nh * hd, in_features)),
        f"{prefix}.self_attn.k_proj.weight": TensorSpec((nkv * hd, in_features)),
        f"{prefix}.self_attn.v_proj.weight": TensorSpec((nkv * hd, in_features)),
        f"{prefix}.self_attn.o_proj.weight": TensorSpec((H, nh * hd)),
        f"{prefix}.mlp.gate_proj.weight": TensorSpec((I, H)),
        f"{prefix}.mlp.up_proj.weight": TensorSpec((I, H)),
        f"{prefix}.mlp.down_proj.weight": TensorSpec((H, I)),
        f"{prefix}.post_attention_layernorm.weight": TensorSpec((H,)),
    }
    if input_norm:
        out[f"{prefix}.input_layernorm.weight"] = TensorSpec((H,))
    if hidden_norm:
        out[f"{prefix}.hidden_norm.weight"] = TensorSpec((H,))
    return out


def _check_llama(cfg: dict) -> None:
    _need(cfg, "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "num_hidden_layers", "vocab_size", "rms_norm_eps")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise LayoutError(f"head config has {flag}=true; the engines' EAGLE drafters load no such biases")


def head_tensors(method: str, cfg: dict) -> dict[str, TensorSpec]:
    """Every tensor a head folder of ``method`` must hold (the names ``save_pretrained`` writes)."""
    if method == "medusa":
        _need(cfg, "hidden_size", "vocab_size", "num_heads", "num_hidden_layers")
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        out = {}
        for k in range(cfg["num_heads"]):
            for j in range(cfg["num_hidden_layers"]):
                out[f"blocks.{k}.layers.{j}.weight"] = TensorSpec((H, H))
                if cfg.get("medusa_fc_bias", True):
                    out[f"blocks.{k}.layers.{j}.bias"] = TensorSpec((H,))
            out[f"lm_heads.{k}.weight"] = TensorSpec((V, H))
        return out
    _check_llama(cfg)
    H = cfg["hidden_size"]
    if method == "eagle1":
        out = {"fc.weight": TensorSpec((H, 2 * H))}
        for i in range(cfg["num_hidden_layers"]):
            out.update(_attention_layer(cfg, f"layers.{i}", H, input_norm=i > 0, hidden_norm=False))
        return out
    if method == "eagle3":
        _need(cfg, "draft_vocab_size", "aux_layers")
        if cfg["num_hidden_layers"] != 1:
            raise LayoutError(f"EAGLE-3 heads have one layer; config says num_hidden_layers={cfg['num_hidden_layers']}")
        Ht = cfg.get("target_hidden_size") or H
        out = {"fc.weight": TensorSpec((H, len(cfg["aux_layers"]) * Ht))}
        out.update(_attention_layer(cfg, "midlayer", 2 * H, input_norm=True, hidden_norm=True))
        out.update({"norm.weight": TensorSpec((H,)), "lm_head.weight": TensorSpec((cfg["draft_vocab_size"], H)),
                    "d2t": TensorSpec((cfg["draft_vocab_size"],), "int64"),
                    "t2d": TensorSpec((cfg["vocab_size"],), "bool")})
        return out
    raise LayoutError(f"unknown method {method!r}; expected one of {METHODS}")


# --------------------------------------------------------------------------- the engine side


def engines_for(method: str) -> tuple[str, ...]:
    """The engines that have a loader for ``method``."""
    return tuple(e for e in ENGINES if (method, e) in _ARCHITECTURES)


def aux_layer_ids(engine: str, aux_layers) -> list[int]:
    """Our aux layers (inputs of decoder layers, see specheads.targets) -> the engine's ids, ascending.

    vLLM counts layer inputs like we do; SGLang's id ``v`` captures the input of layer ``v + 1``.
    """
    layers = [int(i) for i in aux_layers]
    if len(set(layers)) != len(layers):
        raise LayoutError(f"aux layers {layers} repeat a layer; the engines capture each layer once, so the "
                          "fc input would be narrower than the head's (retrain with distinct aux layers)")
    shift = {"vllm": 0, "sglang": -1}[engine]
    return [i + shift for i in sorted(layers)]


def _llama_config(cfg: dict, method: str, engine: str, target: TargetInfo) -> dict:
    out = {"architectures": [_ARCHITECTURES[method, engine]], "model_type": "llama"}
    out.update({k: cfg[k] for k in _LLAMA_FIELDS if cfg.get(k) is not None})
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]  # read by loaders that predate rope_parameters
    out.update(num_hidden_layers=cfg["num_hidden_layers"], vocab_size=target.vocab_size,
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    return out


def _check_target(method: str, cfg: dict, target: TargetInfo) -> None:
    H = cfg["hidden_size"]
    if H != target.hidden_size:
        raise LayoutError(f"head hidden_size {H} != target {target.name} hidden_size {target.hidden_size}")
    if cfg["vocab_size"] != target.vocab_size:
        raise LayoutError(f"head vocab_size {cfg['vocab_size']} != target {target.name} vocab_size {target.vocab_size}")
    if method == "eagle3":
        Ht = cfg.get("target_hidden_size") or H
        if Ht != target.hidden_size:
            raise LayoutError(f"head target_hidden_size {Ht} != target {target.name} hidden_size {target.hidden_size}")
        bad = [i for i in cfg["aux_layers"] if not (target.num_layers is None or 0 <= i < target.num_layers)]
        if bad:
            raise LayoutError(f"aux layers {bad} do not exist in target {target.name} ({target.num_layers} layers)")


def build_layout(method: str, engine: str, cfg: dict, target: TargetInfo) -> Layout:
    """The exported folder's ``config.json`` and tensors for a head of ``method`` with config ``cfg``."""
    if engine not in ENGINES:
        raise LayoutError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if (method, engine) not in _ARCHITECTURES:
        raise LayoutError(f"{engine} has no loader for {method} heads; export with engine="
                          f"{' or '.join(engines_for(method))}")
    src = head_tensors(method, cfg)
    _check_target(method, cfg, target)
    return {"medusa": _medusa, "eagle1": _eagle1, "eagle3": _eagle3}[method](cfg, engine, target, src)


def _identity(src: dict[str, TensorSpec]) -> dict[str, Rule]:
    return {name: Rule(name) for name in src}


def _medusa(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg["hidden_size"],
              "vocab_size": cfg["vocab_size"], "num_heads": cfg["num_heads"],
              "num_hidden_layers": cfg["num_hidden_layers"], "truncated_vocab_size": cfg["vocab_size"],
              "medusa_fc_bias": bool(cfg.get("medusa_fc_bias", True))}
    notes = ["vLLM reads the block biases only when medusa_fc_bias is true (it is written explicitly).",
             "Medusa is served by vLLM releases that ship models/medusa.py (method \"medusa\"); "
             "vLLM 0.33 no longer has it, and SGLang never had a Medusa loader."]
    return Layout("medusa", engine, config, dict(src), _identity(src), notes)


def _eagle1(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    config = _llama_config(cfg, "eagle1", engine, target)
    tensors, rules = dict(src), _identity(src)
    notes = ["Token embedding and LM head are the target's (not in the file; the engine shares them)."]
    if engine == "sglang":
        tensors["fc.bias"] = TensorSpec((cfg["hidden_size"],))
        rules["fc.bias"] = Rule(None)
        notes.append("fc.bias is all zeros: SGLang's fc has a bias, the trained fc has none.")
    return Layout("eagle1", engine, config, tensors, rules, notes)


def _eagle3(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    config = _llama_config(cfg, "eagle3", engine, target)
    aux = [int(i) for i in cfg["aux_layers"]]
    ids = aux_layer_ids(engine, aux)
    config.update(draft_vocab_size=cfg["draft_vocab_size"], target_hidden_size=cfg.get("target_hidden_size")
                  or cfg["hidden_size"], norm_before_residual=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    tensors, rules = dict(src), _identity(src)
    order = tuple(sorted(range(len(aux)), key=lambda j: aux[j]))
    if order != tuple(range(len(aux))):
        rules["fc.weight"] = Rule("fc.weight", chunk_order=order)
    notes = [f"Aux layers {aux} (inputs of target decoder layers) are written as {engine} ids {ids}.",
             "The token embedding is the target's (not in the file); t2d is kept for reference, the loader skips it."]
    if engine == "vllm" and cfg["draft_vocab_size"] >= target.vocab_size:
        del tensors["d2t"], rules["d2t"]
        notes.append("No d2t: vLLM has no draft-to-target map when the draft vocabulary is the full vocabulary.")
    return Layout("eagle3", engine, config, tensors, rules, notes)
