"""The evaluator's drafters: a ``MethodSpec`` to the ``Drafter`` it names (``make_drafter``: the baselines, and each
head through ``specheads.heads.load_head`` and its family's builder), and the n-gram table a prompt-lookup branch
continues drafts from (``load_ngram_table``). ``suite.build_drafter`` adds the branch.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from specheads.data.features import FeatureDataset
from specheads.data.prepare import check_prepared_matches, load_prepared
from specheads.data.render import chat_id
from specheads.data.store import ARGMAX_KEY
from specheads.decoding.drafters import Drafter, EarlyExitDrafter, ModelDrafter, NgramDrafter, TreeShape
from specheads.decoding.lookahead import LookaheadDrafter
from specheads.decoding.ngram_table import NgramTable
from specheads.decoding.suffix_drafter import SuffixDrafter
from specheads.decoding.tree import normalize_choices
from specheads.errors import InputNotFoundError
from specheads.evaluation.spec import MethodSpec
from specheads.families import family
from specheads.heads import check_adapted_target, load_head, resolve_head_dir
from specheads.methods.medusa import tree_for_head
from specheads.targets import Target, load_target

log = logging.getLogger(__name__)


def make_drafter(spec: MethodSpec, target: Target, seed: int = 0) -> Drafter:
    """The drafter ``spec`` names, without a prompt-lookup branch: a baseline, or a head (``load_head``) through its
    family's builder; ``seed``: the lookahead baseline's."""
    if spec.drafter == "ngram":
        return NgramDrafter(k=spec.shape.k, max_ngram=spec.ngram_max)
    if spec.drafter == "lookahead":
        window, ngram, guesses = spec.lookahead
        return LookaheadDrafter(window, ngram, guesses, seed=seed)
    if spec.drafter == "suffix":
        return SuffixDrafter(k=spec.shape.k)
    if spec.drafter == "early_exit":
        return EarlyExitDrafter(target.model, spec.early_exit_layers, spec.shape)
    if spec.drafter == "two_model":
        return _two_model(spec, target)
    head = resolve_head_dir(spec.head_dir)
    fam = family(spec.drafter)
    model = load_head(head, target, expect=fam.name)  # ours or another toolkit's, checked against the target
    check_adapted_target(model, head, target)
    if fam.calibrated_tree and spec.shape.kind == "static":
        spec = _static_tree(spec, head, model.config.num_heads)
    return fam.build_drafter(model, target, spec)


def _static_tree(spec: MethodSpec, head: str, num_heads: int) -> MethodSpec:
    """``spec`` with the static tree its drafter reads: the choices given, normalized, or without choices the head's
    training-time calibration (or a fixed default), never fitted on the prompts scored (then ``spec.shape`` itself
    becomes that tree). Sets ``spec.tree_source``."""
    if spec.shape.choices:
        spec.tree_source = spec.tree_source or "medusa_choices (given)"
        return replace(spec, shape=TreeShape("static", choices=tuple(normalize_choices(spec.shape.choices))))
    choices, spec.tree_source = tree_for_head(head, num_heads, spec.medusa_tree_nodes)
    spec.shape = TreeShape("static", choices=tuple(choices))
    log.info("%s: static tree of %d nodes from %s", spec.name, len(choices), spec.tree_source)
    return spec


def _two_model(spec, target) -> Drafter:
    """A smaller model sharing the target's tokenizer as the drafter."""
    small = load_target(spec.draft_model, dtype=target.dtype, device=target.device)
    if target.tokenizer is not None and small.tokenizer is not None \
            and small.tokenizer_fingerprint() != target.tokenizer_fingerprint():
        if small.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft model {spec.draft_model} does not share the target's tokenizer")
    return ModelDrafter(small.model, spec.shape, name="two_model")


def load_ngram_table(path: str, target: Target, exclude_ids=(), orders=(3, 2),
                     max_tokens: int | None = 1_000_000) -> NgramTable:
    """The n-gram table (``NgramTable``) of a feature store (its tokens, with the target's argmax as the
    next token where the store holds it) or of a prepared dataset (its tokens), rows ``exclude_ids`` left
    out (sample ids, or chat ids: every per-turn sample of the chat; the evaluator passes the chats it
    scores), rows read in order until ``max_tokens`` tokens (None: all; a GPU-scale
    store holds far more than a table needs, and only the shards read are opened and checksummed). The
    store or dataset must come from the target's tokenizer."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"the n-gram table's max_tokens must be >= 1 or None, got {max_tokens}")
    exclude_ids = set(map(str, exclude_ids))
    skip = lambda sid: str(sid) in exclude_ids or chat_id(sid) in exclude_ids  # noqa: E731
    root = Path(path)
    if not root.is_dir():
        raise InputNotFoundError(f"n-gram table source {path}: no such folder (give a feature store or a "
                                 "prepared dataset)")
    if (root / "manifest.json").exists():
        ds = FeatureDataset(root, target=target)
        keep = list(_leading(((i, n) for i, (sid, n) in enumerate(zip(ds.ids, ds.lengths)) if not skip(sid)),
                             max_tokens))
        rows = zip(ds.column_rows(keep, "input_ids"), ds.column_rows(keep, ARGMAX_KEY) or [None] * len(keep))
    else:
        data, meta = load_prepared(root)
        check_prepared_matches(meta, target)
        ids = (r["input_ids"] for r in data if not skip(str(r["id"])))  # one lazy pass
        rows = ((t, None) for t in _leading(((t, len(t)) for t in ids), max_tokens))
    return NgramTable.build(rows, orders)


def _leading(items, max_tokens: int | None):
    """The leading items of ``(item, n_tokens)`` pairs while their tokens add up to at most ``max_tokens``
    (None: all; at least one)."""
    total = 0
    for k, (item, n) in enumerate(items):
        if k and max_tokens is not None and total + n > max_tokens:
            return
        yield item
        total += n
