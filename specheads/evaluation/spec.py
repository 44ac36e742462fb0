"""One drafting configuration of an evaluation (``MethodSpec``): which drafter, its shape and verify rule, its
head folder and options; what the evaluator plans (``plan.py``), builds (``drafters.py``) and measures (``suite.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.decoding.drafters import TreeShape
from specheads.evaluation.shape_choice import measured_fans, measured_reach
from specheads.families import BASELINES, FAMILIES, NAMES, find

DRAFTERS = (*BASELINES, *NAMES)
HEADS = NAMES
# the ``model_type`` of each head family's saved config.json (checked against the drafter asked for)
HEAD_MODEL_TYPES = {f.name: f.model_type for f in FAMILIES}


@dataclass
class MethodSpec:
    """One drafting configuration.

    drafter: one of ``DRAFTERS`` (a baseline, or a head family of ``specheads/families.py``); shape:
    chain/dynamic/static (lookahead: its trie of verified n-grams, depth N-1, at most G branches; ``lookahead`` = (W, N, G));
    verify: auto | chain | tree | typical (T > 0; T = 0 is always greedy); profile: a serving
    engine this configuration reproduces (vllm, sglang) or None.
    """

    name: str
    drafter: str
    shape: TreeShape = field(default_factory=TreeShape)
    verify: str = "auto"
    ngram_max: int = 3
    lookahead: tuple[int, int, int] = (5, 4, 5)  # window W, n-gram size N, guesses G
    early_exit_layers: int = 8
    draft_model: str | None = None
    head_dir: str | None = None
    medusa_tree_nodes: int = 24
    profile: str | None = None
    tree_source: str | None = None  # where a static Medusa tree came from (set by build_drafter)
    auto_shape: bool = False  # EAGLE: a chain whose length is chosen at evaluation (``shape_choice``)
    ngram_branch: int = 0  # > 0: the prompt lookup's chain of this many tokens grafted onto every tree drafted
    # with the branch: the best ``ngram_extend`` first drafts continued by ``ngram_extend_len`` tokens from the
    # prompt lookup or the n-gram table of ``ngram_table`` (a feature store or prepared dataset: ``load_ngram_table``)
    ngram_extend: int = 0
    ngram_extend_len: int = 2
    ngram_table: str | None = None
    ngram_table_tokens: int = 1_000_000  # the table reads at most this many tokens of its corpus (rows in order)
    confidence_threshold: float | None = None  # DSpark: verify the drafts whose confidence survival reaches it

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"method '{self.name}': unknown drafter '{self.drafter}' (one of {', '.join(DRAFTERS)})")
        if self.drafter in HEADS and not self.head_dir:
            raise ValueError(f"method '{self.name}': drafter '{self.drafter}' needs head_dir")
        if self.auto_shape and not getattr(find(self.drafter), "choose_shape", False):
            raise ValueError(f"method '{self.name}': an automatic shape is chosen for EAGLE heads only")
        if self.drafter == "two_model" and not self.draft_model:
            raise ValueError(f"method '{self.name}': the two-model baseline needs draft_model")
        if self.ngram_branch < 0:
            raise ValueError(f"method '{self.name}': ngram_branch must be >= 0, got {self.ngram_branch}")
        if self.ngram_branch and self.drafter in ("ngram", "lookahead"):
            raise ValueError(f"method '{self.name}': a prompt-lookup branch goes on a head, early-exit or "
                             f"two-model drafter, not on '{self.drafter}'")
        if (self.ngram_extend or self.ngram_table) and not self.ngram_branch:
            raise ValueError(f"method '{self.name}': ngram_extend and ngram_table continue the drafts of a "
                             "prompt-lookup branch: set ngram_branch > 0 too")
        if self.ngram_extend < 0 or self.ngram_extend_len < 1:
            raise ValueError(f"method '{self.name}': ngram_extend must be >= 0 (got {self.ngram_extend}) and "
                             f"ngram_extend_len >= 1 (got {self.ngram_extend_len})")
        if self.ngram_table_tokens < 1:
            raise ValueError(f"method '{self.name}': ngram_table_tokens must be >= 1, got {self.ngram_table_tokens}")
        if self.ngram_branch and self.verify == "chain":
            raise ValueError(f"method '{self.name}': a tree with a prompt-lookup branch is verified as a tree "
                             "(verify auto, tree or typical), not with the chain p/q test")

    def shape_label(self) -> str:
        """The shape as the report names it (with the prompt-lookup branch, if any)."""
        ext = f"+x{self.ngram_extend}.{self.ngram_extend_len}" if self.ngram_extend else ""
        return self.shape.label() + (f"+ngram{self.ngram_branch}{ext}" if self.ngram_branch else "")


def chain_spec(drafter: str, k: int, **kw) -> MethodSpec:
    """Convenience: a chain-of-k method spec."""
    return MethodSpec(f"{drafter}-chain{k}", drafter, TreeShape("chain", k=k), **kw)


def draft_rows(spec: MethodSpec) -> int:
    """The most rows one verify forward feeds per batch row for ``spec``: the pending token, the largest draft its
    shape allows (an automatic shape: the measured fans and reach of its head) and the prompt-lookup branch."""
    shape = spec.shape
    sizes = [shape.k if shape.kind == "chain" else shape.total_tokens, len(shape.choices or ()),
             spec.medusa_tree_nodes if getattr(find(spec.drafter), "calibrated_tree", False) else 0,
             spec.lookahead[2] * (spec.lookahead[1] - 1) if spec.drafter == "lookahead" else 0]
    if spec.auto_shape and spec.head_dir:
        sizes += [len(measured_reach(spec.head_dir)), *measured_fans(spec.head_dir)]
    return 1 + max(sizes) + spec.ngram_branch + spec.ngram_extend * spec.ngram_extend_len
