"""The MTP tensors inside a target's own safetensors files: find, read, and stitch tuned ones back.

Layouts are what vLLM 0.32 loads for ``speculative_config={"method": "mtp"}`` (its ``hf_config_override``
rewrites the target's config, and the draft is read from the target's own files):

| architectures[0] | MTP layer count | tensor names |
|---|---|---|
| ``MiMoForCausalLM`` | ``num_nextn_predict_layers`` | ``model.mtp_layers.{i}.*`` |

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
    prefix: str  # the tensor-name prefix of MTP layer {i}
    # the names under the prefix one layer must have (the checkpoint's, vLLM's loader reads exactly these)
    names: tuple[str, ...]


_QWEN2_LAYER = tuple(f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")) + (
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight")
LAYOUTS = {
    "MiMoForCausalLM": MTPLayout("mimo", "num_nextn_predict_layers", "model.mtp_layers.{i}.",
                                 ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                  "final_layernorm.weight") + _QWEN2_LAYER),
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


def mtp_names(layout: MTPLayout, layer: int = 0) -> list[str]:
    prefix = layout.prefix.format(i=layer)
    return [prefix + n for n in layout.names]


def check_mtp_tensors(folder: Path, layer: int = 0) -> tuple[MTPLayout, dict[str, str]]:
    """The folder's layout and weight map, once its config declares MTP layer ``layer`` and its files hold every
    tensor of it."""
    layout = mtp_layout(json.loads((folder / "config.json").read_text()))
    wmap = weight_map(folder)
    missing = [n for n in mtp_names(layout, layer) if n not in wmap]
    if missing:
        raise MTPCheckpointError(f"{folder}: the config declares MTP layers but the checkpoint lacks {len(missing)} "
                                 f"of MTP layer {layer}'s tensors (first: {missing[0]}); vLLM would serve a random "
                                 "layer from it")
    return layout, wmap


def read_mtp_tensors(folder: Path, layer: int = 0) -> dict[str, torch.Tensor]:
    """MTP layer ``layer``'s tensors, named as in the checkpoint (``model.mtp_layers.0.input_proj.weight``, ...)."""
    layout, wmap = check_mtp_tensors(folder, layer)
    out = {}
    for name in mtp_names(layout, layer):
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
