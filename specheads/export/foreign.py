"""Heads trained by other toolkits, read into the specheads head of their family (``specheads evaluate head_dir=...``).

    fmt = foreign_format("hub-download/EAGLE3-x")           # a key of FORMATS, or None (not a foreign head)
    head = read_foreign_head(folder, target_info)            # config + state dict, checked against the target's sizes
    model = load_foreign_head(folder, target)                # the specheads model, unattached

Each format is one of our export layouts (``layouts.py``) read backwards (``reload.head_state``), so the tensor names,
``fc`` column order and Medusa renames have one home. Facts read from speculators 0.9.0's and vLLM 0.32.0's wheels,
SpecForge's, z-lab's and FasterDecoding's code (docs/evaluate.md):

* ``speculators``: vLLM speculators' own folder (``config.json`` with ``speculators_model_type``), EAGLE-3 or DFlash.
  EAGLE-3 (``Eagle3DraftModel``): the draft layer's config in ``transformer_layer_config`` (a Qwen3 config when it
  names no ``model_type``, as speculators reads it), ``draft_vocab_size`` (default 32000), ``target_hidden_size``,
  ``norm_before_residual``/``norm_before_fc``/``fc_norm``/``norm_output`` (all four computed by the EAGLE-3 head;
  absent = off, speculators' default: vLLM's conversion would read an absent ``norm_before_residual`` as true, but
  speculators always writes it), the aux ids
  ``eagle_aux_hidden_state_layer_ids`` (layer inputs, vLLM's and our convention; none: the verifier's (2, N//2, N-3));
  tensors ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``/``t2d`` (absent for a full vocabulary),
  ``fc_norm.{i}``, ``input_norm`` (``norm_before_fc``), maybe the target's ``embed_tokens.weight`` and the
  training-only ``verifier_*``. DFlash
  (``DFlashDraftModel``): ``transformer_layer_config`` (Qwen3 by default), ``block_size`` (default 8),
  ``aux_hidden_state_layer_ids`` (layer inputs; none: (2, N//2, N-3), speculators' default), ``mask_token_id``,
  ``draft_vocab_size``, ``sliding_window_non_causal``, ``sample_from_anchor``; tensors ``fc``, ``hidden_norm``,
  ``norm``, ``layers.{i}.*`` (q/k norms), ``lm_head``/``embed_tokens`` only as copies of the target's. P-EAGLE
  (``PEagleDraftModel``, vLLM: eagle3 with parallel drafting): EAGLE-3's config plus ``mask_token_id`` (vLLM requires
  it); its ``num_depths`` is only written as ``speculators_config.proposal_methods[0].speculative_tokens`` (default
  8); ``transformer_layer_config.num_hidden_layers`` layers, ``mask_hidden`` saved as (1, 1, W) (vLLM views it as
  (1, W)); speculators' CLI trains Qwen3, sliding-window layers unless told otherwise. EAGLE-3 and P-EAGLE: a Qwen3
  layer (``self_attn.q_norm``/``k_norm``) is the head's ``qk_norm``; ``sliding_window`` on the ``sliding_attention``
  entries of ``layer_types`` its window (transformers' Qwen3Config keeps it only with ``use_sliding_window``). DSpark
  (``DSparkDraftModel``): DFlash's config plus ``markov_rank`` (default 256), ``markov_head_type`` (``vanilla``),
  ``enable_confidence_head``/``confidence_head_with_markov`` (true) and ``sample_from_anchor`` (default *true* here,
  unlike DFlash: refused); tensors ``markov_head.markov_w1|w2``, ``confidence_head.proj``. Our ``speculators``
  export layouts.
* ``eagle3``: the original EAGLE-3 format that SpecForge saves and vLLM (``LlamaForCausalLMEagle3`` /
  ``Eagle3LlamaForCausalLM``) and SGLang load: a Llama ``config.json`` plus ``draft_vocab_size`` (vLLM's default: the
  vocabulary), ``target_hidden_size``, ``fc_norm``, ``norm_before_residual``, ``norm_before_fc`` (top level or
  ``eagle_config``), ``norm_output`` (absent = off, as vLLM reads them); tensors ``midlayer.*`` (or ``layers.0.*``),
  ``fc``, ``input_norm``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, maybe the target's ``embed_tokens.weight``, in
  ``model.safetensors`` or ``pytorch_model.bin``. Our ``vllm`` export layout. The aux ids: a top-level
  ``eagle_aux_hidden_state_layer_ids`` is vLLM's (layer inputs); else
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` is what SpecForge writes and SGLang reads, decoder-layer *outputs*
  (ours = id + 1); none written: (2, N//2, N-3).
* ``modelopt``: NVIDIA ModelOpt 0.47's EAGLE-3 export (``export_speculative_decoding``): the original format's
  ``LlamaForCausalLMEagle3`` config whose ``eagle_config`` carries ModelOpt's settings (``use_last_layernorm``,
  ``use_mtp_layernorm``, ``parallel_draft_step``, ...; ``_MODELOPT_SETTINGS``), its aux ids decoder-layer *outputs*
  (ours = id + 1); tensors ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, and ``d2t`` (a reduced vocabulary) in
  frequency order, never ``t2d``. Read as ModelOpt's HF trainer computes it: its first layer normalises the fed hidden
  state with ``input_layernorm`` and then ``hidden_norm`` (the head config's ``hidden_after_input_norm``; vLLM and
  SGLang apply ``hidden_norm`` alone); the draft rows are put in target-id order (the same logits); ``torch_dtype`` (always
  bfloat16) is ignored; the YaRN ``rope_scaling`` its export adds to a head trained without scaling (a dict without
  ``rope_theta``, ModelOpt's ``eagle_export_rope_scaling``) is left out, as the head was trained; a scaling trained
  with (written with its ``rope_theta``) is kept. Other settings: refused.
* ``dflash``: z-lab's DFlash format (``architectures: [DFlashDraftModel]``), which vLLM and SGLang load: a Qwen3
  ``config.json`` (z-lab's class builds Qwen3 layers whatever ``model_type`` says) with ``block_size`` (z-lab's default
  16), ``num_target_layers``, ``target_hidden_size``, ``dflash_config.mask_token_id`` and
  ``dflash_config.target_layer_ids`` (decoder-layer outputs: ours = id + 1; either key may sit at the top level, as
  z-lab's loader reads them; a top-level ``eagle_aux_hidden_state_layer_ids`` is vLLM's, layer inputs, read first);
  tensors as speculators' DFlash, no embedding or LM head. Our ``vllm`` DFlash layout. NVIDIA ModelOpt 0.47's DFlash
  export (``export_speculative_decoding``) is this format (``dflash_config.causal`` false, its bidirectional blocks),
  with ``num_target_layers`` 0 after an offline run (its base model loaded without layers): read as not written;
  its Domino export (``dflash_config.projector_type: domino``) is a Domino head (``export/domino.py``, read by its
  family's reader); its DSpark export (``projector_type: dspark``, ``shift_label`` true: block slot k drafts the
  token at anchor + k + 1, from the anchor slot on) is refused.
* ``medusa``: the original Medusa format (FasterDecoding, TGI): ``config.json`` with ``medusa_num_heads`` (default 4),
  ``medusa_num_layers`` (default 1), ``base_model_name_or_path``, the sizes left to the target; tensors
  ``{k}.{j}.linear.weight|bias`` and ``{k}.{layers}.weight`` in ``medusa_lm_head.safetensors`` or ``.pt``. Our
  ``medusa`` export layout.
* ``eagle1``: EAGLE-1 drafts as vLLM (``EagleLlamaForCausalLM``: ``fc`` without bias) and SGLang
  (``LlamaForCausalLMEagle``: ``fc`` with a bias, which must be zero here) load them: a Llama config, tensors ``fc``,
  ``layers.{i}.*`` (layer 0 without ``input_layernorm``), maybe the target's ``embed_tokens.weight``. Our ``vllm`` and
  ``sglang`` EAGLE-1 layouts. The original EAGLE release's folders (a plain ``LlamaForCausalLM`` config, ``fc`` with a
  trained bias) are neither: nothing in their config.json says EAGLE, and the specheads head has no ``fc`` bias.

Variants the specheads heads do not compute are refused by name rather than evaluated wrongly (each listed where its
format's config is read), and so is a carried embedding or LM head that differs from the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.errors import UserError
from specheads.export.checks import ExportError, check_draft_vocab, check_tensors
from specheads.export.layouts import (ENGINES, Layout, LayoutError, TargetInfo, TensorSpec, build_layout,
                                      engines_for, method_of)
from specheads.export.reload import build_head, head_state
from specheads.families import FAMILIES, family, load

FORMATS = {
    "speculators": "vLLM speculators' format (config.json with speculators_model_type eagle3, dflash, peagle or "
                   "dspark)",
    "eagle3": "the original EAGLE-3 / SpecForge format (config.json architectures LlamaForCausalLMEagle3, "
              "Eagle3LlamaForCausalLM or Eagle3Qwen3ForCausalLM)",
    "modelopt": "NVIDIA ModelOpt's EAGLE-3 export (config.json architectures LlamaForCausalLMEagle3 with ModelOpt's "
                "eagle_config settings such as use_last_layernorm and parallel_draft_step)",
    "dflash": "z-lab's DFlash format (config.json architectures DFlashDraftModel)",
    "medusa": "the original Medusa format (FasterDecoding: config.json with medusa_num_heads, medusa_lm_head weights)",
    "eagle1": "vLLM's or SGLang's EAGLE-1 format (config.json architectures EagleLlamaForCausalLM or "
              "LlamaForCausalLMEagle)",
}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM")
_ARCHITECTURES = {**dict.fromkeys(EAGLE3_ARCHITECTURES, "eagle3"), "DFlashDraftModel": "dflash",
                  "EagleLlamaForCausalLM": "eagle1", "LlamaForCausalLMEagle": "eagle1"}  # architecture -> format
SPECULATORS_METHODS = tuple(f.speculators_type for f in FAMILIES if f.speculators_type)  # speculators_model_type read
# dflash_config.projector_type -> the family a z-lab DFlash folder then holds (ModelOpt's exports of DFlash's variants)
_PROJECTOR_FAMILIES = {f.projector_type: f.name for f in FAMILIES if f.projector_type}
PEAGLE_DEPTHS = 8  # speculators' num_depths default, which it writes as the greedy proposal's speculative_tokens
_DSPARK_DEFAULTS = {  # speculators' DSparkSpeculatorConfig defaults (sample_from_anchor true: refused)
    "sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True}
_MODELOPT_SETTINGS = {  # ModelOpt's eagle_config settings: the value the specheads head computes, what another means
    "use_aux_hidden_state": (True, "no fc over the aux states"),
    "use_input_layernorm_in_first_layer": (True, "no input norm in the first layer"),
    "use_last_layernorm": (True, "no final norm before lm_head"),
    "use_mtp_layernorm": (False, "MTP-style norms"),
    "parallel_draft_step": (1, "several tokens drafted per step"),
}
# what marks a ModelOpt folder (SGLang reads use_aux_hidden_state too; the last two matter past one layer or step)
_MODELOPT_MARKERS = {*_MODELOPT_SETTINGS, "next_layer_regular", "parallel_draft_heads_num_layers"} - {
    "use_aux_hidden_state"}
_BORROWED = {"embed_tokens.weight": "token embedding", "lm_head.weight": "LM head"}  # target tensors a folder may copy
# the formats (keys of FORMATS) that nest EAGLE-3's settings under eagle_config, its aux layer ids counted as decoder
# outputs, and name the draft decoder layer layers.0 (vLLM reads it as midlayer): SpecForge's and ModelOpt's EAGLE-3
_EAGLE_CONFIG_FORMATS = frozenset({"eagle3", "modelopt"})


class ForeignHeadError(UserError, ValueError):
    """A head folder of another toolkit that cannot be evaluated here; the message names the folder and why."""


@dataclass
class ForeignHead:
    """A foreign head as the specheads head: ``config`` (our head config's fields, its ``model_type`` naming the
    family) and ``state`` (its state dict); ``borrowed``: the target's tensors the folder carries a copy of
    (``embed_tokens.weight``, ``lm_head.weight``), checked against the target's once it is loaded."""

    folder: Path
    format: str
    config: dict
    state: dict[str, torch.Tensor]
    borrowed: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return method_of(self.config)


def _config(folder: Path) -> dict | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def foreign_format(folder: str | Path) -> str | None:
    """The key of ``FORMATS`` that ``folder``'s config.json is in, else None (a specheads head folder, a folder
    without a readable config.json, anything else)."""
    cfg = _config(Path(folder))
    if cfg is None or str(cfg.get("model_type", "")).startswith("specheads_"):
        return None
    if "speculators_model_type" in cfg:
        return "speculators"
    if "medusa_num_heads" in cfg:
        return "medusa"
    fmt = next((fmt for arch, fmt in _ARCHITECTURES.items() if arch in (cfg.get("architectures") or ())), None)
    # an eagle_config carrying ModelOpt's settings: ModelOpt's export (its architecture names SpecForge's too)
    return "modelopt" if fmt in _EAGLE_CONFIG_FORMATS and _MODELOPT_MARKERS & set(cfg.get("eagle_config") or ()) \
        else fmt


def check_format(folder: str | Path) -> tuple[str, str]:
    """(format, head family) of ``folder`` (``foreign_format``), refusing a folder of none and a speculators head of
    an algorithm other than ``SPECULATORS_METHODS``."""
    folder = Path(folder)
    fmt = foreign_format(folder)
    if fmt is None:
        raise ForeignHeadError(f"{folder} holds no head of a known format: looked for a specheads head (config.json "
                               f"model_type specheads_*), {formats_looked_for()}")
    if fmt != "speculators":
        return fmt, "eagle3" if fmt == "modelopt" else _PROJECTOR_FAMILIES.get(
            _dflash_value(_config(folder), "projector_type"), fmt)
    kind = _config(folder)["speculators_model_type"]
    if kind not in SPECULATORS_METHODS:
        raise _fail(folder, fmt, f"speculators_model_type {kind!r}: only speculators' "
                                 f"{', '.join(SPECULATORS_METHODS[:-1])} and {SPECULATORS_METHODS[-1]} heads are read")
    return fmt, kind


def formats_looked_for() -> str:
    """The foreign formats, as an error message lists what was looked for."""
    return "; ".join(FORMATS.values())


def _fail(folder: Path, fmt: str, what: str) -> ForeignHeadError:
    return ForeignHeadError(f"{folder} ({FORMATS[fmt]}): {what}")


# --------------------------------------------------------------------------- config.json -> our head config

_EAGLE3_FLAGS = {  # config flags that change what the draft layer computes (the specheads EAGLE-3 head's NORM_FLAGS)
    "norm_before_residual": "the residual stream starts from the normed hidden state",
    "norm_before_fc": "one RMSNorm over the concatenated aux states before fc",
    "norm_output": "the post-norm state is fed back between draft steps",
}
_DFLASH_SCALES = {  # z-lab's config values that change the draft's arithmetic, with the value that leaves it alone
    "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
}
_NOT_CONFIG = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
               "dflash_config", "eagle_config", "speculators_config")


def _layer_config(folder: Path, fmt: str, layer: dict, kinds: tuple[str, ...], default: str):
    """The draft layer's transformers config (defaults filled as transformers fills them: what the engines parse),
    of one of ``kinds`` (``default`` when the config names no ``model_type``), refusing other layer kinds."""
    from transformers import LlamaConfig, Qwen3Config

    kind = layer.get("model_type") or default
    if kind not in kinds:
        raise _fail(folder, fmt, f"the draft layer is a {kind} layer (speculators reads a layer config without "
                                 f"model_type as qwen3, with q/k norms); the specheads head has a "
                                 f"{' or '.join(kinds)} layer")
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind]
    try:
        return cls(**{k: v for k, v in layer.items() if k not in _NOT_CONFIG})
    except Exception as e:  # transformers' validation (layer_types against num_hidden_layers, ...): its own error types
        if not isinstance(e, (ValueError, TypeError)) and "Validation" not in type(e).__name__:
            raise
        raise _fail(folder, fmt, f"the draft layer's config is not a valid {kind} config: "
                                 f"{' '.join(str(e).split())}") from None


def _draft_fields(layer) -> dict:
    """Our head config's layer fields from the draft layer's config."""
    from specheads.models.layers import draft_fields_from_target

    return {**draft_fields_from_target(layer), "num_hidden_layers": layer.num_hidden_layers,
            "tie_word_embeddings": False, "attention_bias": bool(getattr(layer, "attention_bias", False)),
            "mlp_bias": bool(getattr(layer, "mlp_bias", False))}


def _aux_layers(fmt: str, cfg: dict) -> list[int] | None:
    """The fused target layers of an EAGLE-3 folder as written (our convention: inputs of decoder layers), or None."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:  # vLLM's key (speculators' too): layer inputs, like ours
        return [int(i) for i in top]
    nested = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
              if fmt in _EAGLE_CONFIG_FORMATS else None)
    if nested:  # SpecForge / SGLang / ModelOpt: id v is decoder layer v's output = the input of layer v + 1
        return [int(i) + 1 for i in nested]
    return None


def _default_aux_layers(folder: Path, fmt: str, target: TargetInfo, key: str) -> list[int]:
    """What the toolkits use for a head that names no layers: (2, N//2, N-3) of the target's N."""
    from specheads.targets import default_eagle3_layers

    N = target.num_layers
    if N is None or N < 7:  # below 7 layers (2, N//2, N-3) is not three distinct layers
        raise _fail(folder, fmt, f"names no aux layers ({key}) and the default (2, N//2, N-3) needs a target of at "
                                 f"least 7 layers (target {target.name}: {N})")
    return list(default_eagle3_layers(N))


def _norm_flags(cfg: dict) -> dict[str, bool]:
    """The EAGLE-3 normalisation flags as the engines read them: top level (vLLM and SGLang also take
    ``eagle_config.norm_before_fc``); absent = off (speculators' and vLLM's default for these folders)."""
    flags = {k: bool(cfg.get(k)) for k in _EAGLE3_FLAGS}
    nested = (cfg.get("eagle_config") or {}).get("norm_before_fc")
    if nested is not None:  # vLLM and SGLang read eagle_config's first
        flags["norm_before_fc"] = bool(nested)
    return flags


def eagle3_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo, title: str = "EAGLE-3") -> dict:
    flags = _norm_flags(cfg)
    for flag, what in _EAGLE3_FLAGS.items():
        if flags[flag] and title != "EAGLE-3":  # the P-EAGLE head (vLLM's update_peagle forwards no norm_output)
            raise _fail(folder, fmt, f"{flag}: true ({what}); the specheads {title} head does not compute that")
    raw = (cfg.get("transformer_layer_config") or {}) if fmt == "speculators" else cfg
    layer = _layer_config(folder, fmt, raw, ("llama", "qwen3"), "qwen3" if fmt == "speculators" else "llama")
    aux = _aux_layers(fmt, cfg)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    head_cfg = {"model_type": "specheads_eagle3", **_draft_fields(layer),
                # speculators' default draft vocabulary is 32000; vLLM's for the original format is the vocabulary
                "draft_vocab_size": int(cfg.get("draft_vocab_size") or (32000 if fmt == "speculators"
                                                                        else layer.vocab_size)),
                "target_hidden_size": cfg.get("target_hidden_size") or layer.hidden_size,
                "aux_layers": aux if aux is not None else _default_aux_layers(
                    folder, fmt, target, "eagle_aux_hidden_state_layer_ids"),
                "fc_norm": bool(cfg.get("fc_norm")), "target": verifier or target.name,
                "qk_norm": (raw.get("model_type") or ("qwen3" if fmt == "speculators" else "llama")) == "qwen3",
                **_window(folder, fmt, layer), **({} if title != "EAGLE-3" else flags)}
    if head_cfg["draft_vocab_size"] > head_cfg["vocab_size"]:
        raise _fail(folder, fmt, f"draft_vocab_size {head_cfg['draft_vocab_size']} exceeds the vocabulary "
                                 f"{head_cfg['vocab_size']}")
    return head_cfg


def _modelopt_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    """EAGLE-3's config of a ModelOpt export, its settings checked (``_MODELOPT_SETTINGS``: another value refused) and
    the RoPE it was trained with: without the YaRN ``rope_scaling`` that ModelOpt's export adds for serving to a head
    trained without scaling (it writes its ``eagle_export_rope_scaling`` as given, no ``rope_theta`` in it; a scaling
    trained with is written as transformers' RoPE parameters, ``rope_theta`` included, and kept)."""
    settings = cfg.get("eagle_config") or {}
    for key, (want, other) in _MODELOPT_SETTINGS.items():
        value = settings.get(key, want)
        if value != want:
            raise _fail(folder, fmt, f"eagle_config.{key} {json.dumps(value)} ({other}); the specheads EAGLE-3 head "
                                     f"computes {json.dumps(want)} only")
    rope = cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default" and "rope_theta" not in rope:
        cfg = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    return {**eagle3_config(folder, fmt, cfg, target), "hidden_after_input_norm": True}


def _window(folder: Path, fmt: str, layer) -> dict:
    """The draft layers' sliding window as speculators and vLLM read it: ``sliding_window`` on the layers whose
    ``layer_types`` entry is ``sliding_attention`` (none when transformers' config leaves ``sliding_window`` None, as
    Qwen3's does without ``use_sliding_window``); other layer types are refused."""
    types = list(getattr(layer, "layer_types", None) or ())
    other = sorted({t for t in types} - {"full_attention", "sliding_attention"})
    if other:
        raise _fail(folder, fmt, f"layer_types {other}: the specheads head's draft layers attend to the whole context "
                                 "or a sliding window")
    window = getattr(layer, "sliding_window", None)
    if window is None or "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": types}


def _dflash_value(cfg: dict, key: str, default=None):
    """A z-lab DFlash setting: ``dflash_config``'s, else the top level's (z-lab's loader reads both)."""
    value = (cfg.get("dflash_config") or {}).get(key)
    return cfg.get(key, default) if value is None else value


def foreign_block_size(cfg: dict) -> int:
    """B of a DFlash (or DSpark) folder of either format, from its config.json (z-lab's default 16, speculators' 8
    when none is written); ``specheads.heads.dflash_block_size`` reads any head folder's."""
    if "speculators_model_type" in cfg:
        return int(cfg.get("block_size") or 8)
    return int(_dflash_value(cfg, "block_size") or 16)


def _dflash_aux_layers(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> list[int]:
    if fmt == "speculators":  # aux_hidden_state_layer_ids: layer inputs (vLLM's convention, ours)
        ids = cfg.get("aux_hidden_state_layer_ids")
        return ([int(i) for i in ids] if ids is not None
                else _default_aux_layers(folder, fmt, target, "aux_hidden_state_layer_ids"))
    if cfg.get("eagle_aux_hidden_state_layer_ids"):  # vLLM reads this first: layer inputs
        return [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    ids = _dflash_value(cfg, "target_layer_ids")
    if not ids:  # z-lab's DFlashDraftModel refuses such a config too
        raise _fail(folder, fmt, "names no dflash_config.target_layer_ids (z-lab's loader requires them)")
    return [int(i) + 1 for i in ids]  # decoder-layer outputs: the input of the next layer


def _dflash_refusals(folder: Path, fmt: str, cfg: dict, layer) -> None:
    """What the specheads DFlash head does not compute: causal or sliding-window layers, another head beside the
    layers or slots shifted by one (ModelOpt's DSpark, Domino), a sampled anchor, rescaled embeddings or logits, a
    reduced draft vocabulary, a separate mask embedding."""
    dcfg = cfg.get("dflash_config") or {}
    causal = [k for k, v in (("is_causal", getattr(layer, "is_causal", None)), ("dflash_config.causal",
                                                                                dcfg.get("causal"))) if v]
    sliding = [i for i, t in enumerate(getattr(layer, "layer_types", None) or ()) if t != "full_attention"]
    if causal or sliding or dcfg.get("use_swa"):
        what = (f"{causal[0]}: true" if causal else f"layer(s) {sliding} are sliding-window" if sliding
                else "dflash_config.use_swa: true")
        raise _fail(folder, fmt, f"{what}; the specheads DFlash head runs every layer as full, bidirectional "
                                 "attention")
    projector = _dflash_value(cfg, "projector_type")
    if projector is not None and projector != family("dflash").projector_type:  # not DFlash's own
        raise _fail(folder, fmt, f"dflash_config.projector_type {projector!r} (a {projector} head beside the DFlash "
                                 "layers, ModelOpt's); the specheads DFlash head has none")
    if _dflash_value(cfg, "shift_label"):
        raise _fail(folder, fmt, "dflash_config.shift_label: true (block slot k drafts the token at anchor + k + 1, "
                                 "the anchor slot too); the specheads DFlash head's slot k drafts anchor + k")
    if _dflash_value(cfg, "sample_from_anchor"):
        raise _fail(folder, fmt, "sample_from_anchor: true (the anchor slot drafts too); the specheads DFlash head "
                                 "drafts slots 1..B-1 after a bonus anchor")
    for key, neutral in _DFLASH_SCALES.items():
        if _dflash_value(cfg, key) not in (None, neutral):
            raise _fail(folder, fmt, f"{key} {_dflash_value(cfg, key)}: the specheads DFlash head does not rescale")
    draft_vocab = cfg.get("draft_vocab_size", 32000 if fmt == "speculators" else None)
    if draft_vocab is not None and int(draft_vocab) != layer.vocab_size:
        raise _fail(folder, fmt, f"draft_vocab_size {draft_vocab} != vocab_size {layer.vocab_size} (a reduced draft "
                                 "vocabulary); the specheads DFlash head drafts over the target's whole vocabulary")
    if (folder / "mask_embedding.pt").exists():
        raise _fail(folder, fmt, "mask_embedding.pt (a trained mask embedding); the specheads DFlash head embeds "
                                 "the masked slots with the target's row mask_token_id")


def dflash_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    spec = fmt == "speculators"
    layer = _layer_config(folder, fmt, (cfg.get("transformer_layer_config") or {}) if spec else cfg,
                          ("qwen3", "llama") if not spec else ("qwen3",), "qwen3")
    _dflash_refusals(folder, fmt, cfg, layer)
    mask = _dflash_value(cfg, "mask_token_id")
    if mask is None:
        raise _fail(folder, fmt, "names no mask_token_id (the engines need it)")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return {"model_type": "specheads_dflash", **_draft_fields(layer), "block_size": foreign_block_size(cfg),
            "aux_layers": _dflash_aux_layers(folder, fmt, cfg, target), "mask_token_id": int(mask),
            "target_hidden_size": cfg.get("target_hidden_size") or layer.hidden_size,
            # 0: ModelOpt's offline export, whose base model was loaded without layers (as if not written)
            "num_target_layers": None if spec else (cfg.get("num_target_layers") or None),
            "target": verifier or target.name}


def foreign_depths(cfg: dict) -> int:
    """K of a speculators P-EAGLE folder, from its config.json: the greedy proposal's ``speculative_tokens``
    (speculators writes its ``num_depths`` there), else speculators' default 8; ``specheads.heads.peagle_depths``
    reads any head folder's."""
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or PEAGLE_DEPTHS)


def peagle_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    """EAGLE-3's config (the same fields, defaults and refusals) plus the mask token and the depths drafted."""
    head_cfg = eagle3_config(folder, fmt, cfg, target, "P-EAGLE")
    if cfg.get("mask_token_id") is None:
        raise _fail(folder, fmt, "names no mask_token_id (vLLM needs it as its parallel-drafting token)")
    return {**head_cfg, "model_type": "specheads_peagle", "mask_token_id": int(cfg["mask_token_id"]),
            "num_depths": foreign_depths(cfg)}


def dspark_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    """DFlash's config (the same fields, defaults and refusals) plus the Markov and confidence heads."""
    value = {k: cfg.get(k, default) for k, default in _DSPARK_DEFAULTS.items()}
    if value["sample_from_anchor"]:
        why = "" if "sample_from_anchor" in cfg else " (absent: speculators' DSpark default)"
        raise _fail(folder, fmt, f"sample_from_anchor: true{why}, the anchor slot drafts too; the specheads DSpark head "
                                 "drafts slots 1..B-1 after a bonus anchor")
    if value["markov_head_type"] != "vanilla":
        raise _fail(folder, fmt, f"markov_head_type {value['markov_head_type']!r}; the specheads DSpark head (like "
                                 "vLLM 0.32's) has the vanilla Markov head only")
    if int(value["markov_rank"]) <= 0:
        raise _fail(folder, fmt, f"markov_rank {value['markov_rank']} (no Markov head); the specheads DSpark head "
                                 "has one")
    head_cfg = dflash_config(folder, fmt, cfg, target)
    return {**head_cfg, "model_type": "specheads_dspark", "markov_rank": int(value["markov_rank"]),
            "markov_head_type": "vanilla", "enable_confidence_head": bool(value["enable_confidence_head"]),
            "confidence_head_with_markov": bool(value["confidence_head_with_markov"])}


def medusa_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    """The sizes the format leaves to the target (FasterDecoding writes none) come from it; written ones are checked."""
    return {"model_type": "medusa", "hidden_size": int(cfg.get("hidden_size") or target.hidden_size),
            "vocab_size": int(cfg.get("vocab_size") or target.vocab_size),
            "num_heads": int(cfg.get("medusa_num_heads", 4)), "num_hidden_layers": int(cfg.get("medusa_num_layers", 1)),
            "medusa_fc_bias": True, "target_name": cfg.get("base_model_name_or_path") or target.name}


def eagle1_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    layer = _layer_config(folder, fmt, cfg, ("llama",), "llama")
    return {"model_type": "specheads_eagle1", **_draft_fields(layer), "target": target.name}




def _engine(fmt: str, cfg: dict) -> str:
    """The export layout (its engine) a folder of ``fmt`` is in."""
    if fmt in ENGINES:  # speculators' format and FasterDecoding's Medusa format are our layouts of those names
        return fmt
    return "sglang" if "LlamaForCausalLMEagle" in (cfg.get("architectures") or ()) else "vllm"


def foreign_head_config(folder: str | Path, target: TargetInfo) -> tuple[str, dict, Layout]:
    """(format, our head config, the export layout the folder is in) of a foreign head folder, checked against
    ``target``'s sizes (hidden size, vocabulary, layer count) before any tensor is read."""
    folder = Path(folder)
    fmt, method = check_format(folder)
    cfg = _config(folder)
    read = _modelopt_config if fmt == "modelopt" else load(family(method).foreign_config)  # the family's reader
    head_cfg = read(folder, fmt, cfg, target)
    try:  # the tensors' layout: ModelOpt's norm order changes no tensor (and is refused by export layouts)
        engine = _engine(fmt, cfg)
        layout = build_layout(method, engine if engine in engines_for(method) else engines_for(method)[0],
                              {k: v for k, v in head_cfg.items() if k != "hidden_after_input_norm"}, target)
    except LayoutError as e:
        raise _fail(folder, fmt, str(e)) from None
    return fmt, head_cfg, layout


# --------------------------------------------------------------------------- weights -> our state dict


def weight_files(folder: str | Path) -> list[Path]:
    """The folder's weight files: its ``*.safetensors``, else its ``pytorch_model*.bin``, else Medusa's
    ``medusa_lm_head.pt`` (empty when it has none)."""
    folder = Path(folder)
    return (sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
            or sorted(folder.glob("medusa_lm_head.pt")))


def _weights(folder: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files (``weight_files``)."""
    files = weight_files(folder)
    if not files:
        raise _fail(folder, fmt, "no weights (looked for *.safetensors, then pytorch_model*.bin, then "
                                 "medusa_lm_head.pt)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu", weights_only=True)
        if not isinstance(part, dict) or not all(isinstance(t, torch.Tensor) for t in part.values()):
            raise _fail(folder, fmt, f"{f.name} is not a state dict of tensors")
        dup = sorted(set(part) & set(out))
        if dup:
            raise _fail(folder, fmt, f"tensor(s) {dup} appear in two weight files ({f.name})")
        out.update(part)
    return out


_CODES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.bool: "BOOL"}


def _expected(layout: Layout, head_cfg: dict, names: set[str]) -> dict[str, TensorSpec]:
    """The layout's tensors plus those a foreign folder may add or leave out (``names``: what it holds): copies of
    the target's tensors, speculators' training-only tensors, EAGLE-3's maps of a full vocabulary."""
    H, V = head_cfg["hidden_size"], head_cfg["vocab_size"]
    expected = {n: s for n, s in layout.tensors.items() if not (layout.rules[n].from_target and n not in names)}
    fam = family(layout.method)
    optional = {"embed_tokens.weight": TensorSpec((V, H))} if fam.token_embedding else {}
    if fam.lm_head_copy:
        optional["lm_head.weight"] = TensorSpec((V, H))  # the target's LM head, which the head borrows
    if layout.engine == "speculators":
        optional["verifier_norm.weight"] = TensorSpec((H,))  # training only
    if fam.draft_vocab:
        DV = head_cfg["draft_vocab_size"]
        optional.update({"d2t": TensorSpec((DV,), "int64"), "t2d": TensorSpec((V,), "bool")})  # a full vocabulary's
        if layout.engine == "speculators":
            optional["verifier_lm_head.weight"] = TensorSpec((DV, H))
    expected.update({n: s for n, s in optional.items() if n in names and n not in expected})
    if fam.draft_vocab and "t2d" not in names:
        expected.pop("t2d", None)  # rebuilt from d2t (``_t2d``)
    return expected


def _t2d(d2t: torch.Tensor | None, vocab_size: int, where: str) -> torch.Tensor:
    """``t2d`` as the engines rebuild it: the target ids ``arange + d2t`` marks, or every id without a ``d2t``."""
    if d2t is None:
        return torch.ones(vocab_size, dtype=torch.bool)
    ids = torch.arange(d2t.numel()) + d2t
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ForeignHeadError(f"{where}: d2t maps draft ids outside the vocabulary (0..{vocab_size - 1})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return t2d


def _integer_maps(tensors: dict[str, torch.Tensor]) -> None:
    """``d2t`` stored in another integer type as int64 and a 0/1 ``t2d`` as bool (a float d2t stays: refused)."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and not d2t.is_floating_point() and d2t.dtype != torch.bool:
        tensors["d2t"] = d2t.long()
    if t2d is not None and not t2d.is_floating_point() and bool(((t2d == 0) | (t2d == 1)).all()):
        tensors["t2d"] = t2d.bool()


def _draft_rows_by_target_id(tensors: dict[str, torch.Tensor]) -> None:
    """A ``d2t`` in another order than the target ids' (ModelOpt's: by frequency) and no ``t2d``: ``d2t`` and
    ``lm_head``'s rows put in target-id order, as the head keeps them (row i drafts target id i + d2t[i] either way)."""
    d2t, head = tensors.get("d2t"), tensors.get("lm_head.weight")
    if (d2t is None or head is None or "t2d" in tensors or d2t.is_floating_point() or d2t.dim() != 1
            or head.shape[0] != d2t.numel()):
        return
    rows = torch.arange(d2t.numel())
    order = torch.argsort(rows + d2t, stable=True)
    if not torch.equal(order, rows):
        tensors["d2t"], tensors["lm_head.weight"] = (rows + d2t)[order] - rows, head[order]


def _eagle3_maps(folder: Path, where: str, head_cfg: dict, layout: Layout, tensors: dict, state: dict) -> None:
    """EAGLE-3's draft-vocabulary maps in ``state``: those of a full vocabulary the folder carries, checked."""
    for name in ("d2t", "t2d"):
        if name in tensors and name not in layout.rules:
            state[name] = tensors[name]
    try:
        check_draft_vocab(state["d2t"], state["t2d"], where)
    except ExportError as e:
        raise ForeignHeadError(str(e)) from None


def read_foreign_head(folder: str | Path, target: TargetInfo) -> ForeignHead:
    """A foreign head folder as the specheads head, every check done: the format, the config against ``target``,
    each tensor by name (missing, unknown), shape and dtype kind, zeros a layout adds, EAGLE-3's draft vocabulary."""
    fmt, head_cfg, layout = foreign_head_config(folder, target)
    folder = Path(folder)
    where = f"{folder} ({FORMATS[fmt]})"
    tensors = _weights(folder, fmt)
    if fmt in _EAGLE_CONFIG_FORMATS:  # vLLM reads layers.0.* as midlayer.* (and SpecForge writes midlayer.*)
        tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
                   for n, t in tensors.items()}
    if family(layout.method).draft_vocab:
        _integer_maps(tensors)
        _draft_rows_by_target_id(tensors)
    mask = tensors.get("mask_hidden")
    if mask is not None and mask.dim() == 3 and mask.shape[:2] == (1, 1):  # speculators' (1, 1, W); vLLM views (1, W)
        tensors["mask_hidden"] = mask[0]
    header = {n: (tuple(t.shape), _CODES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()}
    try:
        check_tensors(header, _expected(layout, head_cfg, set(tensors)), where)
        if family(layout.method).draft_vocab and "t2d" not in tensors:
            tensors["t2d"] = _t2d(tensors.get("d2t"), head_cfg["vocab_size"], where)
        state = head_state(layout, head_cfg, tensors, where)
    except ExportError as e:
        raise ForeignHeadError(str(e)) from None
    if family(layout.method).draft_vocab:
        _eagle3_maps(folder, where, head_cfg, layout, tensors, state)
    borrowed = {n: tensors[n] for n in _BORROWED if n in tensors and (n not in layout.rules
                                                                       or layout.rules[n].from_target)}
    return ForeignHead(folder, fmt, head_cfg, state, borrowed)


def _check_borrowed(head: ForeignHead, target) -> None:
    """The target's tensors a folder carries must be the target's (the head drafts on them): equal within the
    rounding of a bfloat16 copy or a quantized target (1 % of the table's largest entry)."""
    for name, mine in head.borrowed.items():
        module = target.raw_embedding if name == "embed_tokens.weight" else target.lm_head
        theirs = module.weight.detach()
        scale = float(theirs.abs().max()) or 1.0
        for start in range(0, mine.shape[0], 8192):  # in row blocks: a 128k x 4096 table is not copied in float32
            a, b = mine[start:start + 8192].float(), theirs[start:start + 8192].float().cpu()
            if float((a - b).abs().max()) > 0.01 * scale:
                raise _fail(head.folder, head.format, f"{name} differs from target {target.name}'s {_BORROWED[name]} "
                                                      f"(a head trained for another target, or with its own "
                                                      f"{_BORROWED[name]}, which the specheads head does not carry)")


def load_foreign_head(folder: str | Path, target):
    """The specheads model a foreign folder holds (``Eagle3Model``, ``DFlashModel``, ``MedusaHeads``,
    ``Eagle1Model``), for ``target`` (a loaded ``Target``), unattached and in the folder's float dtype (as
    ``from_pretrained`` keeps a specheads head's)."""
    info = TargetInfo(str(target.name), target.hidden_size, target.vocab_size, target.num_layers)
    head = read_foreign_head(folder, info)
    _check_borrowed(head, target)
    return build_head(head.config, head.state)

