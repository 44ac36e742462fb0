"""Export a tuned MTP layer: a stitched target (its own files, the MTP tensors replaced) that vLLM serves with
``--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`` (no draft repo: the draft model defaults
to the target's path, and vLLM's ``hf_config_override`` turns the target's config into the MTP drafter's).

    path = export_mtp(Path("runs/x/train/mtp/head"), Path("runs/x/export"), target="XiaomiMiMo/MiMo-7B-RL")

The folder is written into a temporary sibling, checked (every MTP tensor present and equal to the head's, in the
target's dtype) and renamed into place. ``specheads_export.json`` records the method, the target and the serve
settings; ``README.md`` says how to serve it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.export.checks import ExportError
from specheads.models.mtp_checkpoint import check_mtp_tensors, read_mtp_tensors, stitch, target_folder

EXPORT_FORMAT = "specheads.export/1"
MODEL_TYPE = "specheads_mtp"


def speculative_config(tokens: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": int(tokens)}


def serve_line(model: str, tokens: int) -> str:
    return f"vllm serve {model} --speculative-config '{json.dumps(speculative_config(tokens))}'"


def stitched_tensors(head: Path, layout, layer: int, expected: list[str]) -> dict[str, torch.Tensor]:
    """The head's tensors under the checkpoint's names (``layout.checkpoint_key``); exactly ``expected``."""
    files = sorted(head.glob("*.safetensors"))
    if not files:
        raise ExportError(f"head {head}: no safetensors weights")
    tensors = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if not k.startswith("layers.0."):
                raise ExportError(f"head {head}: unknown tensor {k} (an MTP head holds layers.0.* only)")
            tensors[layout.checkpoint_key(k, layer)] = v
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ExportError(f"head {head}: its tensors do not match the target's MTP layer (missing {missing[:3]}, "
                          f"unknown {extra[:3]})")
    return tensors


def export_mtp(head: Path, out_dir: str | Path, target: str | None = None, spec_tokens: int | None = None,
               overwrite: bool = False) -> Path:
    """Stitch the MTP head folder ``head`` into a copy of its target at ``out_dir``; returns ``out_dir``.

    target: the target's name/folder/hub id (None: the one the head was trained on, from its config);
    spec_tokens: ``num_speculative_tokens`` of the serve line (None: the steps the head was trained for)."""
    cfg = json.loads((head / "config.json").read_text())
    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass overwrite=true to replace it")
    source = target_folder(target or cfg["target"])
    layer = int(cfg.get("mtp_layer", 0))
    layout, _, names = check_mtp_tensors(source, layer)  # refuses a target without the layer before anything is written
    tensors = stitched_tensors(head, layout, layer, names)
    tokens = int(spec_tokens or cfg.get("num_steps", 1))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        stitch(source, tmp, tensors)
        check_stitched(tmp, tensors, layer)
        _write_records(tmp, cfg, target or cfg["target"], layout.family, layer, tokens)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_stitched(folder: Path, tensors: dict[str, torch.Tensor], layer: int = 0) -> None:
    """Every MTP tensor of ``folder`` present and equal to ``tensors`` (in the checkpoint's dtype)."""
    stored = read_mtp_tensors(folder, layer)
    for name, t in tensors.items():
        if not torch.equal(stored[name], t.to(stored[name].dtype)):
            raise ExportError(f"{folder}: {name} was not written as tuned")


def _write_records(folder: Path, cfg: dict, target: str, family: str, layer: int, tokens: int) -> None:
    record = {"format": EXPORT_FORMAT, "method": "mtp", "engine": "vllm", "target": str(target), "family": family,
              "mtp_layer": layer, "trained_steps": cfg.get("num_steps"),
              "serve": {"engine": "vllm", "speculative_config": speculative_config(tokens)}}
    (folder / "specheads_export.json").write_text(json.dumps(record, indent=2) + "\n")
    readme = folder / "README.md"
    base = readme.read_text() + "\n\n" if readme.is_file() else ""
    readme.write_text(base + (
        "## MTP layer fine-tuned with specheads\n\n"
        f"This folder is the target `{Path(str(target)).name}` with its MTP layer {layer} ({family} layout) replaced "
        f"by one fine-tuned for {cfg.get('num_steps')} recursive steps (FastMTP). Every other file is the target's.\n\n"
        "Serve it with vLLM (the draft model defaults to this folder):\n\n"
        f"```\n{serve_line('<this folder>', tokens)}\n```\n"))
