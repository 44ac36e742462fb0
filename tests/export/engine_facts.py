"""Golden facts about the engines' loaders, read from their release wheels (no engine code is copied here).

Each entry says what a loader reads and where it was read (file inside the wheel, release). The
resolvers below are our own restatement of those rules, so the tests can apply them to exported
folders without the engines installed; ``scripts/check_engine_loaders.py`` runs the engines' own
functions from the wheels against the same folders and compares (not CI).

Wheels checked: vllm 0.32.0 and 0.33.0, sglang 0.5.23, speculators 0.9.0 (``pip download --no-deps``);
TGI from its repository (``server/text_generation_server``).
"""

from __future__ import annotations

CHECKED = {"vllm": ("0.32.0", "0.33.0"), "sglang": ("0.5.23",), "speculators": ("0.9.0",)}

# --------------------------------------------------------------------------- EAGLE-3 aux layer ids
# Where each runner looks for the target layers to capture, in order; the first non-empty wins.
# ("top", key, shift): a top-level config.json key; ("nested", field, key, shift): a key of a dict-valued
# field; shift is added to every id (other methods' id conventions).
AUX_ID_RULES = {
    # vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._get_eagle3_aux_layers_from_config (0.32.0, 0.33.0):
    # the top-level key, else (dflash_config.target_layer_ids + 1, overridden by) eagle_config's key.
    "vllm-v1": [("top", "eagle_aux_hidden_state_layer_ids", 0),
                ("nested", "eagle_config", "eagle_aux_hidden_state_layer_ids", 0)],
    # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config (0.32.0, 0.33.0):
    # never reads eagle_config.eagle_aux_hidden_state_layer_ids.
    "vllm-v2": [("top", "eagle_aux_hidden_state_layer_ids", 0),
                ("nested", "dflash_config", "target_layer_ids", 1),
                ("top", "dspark_target_layer_ids", 1),
                ("top", "target_layer_ids", 1),
                ("nested", "dflash_config", "layer_ids", 0),
                ("nested", "eagle_config", "layer_ids", 0)],
    # sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py,
    # _resolve_eagle_aux_hidden_state (0.5.23): eagle_config only; captured layer = id + 1 (layer outputs).
    "sglang": [("nested", "eagle_config", "eagle_aux_hidden_state_layer_ids", 0)],
}
# The capture each runner uses when no rule matched: vLLM's SupportsEagle3 default (models/interfaces.py)
# and SGLang's model default: (2, N // 2, N - 3).
DEFAULT_AUX = {"vllm-v1": lambda n: (2, n // 2, n - 3), "vllm-v2": lambda n: (2, n // 2, n - 3),
               "sglang": lambda n: (2, n // 2, n - 3)}
# What a captured id means in our convention (the input of decoder layer i = HF hidden_states[i]).
ID_TO_OURS = {"vllm-v1": 0, "vllm-v2": 0, "sglang": +1}
# V2 is the default runner: config/vllm.py VllmConfig.use_v2_model_runner (0.32.0, 0.33.0): the env var
# VLLM_USE_V2_MODEL_RUNNER if set, else V2 when Triton is present and no feature is unsupported; in 0.32.0
# the speculative methods V2 does not support include "medusa" (Medusa runs on V1).
V2_DEFAULT = {"env": "VLLM_USE_V2_MODEL_RUNNER", "needs": "triton", "v1_only_methods_0.32.0": ("medusa",)}

# Width of the drafter's fc input (number of aux states): vLLM llama_eagle3.py and SGLang llama_eagle3.py
# read top-level num_aux_hidden_states, else len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3;
# speculators' Eagle3DraftModel: len(eagle_aux_hidden_state_layer_ids) (top level), else 3.
FC_WIDTH_RULES = {
    "vllm": [("top", "num_aux_hidden_states", 0), ("nested", "eagle_config", "eagle_aux_hidden_state_layer_ids", 0)],
    "sglang": [("top", "num_aux_hidden_states", 0), ("nested", "eagle_config", "eagle_aux_hidden_state_layer_ids", 0)],
    "speculators": [("top", "eagle_aux_hidden_state_layer_ids", 0)],
}


def _lookup(cfg: dict, rule):
    if rule[0] == "top":
        return cfg.get(rule[1])
    inner = cfg.get(rule[1])
    return inner.get(rule[2]) if isinstance(inner, dict) else None


def resolve_aux_ids(runner: str, cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The ids ``runner`` captures for a draft ``config.json`` (our restatement of AUX_ID_RULES)."""
    for rule in AUX_ID_RULES[runner]:
        ids = _lookup(cfg, rule)
        if ids:
            return tuple(int(i) + rule[-1] for i in ids)
    return tuple(DEFAULT_AUX[runner](num_layers))


def captured_layers(runner: str, cfg: dict, num_layers: int) -> list[int]:
    """Our layer ids of the states the target hands the drafter, in concatenation order (ascending, unique)."""
    return sorted({i + ID_TO_OURS[runner] for i in resolve_aux_ids(runner, cfg, num_layers)})


def fc_aux_count(engine: str, cfg: dict) -> int:
    for rule in FC_WIDTH_RULES[engine]:
        value = _lookup(cfg, rule)
        if value:
            return value if isinstance(value, int) else len(value)
    return 3


# --------------------------------------------------------------------------- speculators format
# vllm/transformers_utils/config.py (0.33.0): a draft config.json without model_type but with
# speculators_config is parsed as the "speculators" model type; configs/speculators/base.py
# validate_speculators_config requires these paths; algos.py update_eagle3 builds the drafter's config
# from transformer_layer_config plus the fields below (norm_before_residual defaults to TRUE there).
VLLM_SPECULATORS_REQUIRED = [("speculators_config", "proposal_methods", 0, "speculative_tokens"),
                             ("speculators_config", "verifier", "name_or_path"),
                             ("speculators_model_type",), ("transformer_layer_config",)]
VLLM_SPECULATORS_EAGLE3_COPIED = {"draft_vocab_size": None, "target_hidden_size": None,
                                  "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False,
                                  "norm_output": False, "eagle_aux_hidden_state_layer_ids": None}
VLLM_SPECULATORS_EAGLE3_ARCH = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}


def vllm_speculators_to_draft_config(config: dict) -> dict:
    """The drafter config vLLM builds from a speculators-format config.json (restated from algos.py)."""
    out = dict(config["transformer_layer_config"])
    for key, default in VLLM_SPECULATORS_EAGLE3_COPIED.items():
        if key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if config.get(key):
                out[key] = config[key]
        else:
            out[key] = config.get(key, default)
    out["architectures"] = [VLLM_SPECULATORS_EAGLE3_ARCH[out.get("model_type", "llama")]]
    return out


# speculators 0.9.0 (speculators/models/eagle3/config.py, config.py, model.py, models/eagle3/core.py):
SPECULATORS_EAGLE3 = {
    "config_fields": {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"]},
    "schema_fields": ("transformer_layer_config", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                      "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output",
                      "embed_requires_grad", "speculators_config"),
    "speculators_config_fields": ("algorithm", "proposal_methods", "default_proposal_method", "verifier"),
    "verifier_fields": ("name_or_path", "architectures"),
    # Eagle3DraftModel.state_dict() minus _keys_to_ignore_on_save (verifier_lm_head, verifier_norm);
    # t2d/d2t exist only when draft_vocab_size != the verifier vocabulary (DraftVocabMixin._init_vocab).
    "weights": ("embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight",
                "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                "layers.0.hidden_norm.weight"),
    "vocab_maps_iff_smaller": ("d2t", "t2d"),
    # DraftVocabMixin fills embed_tokens with NaN as a "not loaded" marker and copies the verifier's only
    # when it is still NaN; transformers' from_pretrained re-initialises a missing embed_tokens, so the
    # marker is lost: the embedding must be in the file.
    "embedding_must_be_in_file": True,
    # Eagle3DraftModel.load_verifier_weights reads AutoConfig(verifier.name_or_path) unconditionally, and
    # from_pretrained checks the aux ids against the verifier (distinct, 0 <= id <= num_layers).
    "verifier_required": True,
    "fc_in": "len(eagle_aux_hidden_state_layer_ids) * hidden_size",
}

# --------------------------------------------------------------------------- Medusa
# vLLM 0.32.0 vllm/model_executor/models/medusa.py + transformers_utils/configs/medusa.py +
# model_loader/default_loader.py; 0.33.0 ships neither file (no Medusa method).
VLLM_MEDUSA = {
    "0.32.0": {"loads": True, "missing_key": "error",  # load_weights returns the loaded set; track_weights_loading
               # raises "Following weights were not initialized from checkpoint"
               "unknown_key": "dropped", "bias_read_iff": "medusa_fc_bias (default false)",
               "config_renames": "keys containing 'num' and 'heads' -> num_heads, 'num' and 'layers' -> "
                                 "num_hidden_layers",
               "prefix_stripped": "medusa_heads.",
               # _remap_old_checkpoint_key: '{h}.{l}.linear.{p}' -> 'blocks.{h}.layers.{l}.{p}',
               # '{h}.{n}.{p}' -> 'lm_heads.{h}.{p}'
               "old_format": True},
    "0.33.0": {"loads": False},
}
SGLANG_MEDUSA = {"0.5.23": {"loads": False}}
# TGI server/text_generation_server/models/__init__.py and layers/speculative.py, layers/medusa.py:
# a model folder whose config.json has medusa_num_heads is a Medusa speculator; the base model is
# config["base_model_name_or_path"]; weights from medusa_lm_head.safetensors; a config with an
# "architectures" entry other than MLPSpeculatorPreTrainedModel yields NO speculator (silently);
# heads: '{i}.{j}.linear.weight|bias' (j < medusa_num_layers), '{i}.{medusa_num_layers}.weight'.
TGI_MEDUSA = {"weights_file": "medusa_lm_head.safetensors", "detect_key": "medusa_num_heads",
              "base_key": "base_model_name_or_path", "layers_key": "medusa_num_layers",
              "architectures_must_be_absent": True}


def vllm032_medusa_config(config: dict) -> dict:
    """vLLM 0.32's MedusaConfig.from_pretrained key renaming (restated)."""
    out = dict(config)
    for k in list(out):
        if "num" in k:
            if "heads" in k:
                out["num_heads"] = out.pop(k)
            elif "layers" in k:
                out["num_hidden_layers"] = out.pop(k)
    out.setdefault("truncated_vocab_size", out.get("vocab_size"))
    return out


def vllm032_medusa_name(name: str) -> str:
    """vLLM 0.32's Medusa weight-name rules (prefix strip, then the old FasterDecoding names)."""
    name = name.replace("medusa_heads.", "")
    parts = name.split(".")
    if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
        rest = parts[2:]
        if "linear" in rest:
            return f"blocks.{parts[0]}.layers.{parts[1]}." + ".".join(rest[rest.index("linear") + 1:])
        return f"lm_heads.{parts[0]}." + ".".join(rest)
    return name


def vllm032_medusa_params(config: dict) -> dict[str, tuple]:
    """Parameters of vLLM 0.32's Medusa module for a (renamed) config; all must be loaded."""
    h, p = config["hidden_size"], {}
    for k in range(config["num_heads"]):
        for j in range(config["num_hidden_layers"]):
            p[f"blocks.{k}.layers.{j}.weight"] = (h, h)
            if config.get("medusa_fc_bias", False):
                p[f"blocks.{k}.layers.{j}.bias"] = (h,)
        p[f"lm_heads.{k}.weight"] = (config["vocab_size"], h)
    return p


# --------------------------------------------------------------------------- DFlash
# Wheels: vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl, sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl.
CHECKED_DFLASH = {"vllm": ("0.34.0",), "sglang": ("0.5.23",)}

VLLM_DFLASH = {
    "version": "0.34.0",
    # model_executor/models/registry.py: "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM");
    # transformers_utils/configs/eagle.py EAGLEConfig(method="dflash") keeps an architecture starting with "DFlash".
    "architecture": "DFlashDraftModel", "method": "dflash",
    # 0.34.0 has only the V2 model runner: v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
    # get_eagle3_aux_layers_from_config, the same rules as AUX_ID_RULES["vllm-v2"] (dflash_config.target_layer_ids
    # + 1 when there is no top-level eagle_aux_hidden_state_layer_ids).
    "aux_runner": "vllm-v2",
    # model_executor/models/qwen3_dflash.py _get_dflash_fc_input_size: (target_hidden_size or hidden_size) x
    # len(aux ids) (num_hidden_layers when there are none).
    "fc_in": "(target_hidden_size or hidden_size) * len(aux ids)",
    # qwen3_dflash.DFlashQwen3DecoderLayer: set_default_rope_theta(config, 1e6) (transformers_utils/config.py) when
    # rope_parameters has no rope_theta; is_neox_style defaults to True (HF rotate_half = neox).
    "rope_theta_default": 1_000_000, "neox_default": True,
    # DFlashQwen3ForCausalLM.load_weights: "t2d" skipped; "d2t" -> draft_id_to_target_id; every name but lm_head gets
    # "model."; embed_tokens / draft_id_to_target_id / mask_embedding are dropped from the expected set when absent
    # (the target's are shared); AutoWeightsLoader (models/utils.py) raises "There is no module or parameter named"
    # for an unknown key (".bias" suffixes ignored); missing keys are not tracked (load_weights returns None).
    "unknown_key": "error", "missing_key": "not tracked",
    # DFlashQwen3Model.hf_to_vllm_mapper: q/k/v -> qkv_proj, gate/up -> gate_up_proj, midlayer -> layers.0.
    "stacked": {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
                ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"},
    "own_lm_head_iff_in_file": True,  # ParallelLMHead(draft_vocab_size); the target's is shared when absent
}

# transformers_utils/configs/speculators/algos.py update_dflash (0.34.0), after base.py validate_speculators_config
# (VLLM_SPECULATORS_REQUIRED) and extract_transformers_pre_trained_config (starts from transformer_layer_config).
VLLM_SPECULATORS_DFLASH = {"required": ("aux_hidden_state_layer_ids", "mask_token_id"),
                           "sliding_window_non_causal_default": True,
                           # what speculators itself writes when not told otherwise (the report's pitfall; vLLM
                           # PR 56692 open): every layer causal in vLLM
                           "speculators_writes_by_default": {"sliding_window_non_causal": False}}


def vllm_speculators_dflash_to_draft_config(config: dict) -> dict:
    """The drafter config vLLM 0.34 builds from a speculators DFlash config.json (restated from update_dflash)."""
    out = dict(config["transformer_layer_config"])
    out["architectures"] = ["DFlashDraftModel"]
    out["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config["target_hidden_size"]
    aux = config["aux_hidden_state_layer_ids"]
    out["eagle_aux_hidden_state_layer_ids"] = aux
    out["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                            "sample_from_anchor": config.get("sample_from_anchor", False),
                            "causal": not config.get("sliding_window_non_causal",
                                                     VLLM_SPECULATORS_DFLASH["sliding_window_non_causal_default"])}
    return out


def vllm_dflash_layer_causal(config: dict, layer: int) -> bool:
    """qwen3_dflash._dflash_layer_causal (0.34.0): is_causal, else dflash_config.causal (all layers), else
    layer_types[i] == "sliding_attention" (no layer_types: non-causal)."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    types = config.get("layer_types")
    return bool(types) and types[layer] == "sliding_attention"


def vllm_dflash_fc_in(config: dict, num_layers: int) -> int:
    ids = resolve_aux_ids("vllm-v2", config, num_layers)
    return (config.get("target_hidden_size") or config["hidden_size"]) * len(ids)


SGLANG_DFLASH = {
    "version": "0.5.23",
    # srt/models/dflash.py EntryClass includes DFlashDraftModel; --speculative-algorithm DFLASH.
    "architecture": "DFlashDraftModel", "algorithm": "DFLASH",
    # srt/speculative/dflash_utils.py parse_dflash_draft_config: dflash_config.target_layer_ids, else top-level
    # target_layer_ids, else build_target_layer_ids(N, draft layers); resolve_target_layer_ids refuses id < 0 or
    # id >= N (N = the runtime target's layers, spec_aux_hidden_state.py); block_size and num_target_layers from
    # dflash_config, else top level (block_size default 16); mask_token_id from dflash_config, else top level.
    "reads_speculators_format": False,  # no speculators_model_type handling anywhere in the wheel
    # srt/models/llama.py / qwen3.py set_dflash_layers_to_capture: layers_to_capture = [id + 1]; a layer in that
    # list hands over its *input* (capture before layer i runs): id v -> our v + 1.
    "capture_shift": +1,
    # srt/models/dflash.py DFlashDraftModel: fc = Linear(len(target_layer_ids) * hidden_size, hidden_size), shape
    # checked in load_weights; load_weights: q/k/v -> qkv_proj, gate/up -> gate_up_proj, "model." prefix optional,
    # an unknown name is silently ignored ("Ignore unexpected weights"), missing ones are not tracked.
    "unknown_key": "ignored", "missing_key": "not tracked",
    # _get_dflash_layer_attention_params: layer_types None or "full_attention" -> ENCODER_ONLY (bidirectional)
    # unless config.is_causal; "sliding_attention" -> causal unless is_causal is false.
}


def sglang_dflash_target_layer_ids(config: dict, num_layers: int) -> list[int]:
    """The capture ids SGLang resolves (restated from parse_dflash_draft_config / resolve_target_layer_ids)."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None:
        raise AssertionError("no target_layer_ids: SGLang would pick build_target_layer_ids' default layers")
    for v in ids:
        if not 0 <= int(v) < num_layers:
            raise ValueError(f"DFLASH target_layer_ids contains an out-of-range layer id {v} (N={num_layers})")
    return [int(v) for v in ids]


def sglang_dflash_captured_layers(config: dict, num_layers: int) -> list[int]:
    """Our layer ids of the states SGLang hands the DFlash drafter, in concatenation order (layer order)."""
    return sorted({v + SGLANG_DFLASH["capture_shift"] for v in sglang_dflash_target_layer_ids(config, num_layers)})


def vllm_dflash_captured_layers(config: dict, num_layers: int) -> list[int]:
    return captured_layers(VLLM_DFLASH["aux_runner"], config, num_layers)


def sglang_dflash_layer_causal(config: dict, layer: int) -> bool:
    types = config.get("layer_types")
    kind = "full_attention" if types is None else types[layer]
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    return kind == "sliding_attention"
