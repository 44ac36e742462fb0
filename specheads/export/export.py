"""Export a trained head folder to Hub folders that vLLM and SGLang load as they are.

    path = export_head("runs/x/train/eagle3/head", "runs/x/export", engine="both", target="smollm2",
                       eval_report="runs/x/eval/eagle3/report.json")

Input: the ``save_pretrained`` folder that ``Method.save`` writes (``config.json`` +
``model.safetensors``; for Medusa-2 also the merged adapted target in ``target/``). Every tensor
is checked against ``layouts.head_tensors`` (name, shape, dtype): a missing or unknown key fails
naming the key. Output: one folder per engine layout (``out_dir`` itself for one layout,
``out_dir/<engine>`` for several: ``both`` = vllm + sglang, ``all`` = every layout the method has:
vllm, sglang, speculators (EAGLE-3, DFlash) and medusa (the original Medusa/TGI layout)) with ``config.json``,
the weights, ``specheads_export.json`` and a model card ``README.md``. The whole ``out_dir`` is written
to a temporary sibling and renamed into place, so a failure never leaves a half-written folder; every
file is made world-readable (0644, folders 0755) before the rename, as ``save_pretrained`` output is
meant to be (safetensors' atomic writes create 0600 files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specheads.errors import SpecheadsError
from specheads.export.engine_targets import vllm_refusal
from specheads.export.layouts import (ENGINES, FLOAT, Layout, LayoutError, TargetInfo, TensorSpec,
                                      build_layout, engines_for, head_tensors, method_of)
from specheads.export.serve import (FOLDER_PLACEHOLDER, NO_SGLANG, TARGET_VAR, ServeParams, provenance_serve,
                                    serve_commands, target_line)
from specheads.export.serve import serve_params as _serve_params
from specheads.targets import chat_templates
from specheads.training.run_log import read_train_summary

log = logging.getLogger(__name__)

EXPORT_FORMAT = "specheads.export/1"
WEIGHTS = "model.safetensors"
_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_OTHER_CODES = {"int64": "I64", "bool": "BOOL"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}
FILE_MODE, DIR_MODE = 0o644, 0o755  # what save_pretrained output is meant to be: readable by a server's user
TARGET_PLACEHOLDER = TARGET_VAR  # the serve commands' target when no hub id is known
# Hub models that the embedded targets were converted from (the card names them as the likely original).
KNOWN_ORIGINS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3_270m": "google/gemma-3-270m"}


class ExportError(SpecheadsError, ValueError):
    """The head folder, the target or the requested export does not fit; the message says where."""


# --------------------------------------------------------------------------- reading and checking


def read_head(head_dir: str | Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]], list[Path]]:
    """(config.json contents, {tensor name: (shape, safetensors dtype code)}, weight files) of a head folder."""
    head = Path(head_dir)
    cfg_path = head / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{head} holds no config.json: not a saved head folder (expected <train output_dir>/head)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_path} is not valid JSON: {e}") from e
    files = _weight_files(head)
    return cfg, read_header(files), files


def read_header(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype code such as ``"F32"``)} over safetensors files, without loading them."""
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in header:
                    raise ExportError(f"tensor {name!r} appears in two weight files ({f})")
                sl = sf.get_slice(name)
                header[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return header


def _weight_files(folder: Path) -> list[Path]:
    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = [folder / WEIGHTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ExportError(f"weight file(s) {missing} missing in {folder}")
    return files


def check_tensors(header: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, TensorSpec],
                  where: str) -> str:
    """Strict check of a file's tensors against a layout; returns the float dtype code (e.g. ``"F32"``).

    Every expected name must be present with its shape and dtype kind, no other name may be present,
    and all float tensors must share one dtype. Errors name the offending keys.
    """
    missing = sorted(set(expected) - set(header))
    unknown = sorted(set(header) - set(expected))
    if missing or unknown:
        parts = ([f"missing key(s) {missing}"] if missing else []) + ([f"unknown key(s) {unknown}"] if unknown else [])
        raise ExportError(f"{where}: {'; '.join(parts)}")
    float_codes = set()
    for name, spec in expected.items():
        shape, code = header[name]
        if shape != spec.shape:
            raise ExportError(f"{where}: key {name!r} has shape {list(shape)}, expected {list(spec.shape)}")
        if spec.dtype == FLOAT:
            if code not in _FLOAT_CODES:
                raise ExportError(f"{where}: key {name!r} has dtype {code}, expected a float dtype")
            float_codes.add(code)
        elif code != _OTHER_CODES[spec.dtype]:
            raise ExportError(f"{where}: key {name!r} has dtype {code}, expected {_OTHER_CODES[spec.dtype]}")
    if len(float_codes) > 1:
        raise ExportError(f"{where}: float tensors mix dtypes {sorted(float_codes)}")
    return float_codes.pop() if float_codes else "F32"


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """``arange(V_draft) + d2t`` must list exactly the target ids that ``t2d`` marks, ascending."""
    ids = torch.arange(d2t.numel()) + d2t
    marked = t2d.nonzero().flatten()
    if ids.numel() != marked.numel() or not torch.equal(ids, marked):
        raise ExportError(f"{where}: d2t and t2d disagree (arange + d2t must equal t2d.nonzero()); "
                          "the draft vocabulary was never set (Eagle3Model.set_draft_vocab) or is corrupt")


# --------------------------------------------------------------------------- the target


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
        spec = Path(self.spec).name if os.path.isabs(self.spec) else self.spec  # no path of this machine
        what = {"embedded": f"the embedded default `{spec}` (a GGUF file dequantized to a local folder)",
                "gguf": f"the GGUF file `{spec}` (dequantized to a local folder)",
                "local": f"the local folder `{spec}`"}.get(self.kind, f"`{spec}`")
        text = (f"The head was trained against {what}, which has no hub id: replace `{TARGET_PLACEHOLDER}` in the "
                "commands below with the hub id or path of exactly that model (same weights and tokenizer)")
        if self.hint and self.kind not in ("embedded", "gguf"):  # named by a local folder's config
            text += (f"; its config names `{self.hint}` as its origin (`_name_or_path`), the hub model the card's "
                     "`base_model` and the speculators verifier name: if it holds exactly that model, serve it by "
                     "that id")
        elif self.hint:
            text += (f"; it was converted from a quantized copy of `{self.hint}`, the closest hub model, so acceptance "
                     "serving that one can differ from the figures measured here")
        return text + ". Re-export with `target_id=<hub id>` to name it."


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def target_origin(target, path: str | None, target_id: str | None = None) -> TargetOrigin:
    """The target's origin: an explicit ``target_id``, a hub id given as the target, a hub cache folder
    (``.../models--org--name/snapshots/<rev>``), else a local file with no id (a placeholder in the card)."""
    from specheads.targets import EMBEDDED_GGUF

    spec = str(target) if isinstance(target, (str, Path)) else (getattr(target, "name", None) or "target")
    if target_id is not None:
        if not _HUB_ID.fullmatch(target_id):
            raise ExportError(f"target_id must be a hub id 'owner/name', got {target_id!r}")
        return TargetOrigin(spec, path, target_id, "given")
    if spec in EMBEDDED_GGUF:
        return TargetOrigin(spec, path, None, "embedded", KNOWN_ORIGINS.get(spec))
    if spec.endswith(".gguf"):
        return TargetOrigin(spec, path, None, "gguf", gguf_hub_id(spec))
    if _HUB_ID.fullmatch(spec) and not Path(spec).expanduser().exists():
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
    if isinstance(name, str) and _HUB_ID.fullmatch(name) and not Path(name).expanduser().exists():
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
        if m and _HUB_ID.fullmatch(m.group(1)) and "." not in m.group(1).split("/")[0]:
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
        info = TargetInfo(info.name, info.hidden_size, target.vocab_size, info.num_layers, info.hub_id,
                          info.architectures)
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
                      tuple(getattr(config, "architectures", None) or ()))


def _adapted_target(head: Path, cfg: dict, target: TargetInfo) -> Path | None:
    """The Medusa-2 merged adapted target folder inside the head folder (checked), or None."""
    rel = cfg.get("adapted_target")
    if not rel:
        return None
    folder = head / rel
    if not (folder / "config.json").is_file():
        raise ExportError(f"the heads name an adapted target in {folder}, but it holds no config.json; "
                          "Medusa-2 heads must be exported together with the target they were trained with")
    tcfg = json.loads((folder / "config.json").read_text())
    _weight_files(folder)
    for key, want in (("hidden_size", cfg["hidden_size"]), ("vocab_size", cfg["vocab_size"]),
                      ("num_hidden_layers", target.num_layers)):
        if want is not None and tcfg.get(key) != want:
            raise ExportError(f"adapted target {folder}: {key} {tcfg.get(key)} does not match {want}")
    return folder


# --------------------------------------------------------------------------- building the files


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
                chunks = t.chunk(len(rule.chunk_order), dim=1)
                t = torch.cat([chunks[j] for j in rule.chunk_order], dim=1)
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


# --------------------------------------------------------------------------- the entry point


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
    card: "CardInputs"
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
    (``specheads.chat_templates``): where the target's own tokenizer lacks it, each folder carries it as
    ``chat_template.jinja`` and its serve lines pass it with ``--chat-template``; the prepared data's template
    (``data`` or the train summary's prepared folder) must be the one the engines will apply.
    """
    plan = plan_export(head_dir, out_dir, engine, target, eval_report, data, dtype, spec_tokens, overwrite,
                       push_to_hub, target_id, chat_template)
    write_export(plan)
    log.info("exported %s head %s for %s -> %s", plan.method, plan.head, ", ".join(plan.layouts), plan.out)
    if push_to_hub is not None:
        push_export(plan, push_to_hub, private=hub_private, dry_run=push_dry_run, api=hub_api)
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
        _check_repo_id(push_to_hub, engines)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass overwrite=true to replace it")
    if out == head.resolve() or out in head.resolve().parents:
        raise ExportError(f"output_dir {out} would replace the head folder {head} it is exported from")
    info, origin = target_info(target, cfg, target_id)
    if eval_report == "auto":
        eval_report = find_eval_report(head)
    report = load_eval_report(eval_report, method) if eval_report else None
    draft_len = serve_params(method, cfg, "vllm", report, spec_tokens).tokens
    layouts = {e: _layout(method, e, cfg, info, head, draft_len) for e in engines}
    adapted = _adapted_target(head, cfg, info)
    needs = {r.source for lay in layouts.values() for r in lay.rules.values() if r.from_target}
    target_source = {n: target_tensor(target, origin, n) for n in sorted(needs)}
    source = {k: v for f in files for k, v in load_file(str(f)).items()}
    if method in ("eagle3", "peagle"):
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
            if plan.adapted is not None and e == "medusa":
                # TGI serves base_model_name_or_path: for Medusa-2 the adapted target copied beside the heads.
                layout.config["base_model_name_or_path"] = str(final / plan.adapted.name)
            tensors = build_tensors(layout, plan.source, plan.dtype, plan.target_source)
            write_engine_folder(sub, layout, tensors, plan.dtype, provenance)
            if plan.method == "medusa":
                _copy_medusa_tree(plan.head, sub)
            if plan.adapted is not None:
                # Copied, not hard-linked: save_pretrained rewrites files in place, which would change a link.
                shutil.copytree(plan.adapted, sub / plan.adapted.name)
            if plan.card.chat_template is not None:
                (sub / chat_templates.TEMPLATE_FILE).write_text(plan.card.chat_template.text, encoding="utf-8")
            _write_card(sub, layout, plan.card)
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
    for f in _weight_files(plan.head):
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


def portable_name(value: str) -> str:
    """An absolute path of this machine -> its last part (what a card or an uploaded file may name); else as is."""
    return Path(value).name if os.path.isabs(value) else value


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
    names = tuple(e.strip() for e in str(engine).split(",") if e.strip())
    bad = [e for e in names if e not in ENGINES]
    if bad or not names or len(set(names)) != len(names):
        raise ExportError(f"engine must be one of {', '.join(ENGINES)}, a comma-separated list of them, both or all; "
                          f"got {engine!r}")
    return names


def _layout(method: str, engine: str, cfg: dict, info: TargetInfo, head: Path, spec_tokens: int = 3) -> Layout:
    try:
        return build_layout(method, engine, cfg, info, spec_tokens)
    except LayoutError as e:
        raise ExportError(f"head {head} for {engine}: {e}") from e


def _out_dtype(dtype: str | None, float_code: str) -> torch.dtype:
    if dtype is None:
        return _FLOAT_CODES[float_code]
    if dtype not in _DTYPES:
        raise ExportError(f"dtype must be one of {sorted(_DTYPES)} or null, got {dtype!r}")
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


def prepared_meta(data: str | None, summary: dict | None) -> tuple[Path, dict] | None:
    """(folder, its ``specheads_meta.json``) of the prepared data: ``data`` or the train summary's
    ``prepared_dir``; None when neither is a prepared folder."""
    folder = data if data is not None else (summary or {}).get("prepared_dir")
    meta_path = Path(folder) / "specheads_meta.json" if folder else None
    if meta_path is None or not meta_path.is_file():
        return None
    return Path(folder), json.loads(meta_path.read_text())


def carried_template(spec: str | None, target, origin: TargetOrigin,
                     prepared: tuple[Path, dict] | None) -> chat_templates.CarriedTemplate | None:
    """The ``target.chat_template`` the export carries (``chat_templates.to_carry``), after checking that the
    template the engines will apply (it, else the target tokenizer's own) is the one the data was prepared with."""
    where = origin.path or (origin.hub_id if origin.kind == "hub" else None)
    if where is None and isinstance(target, str) and Path(target).expanduser().is_dir():
        where = target
    own = chat_templates.own_template(where) if where else (False, None)
    try:
        carried = chat_templates.to_carry(spec, own)
        served = chat_templates.resolve(spec)[0] if spec else own[1]
    except chat_templates.ChatTemplateError as e:
        raise ExportError(str(e)) from e
    recorded = prepared[1].get("chat_template_sha") if prepared else None
    if recorded and (spec or own[0]) and chat_templates.template_sha(served) != recorded:
        what = (f"target.chat_template={spec}" if spec else
                "the target tokenizer's own template" if served else "no template (the target's tokenizer has none)")
        raise ExportError(f"the head was trained on data prepared with another chat template (`{prepared[0].name}`: "
                          f"chat_template_sha {recorded}) than the one the engines would apply: {what}, sha "
                          f"{chat_templates.template_sha(served)}; give the export the target.chat_template the run "
                          "was prepared with")
    return carried


def describe_data(data: str | None, summary: dict | None) -> str | None:
    """The card's data line: ``data`` as given, or a prepared folder's metadata (``data`` or the train summary's)."""
    found = prepared_meta(data, summary)
    if found is None:
        return portable_name(data) if data else data
    folder, meta = found
    src = meta.get("source") or {}
    origin = src.get("path") or src.get("source") or "?"
    regen = "answers regenerated by the target" if meta.get("regenerated") else "original answers"
    return (f"{origin} ({src.get('split', '?')} split): {meta.get('num_samples')} conversations, "
            f"{meta.get('num_tokens')} tokens ({meta.get('num_loss_tokens')} assistant), max_length "
            f"{meta.get('max_length')}, {regen}; prepared for {portable_name(str(meta.get('target')))} in "
            f"`{Path(folder).name}`")


def find_eval_report(head: Path) -> Path | None:
    """The evaluate stage's ``report.json`` for a head of the pipeline layout
    (``<run_dir>/train/<head>/head`` -> ``<run_dir>/eval/<head>/report.json``), or None."""
    head = Path(head).resolve()
    train_out = head.parent if head.name == "head" else head
    candidate = train_out.parent.parent / "eval" / train_out.name / "report.json"
    if candidate.is_file():
        log.info("evaluation report found: %s", candidate)
        return candidate
    log.warning("no evaluation report at %s: the card will say acceptance was not measured", candidate)
    return None


def _check_repo_id(repo_id: str, engines: tuple[str, ...]) -> None:
    plain = (repo_id or "").replace("{engine}", "x")
    if not _HUB_ID.fullmatch(plain) or "{" in plain or "}" in plain:
        raise ExportError(f"push_to_hub must be a repo id 'owner/name' (or 'owner/name-{{engine}}', one repo per "
                          f"layout), got {repo_id!r}")


def hub_destinations(repo_spec: str, engines: tuple[str, ...], nested: bool) -> dict[str, tuple[str, str | None]]:
    """{engine: (repo id, folder in the repo or None)}: ``owner/name-{engine}`` gives each layout its own
    repo (what ``vllm serve`` / SGLang can name directly); a plain ``owner/name`` holds one layout at its root,
    or several, each in its own subfolder (``vllm/``, ``sglang/``, ...: download, then serve the folder)."""
    if "{engine}" in repo_spec:
        return {e: (repo_spec.replace("{engine}", e), None) for e in engines}
    return {e: (repo_spec, e if nested else None) for e in engines}


def push_export(plan: "ExportPlan", repo_spec: str, private: bool = True, dry_run: bool = False, api=None) -> list:
    """Upload each exported layout to its hub destination (``hub_destinations``); returns the uploads
    ``[(repo id, folder in repo, local folder, [files])]``. The token comes from ``HF_TOKEN`` or the
    ``huggingface_hub`` login and is never printed; repos are created private unless ``private=False``;
    ``dry_run`` prints the uploads and touches nothing."""
    uploads = []
    for e, (repo_id, path_in_repo) in plan.card.hub.items():
        local = plan.out / e if plan.nested else plan.out
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        uploads.append((repo_id, path_in_repo, local, files))
    if dry_run:
        for repo_id, path_in_repo, local, files in uploads:
            size = sum((local / f).stat().st_size for f in files)
            print(f"would upload {local} -> {repo_id}" + (f" (folder {path_in_repo}/)" if path_in_repo else "")
                  + f", {'private' if private else 'public'}: {len(files)} files, {size / 1e6:.1f} MB")
            for f in files:
                print(f"  {(path_in_repo + '/') if path_in_repo else ''}{f}")
        return uploads
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()  # token: HF_TOKEN or the stored login; never passed through our logs
    for repo_id in dict.fromkeys(u[0] for u in uploads):
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    for repo_id, path_in_repo, local, _ in uploads:
        api.upload_folder(repo_id=repo_id, folder_path=str(local), path_in_repo=path_in_repo, repo_type="model",
                          commit_message=f"specheads export ({plan.method}, {local.name if plan.nested else 'layout'})")
        log.info("pushed %s to %s%s", local, repo_id, f"/{path_in_repo}" if path_in_repo else "")
    return uploads


# --------------------------------------------------------------------------- model card

_TITLES = {"medusa": "Medusa", "eagle1": "EAGLE-1", "eagle3": "EAGLE-3", "dflash": "DFlash", "peagle": "P-EAGLE"}
# Which engines serve each method (read from the loaders; docs/export.md). Layout -> engines that read it.
SERVED_BY = {
    ("medusa", "vllm"): "vLLM up to 0.32 (checked: 0.32.0); not vLLM 0.33 (no Medusa method); not SGLang (no Medusa "
                        "loader)",
    ("medusa", "medusa"): "TGI (medusa_lm_head.safetensors, no `architectures` in config.json) and vLLM up to 0.32 "
                          "(checked: 0.32.0); not vLLM 0.33; not SGLang",
    ("eagle1", "vllm"): "vLLM (checked: 0.32.0, 0.33.0)",
    ("eagle1", "sglang"): "SGLang (checked: 0.5.23)",
    ("eagle3", "vllm"): "vLLM (checked: 0.32.0, 0.33.0; V1 and V2 model runners)",
    ("eagle3", "sglang"): "SGLang (checked: 0.5.23)",
    ("eagle3", "speculators"): "speculators (checked: 0.9.0, `Eagle3DraftModel.from_pretrained`) and vLLM, which "
                               "converts the speculators format itself (checked: 0.33.0)",
    ("dflash", "vllm"): "vLLM (checked: 0.34.0, method `dflash`) and SGLang (checked: 0.5.23, algorithm `DFLASH`): "
                        "the same z-lab-format folder",
    ("dflash", "sglang"): "SGLang (checked: 0.5.23, algorithm `DFLASH`) and vLLM (checked: 0.34.0, method `dflash`): "
                          "the same z-lab-format folder",
    ("dflash", "speculators"): "vLLM (checked: 0.34.0), which converts the speculators format itself; **not SGLang** "
                               "(0.5.23 reads only the z-lab format: use the `sglang/` folder); speculators' own "
                               "loader not checked",
    ("peagle", "vllm"): "vLLM (method `eagle3` with `parallel_drafting: true`; the 0.32.0 wheel's loader read, not "
                        "served here); not SGLang",
    ("peagle", "speculators"): "vLLM, which turns `speculators_model_type: peagle` into eagle3 + parallel drafting "
                               "(the 0.32.0 wheel's config parsing read, not served here); speculators' own loader not "
                               "checked",
}


@dataclass
class CardInputs:
    """Everything the model card states besides the layout itself."""

    method: str
    cfg: dict
    target: TargetInfo
    origin: TargetOrigin
    data: str | None
    report: list[dict] | None
    spec_tokens: int | None
    repo_id: str | None
    train_summary: dict | None
    adapted: bool
    report_path: str | None = None
    hub: dict = field(default_factory=dict)  # {engine: (repo id, folder in repo or None)} when pushed
    chat_template: chat_templates.CarriedTemplate | None = None  # carried as chat_template.jinja

    @property
    def serve_target(self) -> str:
        """The target as the commands name it: its hub id, or ``$TARGET`` (set by a line the card adds)."""
        return self.origin.hub_id or f"${TARGET_PLACEHOLDER}"

    @property
    def base_model(self) -> str | None:
        return self.origin.hub_id or self.origin.hint


def load_eval_report(path: str | Path, method: str | None = None) -> list[dict]:
    """Measured rows of an evaluate ``report.json`` for heads of ``method`` (all rows when None).

    Each row: ``{name, drafter, profile, shape, temperature, domain, alpha, tau, alpha_by_position,
    lossless, recommendation}`` (``lossless``: the method's ``{checked, mismatches, exact}`` or None when not
    checked; ``recommendation``: the report's ``recommendation`` entry of that method, temperature and domain,
    ``recommend.recommend``'s, or None).
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"eval report {path} not found (expected the evaluate stage's report.json)")
    try:
        report = json.loads(path.read_text())
        rec = report.get("recommendation") or {}
        rows = [{"name": m["name"], "drafter": m.get("drafter"), "profile": m.get("profile"), "shape": m.get("shape"),
                 "temperature": temp, "domain": domain, "alpha": r.get("alpha"), "tau": r.get("tau"),
                 "alpha_by_position": r.get("alpha_by_position"), "lossless": m.get("lossless"),
                 "lossless_verify": m.get("lossless_verify", True),
                 "recommendation": ((rec.get(m["name"]) or {}).get(temp) or {}).get(domain)}
                for m in report["methods"] for temp, domains in m["by_temperature"].items()
                for domain, r in domains.items()]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"eval report {path} is not an evaluate report.json (needs methods[].by_temperature"
                          f".<T>.<domain>.alpha/tau): {type(e).__name__} {e}") from e
    mine = [r for r in rows if method is None or r["drafter"] == method]
    if not mine:
        found = sorted({f"{r['name']} ({r['drafter']})" for r in rows})
        raise ExportError(f"eval report {path} measured no {method} head (it holds {found}); "
                          f"give the report of `specheads evaluate head_method={method}`")
    return mine


def serve_params(method: str, cfg: dict, engine: str, report: list[dict] | None,
                 spec_tokens: int | None) -> ServeParams:
    """``serve.serve_params``, its refusals as export errors."""
    try:
        return _serve_params(method, cfg, engine, report, spec_tokens)
    except ValueError as e:
        raise ExportError(str(e)) from e


def _card_commands(layout: Layout, card: CardInputs, folder: str, engine: str | None = None,
                   template: str | None = None) -> dict[str, str]:
    """The serve lines of the card for the draft at ``folder`` (the placeholder, a hub id or a download);
    template: the carried chat template's file as the commands name it."""
    engine = engine or layout.engine
    p = serve_params(layout.method, card.cfg, engine, card.report, card.spec_tokens)
    return serve_commands(layout.method, engine, card.serve_target, folder, p,
                          card.cfg["adapted_target"] if card.adapted else None, template)


def _card_template(card: CardInputs, layout: Layout, folder: str) -> tuple[str | None, list[str]]:
    """(the carried template's file as the commands name it, lines to run first): the engines read a local
    file, so a draft served by its repo id gets the file downloaded beside it."""
    if card.chat_template is None:
        return None, []
    name = chat_templates.TEMPLATE_FILE
    if layout.engine in card.hub and folder == card.hub[layout.engine][0]:  # served straight from the Hub
        local = f"./{folder.split('/')[1]}"
        return f"{local}/{name}", [f"huggingface-cli download {folder} {name} --local-dir {local}"]
    return f"{folder}/{name}", []


def _template_fact(t: chat_templates.CarriedTemplate) -> str:
    where = f"`{t.source}`" + (f" (as `{t.model}` ships it)" if t.model else "")
    why = ("the target's tokenizer has a template of its own, another one" if t.replaces else
           "the target's tokenizer has none")
    return (f"`{chat_templates.TEMPLATE_FILE}` in this folder, from {where}: the head was trained on chats rendered "
            f"with it and {why}, so the serve commands pass it (`--chat-template`)")


def _facts(layout: Layout, card: CardInputs) -> list[tuple[str, str]]:
    cfg, t, o = card.cfg, card.target, card.origin
    if o.hub_id:
        where = f"`{o.hub_id}`" + (" (read from a local copy)" if o.path and o.kind != "hub" else "")
    else:
        where = f"{portable_name(t.name)}: a local folder or file, no hub id (see the warning)"
    arch = (layout.config.get("architectures") or ["none (TGI needs none)"])[0]
    rows = [("target", f"{where}; hidden {t.hidden_size}, vocab {t.vocab_size}"
             + (f", {t.num_layers} layers" if t.num_layers else "")),
            ("method", _TITLES[layout.method] + (" (Medusa-2: served with its adapted target, "
                                                  f"`{cfg['adapted_target']}/`)" if card.adapted else "")),
            ("layout", f"{layout.engine}, architecture `{arch}`"),
            ("served by", SERVED_BY.get((layout.method, layout.engine), layout.engine)
             + (f"; **{refused}**" if (refused := vllm_refusal(layout.method, t.architectures))
                and layout.engine != "sglang" else "")),
            ("data", card.data or "not recorded (pass data=... to the export)")]
    if card.chat_template is not None:
        rows.append(("chat template", _template_fact(card.chat_template)))
    if layout.method == "medusa":
        rows.append(("heads", f"{cfg['num_heads']} heads x {cfg['num_hidden_layers']} residual block(s)"))
        rows.append(("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']})"))
    else:
        rows.append(("draft layers", str(cfg["num_hidden_layers"])))
    if layout.method == "eagle1":
        rows.append(("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']}, target LM head)"))
        rows.append(("input feature", "the target's post-norm last hidden state"))
    if layout.method in ("eagle3", "peagle"):
        ids = (layout.config.get("eagle_config") or layout.config)["eagle_aux_hidden_state_layer_ids"]
        rows.append(("draft vocabulary", f"{cfg['draft_vocab_size']} of {cfg['vocab_size']} target tokens (d2t/t2d)"))
        rows.append(("aux layers", f"inputs of target decoder layers {cfg['aux_layers']} (= HF hidden_states "
                                   f"indices); written as {layout.engine} ids {ids}"))
    if layout.method == "peagle":
        rows.append(("parallel drafting", f"{cfg['num_depths']} tokens per draft forward (mask_token_id "
                                          f"{cfg['mask_token_id']}, learnt mask_hidden)"))
    if layout.method == "dflash":
        c = layout.config
        key, ids = (("aux_hidden_state_layer_ids", c["aux_hidden_state_layer_ids"]) if layout.engine == "speculators"
                    else ("dflash_config.target_layer_ids", c["dflash_config"]["target_layer_ids"]))
        rows.append(("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']}, target LM head)"))
        rows.append(("block", f"{cfg['block_size']} slots (the anchor, then {cfg['block_size'] - 1} mask tokens, "
                              f"mask_token_id {cfg['mask_token_id']}): up to {cfg['block_size'] - 1} drafted tokens per "
                              "step, one draft forward"))
        rows.append(("aux layers", f"inputs of target decoder layers {cfg['aux_layers']} (= HF hidden_states "
                                   f"indices); written as {key} {ids}"))
    s = card.train_summary
    if s:
        rows.append(("training", f"{s.get('steps')} steps, {s.get('train_tokens')} tokens, held-out τ estimate "
                                 f"{_fmt(s.get('tau_estimate'))}"))
    return rows


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _acceptance(card: CardInputs, engine: str) -> list[str]:
    if not card.report:
        return ["Not measured: no evaluation report was given to the export (eval_report=.../report.json, or "
                "eval_report=auto with the pipeline's run folder)."]
    profile = "vllm" if engine in ("speculators", "medusa") else engine
    src = f" (`{Path(*Path(card.report_path).parts[-3:])}`)" if card.report_path else ""
    L = [f"Measured by `specheads evaluate` on this head{src} (α = accepted ÷ tested drafts; τ = tokens per target "
         f"forward, bonus included). Rows marked ◀ use the {profile} serving profile.", "",
         "| drafting | shape | T | domain | α | τ | α by draft position |", "|---|---|---|---|---|---|---|"]
    for r in card.report:
        pos = ", ".join(_fmt(a) for a in (r["alpha_by_position"] or []))
        mark = " ◀" if r["profile"] == profile else ""
        L.append(f"| {r['name']}{mark} | {r['shape']} | {r['temperature']} | {r['domain']} | {_fmt(r['alpha'])} | "
                 f"{_fmt(r['tau'])} | {pos} |")
    return L


def _lossless(card: CardInputs) -> list[str]:
    if not card.report:
        return ["Not checked: no evaluation report was given to the export."]
    L = ["Greedy speculative output compared token for token with the target's plain greedy output (T = 0):", ""]
    seen = set()
    for r in card.report:
        if r["name"] in seen:
            continue
        seen.add(r["name"])
        ll = r.get("lossless")
        if not ll:
            status = "not checked"
        elif ll.get("exact"):
            status = f"exact on all {ll.get('checked')} prompts"
        else:
            status = f"**{len(ll.get('mismatches') or [])} mismatches** in {ll.get('checked')} prompts"
        lossy = "" if r.get("lossless_verify", True) else " (lossy verification rule)"
        L.append(f"- {r['name']}{lossy}: {status}")
    return L


def card_text(layout: Layout, card: CardInputs) -> str:
    """The README.md of one exported engine folder."""
    title = _TITLES[layout.method]
    front = ([f"base_model: {card.base_model}"] if card.base_model else []) + \
        [f"tags: [speculative-decoding, {layout.method}, {layout.engine}, specheads]"]
    name = card.base_model or Path(card.target.name).name
    L = ["---", *front, "---", "", f"# {title} draft head for {name} ({layout.engine})", ""]
    warning = card.origin.warning()
    if warning and not card.adapted:
        L += [f"> **Warning**: {warning}", ""]
    L += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _facts(layout, card)]
    L += ["", "## Measured acceptance", ""] + _acceptance(card, layout.engine)
    L += ["", "## Lossless check", ""] + _lossless(card)
    p = serve_params(layout.method, card.cfg, layout.engine, card.report, card.spec_tokens)
    engine_name = {"speculators": "vLLM (speculators format)", "medusa": "TGI or vLLM 0.32"}.get(layout.engine,
                                                                                               layout.engine)
    L += ["", f"## Serve it with {engine_name}", "", f"Draft settings: {p.source}.", ""]
    if layout.method == "medusa":
        L += [f"Medusa is served by: {SERVED_BY[layout.method, layout.engine]}.", ""]
    set_target = []
    if not card.origin.hub_id and not card.adapted:
        set_target = [target_line(card.origin.hint, "REPLACE: see the warning above")]
    label, folder, pre = _card_destination(layout, card)
    template, fetch = _card_template(card, layout, folder)
    pre = pre + fetch
    cmds = _card_commands(layout, card, folder, template=template)
    L += [f"From {label}:", "", "```bash", *pre, *set_target, cmds["shell"]] + \
         ([cmds["tgi"]] if "tgi" in cmds else []) + \
         ([NO_SGLANG[layout.method]] if layout.method in NO_SGLANG else []) + ["```", ""]
    if "python" in cmds:
        py_set = [f"{TARGET_PLACEHOLDER} = {set_target[0].split('=', 1)[1].split()[0]!r}  # REPLACE: see the "
                  "warning above"] if set_target else []
        chat = ["llm = " + cmds["python"], cmds["python_chat"]] if "python_chat" in cmds else [cmds["python"]]
        L += ["```python", "from vllm import LLM", *py_set, *chat, "```", ""]
    if layout.engine == "speculators" and layout.method == "eagle3":
        L += ["With speculators itself: `from speculators import SpeculatorModel; "
              f"SpeculatorModel.from_pretrained({folder!r})`.", ""]
    if layout.method == "dflash" and layout.engine in ("vllm", "sglang"):
        other = "sglang" if layout.engine == "vllm" else "vllm"
        cmds = _card_commands(layout, card, folder, other, template)
        L += [f"The same folder serves {'SGLang' if other == 'sglang' else 'vLLM'} "
              f"({serve_params('dflash', card.cfg, other, card.report, card.spec_tokens).source}):", "",
              "```bash", *pre, *set_target, cmds["shell"], "```", ""]
    if layout.method == "dflash" and layout.engine == "speculators":
        L += ["SGLang cannot read this folder (no speculators-format reader in 0.5.23): serve the `sglang/` (or "
              "`vllm/`) export with `--speculative-algorithm DFLASH` instead.", ""]
    n = len(layout.tensors)
    L += ["## Layout", ""] + [f"- {n_}" for n_ in layout.notes]
    L += [f"- Files: `config.json`, `{layout.weights_file}` ({n} tensors), `specheads_export.json`"
          + (f", `{chat_templates.TEMPLATE_FILE}`" if card.chat_template else "")
          + (f", `{card.cfg['adapted_target']}/` (the adapted target)" if card.adapted else "") + ".", ""]
    return "\n".join(L)


def _card_destination(layout: Layout, card: CardInputs) -> tuple[str, str, list[str]]:
    """(where the draft is, what the commands name it by, lines to run first): the Hub repo it was pushed to
    (a subfolder or a Medusa-2 head's adapted target: downloaded first), else a placeholder for this folder:
    the card never names a path of the exporting machine."""
    if layout.engine not in card.hub:
        return "this folder", FOLDER_PLACEHOLDER, []
    repo_id, sub = card.hub[layout.engine]
    if sub is None and not card.adapted:
        return f"the Hub repo `{repo_id}`", repo_id, []
    local = f"./{repo_id.split('/')[1]}"
    if sub is None:
        return (f"the Hub repo `{repo_id}` (download it first: the adapted target inside it is the model served)",
                local, [f"huggingface-cli download {repo_id} --local-dir {local}"])
    return (f"the Hub repo `{repo_id}`, folder `{sub}/` (download it first)", f"{local}/{sub}",
            [f"huggingface-cli download {repo_id} --include '{sub}/*' --local-dir {local}"])


def _write_card(sub: Path, layout: Layout, card: CardInputs) -> None:
    (sub / "README.md").write_text(card_text(layout, card))
