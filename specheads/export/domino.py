"""Domino's export: its head tensors, its engine folder, its model card's facts and the reader of another toolkit's
folder of it (the functions its entry in ``specheads/families.py`` names).

The folder is z-lab's DFlash format as NVIDIA ModelOpt's Domino exporter writes it and SGLang's ``DFLASH``
algorithm reads it (a Domino rollout chosen by ``dflash_config.projector_type``): DFlash's config and tensors
(``export/layouts.py``) plus ``prefix_gru.*`` and ``embed_proj.*`` under their own names, and in ``dflash_config``
``projector_type: domino``, ``shift_label``, ``pure_draft_prefix_len``, ``gru_hidden_dim`` and ``emb_dim`` (and
``emb_dim`` at the top level too). vLLM has no Domino drafter, so no vLLM folder is written.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specheads.export.card import dflash_facts
from specheads.export.foreign import _fail, dflash_config
from specheads.export.layouts import (Layout, LayoutError, TargetInfo, TensorSpec, _need, dflash_layout,
                                      dflash_tensors)

PROJECTOR = "domino"  # dflash_config.projector_type of a Domino folder
_FIELDS = ("shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")  # written in dflash_config
SERVED = ("SGLang's `DFLASH` algorithm runs the Domino rollout for `dflash_config.projector_type: domino` (BF16, "
          "CUDA, tensor parallel 1, greedy; added after SGLang 0.5.23, not checked here). vLLM has no Domino "
          "drafter: no vLLM folder is written.")


def domino_tensors(cfg: dict) -> dict[str, TensorSpec]:
    """DFlash's tensors plus the prefix GRU (3G, H), (3G, G) and the correction (E, H+G), (V, E), no biases."""
    _need(cfg, "gru_hidden_dim", "emb_dim")
    if "shift_label" not in cfg:
        raise LayoutError("head config.json lacks shift_label (the trainers' defaults differ: it must be written)")
    H, V, G, E = cfg["hidden_size"], cfg["vocab_size"], int(cfg["gru_hidden_dim"]), int(cfg["emb_dim"])
    out = dflash_tensors(cfg)
    out.update({"prefix_gru.weight_ih_l0": TensorSpec((3 * G, H)), "prefix_gru.weight_hh_l0": TensorSpec((3 * G, G)),
                "embed_proj.0.weight": TensorSpec((E, H + G)), "embed_proj.2.weight": TensorSpec((V, E))})
    return out


def domino_layout(cfg: dict, engine: str, target: TargetInfo, src: dict, spec_tokens: int) -> Layout:
    """DFlash's z-lab folder for ``engine`` with Domino's tensors and ``dflash_config`` fields."""
    base = dflash_layout(cfg, engine, target, src, spec_tokens)
    extra = {"projector_type": PROJECTOR, "shift_label": bool(cfg["shift_label"]),
             "pure_draft_prefix_len": int(cfg.get("pure_draft_prefix_len", 1)),
             "gru_hidden_dim": int(cfg["gru_hidden_dim"]), "emb_dim": int(cfg["emb_dim"])}
    config = {**base.config, "emb_dim": int(cfg["emb_dim"]),
              "dflash_config": {**base.config["dflash_config"], **extra}}
    notes = [n.replace("both engines share them", "SGLang shares them").replace("both engines run", "SGLang runs")
             for n in base.notes if "vLLM (checked" not in n]
    notes += ["Prefix GRU `prefix_gru` (no biases) over the target's token embeddings of the block's earlier tokens, "
              "and the residual correction `embed_proj` (Linear, SiLU, Linear; no biases) added to the logits from "
              "slot `suffix_start` on; `shift_label` and `pure_draft_prefix_len` written explicitly.", SERVED]
    return replace(base, method="domino", config=config, notes=notes)


def domino_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    shift = bool(cfg["shift_label"])
    return dflash_facts(layout, cfg) + [
        ("prefix GRU", f"hidden {cfg['gru_hidden_dim']}, over the target's embeddings of the block's earlier tokens"),
        ("correction", f"bottleneck {cfg['emb_dim']}, added from drafted token "
                       f"{int(cfg.get('pure_draft_prefix_len', 1)) + 1} on"),
        ("labels", "slot k predicts the token k+1 after the anchor (shift_label)" if shift
         else "slot k predicts the token k after the anchor"),
        ("vLLM", "none: vLLM has no Domino drafter; serve with SGLang")]


def domino_config(folder: Path, fmt: str, cfg: dict, target: TargetInfo) -> dict:
    """A ModelOpt Domino export's config.json -> our head config: DFlash's fields (its reader and refusals, given the
    config without Domino's keys) plus Domino's from ``dflash_config`` or the top level (``shift_label`` must be
    written: ModelOpt's default is true, SpecForge's false)."""
    nested = cfg.get("dflash_config") or {}
    value = lambda key: nested.get(key, cfg.get(key))  # noqa: E731  (z-lab's loader reads both places)
    if value("projector_type") != PROJECTOR:
        raise _fail(folder, fmt, f"dflash_config.projector_type {value('projector_type')!r}, not {PROJECTOR!r}")
    if value("shift_label") is None:
        raise _fail(folder, fmt, "names no shift_label (ModelOpt's default is true, SpecForge's false)")
    missing = [k for k in ("gru_hidden_dim", "emb_dim") if value(k) is None]
    if missing:
        raise _fail(folder, fmt, f"dflash_config.projector_type {PROJECTOR!r} names no {' or '.join(missing)} (the "
                                 "GRU's and the correction's sizes)")
    keys = ("projector_type", *_FIELDS)
    plain = {k: v for k, v in cfg.items() if k not in keys}
    plain["dflash_config"] = {k: v for k, v in nested.items() if k not in keys}
    out = dflash_config(folder, fmt, plain, target)
    out.update(model_type="specheads_domino", shift_label=bool(value("shift_label")),
               pure_draft_prefix_len=int(value("pure_draft_prefix_len") if value("pure_draft_prefix_len") is not None
                                         else 1),
               gru_hidden_dim=int(value("gru_hidden_dim")), emb_dim=int(value("emb_dim")))
    return out
