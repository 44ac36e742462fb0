"""An evaluation's inputs checked against each other before anything decodes: each head trained here against the
target's sizes (hidden size, vocabulary, layers: what its config.json records), the early-exit baseline's layer
count against the target's, ``medusa_choices`` against the Medusa head's heads, and the files the methods read
(the two-model baseline's model, the n-gram table's corpus, an automatic shape's training-time measures).

The recipe runs these before the target loads, the target's sizes read from its config.json where that is cheap
(``target_facts_from_config``); ``suite.evaluate`` runs the size checks again on the loaded target, before its
plain pass, so a target whose config is not at hand (an embedded GGUF not yet converted) is caught there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specheads.errors import ConfigError, InputNotFoundError, UserError
from specheads.heads import head_source


@dataclass(frozen=True)
class TargetFacts:
    """What a head or baseline must agree with: the target's hidden size, vocabulary and decoder layer count."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    def describe(self) -> str:
        return f"hidden size {self.hidden_size}, vocabulary {self.vocab_size}, {self.num_layers} layers"


def target_facts(target) -> TargetFacts:
    """The sizes of a loaded ``Target``."""
    return TargetFacts(str(target.name), int(target.hidden_size), int(target.vocab_size), int(target.num_layers))


def target_facts_from_config(name_or_path: str) -> TargetFacts | None:
    """The sizes of a target read from its config.json alone, when that is cheap: a local model folder, or a hub
    id already in the local cache; None otherwise (an embedded target or .gguf file is converted when it loads,
    and its sizes are checked then)."""
    from specheads.targets.files import EMBEDDED_GGUF, EMBEDDED_TARGET

    name = str(name_or_path)
    if name == EMBEDDED_TARGET or name in EMBEDDED_GGUF or name.endswith(".gguf"):
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(Path(name).expanduser()) if Path(name).expanduser().is_dir()
                                            else name, local_files_only=True)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return TargetFacts(name, int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers))
    except Exception:  # noqa: BLE001 - not cheaply readable here: checked once the target has loaded
        return None


def head_config(head_dir: str) -> dict:
    """The config.json of a head folder (or of the ``head/`` folder in a training output folder)."""
    p = Path(head_dir).expanduser()
    folder = p / "head" if (p / "head" / "config.json").is_file() else p
    return json.loads((folder / "config.json").read_text())


def check_head_fits(setting: str, head_dir: str, facts: TargetFacts) -> None:
    """Refuse a head trained here whose recorded target sizes are not ``facts``' (``hidden_size`` and
    ``target_hidden_size``, ``vocab_size``, ``num_target_layers`` and each of ``aux_layers``): drafting with it
    would fail on mismatched tensor shapes after the plain pass. Heads trained elsewhere are read against the
    target by ``check_foreign_heads``."""
    if head_source(head_dir) != "specheads":
        return
    cfg = head_config(head_dir)
    wrong = []
    for key, what, want in (("hidden_size", "hidden size", facts.hidden_size),
                            ("target_hidden_size", "hidden size", facts.hidden_size),
                            ("vocab_size", "vocabulary", facts.vocab_size),
                            ("num_target_layers", "layer count", facts.num_layers)):
        got = cfg.get(key)
        if isinstance(got, int) and got != want and not any(w.startswith(what) for w in wrong):
            wrong.append(f"{what} {got} (its {key}) vs the target's {want}")
    aux = [i for i in cfg.get("aux_layers") or () if isinstance(i, int) and not 0 <= i < facts.num_layers]
    if aux:
        wrong.append(f"aux_layers {list(cfg['aux_layers'])} vs the target's {facts.num_layers} layers")
    if wrong:
        trained = cfg.get("target") or cfg.get("target_name")
        raise UserError(f"{setting}={head_dir} was trained for another target"
                        + (f" ({trained})" if trained else "") + f": {'; '.join(wrong)} (target.name_or_path="
                        f"{facts.name}); give the target it was trained for, or a head trained for this one")


def check_early_exit(layers: int, facts: TargetFacts) -> None:
    """The early-exit baseline drafts with the target's first ``layers`` decoder layers: 1 <= layers < its count."""
    if not 1 <= layers < facts.num_layers:
        fix = (f"give early_exit_layers=1..{facts.num_layers - 1}" if facts.num_layers > 1 else
               "this target has too few layers for it")
        raise ConfigError(f"early_exit_layers={layers}: the early-exit baseline drafts with that many of the target's "
                          f"first layers, and target.name_or_path={facts.name} has {facts.num_layers}; {fix}, or "
                          "leave early_exit out of baselines")


def check_methods_fit(methods, facts: TargetFacts, settings: dict[str, str] | None = None) -> None:
    """Every method of an evaluation against the target's sizes: each head (``check_head_fits``; ``settings`` maps
    a head folder to the setting that named it, default ``head_dir``) and the early-exit baseline."""
    settings = settings or {}
    seen = set()
    for spec in methods:
        if spec.drafter == "early_exit":
            check_early_exit(spec.early_exit_layers, facts)
        elif spec.head_dir and spec.head_dir not in seen:
            seen.add(spec.head_dir)
            check_head_fits(settings.get(spec.head_dir, "head_dir"), spec.head_dir, facts)


def check_medusa_choices(setting: str, head_dir: str, choices) -> None:
    """``medusa_choices`` against a Medusa head: a path of ``d`` ranks needs ``d`` heads, a rank must be a row of the
    heads' vocabulary (read from its config.json)."""
    if not choices:
        return
    cfg = head_config(head_dir)
    heads = cfg.get("num_heads", cfg.get("medusa_num_heads"))
    depth = max(len(c) for c in choices)
    if isinstance(heads, int) and depth > heads:
        deepest = next(list(c) for c in choices if len(c) == depth)
        raise ConfigError(f"medusa_choices: the path {deepest} is {depth} ranks deep, but the Medusa head in "
                          f"{setting}={head_dir} has {heads} heads (one per depth; num_heads in its config.json): "
                          f"give paths of at most {heads} ranks")
    vocab = cfg.get("truncated_vocab_size") or cfg.get("vocab_size")
    top = max(max(c) for c in choices)
    if isinstance(vocab, int) and top >= vocab:
        raise ConfigError(f"medusa_choices: rank {top} is past the {vocab} tokens each head of {setting}={head_dir} "
                          "ranks: give ranks below it (0 = each head's best token)")


def check_auto_shape(setting: str, head_dir: str, prompts) -> None:
    """head_shape=auto on an EAGLE head: its training-time measures (``measured_reach1..`` and a held-out split
    that leaves the scored chats out) must be in its train_summary.json, or the shape choice fails mid-evaluation."""
    from specheads.evaluation.prompts import scored_chat_ids
    from specheads.evaluation.shape_choice import check_heldout_split, measured_reach

    if not measured_reach(head_dir):
        raise UserError(f"head_shape=auto needs the acceptance per draft depth measured at training (measured_reach1.."
                        f" in the train_summary.json of {setting}={head_dir}, written when training ran with "
                        "train.measure_prompts > 0); retrain with it, or set head_shape=tree")
    check_heldout_split(setting, head_dir, scored_chat_ids(list(prompts)))


def check_draft_model(two_model: str) -> None:
    """The two-model baseline's draft model can be read here (a folder, .gguf file or hub id:
    ``check_target_source``), named by its setting."""
    from specheads.targets.files import check_target_source

    try:
        check_target_source(two_model)
    except InputNotFoundError as e:
        why = str(e).split(";")[0].replace(f"target '{two_model}'", "").lstrip(": ")
        raise InputNotFoundError(f"two_model={two_model}: {why}; give a smaller model sharing the target's tokenizer "
                                 "(a folder holding config.json, a .gguf file, or a hub id in the Hugging Face cache)"
                                 ) from None


def check_ngram_table(path: str) -> None:
    """head_ngram_table: a feature store (manifest.json) or a prepared dataset folder."""
    from specheads.data.prepare import META_FILE

    root = Path(path)
    if not root.is_dir():
        raise InputNotFoundError(f"head_ngram_table={path}: no such folder; give a feature store (`specheads "
                                 "collect`) or a prepared dataset (`specheads prepare`)")
    if not (root / "manifest.json").is_file() and not (root / META_FILE).is_file():
        raise InputNotFoundError(f"head_ngram_table={path} is neither a feature store (no manifest.json) nor a "
                                 f"prepared dataset (no {META_FILE}); give the output_dir of `specheads collect` "
                                 "or of `specheads prepare`")
