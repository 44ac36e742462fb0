"""The target as an export names and reads it: where it came from, the hub id a user serves it by, its sizes
and the few tensors a layout copies from it.

    info, origin = target_info("smollm2", head_cfg)   # TargetInfo (sizes), TargetOrigin (kind, hub id, hint)
    origin.warning()                                  # why the card cannot name the target, or None
    embed = target_tensor("smollm2", origin, "embed_tokens.weight")  # read from its files, model not loaded

An export never names a path of the exporting machine: ``portable_name`` keeps a path's last part.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from specheads.export.checks import WEIGHTS, ExportError
from specheads.export.hub import HUB_ID
from specheads.export.layouts import TargetInfo
from specheads.export.serve import TARGET_VAR

log = logging.getLogger(__name__)

# Hub models that the embedded targets were converted from (the card names them as the likely original).
KNOWN_ORIGINS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3_270m": "google/gemma-3-270m"}


def portable_name(value: str) -> str:
    """An absolute path of this machine -> its last part (what a card or an uploaded file may name); else as is."""
    return Path(value).name if os.path.isabs(value) else value


@dataclass
class TargetOrigin:
    """Where the target came from, and the id a user would serve it by (None: only a local file)."""

    spec: str  # what was given (a name, folder, GGUF file or hub id)
    path: str | None  # the folder the weights were read from here (None: not read)
    hub_id: str | None  # the hub id to serve (given, the spec itself, or a hub cache folder's)
    kind: str  # "hub", "hub-cache", "given", "embedded", "gguf", "local", "unknown"
    hint: str | None = None  # a hub id the local file was probably converted from (not verified)

    def warning(self) -> str | None:
        """Why the card cannot name the target for you, or None when it can."""
        if self.hub_id:
            return None
        spec = portable_name(self.spec)
        what = {"embedded": f"the embedded default `{spec}` (a GGUF file dequantized to a local folder)",
                "gguf": f"the GGUF file `{spec}` (dequantized to a local folder)",
                "local": f"the local folder `{spec}`"}.get(self.kind, f"`{spec}`")
        text = (f"The head was trained against {what}, which has no hub id: replace `{TARGET_VAR}` in the "
                "commands below with the hub id or path of exactly that model (same weights and tokenizer)")
        if self.hint and self.kind not in ("embedded", "gguf"):  # named by a local folder's config
            text += (f"; its config names `{self.hint}` as its origin (`_name_or_path`), the hub model the card's "
                     "`base_model` and the speculators verifier name: if it holds exactly that model, serve it by "
                     "that id")
        elif self.hint:
            text += (f"; it was converted from a quantized copy of `{self.hint}`, the closest hub model, so acceptance "
                     "serving that one can differ from the figures measured here")
        return text + ". Re-export with `target_id=<hub id>` to name it."


def target_origin(target, path: str | None, target_id: str | None = None) -> TargetOrigin:
    """The target's origin: an explicit ``target_id``, a hub id given as the target, a hub cache folder
    (``.../models--org--name/snapshots/<rev>``), else a local file with no id (a placeholder in the card)."""
    from specheads.targets import EMBEDDED_GGUF

    spec = str(target) if isinstance(target, (str, Path)) else (getattr(target, "name", None) or "target")
    if target_id is not None:
        if not HUB_ID.fullmatch(target_id):
            raise ExportError(f"target_id must be a hub id 'owner/name', got {target_id!r}")
        return TargetOrigin(spec, path, target_id, "given")
    if spec in EMBEDDED_GGUF:
        return TargetOrigin(spec, path, None, "embedded", KNOWN_ORIGINS.get(spec))
    if spec.endswith(".gguf"):
        return TargetOrigin(spec, path, None, "gguf", gguf_hub_id(spec))
    if HUB_ID.fullmatch(spec) and not Path(spec).expanduser().exists():
        return TargetOrigin(spec, path, spec, "hub")
    for candidate in (spec, path or ""):
        m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", str(Path(candidate).expanduser().resolve())
                      if candidate else "")
        if m:
            return TargetOrigin(spec, path, f"{m.group(1)}/{m.group(2)}", "hub-cache")
    if path or Path(spec).exists():
        return TargetOrigin(spec, path, None, "local", folder_hub_id(path or spec))
    return TargetOrigin(spec, path, None, "unknown")


def folder_hub_id(folder: str | Path) -> str | None:
    """The hub id a local model folder's ``config.json`` names as its origin (``_name_or_path``, which
    ``save_pretrained`` writes from the id the model was loaded by), when it is one; else None."""
    try:
        name = json.loads((Path(folder).expanduser() / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(name, str) and HUB_ID.fullmatch(name) and not Path(name).expanduser().exists():
        return name
    return None


_GGUF_REPO_KEYS = ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.source.url")


def gguf_hub_id(path: str | Path) -> str | None:
    """The hub model a GGUF file was converted from: the embedded target's whose file it is (by name), else the
    repository its metadata names (llama.cpp's ``general.source.*`` / ``general.base_model.0.repo_url``), else None."""
    from specheads.targets import EMBEDDED_GGUF

    for name, (_, _, filename, _) in EMBEDDED_GGUF.items():
        if Path(path).name == filename and name in KNOWN_ORIGINS:
            return KNOWN_ORIGINS[name]
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
        values = [str(fields[k].contents()) for k in _GGUF_REPO_KEYS if k in fields]
    except Exception:  # noqa: BLE001 - no gguf package, or an unreadable file: nothing named
        return None
    for value in values:
        m = re.search(r"([A-Za-z0-9][\w.-]*/[\w.-]+?)/?$", value)  # a repo id, or a URL ending with one
        if m and HUB_ID.fullmatch(m.group(1)) and "." not in m.group(1).split("/")[0]:
            return m.group(1)
    return None


def target_info(target, head_cfg: dict, target_id: str | None = None) -> tuple[TargetInfo, TargetOrigin]:
    """(sizes of the target, its origin: where its files are here and the id a user serves it by).

    target: None (use what the head recorded, sizes unchecked), a name/path/hub id
    (``specheads.targets.resolve_target_path``), a ``Target``, or a transformers config;
    target_id: the hub id to name in the card and configs (for a target given as a local file).
    """
    recorded = head_cfg.get("target") or head_cfg.get("target_name")
    if target is None:
        if not recorded:
            raise ExportError("the head records no target name; pass target=<name, folder or hub id>")
        log.warning("no target given: sizes are taken from the head itself and the card names %r", recorded)
        origin = target_origin(recorded, None, target_id)
        if origin.kind == "local":
            origin.kind = "unknown"
        return TargetInfo(recorded, head_cfg["hidden_size"], head_cfg["vocab_size"], hub_id=origin.hub_id,
                          origin_id=origin.hint), origin
    if isinstance(target, str):
        from transformers import AutoConfig

        from specheads.targets import resolve_target_path

        path = resolve_target_path(target)
        try:
            config = AutoConfig.from_pretrained(path)
        except OSError as e:
            raise ExportError(f"cannot read the config of target {target!r} ({path}): {e}") from e
        local = str(Path(path).resolve()) if Path(path).is_dir() else path
        origin = target_origin(target, local, target_id)
        info = _info_from_config(target, config, head_cfg, origin.hub_id)
        return replace(info, path=local if Path(local).is_dir() else None, origin_id=origin.hint), origin
    config = getattr(target, "config", target)
    name = getattr(target, "name", None) or getattr(config, "_name_or_path", None) or recorded or "target"
    origin = target_origin(name, None, target_id)
    info = _info_from_config(name, config, head_cfg, origin.hub_id)
    if hasattr(target, "vocab_size") and hasattr(target, "lm_head"):
        info = replace(info, vocab_size=target.vocab_size)
    model = getattr(target, "model", None)
    if not info.architectures and model is not None:  # a model made in memory: its class is its architecture
        info = replace(info, architectures=(type(model).__name__,))
    return replace(info, origin_id=origin.hint), origin


def target_tensor(target, origin: TargetOrigin, suffix: str) -> torch.Tensor:
    """One tensor of the target (e.g. ``embed_tokens.weight``), read from its files without loading the model."""
    module = getattr(target, "model", None)
    if isinstance(module, torch.nn.Module):
        for name, t in module.state_dict().items():
            if name == suffix or name.endswith("." + suffix):
                return t.detach().cpu()
    if origin.path is None or not Path(origin.path).is_dir():
        raise ExportError(f"this layout needs the target's {suffix}, but no target folder was given "
                          "(pass target=<name, folder or hub id>)")
    folder = Path(origin.path)
    index = folder / f"{WEIGHTS}.index.json"
    files = ([folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
             if index.is_file() else sorted(folder.glob("*.safetensors")))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name == suffix or name.endswith("." + suffix):
                    return sf.get_tensor(name)
    if suffix == "lm_head.weight" and _ties_embeddings(folder):
        return target_tensor(target, origin, "embed_tokens.weight")  # a tied LM head is saved as the embedding
    raise ExportError(f"target folder {folder} holds no tensor named *{suffix}")


def _ties_embeddings(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    text = cfg.get("text_config") or cfg
    return bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))


def _info_from_config(name: str, config, head_cfg: dict, hub_id: str | None = None) -> TargetInfo:
    from specheads.targets import config_hash

    recorded = head_cfg.get("target_config_hash")
    if recorded and recorded != config_hash(config):
        log.warning("the heads record target config hash %s but %s hashes to %s: check that this is the target "
                    "they were trained on", recorded, name, config_hash(config))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetInfo(name, text.hidden_size, text.vocab_size, text.num_hidden_layers, hub_id,
                      tuple(getattr(config, "architectures", None) or ()),
                      vision_language=getattr(config, "vision_config", None) is not None)
