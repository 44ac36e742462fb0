"""DFlash, Medusa and EAGLE-1 heads trained elsewhere (specheads/export/foreign.py): our own exports read back without
specheads_export.json, folders written the way z-lab, speculators 0.9, FasterDecoding and vLLM write them, and every
refusal (the EAGLE-3 formats: tests/export/test_foreign.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.export.foreign import ForeignHeadError, foreign_format, load_foreign_head, read_foreign_head
from specheads.export.layouts import TargetInfo
from specheads.models.dflash import DFlashConfig, DFlashModel
from specheads.models.eagle1 import Eagle1Model
from specheads.models.medusa import MedusaHeads
from tests.conftest import make_tiny_target
from tests.export.test_export import H, V, _randomize, make_head, save_head
from tests.export.test_foreign import _edit_config, assert_refused, foreign_export

LAYERS, MASK = 8, 255
INFO = TargetInfo("tiny", H, V, LAYERS)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


def dflash_head(target, aux) -> DFlashModel:
    cfg = DFlashConfig.from_target(target, num_layers=2, block_size=4, aux_layers=aux, mask_token_id=MASK)
    return _randomize(DFlashModel(cfg)).eval()


def head_of(method: str, target):
    return dflash_head(target, aux=(2, 4, 5)) if method == "dflash" else make_head(method, target, layers=2).eval()


def assert_same_state(state: dict, head) -> None:
    original = head.state_dict()
    assert set(state) == set(original)
    for name, t in original.items():
        assert torch.equal(state[name], t.to(state[name].dtype)), name


@pytest.mark.parametrize("method,engine,fmt", [("dflash", "vllm", "dflash"), ("dflash", "sglang", "dflash"),
                                               ("dflash", "speculators", "speculators"), ("medusa", "medusa", "medusa"),
                                               ("eagle1", "vllm", "eagle1"), ("eagle1", "sglang", "eagle1")])
def test_our_exports_read_back_as_foreign_heads(method, engine, fmt, target, target_dir, tmp_path):
    """No provenance file: the format is detected from config.json, the aux layers from each format's key (z-lab's
    count layer outputs), every tensor equal to the original head's."""
    head = head_of(method, target)
    out = foreign_export(head, engine, tmp_path, target_dir)
    assert foreign_format(out) == fmt and foreign_format(save_head(head, tmp_path / "again")) is None
    read = read_foreign_head(out, INFO)
    assert read.format == fmt and read.method == method
    assert_same_state(read.state, head)
    if method == "dflash":
        assert read.config["aux_layers"] == [2, 4, 5] and read.config["block_size"] == 4
        assert read.config["mask_token_id"] == MASK
    model = load_foreign_head(out, target)  # speculators' DFlash folder carries the target's embedding and LM head
    assert type(model) is {"dflash": DFlashModel, "medusa": MedusaHeads, "eagle1": Eagle1Model}[method]


def test_unsorted_aux_layers_give_the_same_dflash_features(target, target_dir, tmp_path):
    """A DFlash head trained on aux layers (5, 2, 4) read back as [2, 4, 5]: fed its own layer order, fc gives what the
    original's gives on its order."""
    head = dflash_head(target, aux=(5, 2, 4))
    model = load_foreign_head(foreign_export(head, "vllm", tmp_path, target_dir), target)
    assert model.config.aux_layers == [2, 4, 5]
    states = {i: torch.randn(1, 3, H, generator=torch.Generator().manual_seed(i)) for i in (2, 4, 5)}
    with torch.no_grad():
        a = head.fc(torch.cat([states[i] for i in (5, 2, 4)], -1))
        b = model.fc(torch.cat([states[i] for i in (2, 4, 5)], -1))
    torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- folders as the other toolkits write them


def _qwen3_layer(layers: int = 2) -> dict:
    return {"hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": H // 4, "num_hidden_layers": layers, "vocab_size": V, "rms_norm_eps": 1e-06,
            "max_position_embeddings": 512, "hidden_act": "silu", "rope_theta": 10000.0, "attention_bias": False,
            "layer_types": ["full_attention"] * layers, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "tie_word_embeddings": False}


def zlab_folder(root: Path, head: DFlashModel, **config) -> Path:
    """z-lab's published DFlash folder (``z-lab/Qwen3-8B-DFlash-b16``'s keys): a Qwen3 config with ``auto_map``,
    ``block_size``, ``num_target_layers``, ``dflash_config`` (layer *outputs*), bfloat16 weights, no embedding."""
    root.mkdir(parents=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, **_qwen3_layer(), "block_size": 4,
           "num_target_layers": LAYERS, "bos_token_id": 1, "eos_token_id": 2,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 4]}, "dtype": "bfloat16",
           "initializer_range": 0.02, "use_cache": True, "rope_scaling": None, "transformers_version": "4.57.1",
           **config}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.to(torch.bfloat16) for n, t in head.state_dict().items()}, str(root / "model.safetensors"))
    return root


def speculators_dflash_folder(root: Path, head: DFlashModel, **config) -> Path:
    """speculators 0.9's ``DFlashDraftModel.save_pretrained``: the layer config without ``model_type`` (Qwen3 to
    speculators), every field written, ``aux_hidden_state_layer_ids`` null for the default layers, no embedding or LM
    head for a full vocabulary (ignored on save)."""
    root.mkdir(parents=True)
    layer = {k: v for k, v in _qwen3_layer().items() if k != "rope_theta"}
    layer["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
           "transformer_layer_config": layer, "draft_vocab_size": V, "block_size": 4, "target_hidden_size": None,
           "aux_hidden_state_layer_ids": None, "mask_token_id": MASK, "sliding_window_non_causal": False,
           "sample_from_anchor": False, "torch_dtype": "bfloat16",
           "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy", "proposal_methods": [],
                                  "verifier": {"name_or_path": "org/tiny-llama",
                                               "architectures": ["LlamaForCausalLM"]}},
           **config}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.to(torch.bfloat16) for n, t in head.state_dict().items()}, str(root / "model.safetensors"))
    return root


def medusa_folder(root: Path, heads: MedusaHeads, **config) -> Path:
    """FasterDecoding's release: config.json of MedusaConfig (no sizes), ``medusa_lm_head.pt`` (``torch.save`` of the
    ``medusa_head`` ModuleList's state dict) in float16."""
    root.mkdir(parents=True)
    L = heads.config.num_hidden_layers
    cfg = {"medusa_num_heads": heads.config.num_heads, "medusa_num_layers": L,
           "base_model_name_or_path": "org/tiny-llama", "transformers_version": "4.34.0", **config}
    (root / "config.json").write_text(json.dumps(cfg))
    w = {}
    for name, t in heads.state_dict().items():
        parts = name.split(".")
        out = (f"{parts[1]}.{parts[3]}.linear.{parts[4]}" if parts[0] == "blocks" else f"{parts[1]}.{L}.weight")
        w[out] = t.half()
    torch.save(w, root / "medusa_lm_head.pt")
    return root


def eagle1_folder(root: Path, head: Eagle1Model, target, arch: str = "EagleLlamaForCausalLM") -> Path:
    """An EAGLE-1 draft as vLLM loads it: a Llama config, ``pytorch_model.bin`` with ``fc``, ``layers.*`` and the
    target's ``embed_tokens.weight`` (as the original EAGLE release carries it)."""
    root.mkdir(parents=True)
    cfg = {"architectures": [arch], "model_type": "llama", **{k: v for k, v in _qwen3_layer().items()
                                                             if k not in ("layer_types", "use_sliding_window",
                                                                          "sliding_window", "max_window_layers")}}
    (root / "config.json").write_text(json.dumps(cfg))
    w = dict(head.state_dict())
    w["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    torch.save(w, root / "pytorch_model.bin")
    return root


def test_a_zlab_folder(target, tmp_path):
    """target_layer_ids count decoder-layer outputs (ours are one more); bfloat16 stays bfloat16."""
    head = dflash_head(target, aux=(2, 4, 5))
    model = load_foreign_head(zlab_folder(tmp_path / "z", head), target)
    assert model.config.aux_layers == [2, 4, 5] and model.config.block_size == 4 and model.config.mask_token_id == MASK
    assert model.fc.weight.dtype == torch.bfloat16 and model.config.rope_parameters["rope_theta"] == 10000.0
    assert_same_state(model.state_dict(), head)


def test_a_zlab_folder_with_its_settings_at_the_top_level(target, tmp_path):
    """z-lab's loader reads each DFlash setting from dflash_config, else the top level; no block_size: its 16."""
    head = dflash_head(target, aux=(2, 4, 5))
    folder = zlab_folder(tmp_path / "z", head, dflash_config={}, mask_token_id=MASK, target_layer_ids=[1, 3, 4])
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["block_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    read = read_foreign_head(folder, INFO)
    assert read.config["aux_layers"] == [2, 4, 5] and read.config["block_size"] == 16
    assert read.config["mask_token_id"] == MASK


def test_a_speculators_dflash_folder_uses_the_default_layers(target, tmp_path):
    """aux_hidden_state_layer_ids null: speculators' default (2, N//2, N-3); a full-attention layer config with
    sliding_window_non_causal false (speculators' default) is bidirectional all the same."""
    head = dflash_head(target, aux=(2, 4, 5))
    model = load_foreign_head(speculators_dflash_folder(tmp_path / "s", head), target)
    assert model.config.aux_layers == [2, 4, 5] and model.config.block_size == 4
    assert_same_state(model.state_dict(), head)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_fasterdecoding_medusa_folder(layers, target, tmp_path):
    """Sizes from the target; medusa_lm_head.pt in float16; a one-block head with medusa_num_layers left out: the
    default 1."""
    from specheads.methods.medusa import medusa_for_target

    heads = _randomize(medusa_for_target(target, num_heads=3, num_layers=layers)).eval()
    folder = medusa_folder(tmp_path / "m", heads)
    if layers == 1:
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["medusa_num_layers"]
        (folder / "config.json").write_text(json.dumps(cfg))
    model = load_foreign_head(folder, target)
    assert model.config.num_heads == 3 and model.config.num_hidden_layers == layers and model.config.hidden_size == H
    assert_same_state(model.state_dict(), heads)


@pytest.mark.parametrize("arch", ["EagleLlamaForCausalLM", "LlamaForCausalLMEagle"])
def test_an_eagle1_folder_with_the_targets_embedding(arch, target, tmp_path):
    head = make_head("eagle1", target, layers=2).eval()
    folder = eagle1_folder(tmp_path / "e", head, target, arch)
    if arch == "LlamaForCausalLMEagle":  # SGLang's fc has a bias: a zero one
        w = torch.load(folder / "pytorch_model.bin", weights_only=True)
        w["fc.bias"] = torch.zeros(H)
        torch.save(w, folder / "pytorch_model.bin")
    model = load_foreign_head(folder, target)
    assert_same_state(model.state_dict(), head)


# --------------------------------------------------------------------------- refusals: one line, naming the folder


def _edit_weights(folder: Path, edit) -> None:
    path = next(p for p in folder.iterdir() if p.suffix in (".safetensors", ".pt", ".bin"))
    w = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    edit(w)
    if path.suffix == ".safetensors":
        save_file(w, str(path))
    else:
        torch.save(w, path)


def _bf16(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


ZLAB = {
    "missing tensor": (lambda f: _edit_weights(f, lambda w: w.pop("layers.1.self_attn.q_norm.weight")),
                       r"missing key\(s\) \['layers.1.self_attn.q_norm.weight'\]"),
    "unknown tensor": (lambda f: _edit_weights(f, lambda w: w.update({"mask_hidden": _bf16(3 * H)})),
                       r"unknown key\(s\) \['mask_hidden'\]"),
    "wrong shape": (lambda f: _edit_weights(f, lambda w: w.update({"fc.weight":
                                                                   w["fc.weight"][:, :2 * H].contiguous()})),
                    r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"),
    "hidden size": (lambda f: _edit_config(f, hidden_size=32, head_dim=8), r"head hidden_size 32 != target tiny"),
    "vocabulary": (lambda f: _edit_config(f, vocab_size=512), r"head vocab_size 512 != target tiny vocab_size 256"),
    "layer ids": (lambda f: _edit_config(f, dflash_config={"target_layer_ids": [1, 3, 8]}),
                  r"aux layers \[9\] do not exist in target tiny \(8 layers\)"),
    "target depth": (lambda f: _edit_config(f, num_target_layers=36), r"head num_target_layers 36 != target tiny"),
    "no layer ids": (lambda f: _edit_config(f, replace={"dflash_config": {"mask_token_id": MASK}}),
                     r"names no dflash_config.target_layer_ids"),
    "no mask token": (lambda f: _edit_config(f, replace={"dflash_config": {"target_layer_ids": [1, 3, 4]}}),
                      r"names no mask_token_id"),
    "mask token": (lambda f: _edit_config(f, dflash_config={"mask_token_id": 999}),
                   r"mask_token_id 999 is not a row of target tiny's embedding"),
    "causal": (lambda f: _edit_config(f, dflash_config={"causal": True}),
               r"dflash_config.causal: true; .*bidirectional"),
    "is_causal": (lambda f: _edit_config(f, is_causal=True), r"is_causal: true"),
    "sliding": (lambda f: _edit_config(f, layer_types=["full_attention", "sliding_attention"], sliding_window=8),
                r"layer\(s\) \[1\] are sliding-window"),
    "use_swa": (lambda f: _edit_config(f, dflash_config={"use_swa": True}), r"dflash_config.use_swa: true"),
    "embedding scale": (lambda f: _edit_config(f, dflash_config={"input_embedding_scale": 2.0}),
                        r"input_embedding_scale 2.0: the specheads DFlash head does not rescale"),
    "softcap": (lambda f: _edit_config(f, final_logit_softcapping=30.0), r"final_logit_softcapping 30.0"),
    "draft vocabulary": (lambda f: _edit_config(f, draft_vocab_size=100), r"draft_vocab_size 100 != vocab_size 256"),
    "mask embedding": (lambda f: torch.save(torch.zeros(H), f / "mask_embedding.pt"), r"mask_embedding.pt"),
    "attention bias": (lambda f: _edit_config(f, attention_bias=True), r"attention_bias=true"),
}


@pytest.mark.parametrize("case", list(ZLAB))
def test_zlab_refusals_name_the_folder_and_the_fault(case, target, tmp_path):
    assert_refused(lambda f: read_foreign_head(f, INFO), zlab_folder(tmp_path / "z", dflash_head(target, aux=(2, 4, 5))),
                   *ZLAB[case], "z-lab's DFlash format")


SPECULATORS = {
    "sampled anchor": (lambda f: _edit_config(f, sample_from_anchor=True), r"sample_from_anchor: true"),
    "llama layer": (lambda f: _edit_config(f, transformer_layer_config={"model_type": "llama"}),
                    r"the draft layer is a llama layer .* the specheads head has a qwen3 layer"),
    "draft vocabulary default": (lambda f: _edit_config(f, replace={"draft_vocab_size": None}),
                                 r"draft_vocab_size 32000 != vocab_size 256"),
    "draft maps": (lambda f: _edit_weights(f, lambda w: w.update({"d2t": torch.zeros(V, dtype=torch.long)})),
                   r"unknown key\(s\) \['d2t'\]"),
}


@pytest.mark.parametrize("case", list(SPECULATORS))
def test_speculators_dflash_refusals(case, target, tmp_path):
    folder = speculators_dflash_folder(tmp_path / "s", dflash_head(target, aux=(2, 4, 5)))
    read_foreign_head(folder, INFO)
    edit, message = SPECULATORS[case]
    if case == "draft vocabulary default":  # the key absent: speculators' default 32000
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["draft_vocab_size"]
        (folder / "config.json").write_text(json.dumps(cfg))
    else:
        edit(folder)
    with pytest.raises(ForeignHeadError, match=message) as e:
        read_foreign_head(folder, INFO)
    assert str(folder) in str(e.value) and "speculators" in str(e.value) and "\n" not in str(e.value)


def _scale_lm_head(w: dict) -> None:
    w["lm_head.weight"] = w["lm_head.weight"] * 3.0


def test_a_carried_lm_head_other_than_the_targets_is_refused(target, tmp_path):
    head = dflash_head(target, aux=(2, 4, 5))
    folder = zlab_folder(tmp_path / "z", head)
    own = target.model.lm_head.weight.detach().to(torch.bfloat16)
    _edit_weights(folder, lambda w: w.update({"lm_head.weight": own}))
    load_foreign_head(folder, target)
    _edit_weights(folder, _scale_lm_head)
    with pytest.raises(ForeignHeadError, match=r"lm_head.weight differs from target .*'s LM head"):
        load_foreign_head(folder, target)


MEDUSA = {
    "missing tensor": (lambda f: _edit_weights(f, lambda w: w.pop("2.1.linear.bias")),
                       r"missing key\(s\) \['2.1.linear.bias'\]"),
    "more heads": (lambda f: _edit_config(f, medusa_num_heads=4), r"missing key\(s\) \['3.0.linear.bias'"),
    "hidden size": (lambda f: _edit_config(f, hidden_size=32), r"head hidden_size 32 != target tiny hidden_size 64"),
    "vocabulary": (lambda f: _edit_weights(f, lambda w: w.update({"0.2.weight": torch.zeros(512, H).half()})),
                   r"'0.2.weight' has shape \[512, 64\], expected \[256, 64\]"),
}


@pytest.mark.parametrize("case", list(MEDUSA))
def test_medusa_refusals(case, target, tmp_path):
    assert_refused(lambda f: read_foreign_head(f, INFO), medusa_folder(tmp_path / "m", make_head("medusa", target)),
                   *MEDUSA[case], "original Medusa format")


EAGLE1 = {
    "vllm fc bias": ("EagleLlamaForCausalLM", lambda w: w.update({"fc.bias": torch.zeros(H)}),
                     r"unknown key\(s\) \['fc.bias'\]"),
    "trained fc bias": ("LlamaForCausalLMEagle", lambda w: w.update({"fc.bias": torch.ones(H)}),
                        r"fc.bias should be all zeros"),
    "input norm of layer 0": ("EagleLlamaForCausalLM",
                              lambda w: w.update({"layers.0.input_layernorm.weight": torch.ones(H)}),
                              r"unknown key\(s\) \['layers.0.input_layernorm.weight'\]"),
}


@pytest.mark.parametrize("case", list(EAGLE1))
def test_eagle1_refusals(case, target, tmp_path):
    arch, edit, message = EAGLE1[case]
    folder = eagle1_folder(tmp_path / "e", make_head("eagle1", target, layers=2).eval(), target, arch)
    if arch == "LlamaForCausalLMEagle":
        _edit_weights(folder, lambda w: w.update({"fc.bias": torch.zeros(H)}))
    read_foreign_head(folder, INFO)
    _edit_weights(folder, edit)
    with pytest.raises(ForeignHeadError, match=message) as e:
        read_foreign_head(folder, INFO)
    assert str(folder) in str(e.value) and "EAGLE-1 format" in str(e.value) and "\n" not in str(e.value)


def test_an_eagle1_embedding_other_than_the_targets_is_refused(target, tmp_path):
    folder = eagle1_folder(tmp_path / "e", make_head("eagle1", target, layers=2).eval(), target)
    load_foreign_head(folder, target)
    _edit_weights(folder, lambda w: w.update({"embed_tokens.weight": w["embed_tokens.weight"] + 1.0}))
    with pytest.raises(ForeignHeadError, match=r"embed_tokens.weight differs from target .*'s token embedding"):
        load_foreign_head(folder, target)
