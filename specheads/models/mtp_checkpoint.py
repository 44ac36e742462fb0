"""The MTP tensors inside a target's own safetensors files: find, read, and stitch tuned ones back.

Layouts are what vLLM 0.32 loads for ``speculative_config={"method": "mtp"}`` (its ``hf_config_override``
rewrites the target's config, and the draft is read from the target's own files):

| architectures[0] | MTP layer count | tensor names of MTP layer ``i`` |
|---|---|---|
| ``MiMoForCausalLM`` | ``num_nextn_predict_layers`` | ``model.mtp_layers.{i}.*`` |
| ``Qwen3NextForCausalLM`` | ``num_nextn_predict_layers`` | ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight`` (shared) and ``mtp.layers.{i}.*`` |
| ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` | ``mtp_num_hidden_layers`` | as Qwen3-Next |

A Qwen3-Next layer's MLP is a sparse MoE (``mlp.gate``, ``mlp.experts.{e}.*``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``) or dense (``mlp.{gate,up,down}_proj``) by vLLM's rule (``models.mtp.mtp_layer_is_moe``).
A config that declares no MTP layer, or files that lack any tensor of the declared layer, raise
``MTPCheckpointError`` (a ``UserError``) before any work: vLLM would build a random layer from them and serve it
without a word (0 % acceptance).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class MTPCheckpointError(UserError):
    """A target (or stitched checkpoint) without the MTP layer its config declares, or of a family not supported."""


@dataclass(frozen=True)
class MTPLayout:
    family: str
    count_key: str  # the config field that says how many MTP layers the checkpoint carries
    prefix: str  # the tensor-name prefix of the MTP block ({i}: MTP layer i's own prefix)
    # the names under the prefix one layer must have (the checkpoint's, vLLM's loader reads exactly these); {i} is
    # the layer's index, "{mlp}" stands for the names of its MLP (``mlp_names``)
    names: tuple[str, ...]

    def tensor_names(self, config, layer: int = 0) -> list[str]:
        """The checkpoint names of MTP layer ``layer`` of a target with ``config`` (dict or config object)."""
        prefix, out = self.prefix.format(i=layer), []
        for n in self.names:
            if "{mlp}" in n:
                out += [prefix + n.format(i=layer, mlp=m) for m in mlp_names(config, layer)]
            else:
                out.append(prefix + n.format(i=layer))
        return out

    def module_key(self, name: str, layer: int = 0) -> str:
        """Checkpoint name -> the MTP head's parameter name (``layers.0.<name under the prefix>``, MTP layer
        ``layer``'s own decoder layer renamed ``layers.0``)."""
        rel = name[len(self.prefix.format(i=layer)):]
        if "{i}" not in self.prefix:
            rel = rel.replace(f"layers.{layer}.", "layers.0.", 1) if rel.startswith(f"layers.{layer}.") else rel
        return "layers.0." + rel

    def checkpoint_key(self, key: str, layer: int = 0) -> str:
        """The MTP head's parameter name -> the checkpoint's (``module_key`` reversed)."""
        rel = key[len("layers.0."):]
        if "{i}" not in self.prefix and rel.startswith("layers.0."):
            rel = f"layers.{layer}." + rel[len("layers.0."):]
        return self.prefix.format(i=layer) + rel


def _config_get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def mlp_names(config, layer: int = 0) -> list[str]:
    """The MLP tensor names (under ``mlp.``) of a Qwen3-Next / Qwen3.5 MTP layer: its MoE's or a dense SwiGLU's."""
    from specheads.models.mtp import mtp_layer_is_moe

    swiglu = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    if not mtp_layer_is_moe(config, layer):
        return swiglu
    experts = int(_config_get(config, "num_experts"))
    return (["gate.weight", "shared_expert_gate.weight"] + [f"shared_expert.{w}" for w in swiglu]
            + [f"experts.{e}.{w}" for e in range(experts) for w in swiglu])


_QWEN2_LAYER = tuple(f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")) + (
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight")
_QWEN3_NEXT_BLOCK = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight") + tuple(
    "layers.{i}." + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                                "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.{mlp}"))
LAYOUTS = {
    "MiMoForCausalLM": MTPLayout("mimo", "num_nextn_predict_layers", "model.mtp_layers.{i}.",
                                 ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                  "final_layernorm.weight") + _QWEN2_LAYER),
    "Qwen3NextForCausalLM": MTPLayout("qwen3_next", "num_nextn_predict_layers", "mtp.", _QWEN3_NEXT_BLOCK),
    "Qwen3_5ForCausalLM": MTPLayout("qwen3_next", "mtp_num_hidden_layers", "mtp.", _QWEN3_NEXT_BLOCK),
    "Qwen3_5MoeForCausalLM": MTPLayout("qwen3_next", "mtp_num_hidden_layers", "mtp.", _QWEN3_NEXT_BLOCK),
}


def mtp_layout(config) -> MTPLayout:
    """The MTP layout of a target config (a ``PretrainedConfig`` or config.json dict); refuses a target
    without MTP layers or of a family not supported."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    arch = (get("architectures") or [None])[0]
    if arch not in LAYOUTS:
        raise MTPCheckpointError(f"method=mtp: target architecture {arch} has no MTP layout here (supported: "
                                 f"{', '.join(LAYOUTS)}); train another head for it")
    layout = LAYOUTS[arch]
    if not int(get(layout.count_key) or 0):
        raise MTPCheckpointError(f"method=mtp: the target's config declares no MTP layer ({layout.count_key} is "
                                 f"{get(layout.count_key)}): there is nothing to fine-tune")
    return layout


def target_folder(name_or_path: str) -> Path:
    """The folder holding a target's config.json and safetensors files (a local folder, else the hub snapshot)."""
    from specheads.targets.files import resolve_target_path

    path = Path(resolve_target_path(name_or_path))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                             "*.jinja", "*.py"]))


def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> file name of the folder's safetensors checkpoint (sharded or single)."""
    if (folder / INDEX).is_file():
        return dict(json.loads((folder / INDEX).read_text())["weight_map"])
    if (folder / SINGLE).is_file():
        with safe_open(str(folder / SINGLE), "pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise MTPCheckpointError(f"{folder}: no {SINGLE} nor {INDEX}; method=mtp reads the MTP layer from the "
                             "target's safetensors files")


def check_mtp_tensors(folder: Path, layer: int = 0) -> tuple[MTPLayout, dict[str, str], list[str]]:
    """The folder's layout, weight map and MTP layer ``layer``'s tensor names, once its config declares that layer
    and its files hold every tensor of it."""
    config = json.loads((folder / "config.json").read_text())
    layout = mtp_layout(config)
    declared = int(config.get(layout.count_key) or 0)
    if layer >= declared:
        raise MTPCheckpointError(f"{folder}: method.mtp_layer={layer}, but the config declares {declared} MTP "
                                 f"layer(s) ({layout.count_key})")
    wmap = weight_map(folder)
    names = layout.tensor_names(config, layer)
    missing = [n for n in names if n not in wmap]
    if missing:
        raise MTPCheckpointError(f"{folder}: the config declares MTP layers but the checkpoint lacks {len(missing)} "
                                 f"of MTP layer {layer}'s tensors (first: {missing[0]}); vLLM would serve a random "
                                 "layer from it")
    return layout, wmap, names


def read_mtp_tensors(folder: Path, layer: int = 0) -> dict[str, torch.Tensor]:
    """MTP layer ``layer``'s tensors, named as in the checkpoint (``model.mtp_layers.0.input_proj.weight``, ...)."""
    _, wmap, names = check_mtp_tensors(folder, layer)
    out = {}
    for name in names:
        with safe_open(str(folder / wmap[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def stitch(source: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the checkpoint folder ``source`` into ``out`` (a new folder) with ``tensors`` replaced, each cast to
    the dtype of the tensor it replaces; a name the checkpoint lacks or a shape that differs is refused."""
    wmap = weight_map(source)
    unknown = [n for n in tensors if n not in wmap]
    if unknown:
        raise MTPCheckpointError(f"{source}: no tensor {unknown[0]} to replace")
    by_file: dict[str, list[str]] = {}
    for name in tensors:
        by_file.setdefault(wmap[name], []).append(name)
    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and item.name not in by_file:
            shutil.copy2(item, out / item.name)
    for file, names in by_file.items():
        with safe_open(str(source / file), "pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            shard = {k: f.get_tensor(k) for k in f.keys()}
        for n in names:
            old, new = shard[n], tensors[n]
            if tuple(old.shape) != tuple(new.shape):
                raise MTPCheckpointError(f"{n}: tuned shape {tuple(new.shape)} != the target's {tuple(old.shape)}")
            shard[n] = new.detach().to(old.dtype).contiguous()
        save_file(shard, str(out / file), metadata=metadata)
