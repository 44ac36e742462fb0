"""Export a trained head folder to Hub folders that vLLM and SGLang load as they are: the entry point, the plan
(everything read and checked first) and the atomic write.

    path = export_head("runs/x/train/eagle3/head", "runs/x/export", engine="both", target="smollm2",
                       eval_report="runs/x/eval/eagle3/report.json")

Input: the ``save_pretrained`` folder that ``Method.save`` writes (``config.json`` +
``model.safetensors``; for Medusa-2 also the merged adapted target in ``target/``). Every tensor
is checked against ``layouts.head_tensors`` (name, shape, dtype: ``checks.py``): a missing or unknown key fails
naming the key. Output: one folder per engine layout (``out_dir`` itself for one layout,
``out_dir/<engine>`` for several: ``both`` = vllm + sglang, ``all`` = every layout the method has:
vllm, sglang, speculators (EAGLE-3, DFlash) and medusa (the original Medusa/TGI layout)) with ``config.json``,
the weights, ``specheads_export.json`` and a model card ``README.md`` (``card.py``). The whole ``out_dir`` is
written to a temporary sibling and renamed into place, so a failure never leaves a half-written folder; every
file is made world-readable (0644, folders 0755) before the rename, as ``save_pretrained`` output is
meant to be (safetensors' atomic writes create 0600 files). The target's origin and tensors: ``target.py``; the
prepared data, chat template and evaluation report: ``run_records.py``; the upload: ``hub.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specheads.export.card import CardInputs, write_card
from specheads.errors import check_output_folder
from specheads.export.checks import (FLOAT_CODES, ExportError, adapted_target, check_draft_vocab, check_tensors,
                                     read_head, read_header, weight_files)
from specheads.export.engine_targets import vision_export_refusal, vllm_refusal
from specheads.export.hub import check_repo_id, hub_destinations, push_export
from specheads.export.layouts import (ENGINES, FLOAT, Layout, LayoutError, TargetInfo, build_layout, engines_for,
                                      head_tensors, method_of)
from specheads.export.run_records import (carried_template, describe_data, find_eval_report, load_eval_report,
                                          prepared_meta)
from specheads.export.serve import provenance_serve, serve_params
from specheads.export.target import portable_name, target_info, target_tensor
from specheads.families import family
from specheads.targets import chat_templates
from specheads.training.run_log import read_train_summary

log = logging.getLogger(__name__)

EXPORT_FORMAT = "specheads.export/1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}
FILE_MODE, DIR_MODE = 0o644, 0o755  # what save_pretrained output is meant to be: readable by a server's user


@dataclass
class ExportPlan:
    """Everything checked and loaded before the first byte is written."""

    head: Path
    out: Path
    method: str
    layouts: dict[str, Layout]
    source: dict[str, torch.Tensor]
    dtype: torch.dtype
    adapted: Path | None
    card: CardInputs
    nested: bool
    target_source: dict[str, torch.Tensor] | None = None


def export_head(head_dir: str | Path, out_dir: str | Path, engine: str = "both", target=None,
                eval_report: str | Path | None = None, data: str | None = None, dtype: str | None = None,
                spec_tokens: int | None = None, overwrite: bool = False, push_to_hub: str | None = None,
                target_id: str | None = None, hub_private: bool = True, push_dry_run: bool = False,
                hub_api=None, chat_template: str | None = None) -> Path:
    """Export ``head_dir`` for ``engine`` into ``out_dir``; returns ``out_dir``.

    engine: one of ``vllm``, ``sglang``, ``speculators`` (EAGLE-3, DFlash), ``medusa`` (the original Medusa / TGI
    layout), a comma-separated list, ``both`` (vllm + sglang) or ``all`` (every layout the method has);
    target_id: the hub id a user serves the target by, for a target given as a local folder or GGUF
    (the card then names it, with ``base_model``); eval_report may be ``"auto"``: the evaluate stage's
    ``report.json`` of the pipeline layout (``find_eval_report``), if there is one;

    head_dir: the head folder, or the training output folder that holds ``head/``;
    target: the target's name/folder/hub id (or a Target/config) for size checks and the serve commands;
    eval_report: an evaluation ``report.json`` whose measured α/τ go into the model card;
    data: the training data for the card, a line of text or a prepared folder (described from its
    metadata; None: the train summary's ``prepared_dir`` if it records one); dtype: cast float weights
    (``float32``/``bfloat16``/``float16``; None keeps the head's); spec_tokens: a chain of this many
    draft tokens in the serve commands (None: the engine's measured profile in ``eval_report``, else
    evaluate's defaults: vLLM 3 tokens, SGLang 5 steps x top-4, 8 tokens); overwrite: replace an
    existing ``out_dir`` (once the new one is complete); push_to_hub: where to upload (``hub_destinations``):
    ``owner/name`` (one layout: the repo root; several: one subfolder per layout) or ``owner/name-{engine}``
    (one repo per layout), private unless ``hub_private=False``, with the token of ``HF_TOKEN`` or the
    ``huggingface_hub`` login (never printed); push_dry_run: print what would be uploaded, upload nothing;
    hub_api: an ``HfApi``-like object (tests); chat_template: the run's ``target.chat_template``
    (``specheads.targets.chat_templates``): where the target's own tokenizer lacks it, each folder carries it as
    ``chat_template.jinja`` and its serve lines pass it with ``--chat-template``; the prepared data's template
    (``data`` or the train summary's prepared folder) must be the one the engines will apply.
    """
    check_request(engine, dtype, spec_tokens)
    check_output_folder(out_dir)
    head = resolve_head_dir(head_dir)
    if (head / "config.json").is_file() and json.loads((head / "config.json").read_text()).get("model_type") == \
            "specheads_mtp":  # a tuned MTP layer goes back into its target: a stitched checkpoint (export/mtp.py)
        from specheads.export.mtp import export_mtp

        if engine not in ("vllm", "both", "all") or push_to_hub is not None:
            raise ExportError(f"an MTP head exports as a stitched target for vLLM only (engine={engine}), not pushed")
        return export_mtp(head, out_dir, target, spec_tokens, overwrite)
    plan = plan_export(head_dir, out_dir, engine, target, eval_report, data, dtype, spec_tokens, overwrite,
                       push_to_hub, target_id, chat_template)
    write_export(plan)
    log.info("exported %s head %s for %s -> %s", plan.method, plan.head, ", ".join(plan.layouts), plan.out)
    if push_to_hub is not None:
        push_export(plan.out, plan.card.hub, plan.nested, plan.method, private=hub_private, dry_run=push_dry_run,
                    api=hub_api)
    return plan.out


def plan_export(head_dir, out_dir, engine, target, eval_report, data, dtype, spec_tokens, overwrite,
                push_to_hub, target_id=None, chat_template=None) -> ExportPlan:
    """Read and check the head, the target, the report and the request; write nothing."""
    head, out = resolve_head_dir(head_dir), Path(out_dir).resolve()
    cfg, header, files = read_head(head)
    try:
        method = method_of(cfg)
        float_code = check_tensors(header, head_tensors(method, cfg), f"head {head}")
    except LayoutError as e:
        raise ExportError(f"head {head}: {e}") from e
    engines = _engines(method, engine)
    if push_to_hub is not None:
        check_repo_id(push_to_hub)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass overwrite=true to replace it")
    if out == head.resolve() or out in head.resolve().parents:
        raise ExportError(f"output_dir {out} would replace the head folder {head} it is exported from")
    info, origin = target_info(target, cfg, target_id)
    if refused := vision_export_refusal(method, info.architectures, info.vision_language, engines):
        raise ExportError(f"engine={engine}: {refused}")
    if eval_report == "auto":
        eval_report = find_eval_report(head)
    report = load_eval_report(eval_report, method) if eval_report else None
    draft_len = serve_params(method, cfg, "vllm", report, spec_tokens).tokens
    layouts = {e: _layout(method, e, cfg, info, head, draft_len) for e in engines}
    adapted = adapted_target(head, cfg, info)
    needs = {r.source for lay in layouts.values() for r in lay.rules.values() if r.from_target}
    target_source = {n: target_tensor(target, origin, n) for n in sorted(needs)}
    source = {k: v for f in files for k, v in load_file(str(f)).items()}
    if family(method).draft_vocab:
        check_draft_vocab(source["d2t"], source["t2d"], f"head {head}")
    summary = read_train_summary(head)
    template = carried_template(chat_template, target, origin, prepared_meta(data, summary))
    nested = len(engines) > 1 or engine in ("both", "all")
    hub = hub_destinations(push_to_hub, engines, nested) if push_to_hub is not None else {}
    card = CardInputs(method, cfg, info, origin, describe_data(data, summary), report, spec_tokens,
                      push_to_hub, summary, adapted is not None, eval_report and str(eval_report), hub, template)
    if origin.warning():
        log.warning("%s", origin.warning())
    if (refused := vllm_refusal(method, info.architectures)) and any(e != "sglang" for e in layouts):
        log.warning("%s", refused)
    return ExportPlan(head, out, method, layouts, source, _out_dtype(dtype, float_code), adapted, card,
                      nested=nested, target_source=target_source)


def write_export(plan: ExportPlan) -> None:
    """Write every engine folder into a temporary sibling of ``plan.out``, then rename it into place."""
    tmp = plan.out.with_name(f".{plan.out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for e, layout in plan.layouts.items():
            sub, final = (tmp / e, plan.out / e) if plan.nested else (tmp, plan.out)
            provenance = _provenance(plan, e, layout, final)
            if plan.adapted is not None and e == family(plan.method).tgi_layout:
                # TGI serves base_model_name_or_path: for Medusa-2 the adapted target copied beside the heads.
                layout.config["base_model_name_or_path"] = str(final / plan.adapted.name)
            tensors = build_tensors(layout, plan.source, plan.dtype, plan.target_source)
            write_engine_folder(sub, layout, tensors, plan.dtype, provenance)
            if family(plan.method).calibrated_tree:  # its tree calibrated at training travels with it
                _copy_medusa_tree(plan.head, sub)
            if plan.adapted is not None:
                # Copied, not hard-linked: save_pretrained rewrites files in place, which would change a link.
                shutil.copytree(plan.adapted, sub / plan.adapted.name)
            if plan.card.chat_template is not None:
                (sub / chat_templates.TEMPLATE_FILE).write_text(plan.card.chat_template.text, encoding="utf-8")
            write_card(sub, layout, plan.card)
        make_world_readable(tmp)
        _replace_dir(tmp, plan.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _provenance(plan: ExportPlan, engine: str, layout: Layout, final: Path) -> dict:
    """``specheads_export.json``: what was exported, from what, and the draft settings of its serve lines; no
    absolute path of this machine (the head as a path relative to the export folder, with its weights' hash)."""
    card = plan.card
    p = serve_params(plan.method, card.cfg, engine, card.report, card.spec_tokens)
    digest = hashlib.sha256()
    for f in weight_files(plan.head):
        digest.update(f.read_bytes())
    return {"format": EXPORT_FORMAT, "method": plan.method, "engine": engine,
            "head_dir": os.path.relpath(plan.head.resolve(), final), "head_sha256": digest.hexdigest(),
            "target": portable_name(card.target.name), "target_id": card.origin.hub_id,
            "target_hint": card.origin.hint, "aux_layers": card.cfg.get("aux_layers"),
            "dtype": _DTYPE_NAMES[plan.dtype], "weights": layout.weights_file,
            "adapted_target": card.cfg.get("adapted_target") if card.adapted else None,
            "serve": provenance_serve(plan.method, engine, p),
            "chat_template": card.chat_template.record() if card.chat_template else None,
            "head_config": {k: portable_name(v) if isinstance(v, str) else v for k, v in card.cfg.items()}}


def _copy_medusa_tree(head: Path, sub: Path) -> None:
    """The head's training-time static tree (``medusa_tree.json``: rank accuracies and
    ``medusa_choices``), checked, beside the exported weights; a warning when the head has none."""
    from specheads.methods.medusa import TREE_FILE, read_medusa_tree

    try:
        tree = read_medusa_tree(head)
    except (ValueError, json.JSONDecodeError) as e:
        raise ExportError(f"head {head}: {e}") from e
    if tree is None:
        log.warning("head %s has no %s (no held-out calibration at training time): exported without a tree",
                    head, TREE_FILE)
        return
    shutil.copyfile(head / TREE_FILE, sub / TREE_FILE)


def check_request(engine: str, dtype: str | None, spec_tokens: int | None) -> None:
    """The export's settings alone, before any file is read: the engine names, the dtype, the chain length."""
    _engine_names(engine)
    if dtype is not None and dtype not in _DTYPES:
        raise ExportError(f"dtype={dtype}: use one of {', '.join(_DTYPES)}, or null to keep the head's dtype")
    if spec_tokens is not None and (isinstance(spec_tokens, bool) or not isinstance(spec_tokens, int)
                                    or spec_tokens < 1):
        raise ExportError(f"spec_tokens={spec_tokens}: give an integer >= 1 (the draft tokens of the serve commands' "
                          "chain), or null for the evaluation's measured profile")


def _engine_names(engine: str) -> tuple[str, ...]:
    """``engine`` as layout names: ``all`` and ``both`` as they are, else the comma-separated list, checked."""
    if engine in ("all", "both"):
        return (engine,)
    names = tuple(e.strip() for e in str(engine).split(",") if e.strip())
    bad = [e for e in names if e not in ENGINES]
    if bad or not names or len(set(names)) != len(names):
        raise ExportError(f"engine={engine}: use one of {', '.join(ENGINES)}, a comma-separated list of them "
                          "(quoted: engine='vllm,sglang'), both or all")
    return names


def planned_export_refusal(method: str, engine: str, target: str) -> str | None:
    """Why an export of a ``method`` head for ``engine`` would be refused for ``target`` (a folder, or a hub id whose
    config is in the local cache; nothing is fetched), known before the head exists: ``specheads run`` asks before
    its first stage. None where nothing refuses it, or the target's config is not here to tell."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(Path(target).expanduser()), local_files_only=True)
    except Exception:  # noqa: BLE001 - no readable config here: the export stage itself checks the target
        return None
    if getattr(config, "vision_config", None) is None:
        return None
    name = family(method).name  # a training method's name (medusa1) means its family
    refused = vision_export_refusal(name, tuple(getattr(config, "architectures", None) or ()), True,
                                    _engines(name, engine))
    return f"engine={engine}: {refused}" if refused else None


def _engines(method: str, engine: str) -> tuple[str, ...]:
    found = engines_for(method)
    if engine == "all":
        return found
    if engine == "both":
        both = tuple(e for e in ("vllm", "sglang") if e in found)
        missing = [e for e in ("vllm", "sglang") if e not in found]
        if missing:
            log.warning("%s heads: %s has no loader for them; exporting for %s only", method, missing[0], both[0])
        return both
    return _engine_names(engine)


def _layout(method: str, engine: str, cfg: dict, info: TargetInfo, head: Path, spec_tokens: int = 3) -> Layout:
    try:
        return build_layout(method, engine, cfg, info, spec_tokens)
    except LayoutError as e:
        raise ExportError(f"head {head} for {engine}: {e}") from e


def _out_dtype(dtype: str | None, float_code: str) -> torch.dtype:
    if dtype is None:
        return FLOAT_CODES[float_code]
    check_request("all", dtype, None)
    return _DTYPES[dtype]


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` is replaced only once ``tmp`` is complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    had_old = out.exists()
    if had_old:
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if had_old:
            os.replace(old, out)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)


def resolve_head_dir(path: str | Path) -> Path:
    """A head folder, or a training output folder holding ``head/`` (as ``specheads evaluate`` accepts)."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "head" / "config.json").is_file():
        return path / "head"
    return path


# --------------------------------------------------------------------------- writing the files


def build_tensors(layout: Layout, source: dict[str, torch.Tensor], dtype: torch.dtype,
                  target_source: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The exported tensors of ``layout`` from the head's tensors (and the target's, for rules that take
    one); floats cast to ``dtype``."""
    out = {}
    for name, spec in layout.tensors.items():
        rule = layout.rules[name]
        if rule.source is None:
            t = torch.zeros(spec.shape, dtype=dtype)
        elif rule.from_target:
            t = (target_source or {})[rule.source]
        else:
            t = source[rule.source]
            if rule.chunk_order is not None:
                chunks = t.chunk(len(rule.chunk_order), dim=-1)
                t = torch.cat([chunks[j] for j in rule.chunk_order], dim=-1)
        if spec.dtype == FLOAT:
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def write_engine_folder(folder: Path, layout: Layout, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                        provenance: dict) -> None:
    """config.json, the weights and specheads_export.json of one engine; re-read and checked."""
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(layout.config, torch_dtype=_DTYPE_NAMES[dtype])
    if layout.engine == "speculators":
        config["transformer_layer_config"] = dict(config["transformer_layer_config"], torch_dtype=_DTYPE_NAMES[dtype])
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = folder / layout.weights_file
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (folder / "specheads_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
    check_tensors(read_header([weights]), layout.tensors, f"exported {weights}")


def make_world_readable(root: Path) -> None:
    """Files 0644 and folders 0755 under ``root`` (safetensors and tempfile-based writes create 0600 files,
    and ``copytree`` keeps a source's mode), so a server running as another user can read the export."""
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), DIR_MODE)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), FILE_MODE)
