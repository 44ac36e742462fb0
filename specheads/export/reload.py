"""Load an exported engine folder back into the specheads model it came from (the round trip).

    model = load_exported("runs/x/export/eagle3/vllm")      # Eagle3Model, unattached
    model.attach(target)                                     # EAGLE models borrow the target's embedding

The folder's ``specheads_export.json`` names the method, the layout and the head's config; the
tensors are read from the exported weights file and mapped back through the inverse of the layout's
rules (EAGLE-3 ``fc`` column blocks put back in the head's aux-layer order, ``layers.0.*`` back to
``midlayer.*``, the original Medusa names back to ``blocks``/``lm_heads``). Tensors a layout adds
(SGLang's zero ``fc.bias``, speculators' target embedding and, for DFlash, LM head) are dropped; the draft-vocabulary
maps a layout leaves out for a full vocabulary are rebuilt (identity). The model is loaded with
``strict=True``, so a name the inverse mapping misses is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.export.checks import ExportError
from specheads.export.layouts import Layout, TargetInfo, build_layout, method_of
from specheads.families import family


def _model_class(head_cfg: dict):
    """(config class, model class) of the head family ``head_cfg`` names (``specheads/families.py``)."""
    f = family(method_of(head_cfg))
    return f.config_class(), f.model_class()


def exported_head_state(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the head's config dict, the head's state dict) rebuilt from an exported folder."""
    folder = Path(folder)
    prov_path = folder / "specheads_export.json"
    if not prov_path.is_file():
        raise ExportError(f"{folder} holds no specheads_export.json: not a specheads export folder")
    prov = json.loads(prov_path.read_text())
    head_cfg = prov.get("head_config")
    if not head_cfg:
        raise ExportError(f"{prov_path} records no head_config (exported by an older specheads)")
    exported = load_file(str(folder / prov.get("weights", "model.safetensors")))
    info = TargetInfo(prov.get("target") or "target", head_cfg["hidden_size"], head_cfg["vocab_size"],
                      hub_id=prov.get("target_id"))
    layout = build_layout(prov["method"], prov["engine"], head_cfg, info)
    return head_cfg, head_state(layout, head_cfg, exported, str(folder))


def head_state(layout: Layout, head_cfg: dict, exported: dict[str, torch.Tensor],
               where: str) -> dict[str, torch.Tensor]:
    """The head's state dict from the tensors of a folder in ``layout``: the inverse of its rules.

    Tensors the layout copies from the target are dropped (they need not be in ``exported``); zeros it adds
    must be zeros; the draft-vocabulary maps a layout leaves out are rebuilt (identity for a full draft
    vocabulary, ``t2d`` from ``d2t``). ``where`` names the folder in errors.
    """
    state: dict[str, torch.Tensor] = {}
    for name, rule in layout.rules.items():
        if rule.from_target:
            continue
        t = exported[name]
        if rule.source is None:
            if t.any():
                raise ExportError(f"{where}: {name} should be all zeros (added by the {layout.engine} layout)")
            continue
        if rule.chunk_order is not None:
            chunks = t.chunk(len(rule.chunk_order), dim=-1)
            back = [None] * len(chunks)
            for pos, j in enumerate(rule.chunk_order):
                back[j] = chunks[pos]
            t = torch.cat(back, dim=-1)
        state[rule.source] = t
    if family(layout.method).draft_vocab and "d2t" not in state:  # a full draft vocabulary: identity maps
        state["d2t"] = torch.zeros(head_cfg["draft_vocab_size"], dtype=torch.long)
        state["t2d"] = torch.ones(head_cfg["vocab_size"], dtype=torch.bool)
    elif family(layout.method).draft_vocab and "t2d" not in state:
        t2d = torch.zeros(head_cfg["vocab_size"], dtype=torch.bool)
        t2d[torch.arange(state["d2t"].numel()) + state["d2t"]] = True
        state["t2d"] = t2d
    return state


def build_head(head_cfg: dict, state: dict[str, torch.Tensor]):
    """The specheads model of ``head_cfg``'s method holding ``state`` (strict: a name the model lacks, or one it
    has that ``state`` lacks, is an error), in the dtype of ``state``'s float tensors."""
    config_cls, model_cls = _model_class(head_cfg)
    fields = {k: v for k, v in head_cfg.items() if k not in ("model_type", "transformers_version", "architectures")}
    model = model_cls(config_cls(**fields))
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_exported(folder: str | Path):
    """The specheads model (Medusa heads, ``Eagle1Model``, ``Eagle3Model`` or ``DFlashModel``) an exported folder
    holds (EAGLE and DFlash models unattached: ``model.attach(target)`` lends them the target's embedding)."""
    return build_head(*exported_head_state(folder))
