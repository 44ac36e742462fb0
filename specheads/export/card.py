"""The model card (``README.md``) of each exported engine folder: what the head is and was trained on, which
engines serve it, its measured acceptance and lossless check, and the commands that serve it.

    card = CardInputs(method, cfg, info, origin, data_line, rows, spec_tokens, repo_id, summary, adapted=False)
    write_card(folder, layout, card)

The card never names a path of the exporting machine: the draft is named by its Hub repo or a placeholder,
the target by its hub id or ``$TARGET`` (set by a line the card adds, with the warning why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specheads.export.engine_targets import VLLM_CPU_REFUSED, vllm_refusal
from specheads.export.layouts import Layout, TargetInfo
from specheads.export.serve import (FOLDER_PLACEHOLDER, NO_SGLANG, TARGET_VAR, engine_family, serve_commands,
                                    serve_params, target_line)
from specheads.export.target import TargetOrigin, portable_name
from specheads.families import family, load
from specheads.targets import chat_templates

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
    ("dspark", "vllm"): "vLLM's V2 GPU model runner (method `dspark`; the 0.32.0 wheel's loader read, not served here); "
                        f"**not vLLM's CPU build**, which runs the V1 runner and refuses it (\"{VLLM_CPU_REFUSED['dspark']}\"); "
                        "SGLang not checked",
    ("dspark", "speculators"): "vLLM's V2 GPU model runner, which converts `speculators_model_type: dspark` itself (the "
                               "0.32.0 wheel's config parsing read, not served here); **not vLLM's CPU build** "
                               f"(\"{VLLM_CPU_REFUSED['dspark']}\"); speculators' own loader not checked",
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
        return self.origin.hub_id or f"${TARGET_VAR}"

    @property
    def base_model(self) -> str | None:
        return self.origin.hub_id or self.origin.hint


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
            ("method", family(layout.method).title + (" (Medusa-2: served with its adapted target, "
                                                  f"`{cfg['adapted_target']}/`)" if card.adapted else "")),
            ("layout", f"{layout.engine}, architecture `{arch}`"),
            ("served by", SERVED_BY.get((layout.method, layout.engine), layout.engine)
             + (f"; **{refused}**" if (refused := vllm_refusal(layout.method, t.architectures))
                and layout.engine != "sglang" else "")),
            ("data", card.data or "not recorded (pass data=... to the export)")]
    if card.chat_template is not None:
        rows.append(("chat template", _template_fact(card.chat_template)))
    rows += load(family(layout.method).card_facts)(layout, cfg)  # the family's own rows
    s = card.train_summary
    if s:
        rows.append(("training", f"{s.get('steps')} steps, {s.get('train_tokens')} tokens, held-out τ estimate "
                                 f"{_fmt(s.get('tau_estimate'))}"))
    return rows


# ------------------------------------------------------------------ each family's facts (``Family.card_facts``)


def medusa_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    return [("heads", f"{cfg['num_heads']} heads x {cfg['num_hidden_layers']} residual block(s)"),
            ("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']})")]


def eagle1_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    return [("draft layers", str(cfg["num_hidden_layers"])),
            ("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']}, target LM head)"),
            ("input feature", "the target's post-norm last hidden state")]


def eagle3_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    ids = (layout.config.get("eagle_config") or layout.config)["eagle_aux_hidden_state_layer_ids"]
    return [("draft layers", str(cfg["num_hidden_layers"])),
            ("draft vocabulary", f"{cfg['draft_vocab_size']} of {cfg['vocab_size']} target tokens (d2t/t2d)"),
            ("aux layers", f"inputs of target decoder layers {cfg['aux_layers']} (= HF hidden_states "
                           f"indices); written as {layout.engine} ids {ids}")]


def peagle_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    return eagle3_facts(layout, cfg) + [("parallel drafting", f"{cfg['num_depths']} tokens per draft forward "
                                                              f"(mask_token_id {cfg['mask_token_id']}, learnt "
                                                              "mask_hidden)")]


def _block_facts(cfg: dict) -> list[tuple[str, str]]:
    """DFlash's and DSpark's: the draft layers and vocabulary, the block."""
    B = cfg["block_size"]
    return [("draft layers", str(cfg["num_hidden_layers"])),
            ("draft vocabulary", f"full target vocabulary ({cfg['vocab_size']}, target LM head)"),
            ("block", f"{B} slots (the anchor, then {B - 1} mask tokens, mask_token_id {cfg['mask_token_id']}): "
                      f"up to {B - 1} drafted tokens per step, one draft forward")]


def _aux_fact(layout: Layout, cfg: dict, ids_key: str) -> tuple[str, str]:
    """The aux layers and where the layout writes them (``ids_key``; speculators' folder:
    ``aux_hidden_state_layer_ids``)."""
    c = layout.config
    key, ids = (("aux_hidden_state_layer_ids", c["aux_hidden_state_layer_ids"]) if layout.engine == "speculators"
                else (ids_key, c["dflash_config"]["target_layer_ids"] if ids_key.startswith("dflash_config")
                      else c[ids_key]))
    return ("aux layers", f"inputs of target decoder layers {cfg['aux_layers']} (= HF hidden_states "
                          f"indices); written as {key} {ids}")


def dflash_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    key = "dflash_config.target_layer_ids"
    return _block_facts(cfg) + [_aux_fact(layout, cfg, key)]


def dspark_facts(layout: Layout, cfg: dict) -> list[tuple[str, str]]:
    heads = [("Markov head", f"rank {cfg['markov_rank']} ({cfg.get('markov_head_type', 'vanilla')}), on the "
                             "previous token"),
             ("confidence head", "yes: vLLM's adaptive verification reads it"
              if layout.config["enable_confidence_head"] else "none")]
    key = "target_layer_ids"
    return _block_facts(cfg) + heads + [_aux_fact(layout, cfg, key)]


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _acceptance(card: CardInputs, engine: str) -> list[str]:
    if not card.report:
        return ["Not measured: no evaluation report was given to the export (eval_report=.../report.json, or "
                "eval_report=auto with the pipeline's run folder)."]
    profile = engine_family(engine)  # the speculators and medusa layouts: vLLM's profile
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


_ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}


def card_text(layout: Layout, card: CardInputs) -> str:
    """The README.md of one exported engine folder."""
    fam = family(layout.method)
    title = fam.title
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
    if fam.card_served_by_note:
        L += [f"{title} is served by: {SERVED_BY[layout.method, layout.engine]}.", ""]
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
        py_set = [f"{TARGET_VAR} = {set_target[0].split('=', 1)[1].split()[0]!r}  # REPLACE: see the "
                  "warning above"] if set_target else []
        chat = ["llm = " + cmds["python"], cmds["python_chat"]] if "python_chat" in cmds else [cmds["python"]]
        L += ["```python", "from vllm import LLM", *py_set, *chat, "```", ""]
    if layout.engine == "speculators" and fam.speculators_card_note:
        L += [fam.speculators_card_note.format(folder=folder), ""]
    others = [e for e in fam.one_folder if e != layout.engine] if layout.engine in fam.one_folder else []
    for other in others:  # one folder that these engines serve too
        cmds = _card_commands(layout, card, folder, other, template)
        L += [f"The same folder serves {_ENGINE_TITLES[other]} "
              f"({serve_params(layout.method, card.cfg, other, card.report, card.spec_tokens).source}):", "",
              "```bash", *pre, *set_target, cmds["shell"], "```", ""]
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


def write_card(sub: Path, layout: Layout, card: CardInputs) -> None:
    """``README.md``: the model card of one exported engine folder."""
    (sub / "README.md").write_text(card_text(layout, card))
