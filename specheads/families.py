"""The drafter families: each named once, with what every stage needs to know about it.

    from specheads.families import FAMILIES, family, family_of_model_type
    family("eagle3").vllm_method                 # "eagle3"
    family_of_model_type("specheads_dflash")     # the DFlash entry
    family("medusa2").name                       # "medusa" (a training method's name is an alias)

A family is one kind of trained draft head: one model class (``models/``), one or more training methods
(``methods/``: Medusa-1 and Medusa-2 train the same heads), one drafter (``decoding/``), its export layouts
(``export/layouts.py``) and what the engines call it. Stages read this table instead of keeping their own;
``tests/test_families.py`` checks that each stage covers every family here, and that no stage compares family
names outside the files of one family.

The training-free drafters the evaluator compares against (``BASELINES``) need no head and have no entry.

Classes and functions are named as ``"module:attribute"`` strings, imported on use (``load``): this module sits
below every stage and imports none of them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

BASELINES = ("ngram", "lookahead", "suffix", "early_exit", "two_model")  # the evaluator's drafters that need no head


@dataclass(frozen=True)
class Family:
    """One drafter family.

    name: the family's name (the evaluator's drafter, the export record's method, ``head_method=``).
    title: as a model card and report title it. model_type: the ``model_type`` of its saved head config.json.
    model, config: its ``PreTrainedModel`` and ``PretrainedConfig`` classes. methods: {training method name: its
    ``Method`` class} (``specheads train method=...``). target_states: what it drafts from, ``"last"`` (the target's
    final hidden state) or ``"aux"`` (hidden states of several target layers, which an engine hands only targets
    that implement vLLM's ``SupportsEagle3``). draft_vocab: the head drafts over a reduced vocabulary mapped by
    ``d2t``/``t2d``. layouts: {engine layout: the ``architectures`` entry written there} (``export/layouts.py``);
    empty: no layout of ours (an MTP head is stitched back into its target, ``export/mtp.py``). vllm_method: vLLM's
    ``speculative_config`` method (None: vLLM has none); vllm_extra: the fields that method needs besides.
    sglang_algorithm: SGLang's ``--speculative-algorithm`` (None: not served by SGLang). speculators_type: the
    ``speculators_model_type`` of speculators' folder of it, which we read and write. choose_shape:
    ``head_shape=auto`` can choose its chain or fan (a drafter that grows trees one draft step at a time). drafter:
    the builder of its evaluator ``Drafter`` (``(model, target, spec) -> Drafter``, in ``decoding/``).
    calibrated_tree: a static shape without choices drafts the tree calibrated at training (Medusa's
    ``medusa_tree.json``, ``methods/medusa.py:tree_for_head``). rows: the evaluator's planner of its own rows
    (``evaluation/plan.py``). vllm_profile: the evaluator adds a row of the top-1 chain vLLM drafts with it.
    drafts: what one draft step makes, for the serve commands' settings: ``"tree"`` (a chain or tree of any
    length, step by step), ``"block"`` (the ``block_size - 1`` slots of one block forward) or ``"depths"`` (the
    ``num_depths`` tokens of one forward). sglang_note: the serve commands' line where SGLang does not serve it.
    head_tensors, build_layout: ``export/layouts.py``'s functions of it: every tensor its head folder holds
    (``(cfg) -> {name: TensorSpec}``), and its folder for an engine of ``layouts``
    (``(cfg, engine, target, src, spec_tokens) -> Layout``). card_facts: the model card's rows about its head
    (``export/card.py``, ``(layout, cfg) -> [(fact, value)]``). foreign_config: the reader of another toolkit's
    config.json of it into our head config (``export/foreign.py``, ``(folder, fmt, cfg, target) -> dict``).
    """

    name: str
    title: str
    model_type: str
    model: str
    config: str
    methods: dict[str, str]
    target_states: str
    layouts: dict[str, str] = field(default_factory=dict)
    draft_vocab: bool = False
    vllm_method: str | None = None
    vllm_extra: dict = field(default_factory=dict)
    sglang_algorithm: str | None = None
    speculators_type: str | None = None
    choose_shape: bool = False
    drafter: str = ""
    calibrated_tree: bool = False
    rows: str = ""
    vllm_profile: bool = False
    drafts: str = "tree"
    sglang_note: str | None = None
    head_tensors: str = ""
    build_layout: str = ""
    card_facts: str = ""
    foreign_config: str = ""
    # its export is its target with the head stitched back in (``export/mtp.py``): that folder is the model served,
    # with no separate draft folder
    stitched: bool = False
    # engine layouts written as one folder that each of those engines serves (z-lab's DFlash format: vLLM and SGLang);
    # a layout outside it is read by its own engine only
    one_folder: tuple[str, ...] = ()
    # the engine layout TGI's ``text-generation-launcher`` serves too (the serve commands add its line); None: none
    tgi_layout: str | None = None
    # the model card repeats its "served by" row above the serve commands (engine support that is easy to miss)
    card_served_by_note: bool = False
    # the model card's line after the serve commands of its speculators folder (``{folder}``: the folder they name)
    speculators_card_note: str | None = None
    # the target LM-head columns its training loss takes per trained row (``planning.label_columns``): "full" (the
    # whole distribution), "draft" (the stored argmax, then its draft vocabulary's columns), "labels" (none on the
    # data's tokens, the whole distribution when distilled from the target), "argmax" (none on the data's tokens,
    # else the target's argmax computed online)
    label_columns: str = "full"
    # it trains on a store's image rows (their M-RoPE positions; ``FeatureSpec.image_rows``, the method class's
    # ``trains_image_rows``)
    image_rows: bool = False
    # its training methods that train on online features only (a feature store would go stale: Medusa-2 trains the
    # target with its heads; ``FeatureSpec.online_only``)
    online_methods: tuple[str, ...] = ()
    # one draft forward makes every depth (Medusa's heads run side by side): the recommendation keeps the measured
    # draft forwards per step at each shorter depth instead of scaling them with depth (``evaluation/recommend.py``)
    one_forward: bool = False
    # its head reads the token embedding, so another toolkit's folder of it may carry the target's copy (Medusa's heads
    # read none; ``export/foreign.py``)
    token_embedding: bool = True
    # another toolkit's folder of it may carry a copy of the target's LM head, which the head borrows
    lm_head_copy: bool = False
    # ``dflash_config.projector_type`` of a z-lab-format folder of it (ModelOpt's exports of DFlash's variants); None:
    # a folder naming none is DFlash's own
    projector_type: str | None = None

    @property
    def aliases(self) -> tuple[str, ...]:
        """The names that mean this family: its own, then its training methods' (``medusa1``, ``medusa2``)."""
        return (self.name, *(m for m in self.methods if m != self.name))

    @property
    def exported(self) -> bool:
        """Whether ``export/layouts.py`` writes it (an MTP head is stitched into its target instead)."""
        return bool(self.layouts)

    @property
    def aux_states(self) -> bool:
        return self.target_states == "aux"

    def model_class(self):
        return load(self.model)

    def config_class(self):
        return load(self.config)

    def build_drafter(self, model, target, spec):
        """The family's evaluator drafter over a loaded head (``drafter``: its builder in ``decoding/``, which places
        the head on the target and returns the ``Drafter``); ``spec``: the evaluator's ``MethodSpec``."""
        return load(self.drafter)(model, target, spec)


def load(ref: str):
    """The attribute a ``"module:attribute"`` string names."""
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


_DRAFTERS, _ROWS = "specheads.decoding.", "specheads.evaluation.plan:"
_LAYOUTS, _CARD, _FOREIGN = "specheads.export.layouts:", "specheads.export.card:", "specheads.export.foreign:"
_DOMINO = "specheads.export.domino:"  # Domino's export functions, in its own file
FAMILIES: tuple[Family, ...] = (
    Family("medusa", "Medusa", "medusa", "specheads.models.medusa:MedusaHeads", "specheads.models.medusa:MedusaConfig",
           {"medusa1": "specheads.methods.medusa:Medusa1Method", "medusa2": "specheads.methods.medusa:Medusa2Method"},
           "last", layouts={"vllm": "MedusaModel", "medusa": "MedusaModel"}, vllm_method="medusa",
           head_tensors=_LAYOUTS + "medusa_tensors", build_layout=_LAYOUTS + "medusa_layout",
           card_facts=_CARD + "medusa_facts", foreign_config=_FOREIGN + "medusa_config",
           sglang_note="# SGLang: no Medusa support (no Medusa loader in SGLang 0.5.23): serve with vLLM up to 0.32 "
                       "(the line above) or TGI",
           drafter=_DRAFTERS + "head_drafters:medusa_drafter", rows=_ROWS + "medusa_rows", vllm_profile=True,
           calibrated_tree=True, tgi_layout="medusa", card_served_by_note=True, label_columns="labels",
           online_methods=("medusa2",), one_forward=True, token_embedding=False),
    Family("eagle1", "EAGLE-1", "specheads_eagle1", "specheads.models.eagle1:Eagle1Model",
           "specheads.models.eagle1:Eagle1Config", {"eagle1": "specheads.methods.eagle1:Eagle1Method"}, "last",
           layouts={"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}, vllm_method="eagle",
           head_tensors=_LAYOUTS + "eagle1_tensors", build_layout=_LAYOUTS + "eagle1_layout",
           card_facts=_CARD + "eagle1_facts", foreign_config=_FOREIGN + "eagle1_config",
           sglang_algorithm="EAGLE", drafter=_DRAFTERS + "head_drafters:eagle_drafter", rows=_ROWS + "eagle_rows",
           vllm_profile=True, choose_shape=True),
    Family("eagle3", "EAGLE-3", "specheads_eagle3", "specheads.models.eagle3:Eagle3Model",
           "specheads.models.eagle3:Eagle3Config", {"eagle3": "specheads.methods.eagle3:Eagle3Method"}, "aux",
           layouts={"vllm": "LlamaForCausalLMEagle3", "sglang": "LlamaForCausalLMEagle3",
                    "speculators": "Eagle3DraftModel"},
           head_tensors=_LAYOUTS + "eagle3_tensors", build_layout=_LAYOUTS + "eagle3_layout",
           card_facts=_CARD + "eagle3_facts", foreign_config=_FOREIGN + "eagle3_config",
           draft_vocab=True, vllm_method="eagle3", sglang_algorithm="EAGLE3", speculators_type="eagle3",
           drafter=_DRAFTERS + "head_drafters:eagle_drafter", rows=_ROWS + "eagle_rows", vllm_profile=True,
           choose_shape=True, label_columns="draft", image_rows=True,
           speculators_card_note="With speculators itself: `from speculators import SpeculatorModel; "
                                 "SpeculatorModel.from_pretrained({folder!r})`."),
    Family("dflash", "DFlash", "specheads_dflash", "specheads.models.dflash:DFlashModel",
           "specheads.models.dflash:DFlashConfig", {"dflash": "specheads.methods.dflash:DFlashMethod"}, "aux",
           # z-lab's format, one folder both engines load (vLLM registry -> qwen3_dflash.DFlashQwen3ForCausalLM,
           # SGLang srt/models/dflash.py EntryClass); speculators' format, which vLLM converts (algos.update_dflash)
           layouts={"vllm": "DFlashDraftModel", "sglang": "DFlashDraftModel", "speculators": "DFlashSpeculator"},
           head_tensors=_LAYOUTS + "dflash_tensors", build_layout=_LAYOUTS + "dflash_layout",
           card_facts=_CARD + "dflash_facts", foreign_config=_FOREIGN + "dflash_config",
           vllm_method="dflash", sglang_algorithm="DFLASH", speculators_type="dflash",
           drafter=_DRAFTERS + "head_drafters:dflash_drafter", rows=_ROWS + "dflash_rows", drafts="block",
           one_folder=("vllm", "sglang"), label_columns="argmax", lm_head_copy=True, projector_type="dflash",
           speculators_card_note="SGLang cannot read this folder (no speculators-format reader in 0.5.23): serve the "
                                 "`sglang/` (or `vllm/`) export with `--speculative-algorithm DFLASH` instead."),
    Family("peagle", "P-EAGLE", "specheads_peagle", "specheads.models.peagle:PEagleModel",
           "specheads.models.peagle:PEagleConfig", {"peagle": "specheads.methods.peagle:PEagleMethod"}, "aux",
           # EAGLE-3's loader, served with parallel_drafting: true; speculators' peagle format (algos.update_peagle)
           layouts={"vllm": "LlamaForCausalLMEagle3", "speculators": "PEagleSpeculator"}, draft_vocab=True,
           head_tensors=_LAYOUTS + "peagle_tensors", build_layout=_LAYOUTS + "peagle_layout",
           card_facts=_CARD + "peagle_facts", foreign_config=_FOREIGN + "peagle_config",
           vllm_method="eagle3", vllm_extra={"parallel_drafting": True}, speculators_type="peagle",
           drafter=_DRAFTERS + "peagle_drafter:peagle_drafter", rows=_ROWS + "peagle_rows", drafts="depths",
           sglang_note="# SGLang: no parallel-drafting EAGLE (P-EAGLE) in SGLang 0.5.23: serve with vLLM (the line "
                       "above)"),
    Family("mtp", "MTP", "specheads_mtp", "specheads.models.mtp:MTPModel", "specheads.models.mtp:MTPConfig",
           {"mtp": "specheads.methods.mtp:MTPMethod"}, "last", vllm_method="mtp", stitched=True,
           drafter=_DRAFTERS + "mtp_drafter:mtp_drafter", rows=_ROWS + "mtp_rows"),
    Family("dspark", "DSpark", "specheads_dspark", "specheads.models.dspark:DSparkModel",
           "specheads.models.dspark:DSparkConfig", {"dspark": "specheads.methods.dspark:DSparkMethod"}, "aux",
           # vLLM registry -> qwen3_dspark.Qwen3DSparkForCausalLM; kept by vLLM's algos.update_dspark
           layouts={"vllm": "Qwen3DSparkModel", "speculators": "Qwen3DSparkModel"},
           head_tensors=_LAYOUTS + "dspark_tensors", build_layout=_LAYOUTS + "dspark_layout",
           card_facts=_CARD + "dspark_facts", foreign_config=_FOREIGN + "dspark_config",
           # the confidence head sizes each request's verified drafts (vLLM's V2 runner)
           vllm_method="dspark", vllm_extra={"enable_adaptive_verification": True}, speculators_type="dspark",
           lm_head_copy=True,
           drafter=_DRAFTERS + "dspark_drafter:dspark_drafter", rows=_ROWS + "dspark_rows", drafts="block",
           sglang_note="# SGLang: its DSpark loader was not checked against this layout: serve with vLLM's GPU build "
                       "(above)"),
    Family("domino", "Domino", "specheads_domino", "specheads.models.domino:DominoModel",
           "specheads.models.domino:DominoConfig", {"domino": "specheads.methods.domino:DominoMethod"}, "aux",
           # z-lab's DFlash format with dflash_config.projector_type domino (ModelOpt's export), which SGLang's DFLASH
           # algorithm reads; vLLM has no Domino drafter
           layouts={"sglang": "DFlashDraftModel"}, head_tensors=_DOMINO + "domino_tensors",
           build_layout=_DOMINO + "domino_layout", card_facts=_DOMINO + "domino_facts",
           foreign_config=_DOMINO + "domino_config", sglang_algorithm="DFLASH", projector_type="domino",
           drafter=_DRAFTERS + "domino_drafter:domino_drafter", rows=_ROWS + "domino_rows", drafts="block"),
)
NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
_BY_ALIAS = {alias: f for f in FAMILIES for alias in f.aliases}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def family(name: str) -> Family:
    """The family ``name`` names (its own name or a training method's); ``KeyError`` for any other."""
    return _BY_ALIAS[name]


def find(name: str | None) -> Family | None:
    """The family ``name`` names, else None."""
    return _BY_ALIAS.get(name) if name is not None else None


def family_of_model_type(model_type: str | None) -> Family | None:
    """The family whose saved head config.json has ``model_type``, else None."""
    return _BY_MODEL_TYPE.get(model_type) if model_type is not None else None


def training_methods() -> dict[str, str]:
    """{training method name: its ``Method`` class}, in family order."""
    return {m: ref for f in FAMILIES for m, ref in f.methods.items()}


def aliases() -> dict[str, str]:
    """{every name that means a family: the family's name}, in family order."""
    return {alias: f.name for f in FAMILIES for alias in f.aliases}


def exported() -> tuple[str, ...]:
    """The families ``export/layouts.py`` writes, in family order."""
    return tuple(f.name for f in FAMILIES if f.exported)
