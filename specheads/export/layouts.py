"""What each serving engine loads, per head method: ``config.json`` and the weight names and shapes.

The facts (read from the loaders themselves; table and sources in docs/export.md):

* **vLLM** (0.33 wheel): EAGLE-1 loads ``EagleLlamaForCausalLM`` (``fc`` has no bias, layer 0 has no
  ``input_layernorm``, embedding and LM head come from the target; an ``lm_head`` or an unknown key in
  the file is a load error); EAGLE-3 loads ``LlamaForCausalLMEagle3`` (``midlayer.*`` is read as
  ``layers.0.*``; ``d2t`` becomes ``draft_id_to_target_id`` and exists only when
  ``draft_vocab_size < vocab_size``, so a ``d2t`` for a full-size draft vocabulary is a load error;
  ``t2d`` is skipped); the aux ids are layer *inputs* (our convention) and the target concatenates them
  in ascending order. Which key holds them depends on the model runner: V1 (``gpu_model_runner.py``)
  reads the top-level ``eagle_aux_hidden_state_layer_ids``, then ``eagle_config.eagle_aux_hidden_state_layer_ids``;
  V2 (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, the default when Triton is present) reads the
  top-level key, then ``eagle_config.layer_ids``, and never the nested ``eagle_aux_...`` key: without a
  top-level key it captures (2, N//2, N-3). So the vLLM folder writes the ids in both places; the
  drafter's ``fc`` width comes from ``num_aux_hidden_states`` or the nested ids. Medusa (``MedusaModel``,
  ``method: medusa``) is not in the 0.33 wheel; the layout is the one of the releases that ship
  ``models/medusa.py``.
* **SGLang** (0.5.23): EAGLE-1 loads ``LlamaForCausalLMEagle`` whose ``fc`` is an ``nn.Linear`` *with*
  bias (so a zero bias is written: an absent one would stay randomly initialised); EAGLE-3 loads
  ``LlamaForCausalLMEagle3`` (``d2t`` -> hot token ids, ``t2d`` skipped, ``midlayer`` -> ``layers.0``);
  its ``eagle_aux_hidden_state_layer_ids`` count layer *outputs*: id ``v`` captures the input of
  layer ``v + 1``, so ours are written minus one. SGLang has no Medusa loader.
* **speculators** (0.9.0, the native format that ``Eagle3DraftModel.from_pretrained`` reads and vLLM
  converts through its ``SpeculatorsConfig``): a ``config.json`` with ``speculators_model_type: eagle3``,
  a ``transformer_layer_config`` (the draft layer's Llama config), ``speculators_config`` (algorithm,
  greedy proposal with ``speculative_tokens``, verifier id and architectures) and the aux ids at the top
  level (vLLM's convention); weights named ``layers.0.*`` and **the token embedding included**
  (``embed_tokens.weight``, the target's): speculators marks an unloaded embedding with NaN, which
  transformers' ``from_pretrained`` re-initialises, so a folder without it drafts on random embeddings.
  EAGLE-3 here (speculators 0.9 has no EAGLE-1 or Medusa model); DFlash has its own speculators layout below.
* **medusa** (the original FasterDecoding Medusa layout, which TGI and vLLM 0.32's
  ``_remap_old_checkpoint_key`` read): ``config.json`` with ``medusa_num_heads``/``medusa_num_layers``
  and weights ``{k}.{j}.linear.weight|bias`` (residual blocks), ``{k}.{num_layers}.weight`` (LM head).

* **DFlash** (vLLM 0.34.0, SGLang 0.5.23; ``docs/export.md``): z-lab's format, one folder both engines load
  (``DFlashDraftModel``, a Qwen3 config with every layer ``full_attention`` = bidirectional,
  ``dflash_config.target_layer_ids`` = our aux layers minus one, no embedding or LM head), written as ``vllm/``
  and ``sglang/``; and speculators' format (``speculators_model_type: dflash``, our aux ids,
  ``sliding_window_non_causal: true``, the target's embedding and LM head), which vLLM converts and SGLang cannot read.
* **EAGLE-3 normalisation options** (``NORM_FLAGS``, speculators' names): vLLM 0.32.0's ``llama_eagle3.py`` reads
  ``norm_before_fc`` (``eagle_config``'s, else the top level's; weight ``input_norm``, n_aux * target_hidden_size,
  before ``fc_norm``), ``norm_before_residual`` and ``norm_output`` (the post-norm state returned as the state fed
  back); its speculators conversion (``algos.update_eagle3``) copies all three, an absent ``norm_before_residual``
  as **true**, so every layout writes each explicitly. SGLang 0.5.23's reads ``norm_before_fc`` and ``norm_output``,
  not ``norm_before_residual`` (its layer 0 keeps the un-normed residual): refused there (``ENGINE_NORMS``).
* **EAGLE-3 / P-EAGLE draft layer** (``layer_variant``): a sliding window as ``sliding_window``, ``layer_types`` and
  ``use_sliding_window`` (vLLM 0.32's ``llama.py`` / ``qwen3_eagle3.py`` pass the window of each ``sliding_attention``
  layer to its attention; speculators reads the same fields of ``transformer_layer_config``); Qwen3 q/k norms as
  ``model_type: qwen3`` (vLLM: ``Eagle3Qwen3ForCausalLM`` / ``PeagleQwen3ForCausalLM``) with
  ``self_attn.q_norm``/``k_norm``. SGLang 0.5.23 reads neither from the config: refused there.
* **DSpark** (vLLM 0.32.0's ``qwen3_dspark.py`` and speculators conversion, read from the wheel): DFlash's tensors
  plus ``markov_head.markov_w1``/``markov_w2`` and ``confidence_head.proj``; a Qwen3 config with the top-level
  keys ``Qwen3DSparkModel`` reads (below). vLLM serves it only on the V2 GPU model runner.

Everything here works on plain dicts (``config.json`` contents) so it can be checked without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specheads.families import FAMILIES, exported, family, find, load

METHODS = exported()  # the families with export layouts (specheads/families.py)
ENGINES = ("vllm", "sglang", "speculators", "medusa")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format and loader were checked
FLOAT = "float"  # any floating dtype, the same for every float tensor of a file

_MODEL_TYPES = {f.model_type: f.name for f in FAMILIES if f.exported}
# (method, engine) -> the architecture written, from each family's ``layouts`` (specheads/families.py)
_ARCHITECTURES = {(f.name, engine): arch for f in FAMILIES for engine, arch in f.layouts.items()}
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")  # EAGLE-3 options, as the engines name them
ENGINE_NORMS = {  # the NORM_FLAGS each engine's EAGLE-3 drafter computes (read from its loader)
    "vllm": NORM_FLAGS,  # 0.32.0 llama_eagle3.py: input_norm, _norm_before_residual, norm_output's aux output
    "speculators": NORM_FLAGS,  # 0.9.0 Eagle3SpeculatorConfig / Eagle3DraftModel; vLLM converts all three
    "sglang": ("norm_before_fc", "norm_output"),  # 0.5.23 llama_eagle3.py: layer 0 always keeps the raw residual
}
ENGINE_NORMS_CHECKED = {"vllm": "vLLM 0.32's LlamaForCausalLMEagle3", "speculators": "speculators 0.9",
                        "sglang": "SGLang 0.5.23's LlamaForCausalLMEagle3"}
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
    aux layer) are taken, so the blocks follow ascending layer ids as the engines concatenate them;
    from_target: ``source`` names a tensor of the target model (e.g. its token embedding), not the head.
    """

    source: str | None
    chunk_order: tuple[int, ...] | None = None
    from_target: bool = False


@dataclass
class Layout:
    """One method x engine: the ``config.json`` to write and every tensor of ``model.safetensors``."""

    method: str
    engine: str
    config: dict
    tensors: dict[str, TensorSpec]
    rules: dict[str, Rule]
    notes: list[str] = field(default_factory=list)
    weights_file: str = "model.safetensors"


@dataclass(frozen=True)
class TargetInfo:
    """What the layouts need to know about the target (read from its config)."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int | None = None
    hub_id: str | None = None  # the hub id a user serves the target by, when known
    architectures: tuple[str, ...] = ()
    path: str | None = None  # the local folder the target was read from, when it has no hub id
    origin_id: str | None = None  # without a hub id: the hub model it was converted from (embedded GGUF, a folder's
    #                               config ``_name_or_path``), which the speculators verifier names
    vision_language: bool = False  # its config has a vision part (``engine_targets.vision_export_refusal``)

    @property
    def verifier(self) -> str | None:
        """speculators' ``verifier.name_or_path``: a hub id when one is known, else the local folder."""
        return self.hub_id or self.origin_id or self.path


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
    if cfg.get("qk_norm"):  # Qwen3's per-head query/key norms
        out[f"{prefix}.self_attn.q_norm.weight"] = TensorSpec((hd,))
        out[f"{prefix}.self_attn.k_norm.weight"] = TensorSpec((hd,))
    return out


def _check_llama(cfg: dict) -> None:
    _need(cfg, "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "num_hidden_layers", "vocab_size", "rms_norm_eps")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise LayoutError(f"head config has {flag}=true; the engines' EAGLE drafters load no such biases")


def head_tensors(method: str, cfg: dict) -> dict[str, TensorSpec]:
    """Every tensor a head folder of ``method`` must hold (the names ``save_pretrained`` writes): its family's
    ``head_tensors`` (``specheads/families.py``)."""
    fam = find(method)
    if fam is None or fam.name != method or not fam.head_tensors:
        raise LayoutError(f"unknown method {method!r}; expected one of {METHODS}")
    return load(fam.head_tensors)(cfg)


def medusa_tensors(cfg: dict) -> dict[str, TensorSpec]:
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


def eagle1_tensors(cfg: dict) -> dict[str, TensorSpec]:
    _check_llama(cfg)
    H = cfg["hidden_size"]
    out = {"fc.weight": TensorSpec((H, 2 * H))}
    for i in range(cfg["num_hidden_layers"]):
        out.update(_attention_layer(cfg, f"layers.{i}", H, input_norm=i > 0, hidden_norm=False))
    return out


def eagle3_tensors(cfg: dict) -> dict[str, TensorSpec]:
    _check_llama(cfg)
    H = cfg["hidden_size"]
    _need(cfg, "draft_vocab_size", "aux_layers")
    if cfg["num_hidden_layers"] != 1:
        raise LayoutError(f"EAGLE-3 heads have one layer; config says num_hidden_layers={cfg['num_hidden_layers']}")
    Ht = cfg.get("target_hidden_size") or H
    out = {"fc.weight": TensorSpec((H, len(cfg["aux_layers"]) * Ht))}
    if cfg.get("fc_norm"):  # EAGLE-3.1: one RMSNorm per fused feature before fc
        out.update({f"fc_norm.{i}.weight": TensorSpec((Ht,)) for i in range(len(cfg["aux_layers"]))})
    if cfg.get("norm_before_fc"):  # speculators' one RMSNorm over the concatenated features before fc
        out["input_norm.weight"] = TensorSpec((len(cfg["aux_layers"]) * Ht,))
    out.update(_attention_layer(cfg, "midlayer", 2 * H, input_norm=True, hidden_norm=True))
    out.update({"norm.weight": TensorSpec((H,)), "lm_head.weight": TensorSpec((cfg["draft_vocab_size"], H)),
                "d2t": TensorSpec((cfg["draft_vocab_size"],), "int64"),
                "t2d": TensorSpec((cfg["vocab_size"],), "bool")})
    return out


def dflash_tensors(cfg: dict) -> dict[str, TensorSpec]:
    _check_llama(cfg)
    H = cfg["hidden_size"]
    _need(cfg, "aux_layers", "block_size", "mask_token_id")
    Ht = cfg.get("target_hidden_size") or H
    out = {"fc.weight": TensorSpec((H, len(cfg["aux_layers"]) * Ht)), "hidden_norm.weight": TensorSpec((H,)),
           "norm.weight": TensorSpec((H,))}
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        out.update(_attention_layer(cfg, f"layers.{i}", H, input_norm=True, hidden_norm=False))
        out[f"layers.{i}.self_attn.q_norm.weight"] = TensorSpec((hd,))
        out[f"layers.{i}.self_attn.k_norm.weight"] = TensorSpec((hd,))
    return out


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
    if family(method).aux_states:
        Ht = cfg.get("target_hidden_size") or H
        if Ht != target.hidden_size:
            raise LayoutError(f"head target_hidden_size {Ht} != target {target.name} hidden_size {target.hidden_size}")
        bad = [i for i in cfg["aux_layers"] if not (target.num_layers is None or 0 <= i < target.num_layers)]
        if bad:
            raise LayoutError(f"aux layers {bad} do not exist in target {target.name} ({target.num_layers} layers)")
    if cfg.get("mask_token_id") is not None:  # DFlash's, DSpark's and P-EAGLE's masked slots
        mask = cfg["mask_token_id"]
        if not 0 <= int(mask) < target.vocab_size:
            raise LayoutError(f"mask_token_id {mask} is not a row of target {target.name}'s embedding (vocab "
                              f"{target.vocab_size}); vLLM and SGLang embed the masked slots with the target's rows")
        n = cfg.get("num_target_layers")
        if n is not None and target.num_layers is not None and n != target.num_layers:
            raise LayoutError(f"head num_target_layers {n} != target {target.name} ({target.num_layers} layers)")


def build_layout(method: str, engine: str, cfg: dict, target: TargetInfo, spec_tokens: int = 3) -> Layout:
    """The exported folder's ``config.json`` and tensors for a head of ``method`` with config ``cfg``.

    spec_tokens: the draft length recorded where a format carries one (speculators' greedy proposal).
    """
    if engine not in ENGINES:
        raise LayoutError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if (method, engine) not in _ARCHITECTURES:
        raise LayoutError(f"{engine} has no loader for {method} heads; export with engine="
                          f"{' or '.join(engines_for(method))}")
    src = head_tensors(method, cfg)
    _check_target(method, cfg, target)
    return load(family(method).build_layout)(cfg, engine, target, src, spec_tokens)


def medusa_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    tgi = engine == family("medusa").tgi_layout  # FasterDecoding's original format, which TGI serves
    return _medusa_original(cfg, target, src) if tgi else _medusa(cfg, engine, target, src)


def eagle1_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    return _eagle1(cfg, engine, target, src)


def eagle3_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    if engine == "speculators":
        return _eagle3_speculators(cfg, target, src, spec_tokens)
    return _eagle3(cfg, engine, target, src)


def dflash_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    if engine == "speculators":
        return _dflash_speculators(cfg, target, src, spec_tokens)
    return _dflash(cfg, engine, target, src)


def _identity(src: dict[str, TensorSpec]) -> dict[str, Rule]:
    return {name: Rule(name) for name in src}


def _medusa(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg["hidden_size"],
              "vocab_size": cfg["vocab_size"], "num_heads": cfg["num_heads"],
              "num_hidden_layers": cfg["num_hidden_layers"], "truncated_vocab_size": cfg["vocab_size"],
              "medusa_fc_bias": bool(cfg.get("medusa_fc_bias", True))}
    notes = ["vLLM reads the block biases only when medusa_fc_bias is true (it is written explicitly).",
             MEDUSA_ENGINES]
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


def _norm_flags(cfg: dict, engine: str) -> dict[str, bool]:
    """The head's ``NORM_FLAGS`` as ``engine`` reads them, refusing one it does not compute (``ENGINE_NORMS``)."""
    if cfg.get("hidden_after_input_norm"):
        raise LayoutError("hidden_after_input_norm: no engine's EAGLE-3 drafter norms the fed hidden state with "
                          "input_layernorm before hidden_norm (NVIDIA ModelOpt's trainer does; a head read from its "
                          "export is evaluated, not exported here)")
    flags = {k: bool(cfg.get(k)) for k in NORM_FLAGS}
    missing = [k for k, on in flags.items() if on and k not in ENGINE_NORMS[engine]]
    if missing:
        raise LayoutError(f"{missing[0]}: {ENGINE_NORMS_CHECKED[engine]} does not compute it (its EAGLE-3 drafter "
                          f"would run the head without it); export with engine="
                          f"{' or '.join(e for e in ENGINE_NORMS if missing[0] in ENGINE_NORMS[e])}")
    return flags


def layer_variant(cfg: dict, engine: str) -> dict:
    """The draft layer's sliding window and Qwen3 q/k norms as ``engine`` reads them (config fields to write), refusing
    SGLang: its 0.5.23 ``LlamaForCausalLMEagle3`` has no q/k norms and takes a window from the server's
    ``--speculative-draft-window-size`` only, not from the head's config."""
    window = cfg.get("sliding_window") if "sliding_attention" in (cfg.get("layer_types") or ()) else None
    if engine == "sglang" and (window is not None or cfg.get("qk_norm")):
        what = f"a sliding-window draft layer (window {window})" if window is not None else "Qwen3 q/k norms"
        raise LayoutError(f"{what}: SGLang 0.5.23's LlamaForCausalLMEagle3 does not read it from the head's config; "
                          "export with engine=vllm or engine=speculators")
    out = {"model_type": "qwen3"} if cfg.get("qk_norm") else {}
    if window is not None:  # use_sliding_window: transformers' Qwen3Config drops sliding_window without it
        out.update(sliding_window=int(window), layer_types=list(cfg["layer_types"]), use_sliding_window=True)
    return out


def _eagle3(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    config = _llama_config(cfg, "eagle3", engine, target)
    config.update(layer_variant(cfg, engine))
    if cfg.get("qk_norm"):  # vLLM's registry: qwen3_eagle3.Eagle3Qwen3ForCausalLM (q/k norms, the window per layer)
        config["architectures"] = ["Eagle3Qwen3ForCausalLM"]
    aux = [int(i) for i in cfg["aux_layers"]]
    ids = aux_layer_ids(engine, aux)
    config.update(draft_vocab_size=cfg["draft_vocab_size"], target_hidden_size=cfg.get("target_hidden_size")
                  or cfg["hidden_size"], **_norm_flags(cfg, engine),
                  eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    if cfg.get("fc_norm"):
        config["fc_norm"] = True  # vLLM 0.34's and SGLang 0.5.23's LlamaForCausalLMEagle3 read it (fc_norm.{i})
    if engine == "vllm":
        # vLLM's V2 model runner (the default in 0.32/0.33 when Triton is present) reads only the top-level
        # key (or eagle_config.layer_ids) and otherwise captures (2, N//2, N-3); V1 reads either.
        config["eagle_aux_hidden_state_layer_ids"] = ids
    tensors, rules = dict(src), _identity(src)
    order = tuple(sorted(range(len(aux)), key=lambda j: aux[j]))
    if order != tuple(range(len(aux))):
        rules.update(_fused_rules(cfg, order))
    notes = [f"Aux layers {aux} (inputs of target decoder layers) are written as {engine} ids {ids}.",
             "The token embedding is the target's (not in the file); t2d is kept for reference, the loader skips it."]
    if engine == "vllm" and cfg["draft_vocab_size"] >= target.vocab_size:
        del tensors["d2t"], rules["d2t"]
        notes.append("No d2t: vLLM has no draft-to-target map when the draft vocabulary is the full vocabulary.")
    return Layout("eagle3", engine, config, tensors, rules, notes)


def _fused_rules(cfg: dict, order: tuple[int, ...]) -> dict[str, Rule]:
    """Rules for the tensors over the fused features when the aux layers are not ascending: ``fc``'s column blocks
    and ``input_norm``'s blocks in ``order``; ``fc_norm.{k}`` from the head's ``fc_norm.{order[k]}``."""
    rules = {"fc.weight": Rule("fc.weight", chunk_order=order)}
    if cfg.get("norm_before_fc"):
        rules["input_norm.weight"] = Rule("input_norm.weight", chunk_order=order)
    if cfg.get("fc_norm"):
        rules.update({f"fc_norm.{k}.weight": Rule(f"fc_norm.{j}.weight") for k, j in enumerate(order)})
    return rules


MEDUSA_BASE_PLACEHOLDER = "REPLACE-WITH-TARGET-HUB-ID-OR-PATH"
MEDUSA_ENGINES = ("Served by vLLM up to 0.32 (method \"medusa\", checked against 0.32.0: a missing tensor is a load "
                  "error); vLLM 0.33 has no Medusa method, and SGLang has no Medusa loader.")


def _speculators_config(algorithm: str, spec_tokens: int, target: TargetInfo) -> dict:
    """speculators' ``speculators_config``: the algorithm, a greedy proposal of ``spec_tokens`` and the verifier."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(spec_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": target.verifier, "architectures": list(target.architectures)}}


def _verifier_note(target: TargetInfo) -> list[str]:
    """What the card says of ``verifier.name_or_path`` when the target has no hub id of its own."""
    if target.hub_id is not None:
        return []
    if target.origin_id is not None:
        return [f"speculators_config.verifier.name_or_path is `{target.origin_id}`, the hub model the target was "
                "converted from (the head was trained on a local copy, not those exact weights); no path of the "
                "exporting machine. Re-export with target_id=<hub id> if the target has an id of its own."]
    # speculators 0.9 needs a verifier: Eagle3DraftModel.load_verifier_weights reads its config even when
    # name_or_path is null (and fails), so the local folder is named; vLLM auto-serves only a hub id.
    return [f"speculators_config.verifier.name_or_path is the exporting machine's local target folder "
            f"(`{Path(target.path or target.name).name}`; no hub id was known): speculators' from_pretrained reads "
            "the verifier's config from it; re-export with target_id=<hub id> before publishing (vLLM serves a "
            "speculators folder on its own only when the verifier is a hub id)."]


def _eagle3_speculators(cfg: dict, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    """speculators' own EAGLE-3 format (``Eagle3DraftModel``): one folder that speculators and vLLM load."""
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        raise LayoutError("norm_before_fc with fc_norm: speculators 0.9's Eagle3SpeculatorConfig refuses the two "
                          "together; export with engine=vllm or engine=sglang")
    H = cfg["hidden_size"]
    aux = [int(i) for i in cfg["aux_layers"]]
    ids = aux_layer_ids("vllm", aux)
    layer = {k: cfg[k] for k in _LLAMA_FIELDS if cfg.get(k) is not None}
    layer.update(model_type="llama", num_hidden_layers=1, vocab_size=target.vocab_size, tie_word_embeddings=False,
                 head_dim=cfg.get("head_dim") or H // cfg["num_attention_heads"], attention_bias=False,
                 mlp_bias=False)
    layer.update(layer_variant(cfg, "speculators"))
    config = {"architectures": [_ARCHITECTURES["eagle3", "speculators"]], "speculators_model_type": "eagle3",
              "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
              "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg.get("target_hidden_size") or H,
              **_norm_flags(cfg, "speculators"), "fc_norm": bool(cfg.get("fc_norm")),
              "embed_requires_grad": False, "eagle_aux_hidden_state_layer_ids": ids, "tie_word_embeddings": False,
              "speculators_config": _speculators_config("eagle3", spec_tokens, target)}
    tensors: dict[str, TensorSpec] = {}
    rules: dict[str, Rule] = {}
    for name, spec in src.items():
        out = name.replace("midlayer.", "layers.0.", 1)
        tensors[out], rules[out] = spec, Rule(name)
    order = tuple(sorted(range(len(aux)), key=lambda j: aux[j]))
    if order != tuple(range(len(aux))):
        rules.update(_fused_rules(cfg, order))
    tensors["embed_tokens.weight"] = TensorSpec((target.vocab_size, H))
    rules["embed_tokens.weight"] = Rule("embed_tokens.weight", from_target=True)
    notes = [f"Aux layers {aux} (inputs of target decoder layers) are written as ids {ids} (vLLM's convention).",
             "embed_tokens.weight is the target's token embedding, included: speculators' loader would "
             "otherwise draft on a randomly initialised embedding."]
    if cfg["draft_vocab_size"] >= target.vocab_size:
        for k in ("d2t", "t2d"):
            del tensors[k], rules[k]
        notes.append("No d2t/t2d: the draft vocabulary is the full vocabulary (speculators then has no map).")
    notes += _verifier_note(target)
    return Layout("eagle3", "speculators", config, tensors, rules, notes)


def _medusa_original(cfg: dict, target: TargetInfo, src: dict) -> Layout:
    """The original Medusa layout (FasterDecoding ``MedusaModel``: ``medusa_head`` = per head, num_layers
    ``ResBlock``s (``linear`` with bias) then an ``nn.Linear(H, V, bias=False)``)."""
    if not cfg.get("medusa_fc_bias", True):
        raise LayoutError("the original Medusa layout's residual blocks always have a bias; this head has none "
                          "(export with engine=vllm)")
    K, L = cfg["num_heads"], cfg["num_hidden_layers"]
    tensors: dict[str, TensorSpec] = {}
    rules: dict[str, Rule] = {}
    for k in range(K):
        for j in range(L):
            for p in ("weight", "bias"):
                tensors[f"{k}.{j}.linear.{p}"] = src[f"blocks.{k}.layers.{j}.{p}"]
                rules[f"{k}.{j}.linear.{p}"] = Rule(f"blocks.{k}.layers.{j}.{p}")
        tensors[f"{k}.{L}.weight"] = src[f"lm_heads.{k}.weight"]
        rules[f"{k}.{L}.weight"] = Rule(f"lm_heads.{k}.weight")
    # No "architectures": TGI loads a Medusa speculator only when config.json has none (any other
    # architecture than MLPSpeculatorPreTrainedModel silently disables speculation); vLLM's MedusaConfig
    # defaults it to MedusaModel and renames medusa_num_heads / medusa_num_layers itself.
    config = {"model_type": "medusa", "medusa_num_heads": K, "medusa_num_layers": L,
              "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"], "medusa_fc_bias": True,
              "base_model_name_or_path": target.hub_id or MEDUSA_BASE_PLACEHOLDER}
    notes = ["The original Medusa layout (FasterDecoding Medusa, TGI): heads `{k}.{j}.linear.*` and "
             f"`{{k}}.{L}.weight` (LM head) in `medusa_lm_head.safetensors`, `medusa_num_heads`/`medusa_num_layers` "
             "and `base_model_name_or_path` (the model TGI serves) in config.json, no `architectures` (TGI "
             "ignores a Medusa folder that has one).",
             "vLLM 0.32 reads this folder too: it maps the names (`_remap_old_checkpoint_key`) and the config keys; "
             "medusa_fc_bias is written because vLLM would otherwise drop the block biases.", MEDUSA_ENGINES]
    return Layout("medusa", "medusa", config, tensors, rules, notes, weights_file="medusa_lm_head.safetensors")


# --------------------------------------------------------------------------- DFlash

DFLASH_SERVED = ("vLLM (checked: 0.34.0, `DFlashDraftModel` -> `qwen3_dflash.DFlashQwen3ForCausalLM`, method "
                 "\"dflash\") and SGLang (checked: 0.5.23, `--speculative-algorithm DFLASH`) load this folder; vLLM "
                 "before 0.34 was not checked.")


def dflash_target_layer_ids(engine: str, aux_layers) -> list[int]:
    """Our aux layers (inputs of decoder layers) -> z-lab's ``dflash_config.target_layer_ids``, ascending.

    Those ids name decoder layers whose *output* is used (HF ``hidden_states[id + 1]``), so ours minus one:
    vLLM adds one back (``get_eagle3_aux_layers_from_config``: our id, the stream entering that layer), SGLang
    captures the input of layer ``id + 1`` (``set_dflash_layers_to_capture``). SGLang refuses a negative id
    (``resolve_target_layer_ids``: 0 <= id < N), so our layer 0 (the embedding output) is vLLM-only.
    """
    layers = [int(i) for i in aux_layers]
    if len(set(layers)) != len(layers):
        raise LayoutError(f"aux layers {layers} repeat a layer; the engines capture each layer once, so the "
                          "fc input would be narrower than the head's (retrain with distinct aux layers)")
    ids = [i - 1 for i in sorted(layers)]
    if engine == "sglang" and ids[0] < 0:
        raise LayoutError(f"aux layer 0 (the embedding output) would be target_layer_id -1, which SGLang 0.5.23 "
                          "refuses (0 <= id < N); export with engine=vllm or engine=speculators, or retrain on "
                          "layers >= 1")
    return ids


def _qwen3_config(cfg: dict, target: TargetInfo) -> dict:
    """The draft layers as a Qwen3 config (what both engines parse; all layers full, bidirectional attention)."""
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    out = {k: cfg[k] for k in _LLAMA_FIELDS if cfg.get(k) is not None}
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        # vLLM's DFlash layer falls back to rope_theta 1e6 (set_default_rope_theta) when the config has none.
        out["rope_theta"] = rope["rope_theta"]
    out.update(model_type="qwen3", num_hidden_layers=L, vocab_size=target.vocab_size,
               head_dim=cfg.get("head_dim") or H // cfg["num_attention_heads"], tie_word_embeddings=False,
               attention_bias=False, layer_types=["full_attention"] * L, use_sliding_window=False,
               sliding_window=None, max_window_layers=L)
    return out


def _dflash_tensors(cfg: dict, src: dict) -> tuple[dict, dict]:
    tensors, rules = dict(src), _identity(src)
    aux = [int(i) for i in cfg["aux_layers"]]
    order = tuple(sorted(range(len(aux)), key=lambda j: aux[j]))
    if order != tuple(range(len(aux))):
        rules["fc.weight"] = Rule("fc.weight", chunk_order=order)
    return tensors, rules


def _dflash(cfg: dict, engine: str, target: TargetInfo, src: dict) -> Layout:
    """z-lab's DFlash format: one folder that vLLM (0.34) and SGLang (0.5.23) load as it is."""
    aux = [int(i) for i in cfg["aux_layers"]]
    ids = dflash_target_layer_ids(engine, aux)
    config = {"architectures": [_ARCHITECTURES["dflash", engine]], **_qwen3_config(cfg, target)}
    config.update(block_size=int(cfg["block_size"]), num_target_layers=cfg.get("num_target_layers") or target.num_layers,
                  target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                  dflash_config={"mask_token_id": int(cfg["mask_token_id"]), "target_layer_ids": ids})
    tensors, rules = _dflash_tensors(cfg, src)
    notes = [f"Aux layers {aux} (inputs of target decoder layers) are written as dflash_config.target_layer_ids {ids} "
             "(decoder layers whose output is used: ours minus one).",
             "Token embedding and LM head are the target's (not in the file; both engines share them).",
             "All layers `full_attention` with no `causal` override: both engines run them bidirectionally, "
             "as the head was trained.", DFLASH_SERVED]
    return Layout("dflash", engine, config, tensors, rules, notes)


def _dflash_speculators(cfg: dict, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    """speculators' DFlash format (``speculators_model_type: dflash``), which vLLM 0.34 converts itself; SGLang
    0.5.23 has no reader for it."""
    H = cfg["hidden_size"]
    aux = [int(i) for i in cfg["aux_layers"]]
    dflash_target_layer_ids("vllm", aux)  # refuses repeats
    ids = sorted(aux)  # vLLM's aux_hidden_state_layer_ids count layer inputs, like ours
    B = int(cfg["block_size"])
    config = {"architectures": [_ARCHITECTURES["dflash", "speculators"]], "speculators_model_type": "dflash",
              "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _qwen3_config(cfg, target),
              "draft_vocab_size": target.vocab_size, "target_hidden_size": cfg.get("target_hidden_size") or H,
              "block_size": B, "aux_hidden_state_layer_ids": ids, "mask_token_id": int(cfg["mask_token_id"]),
              "sample_from_anchor": False,
              # vLLM writes dflash_config.causal = not sliding_window_non_causal, which overrides every layer;
              # speculators itself defaults it to false (all layers causal): written explicitly.
              "sliding_window_non_causal": True, "tie_word_embeddings": False,
              "speculators_config": _speculators_config("dflash", spec_tokens, target)}
    tensors, rules = _dflash_tensors(cfg, src)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        tensors[name] = TensorSpec((target.vocab_size, H))
        rules[name] = Rule(name, from_target=True)
    notes = [f"Aux layers {aux} (inputs of target decoder layers) are written as aux_hidden_state_layer_ids {ids} "
             "(vLLM's convention, ours); vLLM derives dflash_config.target_layer_ids (minus one) itself.",
             "`sliding_window_non_causal: true`: vLLM turns it into `dflash_config.causal: false`; without it "
             "speculators' default (false) would make vLLM run every layer causally, unlike training.",
             "embed_tokens.weight and lm_head.weight are copies of the target's (speculators' format carries them; "
             "vLLM shares the target's when they are equal).",
             "Served by vLLM (checked: 0.34.0, which converts this format); SGLang 0.5.23 reads only the z-lab "
             "format (the `sglang/` or `vllm/` folder)."]
    notes += _verifier_note(target)
    return Layout("dflash", "speculators", config, tensors, rules, notes)


# --------------------------------------------------------------------------- P-EAGLE

PEAGLE_SERVED = ("vLLM (checked against the 0.32.0 wheel's loader and config parsing, not served here): EAGLE-3's "
                 "loader with `parallel_drafting: true` in the speculative config; it reads `mask_hidden` (a load error "
                 "when missing) and the config's `mask_token_id`, and fills each parallel slot with "
                 "`fc(mask_hidden)` and that token. SGLang has no parallel-drafting EAGLE.")


def peagle_tensors(cfg: dict) -> dict[str, TensorSpec]:
    """EAGLE-3's tensors (``midlayer`` reads 2H), its later layers ``layers.{i}`` (H) and ``mask_hidden``."""
    _need(cfg, "draft_vocab_size", "aux_layers", "mask_token_id", "num_depths")
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    Ht = cfg.get("target_hidden_size") or H
    out = eagle3_tensors(dict(cfg, num_hidden_layers=1))
    for i in range(1, L):
        out.update(_attention_layer(cfg, f"layers.{i}", H, input_norm=True, hidden_norm=False))
    out["mask_hidden"] = TensorSpec((1, len(cfg["aux_layers"]) * Ht))
    return out


def peagle_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    """EAGLE-3's layout for ``engine`` (vllm or speculators) plus ``mask_hidden``, the mask token and the layers
    after the first; ``mask_hidden``'s column blocks follow ``fc``'s (ascending aux layers)."""
    one = dict(cfg, num_hidden_layers=1)
    if engine == "speculators":
        lay = _eagle3_speculators(one, target, src, spec_tokens)
        lay.config.update(architectures=[_ARCHITECTURES["peagle", "speculators"]], speculators_model_type="peagle",
                          mask_token_id=int(cfg["mask_token_id"]))
        lay.config["transformer_layer_config"]["num_hidden_layers"] = cfg["num_hidden_layers"]
        if cfg.get("fc_norm"):  # vLLM's update_peagle forwards no fc_norm: the layer config carries it
            lay.config["transformer_layer_config"]["fc_norm"] = True
        lay.config["speculators_config"]["algorithm"] = "peagle"
        lay.notes.append("vLLM turns `speculators_model_type: peagle` into method eagle3 with parallel_drafting and "
                         "reads `mask_token_id` as its parallel-drafting token.")
    else:
        lay = _eagle3(one, engine, target, src)
        arch = "PeagleQwen3ForCausalLM" if cfg.get("qk_norm") else _ARCHITECTURES["peagle", engine]
        lay.config.update(architectures=[arch], num_hidden_layers=cfg["num_hidden_layers"],
                          mask_token_id=int(cfg["mask_token_id"]))
    aux = [int(i) for i in cfg["aux_layers"]]
    order = tuple(sorted(range(len(aux)), key=lambda j: aux[j]))
    if order != tuple(range(len(aux))):
        lay.rules["mask_hidden"] = Rule("mask_hidden", chunk_order=order)
    lay.notes += [f"Trained to draft {cfg['num_depths']} tokens per forward (num_speculative_tokens at most that).",
                  PEAGLE_SERVED]
    return Layout("peagle", engine, lay.config, lay.tensors, lay.rules, lay.notes)


# --------------------------------------------------------------------------- DSpark

DSPARK_SERVED = ("vLLM's V2 GPU model runner (method \"dspark\"; the 0.32.0 wheel's loader and config parsing read, not "
                 "served here). vLLM's CPU build refuses it (no Triton, so the V1 runner: \"Model Runner V1 does not "
                 "support: dspark speculative decoding\"). SGLang's DSpark loader was not checked.")


def dspark_tensors(cfg: dict) -> dict[str, TensorSpec]:
    """DFlash's tensors plus the Markov head (V, r) x 2 and the confidence head (1, H [+ r]) with its bias."""
    _need(cfg, "markov_rank")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise LayoutError(f"markov_head_type {cfg['markov_head_type']!r}: vLLM 0.32 loads the vanilla Markov head only")
    out = dflash_tensors(cfg)
    V, H, r = cfg["vocab_size"], cfg["hidden_size"], int(cfg["markov_rank"])
    out.update({"markov_head.markov_w1.weight": TensorSpec((V, r)), "markov_head.markov_w2.weight": TensorSpec((V, r))})
    if cfg.get("enable_confidence_head", True):
        width = H + (r if cfg.get("confidence_head_with_markov", True) else 0)
        out.update({"confidence_head.proj.weight": TensorSpec((1, width)), "confidence_head.proj.bias": TensorSpec((1,))})
    return out


def dspark_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    """vLLM's dense DSpark format (``Qwen3DSparkModel``) or speculators' (``speculators_model_type: dspark``).

    The head drafts DFlash's way, the anchor a bonus token and slots 1..B-1 predicting (``sample_from_anchor:
    false``, ``dspark_bonus_anchor: true``): vLLM's default ``num_speculative_tokens`` is ``block_size``, so the
    native folder writes B-1 there; speculators' ``block_size`` counts the anchor, as DFlash's does.
    """
    B, H = int(cfg["block_size"]), cfg["hidden_size"]
    aux = [int(i) for i in cfg["aux_layers"]]
    ids = dflash_target_layer_ids("vllm", aux)
    heads = {"markov_rank": int(cfg["markov_rank"]), "markov_head_type": cfg.get("markov_head_type", "vanilla"),
             "enable_confidence_head": bool(cfg.get("enable_confidence_head", True)),
             "confidence_head_with_markov": bool(cfg.get("confidence_head_with_markov", True)),
             "mask_token_id": int(cfg["mask_token_id"]), "target_hidden_size": cfg.get("target_hidden_size") or H,
             "sample_from_anchor": False}
    tensors, rules = _dflash_tensors(cfg, src)
    notes = ["Markov head `markov_head.markov_w1` (V, r) and `markov_w2` (V, r): slot j's logits plus "
             "`markov_w2 @ markov_w1[previous token]`; confidence head `confidence_head.proj` on "
             "[norm(h); markov_w1[previous token]] (vLLM's adaptive verification reads its sigmoid).",
             "The anchor is a bonus token (`sample_from_anchor: false`): slots 1..B-1 draft, as the head was trained."]
    if engine == "speculators":
        for name in ("embed_tokens.weight", "lm_head.weight"):
            tensors[name] = TensorSpec((target.vocab_size, H))
            rules[name] = Rule(name, from_target=True)
        config = {"architectures": [_ARCHITECTURES["dspark", "speculators"]], "speculators_model_type": "dspark",
                  "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _qwen3_config(cfg, target),
                  "draft_vocab_size": target.vocab_size, "block_size": B, "aux_hidden_state_layer_ids": sorted(aux),
                  "use_aux_hidden_state": True, "tie_word_embeddings": False, **heads,
                  "speculators_config": _speculators_config("dspark", spec_tokens, target)}
        notes.insert(0, f"Aux layers {aux} are written as aux_hidden_state_layer_ids {sorted(aux)} (vLLM's convention, "
                        f"ours); vLLM derives target_layer_ids {ids} (minus one) and dspark_bonus_anchor itself.")
        notes += ["embed_tokens.weight and lm_head.weight are copies of the target's (as speculators' DFlash format "
                  "carries them; vLLM's DSpark loader keeps them, or shares the target's when they are equal)."]
        notes += _verifier_note(target)
    else:
        notes.append("Token embedding and LM head are the target's (not in the file; vLLM shares them).")
        config = {"architectures": [_ARCHITECTURES["dspark", engine]], **_qwen3_config(cfg, target), **heads,
                  "block_size": B - 1, "dspark_bonus_anchor": True, "target_layer_ids": ids,
                  "num_target_layers": cfg.get("num_target_layers") or target.num_layers}
        notes.insert(0, f"Aux layers {aux} (inputs of target decoder layers) are written as target_layer_ids {ids} "
                        "(decoder layers whose output is used: ours minus one, as vLLM's dense DSpark configs).")
        notes.append(f"`block_size` is {B - 1}, the tokens drafted per step (vLLM's default num_speculative_tokens); "
                     f"the trained block has {B} slots with the anchor.")
    return Layout("dspark", engine, config, tensors, rules, notes + [DSPARK_SERVED])
