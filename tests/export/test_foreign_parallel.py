"""P-EAGLE and DSpark heads trained elsewhere (specheads/export/foreign.py), in speculators 0.9's format: our own exports
read back without specheads_export.json, folders written the way speculators writes them, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specheads.export.foreign import ForeignHeadError, foreign_format, load_foreign_head, read_foreign_head
from specheads.export.layouts import TargetInfo
from specheads.models.dspark import DSparkConfig, DSparkModel
from specheads.models.peagle import PEagleConfig, PEagleModel
from tests.conftest import make_tiny_target
from tests.export.test_export import H, V, _randomize, save_head
from tests.export.test_foreign import _edit_config, assert_refused, foreign_export
from tests.export.test_foreign_families import _edit_weights, _qwen3_layer, assert_same_state

LAYERS, MASK, DV, RANK = 8, 255, 200, 16
INFO = TargetInfo("tiny", H, V, LAYERS)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


def peagle_head(target, aux=(2, 4, 5), draft_vocab: int = DV, fc_norm: bool = False) -> PEagleModel:
    cfg = PEagleConfig.from_target(target, draft_vocab, aux_layers=aux, fc_norm=fc_norm, num_layers=2, num_depths=4,
                                   mask_token_id=MASK)
    head = _randomize(PEagleModel(cfg))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(1))[:draft_vocab]] = True
    ids = t2d.nonzero().flatten()
    head.set_draft_vocab(ids - torch.arange(draft_vocab), t2d)
    return head.eval()


def dspark_head(target, aux=(2, 4, 5), confidence: bool = True) -> DSparkModel:
    cfg = DSparkConfig.from_target(target, num_layers=2, block_size=4, aux_layers=aux, mask_token_id=MASK,
                                   markov_rank=RANK)
    cfg.enable_confidence_head = confidence
    return _randomize(DSparkModel(cfg)).eval()


HEADS = {"peagle": peagle_head, "dspark": dspark_head}


def _drop(folder: Path, *keys: str) -> None:
    """``keys`` removed from config.json (the format's default applies)."""
    cfg = json.loads((folder / "config.json").read_text())
    for key in keys:
        del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- our exports, read back


@pytest.mark.parametrize("method", ["peagle", "dspark"])
def test_our_speculators_exports_read_back(method, target, target_dir, tmp_path):
    """No provenance file: the family from speculators_model_type, every field and tensor equal to the original head's
    (unsorted aux layers: fc's and mask_hidden's column blocks put back in the head's order)."""
    head = HEADS[method](target, aux=(5, 2, 4))
    out = foreign_export(head, "speculators", tmp_path, target_dir)
    assert foreign_format(out) == "speculators" and foreign_format(save_head(head, tmp_path / "again")) is None
    read = read_foreign_head(out, INFO)
    assert read.format == "speculators" and read.method == method
    assert read.config["aux_layers"] == [2, 4, 5] and read.config["mask_token_id"] == MASK
    expected = head.state_dict()
    for name in ("fc.weight", "mask_hidden"):  # the blocks follow ascending layers; ours were (5, 2, 4)
        if name in expected:
            blocks = expected[name].chunk(3, dim=1)
            expected[name] = torch.cat([blocks[1], blocks[2], blocks[0]], dim=1)
    assert set(read.state) == set(expected)
    for name, t in expected.items():
        assert torch.equal(read.state[name], t), name
    if method == "peagle":
        assert read.config["num_depths"] == 4 and read.config["num_hidden_layers"] == 2
        assert read.config["draft_vocab_size"] == DV
    else:
        assert read.config["block_size"] == 4 and read.config["markov_rank"] == RANK
    model = load_foreign_head(out, target)  # the target's embedding (and DSpark's LM head) it carries: checked
    assert type(model) is type(head)


# --------------------------------------------------------------------------- folders as speculators writes them


def _llama_layer(layers: int = 2) -> dict:
    return {"model_type": "llama", **{k: v for k, v in _qwen3_layer(layers).items() if k not in (
        "use_sliding_window", "max_window_layers")}, "layer_types": ["full_attention"] * layers}


def _speculators_config(algorithm: str, tokens: int | None = 4) -> dict:
    method = {"proposal_type": "greedy"} | ({} if tokens is None else {"speculative_tokens": tokens})
    return {"algorithm": algorithm, "default_proposal_method": "greedy", "proposal_methods": [method],
            "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}}


def speculators_peagle_folder(root: Path, head: PEagleModel, target, **config) -> Path:
    """speculators 0.9's ``PEagleDraftModel.save_pretrained`` (a ``--draft-arch llama`` head with full attention):
    every PEagleSpeculatorConfig field written, ``num_depths`` as the proposal's speculative_tokens, tensors
    ``layers.0.*`` .. ``layers.{L-1}.*``, ``mask_hidden`` of shape (1, 1, W), the target's ``embed_tokens`` (speculators
    saves it for EAGLE-3), ``d2t``/``t2d``, bfloat16."""
    root.mkdir(parents=True)
    cfg = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "speculators_version": "0.9.0",
           "transformer_layer_config": _llama_layer(), "draft_vocab_size": DV, "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_fc": False,
           "fc_norm": False, "norm_output": False, "embed_requires_grad": True, "mask_token_id": MASK,
           "torch_dtype": "bfloat16", "speculators_config": _speculators_config("peagle"), **config}
    (root / "config.json").write_text(json.dumps(cfg))
    w = {}
    for name, t in head.state_dict().items():
        name = name.replace("midlayer.", "layers.0.", 1)
        w[name] = t if not t.is_floating_point() else t.to(torch.bfloat16)
    w["mask_hidden"] = w["mask_hidden"].unsqueeze(0)
    w["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    save_file(w, str(root / "model.safetensors"))
    return root


def speculators_dspark_folder(root: Path, head: DSparkModel, **config) -> Path:
    """speculators 0.9's ``DSparkDraftModel.save_pretrained``: DFlash's fields and its Markov and confidence fields,
    the layer config without model_type (Qwen3 to speculators), no embedding or LM head for a full vocabulary
    (ignored on save), bfloat16."""
    root.mkdir(parents=True)
    layer = {k: v for k, v in _qwen3_layer().items() if k != "rope_theta"}
    layer["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    cfg = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "speculators_version": "0.9.0",
           "transformer_layer_config": layer, "draft_vocab_size": V, "block_size": 4, "target_hidden_size": None,
           "aux_hidden_state_layer_ids": [2, 4, 5], "mask_token_id": MASK, "sliding_window_non_causal": False,
           "sample_from_anchor": False, "markov_rank": RANK, "markov_head_type": "vanilla",
           "enable_confidence_head": True, "confidence_head_with_markov": True, "torch_dtype": "bfloat16",
           "speculators_config": _speculators_config("dspark", 3), **config}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.to(torch.bfloat16) for n, t in head.state_dict().items()}, str(root / "model.safetensors"))
    return root


def test_a_speculators_peagle_folder(target, tmp_path):
    """mask_hidden (1, 1, W) read as (1, W); speculative_tokens as num_depths; bfloat16 stays bfloat16."""
    head = peagle_head(target)
    model = load_foreign_head(speculators_peagle_folder(tmp_path / "p", head, target), target)
    assert type(model) is PEagleModel and model.config.num_depths == 4 and model.config.mask_token_id == MASK
    assert model.config.aux_layers == [2, 4, 5] and model.config.num_hidden_layers == 2
    assert model.fc.weight.dtype == torch.bfloat16 and model.mask_hidden.shape == (1, 3 * H)
    assert_same_state(model.state_dict(), head)


def test_a_speculators_peagle_folder_with_its_defaults(target, tmp_path):
    """No aux ids: (2, N//2, N-3); no speculative_tokens: speculators' num_depths default 8; a full vocabulary: no maps."""
    head = peagle_head(target, draft_vocab=V)
    folder = speculators_peagle_folder(tmp_path / "p", head, target, eagle_aux_hidden_state_layer_ids=None,
                                       draft_vocab_size=V, speculators_config=_speculators_config("peagle", None))
    _edit_weights(folder, lambda w: [w.pop(k) for k in ("d2t", "t2d")])
    read = read_foreign_head(folder, INFO)
    assert read.config["aux_layers"] == [2, 4, 5] and read.config["num_depths"] == 8
    assert torch.equal(read.state["d2t"], torch.zeros(V, dtype=torch.long)) and bool(read.state["t2d"].all())


@pytest.mark.parametrize("confidence", [True, False])
def test_a_speculators_dspark_folder(confidence, target, tmp_path):
    head = dspark_head(target, confidence=confidence)
    folder = speculators_dspark_folder(tmp_path / "d", head, enable_confidence_head=confidence)
    model = load_foreign_head(folder, target)
    assert type(model) is DSparkModel and model.config.block_size == 4 and model.config.markov_rank == RANK
    assert (model.confidence_head is not None) == confidence and model.fc.weight.dtype == torch.bfloat16
    assert_same_state(model.state_dict(), head)


def test_a_speculators_dspark_folder_with_its_defaults(target, tmp_path):
    """Markov fields absent: speculators' rank 256 (here the tensors say 16: refused by shape), vanilla head, and the
    confidence head with the Markov embedding."""
    folder = speculators_dspark_folder(tmp_path / "d", dspark_head(target))
    _drop(folder, "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "block_size")
    read = read_foreign_head(folder, INFO)
    assert read.config["enable_confidence_head"] and read.config["confidence_head_with_markov"]
    assert read.config["block_size"] == 8  # speculators' DFlash default
    _drop(folder, "markov_rank")
    with pytest.raises(ForeignHeadError, match=r"'markov_head.markov_w1.weight' has shape \[256, 16\], expected "
                                               r"\[256, 256\]"):
        read_foreign_head(folder, INFO)


# --------------------------------------------------------------------------- refusals: one line, naming the folder


PEAGLE = {
    "missing tensor": (lambda f: _edit_weights(f, lambda w: w.pop("mask_hidden")), r"missing key\(s\) \['mask_hidden'\]"),
    "unknown tensor": (lambda f: _edit_weights(f, lambda w: w.update({"hidden_norm.weight": torch.ones(H)})),
                       r"unknown key\(s\) \['hidden_norm.weight'\]"),
    "mask_hidden shape": (lambda f: _edit_weights(f, lambda w: w.update({"mask_hidden": w["mask_hidden"][..., :2 * H]})),
                          r"'mask_hidden' has shape \[1, 128\], expected \[1, 192\]"),
    "more layers": (lambda f: _edit_config(f, transformer_layer_config={"num_hidden_layers": 3,
                                                                        "layer_types": ["full_attention"] * 3}),
                    r"missing key\(s\) \['layers.2.input_layernorm.weight'"),
    "invalid layer config": (lambda f: _edit_config(f, transformer_layer_config={"num_hidden_layers": 3}),
                             r"the draft layer's config is not a valid llama config: .*layer_types"),
    "vocabulary": (lambda f: _edit_config(f, transformer_layer_config={"vocab_size": 512}),
                   r"head vocab_size 512 != target tiny-llama vocab_size 256"),
    "layer ids": (lambda f: _edit_config(f, eagle_aux_hidden_state_layer_ids=[2, 4, 8]),
                  r"aux layers \[8\] do not exist in target tiny-llama \(8 layers\)"),
    "no mask token": (lambda f: _edit_config(f, mask_token_id=None), r"names no mask_token_id"),
    "mask token": (lambda f: _edit_config(f, mask_token_id=999), r"mask_token_id 999 is not a row of target tiny"),
    "qwen3 layer without q/k norms": (lambda f: _edit_config(f, transformer_layer_config={"model_type": "qwen3"}),
                                      r"missing key\(s\) \['layers.0.self_attn.k_norm.weight'"),
    "layer kind default (qwen3) without q/k norms": (lambda f: _edit_config(f, transformer_layer_config={
                                                         "model_type": None}),
                                                     r"missing key\(s\) \['layers.0.self_attn.k_norm.weight'"),
    "other layer type": (lambda f: _edit_config(f, transformer_layer_config={"layer_types": ["chunked_attention"] * 2}),
                         r"layer_types \['chunked_attention'\]"),
    "norm_before_fc": (lambda f: _edit_config(f, norm_before_fc=True),
                       r"norm_before_fc: true .* the specheads P-EAGLE head does not compute that"),
    "draft maps": (lambda f: _edit_weights(f, lambda w: w.update({"d2t": w["d2t"] + 1})), r"d2t and t2d disagree"),
    "carried embedding": (lambda f: _edit_weights(f, lambda w: w.update({"embed_tokens.weight":
                                                                         w["embed_tokens.weight"] + 1})),
                          r"embed_tokens.weight differs from target .*'s token embedding"),
}


@pytest.mark.parametrize("case", list(PEAGLE))
def test_peagle_refusals(case, target, tmp_path):
    assert_refused(lambda f: load_foreign_head(f, target),
                   speculators_peagle_folder(tmp_path / "p", peagle_head(target), target), *PEAGLE[case],
                   "speculators' format")


DSPARK = {
    "missing tensor": (lambda f: _edit_weights(f, lambda w: w.pop("markov_head.markov_w2.weight")),
                       r"missing key\(s\) \['markov_head.markov_w2.weight'\]"),
    "unknown tensor": (lambda f: _edit_weights(f, lambda w: w.update({"markov_head.gate_proj.weight":
                                                                     torch.ones(RANK, H + RANK)})),
                       r"unknown key\(s\) \['markov_head.gate_proj.weight'\]"),
    "confidence without markov": (lambda f: _edit_config(f, confidence_head_with_markov=False),
                                  r"'confidence_head.proj.weight' has shape \[1, 80\], expected \[1, 64\]"),
    "no confidence head": (lambda f: _edit_config(f, enable_confidence_head=False),
                           r"unknown key\(s\) \['confidence_head.proj.bias', 'confidence_head.proj.weight'\]"),
    "hidden size": (lambda f: _edit_config(f, transformer_layer_config={"hidden_size": 32, "head_dim": 8}),
                    r"head hidden_size 32 != target tiny"),
    "layer ids": (lambda f: _edit_config(f, aux_hidden_state_layer_ids=[2, 4, 9]),
                  r"aux layers \[9\] do not exist in target tiny"),
    "no mask token": (lambda f: _edit_config(f, mask_token_id=None), r"names no mask_token_id"),
    "sampled anchor": (lambda f: _edit_config(f, sample_from_anchor=True), r"sample_from_anchor: true, the anchor"),
    "sampled anchor by default": (lambda f: _drop(f, "sample_from_anchor"),
                                  r"sample_from_anchor: true \(absent: speculators' DSpark default\)"),
    "gated markov": (lambda f: _edit_config(f, markov_head_type="gated"), r"markov_head_type 'gated'"),
    "no markov head": (lambda f: _edit_config(f, markov_rank=0), r"markov_rank 0 \(no Markov head\)"),
    "sliding": (lambda f: _edit_config(f, transformer_layer_config={"layer_types": ["sliding_attention"] * 2}),
                r"layer\(s\) \[0, 1\] are sliding-window"),
    "draft vocabulary": (lambda f: _edit_config(f, draft_vocab_size=100), r"draft_vocab_size 100 != vocab_size 256"),
    "llama layer": (lambda f: _edit_config(f, transformer_layer_config={"model_type": "llama"}),
                    r"the draft layer is a llama layer"),
    "carried lm head": (lambda f: _edit_weights(f, lambda w: w.update({"lm_head.weight": torch.ones(V, H).bfloat16()})),
                        r"lm_head.weight differs from target .*'s LM head"),
}


@pytest.mark.parametrize("case", list(DSPARK))
def test_dspark_refusals(case, target, tmp_path):
    assert_refused(lambda f: load_foreign_head(f, target), speculators_dspark_folder(tmp_path / "d", dspark_head(target)),
                   *DSPARK[case], "speculators' format")
