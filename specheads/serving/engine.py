"""A real serving engine beside specheads: check an exported folder before the engine starts, and the engine
arguments a served head and model need. Finding vLLM's python and running its offline API in its own process
(``engine_worker.py``, JSON lines) is ``specheads.engine_process``'s, re-exported here.

The engine lives in its own venv (``bash scripts/setup_engine.sh`` makes ``.venv-vllm``) because vLLM pins
its own torch and transformers; specheads never imports vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# the engine's process, re-exported: recipes, scripts and the serving checks start engines from here
from specheads.engine_process import (ENGINE_VENV, SETUP_COMMAND, Engine, EngineNotFoundError,  # noqa: F401
                                      EngineProcess, EngineRefusedError, engine_settings, find_engine, first_line,
                                      rank_gpus, root_cause, tail, worker_cores)
from specheads.errors import InputNotFoundError, UserError
from specheads.export.foreign import check_format, foreign_format, weight_files
from specheads.export.serve import VLLM_METHOD, vllm_speculative_config
from specheads.families import family
from specheads.models.mtp_checkpoint import check_mtp_tensors
from specheads.targets.model import recurrent_layer_types


# ------------------------------------------------------------------ the exported folder

@dataclass
class ExportedHead:
    """An exported folder ``specheads export`` wrote, as the engine will be given it."""

    folder: Path
    method: str           # medusa | eagle1 | eagle3 | peagle | dflash | dspark | mtp (specheads_export.json's "method")
    layout: str           # vllm | sglang | speculators | medusa; a foreign folder: its format (export.foreign)
    target: str | None    # the target the head was exported against (a name, folder or hub id)
    adapted_target: str | None = None  # served as the model: Medusa-2's target/, an MTP export's folder itself
    info: dict = field(default_factory=dict)


def read_export(folder: str | Path) -> ExportedHead:
    """The exported head in ``folder`` (``specheads_export.json`` read, weights present), or a head folder another
    trainer wrote (``_foreign_export``); raises a ``UserError`` naming what is wrong, before any engine starts."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise InputNotFoundError(f"export_dir={folder}: no such folder; give a folder `specheads export` wrote "
                                 "(e.g. runs/quickstart/export/eagle3/vllm)")
    record = path / "specheads_export.json"
    if not record.is_file() and (foreign := _foreign_export(path)) is not None:
        return foreign
    if not record.is_file():
        layouts = sorted(p.name for p in path.iterdir() if (p / "specheads_export.json").is_file())
        hint = (f"it holds the layouts {', '.join(layouts)}: give one of them, e.g. export_dir={path / layouts[0]}"
                if layouts else "give a folder `specheads export` wrote (it holds specheads_export.json)")
        raise UserError(f"export_dir={folder} is not an exported head (no specheads_export.json); {hint}")
    try:
        info = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{record} is not readable JSON ({e}); export the head again") from None
    if not str(info.get("format", "")).startswith("specheads.export/"):
        raise UserError(f"{record} is no specheads export record (format {info.get('format')!r}); export the head again")
    method, layout = str(info.get("method")), str(info.get("engine"))
    if method not in VLLM_METHOD:
        raise UserError(f"export_dir={folder}: method {method!r} is no head vLLM drafts with "
                        f"({', '.join(sorted(set(VLLM_METHOD)))})")
    fam = family(method)
    if layout == "sglang" and not {layout, "vllm"} <= set(fam.one_folder):  # vLLM reads it only if it is vLLM's too
        raise UserError(f"export_dir={folder} is the SGLang layout, which vLLM does not read for {method}; give the "
                        f"vllm/ (or speculators/) folder beside it")
    weights = info.get("weights") or "model.safetensors"
    if not (path / weights).is_file() and not any(path.glob("*.safetensors")):
        raise InputNotFoundError(f"export_dir={folder} holds no weights ({weights}); export the head again")
    adapted = path / "target" if info.get("adapted_target") and (path / "target").is_dir() else None
    if fam.stitched:  # a stitched target: the folder is the model served; vLLM would draft with a random layer
        # if its MTP tensors were missing
        check_mtp_tensors(path, int(info.get("mtp_layer", 0)))
        adapted = path
    return ExportedHead(path, method, layout, info.get("target"), str(adapted) if adapted else None, info)


def _foreign_export(path: Path) -> ExportedHead | None:
    """A head folder another trainer wrote (speculators, SpecForge, ModelOpt, z-lab's DFlash, Medusa's:
    ``export.foreign``), served as that trainer wrote it, the way its users serve it; None for a folder of no known
    format. Its ``layout`` is the format; ``info`` {"foreign": format}."""
    if foreign_format(path) is None:
        return None
    fmt, method = check_format(path)
    if method not in VLLM_METHOD:
        raise UserError(f"export_dir={path}: a {fmt} folder of a {method} head, which vLLM does not draft with")
    if not weight_files(path):
        raise InputNotFoundError(f"export_dir={path} ({fmt} format) holds no weights")
    return ExportedHead(path, method, fmt, None, None, {"foreign": fmt})


def speculative_config(head: ExportedHead, num_speculative_tokens: int) -> dict:
    """vLLM's ``speculative_config`` for the head."""
    return vllm_speculative_config(head.method, str(head.folder.resolve()), num_speculative_tokens)


def model_engine_kwargs(model: str | Path) -> dict:
    """Engine arguments a served model needs: a hybrid target (recurrent layers, e.g. Qwen3-Next's Gated DeltaNet)
    decodes speculatively with prefix caching off, whose 'align' state-cache mode runs a Triton kernel the CPU build
    lacks (vLLM 0.32.0: "'function' object is not subscriptable" in mamba_utils' fused pre-copy)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"enable_prefix_caching": False} if recurrent_layer_types(config) else {}
