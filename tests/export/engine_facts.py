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
