"""The command lines that serve an exported head with vLLM and SGLang, and the draft settings they use.

One home for them: the model card (``card.card_text``), the export recipe and the pipeline's end summary
all build their lines here.

Draft settings (``serve_params``): ``spec_tokens`` when given (a chain); else what the evaluation report
recommends for GPU serving (``recommend.py``: the chain length or tree depth with the best predicted GPU
speed-up, never beyond what was measured) for the engine's serving-profile row (``<method>-vllm`` chain,
``<method>-sglang`` tree; SGLang without a tree row drafts the vLLM row's recommended chain, DFlash reads
its ``dflash-chain{B-1}`` row), at T = 0 over all domains; else that row's measured shape; else evaluate's
default profiles (vLLM 3 tokens; SGLang 5 steps x top-4, 8 draft tokens); settings no head can draft are an
``ExportError``. Flags: docs/export.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from specheads.export.checks import ExportError
from specheads.export.engine_targets import VLLM_CPU_REFUSED
from specheads.families import FAMILIES, family

FOLDER_PLACEHOLDER = "<path-or-repo-id-of-this-folder>"  # the card's draft model when nothing was pushed
TARGET_VAR = "TARGET"  # the commands' target when it has no hub id: ``$TARGET``, set by a line before them
# vLLM's speculative_config "method" per head kind (the export record's method: a family, or medusa1/medusa2)
VLLM_METHOD = {alias: f.vllm_method for f in FAMILIES if f.vllm_method for alias in f.aliases}


def vllm_speculative_config(method: str, model: str, tokens: int) -> dict:
    """vLLM's ``speculative_config`` for a head of kind ``method`` at ``model`` drafting ``tokens`` per step
    (P-EAGLE is EAGLE-3 with the parallel slots: vLLM's ``parallel_drafting`` field; for MTP ``model`` is the
    stitched target itself, which vLLM also serves as the target)."""
    spec = {"method": VLLM_METHOD[method], "model": model, "num_speculative_tokens": int(tokens)}
    return {**spec, **family(method).vllm_extra}  # P-EAGLE's parallel_drafting, DSpark's adaptive verification


SGLANG_ALGO = {f.name: f.sglang_algorithm for f in FAMILIES if f.sglang_algorithm}  # --speculative-algorithm
NO_SGLANG = {f.name: f.sglang_note for f in FAMILIES if f.sglang_note}  # the line in place of SGLang's
PREFERRED_T, PREFERRED_DOMAIN = "0.0", "all"


@dataclass
class ServeParams:
    """Draft settings of the serve commands: vLLM's chain length; SGLang's steps, top-k and draft tokens
    (the root included); ``source`` says where they come from."""

    tokens: int
    steps: int
    topk: int
    draft_tokens: int
    source: str

    @classmethod
    def chain(cls, k: int, source: str) -> "ServeParams":
        return cls(k, k, 1, k + 1, source)


def engine_family(engine: str) -> str:
    """The engine that serves a layout: the speculators and medusa layouts are served by vLLM (and TGI)."""
    return "sglang" if engine == "sglang" else "vllm"


def serve_params(method: str, cfg: dict, engine: str, report: list[dict] | None,
                 spec_tokens: int | None = None) -> ServeParams:
    """The draft settings for serving ``method`` (head config ``cfg``) with the layout ``engine``.

    report: rows of ``run_records.load_eval_report`` (each with its ``recommendation`` entry, when the report
    has one)."""
    engine = engine_family(engine)
    drafts = family(method).drafts
    if drafts == "block":
        return _dflash_params(cfg, engine, report, spec_tokens, method)
    if drafts == "depths":
        return _peagle_params(cfg, report, spec_tokens, method)
    if spec_tokens is not None:
        return ServeParams.chain(int(spec_tokens), "given by spec_tokens (a chain)")
    rows = _rows(report, lambda r: r["profile"] == engine)
    if engine == "sglang" and not rows:  # no SGLang tree measured: the vLLM row's chain, which SGLang drafts too
        chain = _rows(report, lambda r: r["profile"] == "vllm")
        if chain:
            p = _from_row(chain[0])
            return ServeParams.chain(p.tokens, p.source + "; the report measured no SGLang tree, so SGLang drafts "
                                     "that chain (evaluate with serving.engines=[vllm,sglang] to measure one)")
    if rows:
        return _from_row(rows[0])
    n = min(3, cfg["num_heads"]) if "num_heads" in cfg else 3  # Medusa: a chain of at most its heads
    if engine == "sglang":
        return ServeParams(n, 5, 4, 8, "evaluate's default SGLang profile (not measured here)")
    return ServeParams.chain(n, "evaluate's default vLLM profile (not measured here)")


def _rows(report: list[dict] | None, keep) -> list[dict]:
    """Matching rows, the preferred temperature and domain first."""
    rows = [r for r in report or () if keep(r)]
    return sorted(rows, key=lambda r: (r["temperature"] != PREFERRED_T, r["domain"] != PREFERRED_DOMAIN))



def best_for_gpu(entry: dict) -> dict | None:
    """The prediction the evaluation recommended for GPU serving in a row's ``recommendation`` entry (its
    ``best_k_gpu``; ``specheads.evaluation.recommend`` writes it), or None."""
    k = entry.get("best_k_gpu")
    return next((p for p in entry.get("predictions") or () if p["k"] == k), None)


def _from_row(row: dict) -> ServeParams:
    """The row's recommended GPU setting, else its measured shape."""
    shape, rec = row["shape"] or "", row.get("recommendation")
    where = f"{row['name']} ({shape}, T={row['temperature']}, {row['domain']})"
    chain = re.fullmatch(r"chain(\d+)", shape)
    tree = re.fullmatch(r"tree\(d(\d+),k(\d+),n(\d+)\)", shape)
    best = best_for_gpu(rec) if rec else None
    if best is not None and (chain or tree):
        why = (f"recommended for GPU serving by the evaluation report: {where}, predicted GPU speed-up "
               f"{best['speedup_gpu_pred']:.2f}x")
        if chain:
            return ServeParams.chain(best["k"], why + f" at a chain of {best['k']}")
        d, k, n = map(int, tree.groups())
        nodes = n if best["k"] >= d else min(n, max(1, math.ceil(best.get("tokens_per_step", n) - 1e-9)))
        return ServeParams(best["k"], best["k"], k, nodes + 1, why + f" at depth {best['k']}, {nodes} draft tokens")
    if chain:
        k = int(chain.group(1))
        return ServeParams.chain(k, f"the measured {where}")
    if tree:
        d, k, n = map(int, tree.groups())
        return ServeParams(d, d, k, n + 1, f"the measured {where}")
    raise ExportError(f"report row {row['name']}: shape {shape!r} is neither chainK nor tree(dD,kK,nN)")


def _peagle_params(cfg: dict, report: list[dict] | None, spec_tokens: int | None,
                   drafter: str = "peagle") -> ServeParams:
    """P-EAGLE drafts a chain of up to ``num_depths`` tokens in one forward: ``spec_tokens`` when given (at most
    that), else the evaluated ``peagle-chain{K}`` row, else K."""
    K = int(cfg["num_depths"])
    if spec_tokens is not None:
        if not 1 <= int(spec_tokens) <= K:
            raise ExportError(f"spec_tokens={spec_tokens}: this P-EAGLE head drafts 1 to {K} tokens per forward")
        return ServeParams.chain(int(spec_tokens), "given by spec_tokens (a chain)")
    rows = _rows(report, lambda r: r["drafter"] == drafter and re.fullmatch(r"chain\d+", r["shape"] or ""))
    if rows:
        p = _from_row(rows[0])
        return ServeParams.chain(min(p.tokens, K), p.source)
    return ServeParams.chain(K, f"the head's num_depths ({K} tokens per draft forward; not measured here)")


def _dflash_params(cfg: dict, engine: str, report: list[dict] | None, spec_tokens: int | None,
                   drafter: str = "dflash") -> ServeParams:
    """DFlash (and DSpark, ``drafter``) drafts one block per step: ``block_size - 1`` tokens after the anchor
    (vLLM's ``num_speculative_tokens``; SGLang's ``--speculative-num-draft-tokens`` counts the anchor too)."""
    B = int(cfg["block_size"])
    p = ServeParams.chain(B - 1, f"the trained block ({B} slots: the anchor and {B - 1} drafted tokens)")
    if spec_tokens is not None:
        p = ServeParams.chain(int(spec_tokens), "given by spec_tokens (a chain)")
    else:
        rows = _rows(report, lambda r: r["drafter"] == drafter and re.fullmatch(r"chain\d+", r["shape"] or ""))
        if rows:
            p = _from_row(rows[0])
    if not 1 <= p.tokens <= B - 1:
        raise ExportError(f"a {family(drafter).title} head with block_size {B} drafts 1..{B - 1} tokens per step; got "
                          f"{p.tokens} (the slots past the trained block were never trained)")
    return ServeParams(p.tokens, 1, 1, p.tokens + 1, p.source)


def serve_commands(method: str, engine: str, target: str, model: str, p: ServeParams,
                   adapted: str | None = None, chat_template: str | None = None) -> dict[str, str]:
    """``{"shell": ..., ["python": ...], ["tgi": ...]}``: the lines that serve the draft at ``model`` (a folder or
    hub id) for ``target`` (a hub id, a folder, or ``$TARGET``) with the ``engine`` layout. adapted: a Medusa-2
    head's adapted target, a folder inside ``model`` (it is then the model served). chat_template: a template
    file the engine must apply instead of the target tokenizer's (``--chat-template``, vLLM's and SGLang's flag;
    in Python, ``LLM.chat``'s ``chat_template`` argument)."""
    target = f"{model}/{adapted}" if adapted else target
    flag = f" --chat-template {chat_template}" if chat_template else ""
    if engine_family(engine) == "vllm":
        spec = vllm_speculative_config(method, model, p.tokens)
        py_target = target[1:] if target.startswith("$") else repr(target)
        gpu_only = f"   # GPU only: vLLM's CPU build refuses it (\"{VLLM_CPU_REFUSED[method]}\")" \
            if method in VLLM_CPU_REFUSED else ""
        out = {"shell": f"vllm serve {target} --speculative-config '{json.dumps(spec)}'{flag}{gpu_only}",
               "python": f"LLM(model={py_target}, speculative_config={spec!r})"}
        if chat_template:
            out["python_chat"] = ("llm.chat([{'role': 'user', 'content': 'Hello'}], "
                                  f"chat_template=open({chat_template!r}).read())")
        if engine == family(method).tgi_layout:  # Medusa's original layout
            out["tgi"] = (f"text-generation-launcher --model-id {model}   # serves config.json's "
                          "base_model_name_or_path with these heads")
        return out
    if method not in SGLANG_ALGO:
        return {"shell": NO_SGLANG[method]}
    line = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {SGLANG_ALGO[method]} "
            f"--speculative-draft-model-path {model}")
    if family(method).drafts == "block":  # one block per step: no steps or top-k
        return {"shell": f"{line} --speculative-num-draft-tokens {p.draft_tokens}{flag}"}
    return {"shell": f"{line} --speculative-num-steps {p.steps} --speculative-eagle-topk {p.topk} "
                     f"--speculative-num-draft-tokens {p.draft_tokens}{flag}"}


def target_line(hint: str | None, comment: str) -> str:
    """The line that sets ``$TARGET`` when the target has no hub id."""
    return f"{TARGET_VAR}={hint or '/path/to/the/target/model'}   # {comment}"


# --------------------------------------------------------------------------- what an export folder records


def provenance_serve(method: str, engine: str, p: ServeParams) -> dict:
    """What ``specheads_export.json`` records to rebuild the lines (``exported_lines``)."""
    return {"engine": engine_family(engine), **asdict(p)}


def export_folders(export_dir: str | Path) -> list[tuple[Path, dict]]:
    """(folder, its specheads_export.json) of ``export_dir`` itself or of each engine folder in it."""
    root = Path(export_dir)
    order = ("vllm", "sglang", "speculators", "medusa")
    if (root / "specheads_export.json").is_file():
        found = [root]
    else:
        found = sorted((p for p in root.iterdir() if (p / "specheads_export.json").is_file()) if root.is_dir() else (),
                       key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))
    return [(f, json.loads((f / "specheads_export.json").read_text())) for f in found]


def exported_lines(export_dir: str | Path, target_here: str | None = None) -> list[str]:
    """The serve commands of every folder under ``export_dir``, naming those folders as they are here
    (for the end of ``specheads export`` / ``specheads run``; the cards name no local path).

    target_here: the target's local folder when it is one (served as is); else the export's hub id,
    else ``$TARGET`` with a line to set it."""
    folders = export_folders(export_dir)
    if not folders:
        return [f"(no exported folder in {export_dir})"]
    prov = folders[0][1]
    if family(prov["method"]).stitched:  # a stitched target (export/mtp.py): the folder is the model, no draft repo
        s = json.dumps(prov["serve"]["speculative_config"])
        return [f"# vLLM (the stitched target: {folders[0][0]})", f"vllm serve {folders[0][0]} --speculative-config '{s}'"]
    target, lines = prov.get("target_id") or target_here, []
    if target is None:
        hint = prov.get("target_hint")
        lines.append(target_line(hint, "the hub model the target was converted from: the head was trained on a "
                                       "quantized copy, acceptance can differ" if hint else
                                       "REPLACE: the hub id or folder of the target"))
        target = f"${TARGET_VAR}"
    served = set()
    for folder, prov in folders:
        method, engine, s = prov["method"], prov["engine"], prov.get("serve") or {}
        p = ServeParams(s["tokens"], s["steps"], s["topk"], s["draft_tokens"], s["source"])
        fam = engine_family(engine)
        label = {"vllm": "vLLM", "sglang": "SGLang"}[fam] + f" ({engine} layout: {folder})"
        template = prov.get("chat_template")  # carried beside the head: the target's tokenizer lacks it
        cmds = serve_commands(method, engine, target, str(folder), p, prov.get("adapted_target"),
                              str(folder / template["file"]) if template else None)
        lines += [f"# {label}; draft settings: {p.source}", cmds["shell"]] + ([cmds["tgi"]] if "tgi" in cmds else [])
        served.add(fam)
    if "sglang" not in served and prov["method"] in NO_SGLANG:
        lines.append(NO_SGLANG[prov["method"]])
    return lines
