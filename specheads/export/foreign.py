"""EAGLE-3 heads trained by other toolkits, read into the specheads EAGLE-3 head (``specheads evaluate head_dir=...``).

    fmt = foreign_format("hub-download/EAGLE3-x")           # "speculators", "eagle3", or None (not a foreign head)
    head = read_foreign_head(folder, target_info)            # config + state dict, checked against the target's sizes
    model = load_foreign_head(folder, target)                # Eagle3Model, unattached (``model.attach(target)``)

Two formats (facts read from speculators 0.9.0's wheel, SpecForge's and vLLM's loaders; docs/evaluate.md):

* ``speculators``: vLLM speculators' own folder (``Eagle3DraftModel.save_pretrained``): ``config.json`` with
  ``speculators_model_type: eagle3``, the draft layer's config in ``transformer_layer_config`` (a Qwen3 config when
  it names no ``model_type``, as speculators reads it), ``draft_vocab_size`` (speculators' default 32000),
  ``target_hidden_size``, ``norm_before_residual``/``norm_before_fc``/``fc_norm``/``norm_output`` and the aux ids
  ``eagle_aux_hidden_state_layer_ids`` (layer inputs, vLLM's and our convention; none written: the verifier's
  (2, N//2, N-3), which vLLM captures too); tensors ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``/``t2d``
  (absent for a full vocabulary), ``fc_norm.{i}``, maybe the target's ``embed_tokens.weight`` and the
  training-only ``verifier_lm_head.weight``/``verifier_norm.weight``. It is our ``speculators`` export layout.
* ``eagle3``: the original EAGLE-3 format that SpecForge saves and vLLM (``LlamaForCausalLMEagle3`` /
  ``Eagle3LlamaForCausalLM``) and SGLang load: a Llama ``config.json`` plus ``draft_vocab_size`` (vLLM's default: the
  vocabulary), ``target_hidden_size``, ``fc_norm``, ``norm_before_residual``; tensors ``midlayer.*`` (or
  ``layers.0.*``, which vLLM reads alike), ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, maybe the target's
  ``embed_tokens.weight``, in ``model.safetensors`` or ``pytorch_model.bin``. It is our ``vllm`` export layout. The
  aux ids: a top-level ``eagle_aux_hidden_state_layer_ids`` is vLLM's (layer inputs, read first by vLLM); else
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` is what SpecForge writes and SGLang reads, decoder-layer
  *outputs* (ours = id + 1); none written: (2, N//2, N-3), the layers vLLM, SGLang and SpecForge all default to.

The tensors go back through the inverse of those export layouts (``reload.head_state``), so the names and the
``fc`` column order have one home (``layouts.py``). Variants the specheads head does not compute are refused by
name rather than evaluated wrongly: a Qwen3 draft layer (q/k norms), more than one layer, ``norm_before_residual``,
``norm_before_fc``, ``norm_output``, a trained token embedding that differs from the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.errors import UserError
from specheads.export.checks import ExportError, check_draft_vocab, check_tensors
from specheads.export.layouts import FLOAT, Layout, LayoutError, TargetInfo, TensorSpec, build_layout
from specheads.export.reload import build_head, head_state

FORMATS = {
    "speculators": "vLLM speculators' format (config.json with speculators_model_type: eagle3)",
    "eagle3": "the original EAGLE-3 / SpecForge format (config.json architectures LlamaForCausalLMEagle3 or "
              "Eagle3LlamaForCausalLM)",
}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYOUT = {"speculators": "speculators", "eagle3": "vllm"}  # the export layout each format is
_UNSUPPORTED_FLAGS = {  # config flags that change what the draft layer computes, which the specheads head does not do
    "norm_before_residual": "the residual stream starts from the normed hidden state",
    "norm_before_fc": "one RMSNorm over the concatenated aux states before fc",
    "norm_output": "the post-norm state is fed back between draft steps",
}


class ForeignHeadError(UserError, ValueError):
    """A head folder of another toolkit that cannot be evaluated here; the message names the folder and why."""


@dataclass
class ForeignHead:
    """A foreign EAGLE-3 head as the specheads head: ``config`` (our ``Eagle3Config`` fields) and ``state``
    (its state dict); ``embedding`` is the token embedding the folder carries (the target's, normally), or None."""

    folder: Path
    format: str
    config: dict
    state: dict[str, torch.Tensor]
    embedding: torch.Tensor | None = None


def _config(folder: Path) -> dict | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def foreign_format(folder: str | Path) -> str | None:
    """``"speculators"`` or ``"eagle3"`` when ``folder``'s config.json is one of those formats, else None (a specheads
    head folder, a folder without a readable config.json, anything else)."""
    cfg = _config(Path(folder))
    if cfg is None or str(cfg.get("model_type", "")).startswith("specheads_"):
        return None
    if "speculators_model_type" in cfg:
        return "speculators"
    if set(cfg.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        return "eagle3"
    return None


def check_format(folder: str | Path) -> str:
    """The foreign format of ``folder`` (``foreign_format``), refusing a folder of none and a speculators head of
    another algorithm than EAGLE-3."""
    folder = Path(folder)
    fmt = foreign_format(folder)
    if fmt is None:
        raise ForeignHeadError(f"{folder} holds no head of a known format: looked for a specheads head (config.json "
                               f"model_type specheads_*), {formats_looked_for()}")
    kind = _config(folder)["speculators_model_type"] if fmt == "speculators" else "eagle3"
    if kind != "eagle3":
        raise _fail(folder, fmt, f"speculators_model_type {kind!r}: only speculators' eagle3 heads are read")
    return fmt


def formats_looked_for() -> str:
    """The foreign formats, as an error message lists what was looked for."""
    return "; ".join(FORMATS.values())


def _fail(folder: Path, fmt: str, what: str) -> ForeignHeadError:
    return ForeignHeadError(f"{folder} ({FORMATS[fmt]}): {what}")


# --------------------------------------------------------------------------- config.json -> our head config


def _llama_layer(folder: Path, fmt: str, layer: dict):
    """The draft layer's Llama config (defaults filled as transformers fills them), refusing other layer kinds."""
    from transformers import LlamaConfig

    kind = layer.get("model_type", "qwen3" if fmt == "speculators" else "llama")
    if kind != "llama":
        raise _fail(folder, fmt, f"the draft layer is a {kind} layer (speculators reads a layer config without "
                                 "model_type as qwen3, with q/k norms); the specheads EAGLE-3 head has a Llama layer")
    return LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})


def _aux_layers(fmt: str, cfg: dict) -> list[int] | None:
    """The fused target layers as written (our convention: inputs of decoder layers), or None when none are."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:  # vLLM's key (speculators' too): layer inputs, like ours
        return [int(i) for i in top]
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if fmt == "eagle3" else None
    if nested is not None:  # SpecForge / SGLang: id v is decoder layer v's output = the input of layer v + 1
        return [int(i) + 1 for i in nested]
    return None


def _default_aux_layers(folder: Path, fmt: str, target: TargetInfo) -> list[int]:
    """What vLLM (and speculators, SGLang, SpecForge) capture for a head that names no layers: (2, N//2, N-3)."""
    from specheads.targets import default_eagle3_layers

    N = target.num_layers
    if N is None or N < 7:  # below 7 layers (2, N//2, N-3) is not three distinct layers
        raise _fail(folder, fmt, f"names no aux layers (eagle_aux_hidden_state_layer_ids) and the engines' default "
                                 f"(2, N//2, N-3) needs a target of at least 7 layers (target {target.name}: {N})")
    return list(default_eagle3_layers(N))


def foreign_head_config(folder: str | Path, target: TargetInfo) -> tuple[str, dict, Layout]:
    """(format, our EAGLE-3 head config, the export layout the folder is in) of a foreign head folder, checked
    against ``target``'s sizes (hidden size, vocabulary, layer count) before any tensor is read."""
    from specheads.models.layers import draft_fields_from_target

    folder = Path(folder)
    fmt = check_format(folder)
    cfg = _config(folder)
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if cfg.get(flag):
            raise _fail(folder, fmt, f"{flag}: true ({what}); the specheads EAGLE-3 head does not compute that")
    layer = _llama_layer(folder, fmt, (cfg.get("transformer_layer_config") or {}) if fmt == "speculators" else cfg)
    aux = _aux_layers(fmt, cfg)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    head_cfg = {"model_type": "specheads_eagle3", **draft_fields_from_target(layer),
                "num_hidden_layers": layer.num_hidden_layers, "tie_word_embeddings": False,
                "attention_bias": bool(getattr(layer, "attention_bias", False)),
                "mlp_bias": bool(getattr(layer, "mlp_bias", False)),
                # speculators' default draft vocabulary is 32000; vLLM's for the original format is the vocabulary
                "draft_vocab_size": int(cfg.get("draft_vocab_size") or (32000 if fmt == "speculators"
                                                                        else layer.vocab_size)),
                "target_hidden_size": cfg.get("target_hidden_size") or layer.hidden_size,
                "aux_layers": aux if aux is not None else _default_aux_layers(folder, fmt, target),
                "fc_norm": bool(cfg.get("fc_norm")), "target": verifier or target.name}
    if head_cfg["draft_vocab_size"] > head_cfg["vocab_size"]:
        raise _fail(folder, fmt, f"draft_vocab_size {head_cfg['draft_vocab_size']} exceeds the vocabulary "
                                 f"{head_cfg['vocab_size']}")
    try:
        layout = build_layout("eagle3", _LAYOUT[fmt], head_cfg, target)
    except LayoutError as e:
        raise _fail(folder, fmt, str(e)) from None
    return fmt, head_cfg, layout


# --------------------------------------------------------------------------- weights -> our state dict


def _weights(folder: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files, else of its ``pytorch_model*.bin`` files."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise _fail(folder, fmt, "no weights (looked for *.safetensors, then pytorch_model*.bin)")
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
    """The layout's tensors plus those a foreign folder may add or leave out (``names``: what it holds)."""
    H, V, DV = head_cfg["hidden_size"], head_cfg["vocab_size"], head_cfg["draft_vocab_size"]
    expected = {n: s for n, s in layout.tensors.items() if not (layout.rules[n].from_target and n not in names)}
    optional = {"embed_tokens.weight": TensorSpec((V, H)),  # the target's embedding, which the head borrows
                "verifier_lm_head.weight": TensorSpec((DV, H)), "verifier_norm.weight": TensorSpec((H,)),  # training
                "d2t": TensorSpec((DV,), "int64"), "t2d": TensorSpec((V,), "bool")}  # maps of a full vocabulary
    if layout.engine != "speculators":
        del optional["verifier_lm_head.weight"], optional["verifier_norm.weight"]
    expected.update({n: s for n, s in optional.items() if n in names and n not in expected})
    if "t2d" not in names:
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


def read_foreign_head(folder: str | Path, target: TargetInfo) -> ForeignHead:
    """A foreign EAGLE-3 head folder as the specheads head, every check done: the format, the config against
    ``target``, each tensor by name (missing, unknown), shape and dtype kind, and the draft vocabulary maps."""
    fmt, head_cfg, layout = foreign_head_config(folder, target)
    folder = Path(folder)
    tensors = _weights(folder, fmt)
    if fmt == "eagle3":  # vLLM reads layers.0.* as midlayer.* (and SpecForge writes midlayer.*)
        tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
                   for n, t in tensors.items()}
    _integer_maps(tensors)
    header = {n: (tuple(t.shape), _CODES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()}
    try:
        check_tensors(header, _expected(layout, head_cfg, set(tensors)), f"{folder} ({FORMATS[fmt]})")
    except ExportError as e:
        raise ForeignHeadError(str(e)) from None
    if "t2d" not in tensors:
        tensors["t2d"] = _t2d(tensors.get("d2t"), head_cfg["vocab_size"], f"{folder} ({FORMATS[fmt]})")
    state = head_state(layout, head_cfg, tensors, str(folder))
    for name in ("d2t", "t2d"):  # the maps of a full vocabulary, when the folder carries them
        if name in tensors and name not in layout.rules:
            state[name] = tensors[name]
    try:
        check_draft_vocab(state["d2t"], state["t2d"], f"{folder} ({FORMATS[fmt]})")
    except ExportError as e:
        raise ForeignHeadError(str(e)) from None
    return ForeignHead(folder, fmt, head_cfg, state, tensors.get("embed_tokens.weight"))


def _check_embedding(head: ForeignHead, target) -> None:
    """The embedding a folder carries must be the target's (the head drafts on the target's): equal within the
    rounding of a bfloat16 copy or a quantized target (1 % of the table's largest entry)."""
    mine, theirs = head.embedding, target.raw_embedding.weight.detach()
    scale = float(theirs.abs().max()) or 1.0
    for start in range(0, mine.shape[0], 8192):  # in row blocks: a 128k x 4096 table is not copied whole in float32
        a, b = mine[start:start + 8192].float(), theirs[start:start + 8192].float().cpu()
        if float((a - b).abs().max()) > 0.01 * scale:
            raise _fail(head.folder, head.format, f"embed_tokens.weight differs from target {target.name}'s token "
                                                  "embedding (a head trained for another target, or with its own "
                                                  "embedding, which the specheads head does not carry)")


def load_foreign_head(folder: str | Path, target):
    """The ``Eagle3Model`` a foreign folder holds, for ``target`` (a loaded ``Target``), unattached and in the
    folder's float dtype (as ``from_pretrained`` keeps a specheads head's)."""
    info = TargetInfo(str(target.name), target.hidden_size, target.vocab_size, target.num_layers)
    head = read_foreign_head(folder, info)
    if head.embedding is not None:
        _check_embedding(head, target)
    return build_head(head.config, head.state)
