"""EAGLE-3 heads trained elsewhere (specheads/export/foreign.py): our own speculators/vllm/sglang exports read back
without specheads_export.json, folders written the way speculators 0.9 and SpecForge write them, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.export import export_head
from specheads.export.foreign import ForeignHeadError, foreign_format, load_foreign_head, read_foreign_head
from specheads.export.layouts import TargetInfo
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from tests.conftest import make_tiny_target
from tests.export.test_export import H, V, make_head, save_head

LAYERS, DV = 8, 100
INFO = TargetInfo("tiny", H, V, LAYERS)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


def foreign_export(head, engine: str, root: Path, target_dir: Path) -> Path:
    """``head`` exported for ``engine``, its specheads_export.json removed: what a user downloads from the Hub."""
    out = export_head(save_head(head, root), root / "out", engine, str(target_dir))
    (out / "specheads_export.json").unlink()
    (out / "README.md").unlink()
    return out


@pytest.mark.parametrize("engine,fmt", [("speculators", "speculators"), ("vllm", "eagle3"), ("sglang", "eagle3")])
def test_our_exports_read_back_as_foreign_heads(engine, fmt, target, target_dir, tmp_path):
    """No provenance file: the format is detected from config.json, the aux ids from each engine's key (SGLang's
    count layer outputs), and every tensor equals the original head's."""
    head = make_head("eagle3", target, aux=(0, 2, 5)).eval()
    out = foreign_export(head, engine, tmp_path, target_dir)
    assert foreign_format(out) == fmt and foreign_format(save_head(head, tmp_path / "again")) is None
    read = read_foreign_head(out, INFO)
    assert read.format == fmt and read.config["aux_layers"] == [0, 2, 5]
    original = head.state_dict()
    assert set(read.state) == set(original)
    for name, t in original.items():
        assert torch.equal(read.state[name], t), name
    model = load_foreign_head(out, target)  # speculators' folder carries the target's embedding: checked equal
    assert type(model) is Eagle3Model and model.config.draft_vocab_size == DV


def test_unsorted_aux_layers_give_the_same_logits(target, target_dir, tmp_path):
    """A head trained on aux layers (5, 0, 2): the exported fc columns follow ascending layers, so the foreign head
    (aux [0, 2, 5]) fed its own layer order computes what the original computes on its own."""
    head = make_head("eagle3", target, aux=(5, 0, 2)).eval().attach(target)
    model = load_foreign_head(foreign_export(head, "vllm", tmp_path, target_dir), target).attach(target)
    assert model.config.aux_layers == [0, 2, 5]
    g = torch.Generator().manual_seed(3)
    T = 5
    states = {i: torch.randn(2, T, H, generator=g) for i in (0, 2, 5)}
    ids, pos = torch.randint(0, V, (2, T), generator=g), torch.arange(T).expand(2, T)
    with torch.no_grad():
        a = head.step(head.fuse(torch.cat([states[i] for i in (5, 0, 2)], -1)), ids, pos)
        b = model.step(model.fuse(torch.cat([states[i] for i in (0, 2, 5)], -1)), ids, pos)
    torch.testing.assert_close(a, b)  # fc sums its column blocks in another order: float32 rounding only


# --------------------------------------------------------------------------- folders as the other toolkits write them


def _weights(head: Eagle3Model, dtype) -> dict[str, torch.Tensor]:
    return {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in head.state_dict().items()}


def _llama_layer() -> dict:
    """The draft layer's config as speculators writes it (``LlamaConfig.to_diff_dict()``)."""
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": V, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-06, "head_dim": H // 4, "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "torch_dtype": "bfloat16"}


def speculators_folder(root: Path, head: Eagle3Model, target, aux=None, **config) -> Path:
    """speculators 0.9's ``Eagle3DraftModel.save_pretrained``: bfloat16 weights named ``layers.0.*``, the target's
    embedding included, no ``verifier_lm_head`` (ignored on save), aux ids null when trained on the default."""
    root.mkdir(parents=True)
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "transformer_layer_config": _llama_layer(), "draft_vocab_size": DV, "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": aux, "norm_before_fc": False,
           "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.57.1",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                  "verifier": {"name_or_path": "org/tiny-llama",
                                               "architectures": ["LlamaForCausalLM"]}},
           **config}
    (root / "config.json").write_text(json.dumps(cfg))
    w = {n.replace("midlayer.", "layers.0."): t for n, t in _weights(head, torch.bfloat16).items()}
    w["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    save_file(w, str(root / "model.safetensors"))
    return root


def specforge_folder(root: Path, head: Eagle3Model, eagle_config: dict | None = None) -> Path:
    """SpecForge's ``save_pretrained`` of ``LlamaForCausalLMEagle3`` (the embedding left out), written as the original
    EAGLE-3 release ships it: ``pytorch_model.bin`` in float16, names ``midlayer.*``, a Llama config with
    ``rope_theta`` and ``draft_vocab_size``."""
    root.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 2 * H, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "vocab_size": V, "draft_vocab_size": DV, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
           "head_dim": H // 4, "hidden_act": "silu", "rope_theta": 10000.0, "rope_scaling": None,
           "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False,
           "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    if eagle_config is not None:
        cfg["eagle_config"] = eagle_config
    (root / "config.json").write_text(json.dumps(cfg))
    torch.save(_weights(head, torch.float16), root / "pytorch_model.bin")
    return root


def _same_logits(ours: Eagle3Model, theirs: Eagle3Model, target) -> None:
    ours, theirs = ours.eval().attach(target), theirs.attach(target)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 4, 3 * H, generator=g)
    ids, pos = torch.randint(0, V, (1, 4), generator=g), torch.arange(4)[None]
    with torch.no_grad():
        torch.testing.assert_close(theirs.step(theirs.fuse(feats), ids, pos), ours.step(ours.fuse(feats), ids, pos))


def test_a_speculators_folder_without_aux_ids_uses_the_default_layers(target, tmp_path):
    """speculators 0.9 writes eagle_aux_hidden_state_layer_ids null for a head trained on the default: the verifier's
    (2, N//2, N-3), which vLLM captures too; bfloat16 weights stay bfloat16, as a specheads head's dtype stays."""
    head = make_head("eagle3", target, aux=(2, 4, 5)).to(torch.bfloat16).eval()
    folder = speculators_folder(tmp_path / "spec", head, target)
    model = load_foreign_head(folder, target)
    assert model.config.aux_layers == [2, 4, 5] and model.fc.weight.dtype == torch.bfloat16
    assert model.config.rope_parameters["rope_theta"] == 10000.0 and model.config.num_key_value_heads == 2
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    _same_logits(head, model, target)


@pytest.mark.parametrize("eagle_config,aux", [({"eagle_aux_hidden_state_layer_ids": [1, 3, 6],
                                                "use_aux_hidden_state": True}, [2, 4, 7]),
                                               (None, [2, 4, 5])])
def test_a_specforge_folder_reads_midlayer_names_and_its_layer_outputs(eagle_config, aux, target, tmp_path):
    """SpecForge's ids count decoder-layer outputs (SGLang's convention): ours are one more; none written: the
    default every engine captures. float16 weights from pytorch_model.bin."""
    head = make_head("eagle3", target, aux=aux).to(torch.float16).eval()
    model = load_foreign_head(specforge_folder(tmp_path / "sf", head, eagle_config), target)
    assert model.config.aux_layers == aux and model.fc.weight.dtype == torch.float16
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    _same_logits(head, model, target)


def test_the_original_format_with_layers_0_names_and_no_t2d(target, tmp_path):
    """vLLM reads ``layers.0.*`` like ``midlayer.*`` and skips t2d: a folder of that shape reads the same."""
    head = make_head("eagle3", target, aux=(2, 4, 5)).eval()
    folder = specforge_folder(tmp_path / "sf", head)
    w = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del w["t2d"]
    save_file({n.replace("midlayer.", "layers.0."): t for n, t in w.items()}, str(folder / "model.safetensors"))
    (folder / "pytorch_model.bin").unlink()
    model = load_foreign_head(folder, target)
    assert torch.equal(model.t2d, head.t2d) and torch.equal(model.midlayer.hidden_norm.weight,
                                                            head.midlayer.hidden_norm.weight.half())


@pytest.mark.parametrize("writer", ["speculators", "vllm", "specforge"])
def test_a_full_draft_vocabulary(writer, target, target_dir, tmp_path):
    """A draft vocabulary as large as the target's: speculators and vLLM folders carry no d2t (speculators no t2d
    either), SpecForge's carries identity maps; all read as the identity."""
    head = make_head("eagle3", target, draft_vocab=V, aux=(2, 4, 5)).eval()
    if writer == "specforge":
        folder = specforge_folder(tmp_path / "sf", head)
        _edit_config(folder, draft_vocab_size=V)
    else:
        folder = foreign_export(head, writer, tmp_path, target_dir)
        assert "d2t" not in load_file(str(folder / "model.safetensors"))
    model = load_foreign_head(folder, target)
    assert not model.d2t.any() and bool(model.t2d.all())
    assert torch.equal(model.lm_head.weight, head.lm_head.weight.to(model.lm_head.weight.dtype))


NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def _norm_head(target, **norms) -> Eagle3Model:
    head = make_head("eagle3", target, aux=(2, 4, 5))
    model = Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=(2, 4, 5), **norms))
    missing, _ = model.load_state_dict(head.state_dict(), strict=False)
    with torch.no_grad():
        for name in missing:  # input_norm: a trained-looking weight, not ones
            model.get_parameter(name).copy_(torch.rand_like(model.get_parameter(name)) + 0.5)
    return model.eval()


@pytest.mark.parametrize("norms", [NORMS, {"norm_before_residual": True}, {"norm_output": True},
                                   {"norm_before_fc": True}])
def test_a_speculators_folder_with_its_normalisations_reads_into_the_same_head(norms, target, tmp_path):
    """speculators' defaults (norm_before_residual, norm_before_fc with its ``input_norm``, norm_output) are read as
    the EAGLE-3 head's options: the same tensors and the same logits over two draft steps."""
    head = _norm_head(target, **norms).to(torch.bfloat16)
    folder = speculators_folder(tmp_path / "spec", head, target, aux=[2, 4, 5], **norms)
    model = load_foreign_head(folder, target)
    assert {k: getattr(model.config, k) for k in NORMS} == {k: k in norms for k in NORMS}
    assert ("input_norm.weight" in model.state_dict()) == ("norm_before_fc" in norms)
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    _same_logits(head.float(), model.float(), target)
    plain = load_foreign_head(speculators_folder(tmp_path / "plain", _norm_head(target), target, aux=[2, 4, 5]),
                              target)
    assert not any(getattr(plain.config, k) for k in NORMS)


def test_a_specforge_folder_with_norm_before_residual_and_nested_norm_before_fc(target, tmp_path):
    """The original format: flags at the top level as vLLM reads them, ``norm_before_fc`` also from
    ``eagle_config`` (read there first by vLLM and SGLang)."""
    head = _norm_head(target, norm_before_residual=True, norm_before_fc=True).to(torch.float16)
    folder = specforge_folder(tmp_path / "sf", head, {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                      "norm_before_fc": True})
    _edit_config(folder, norm_before_residual=True)
    model = load_foreign_head(folder, target)
    assert model.config.norm_before_residual and model.config.norm_before_fc and not model.config.norm_output
    _same_logits(head.float(), model.float(), target)


# --------------------------------------------------------------------------- refusals: one line, naming the folder


def _edit_weights(folder: Path, edit) -> None:
    w = load_file(str(folder / "model.safetensors"))
    edit(w)
    save_file(w, str(folder / "model.safetensors"))


def _edit_config(folder: Path, replace: dict | None = None, **changes) -> None:
    """``changes`` merged into config.json (a dict into the dict it names); ``replace``: keys set as given."""
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    cfg.update(replace or {})
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def spec_dir(target, tmp_path):
    return speculators_folder(tmp_path / "spec", make_head("eagle3", target, aux=(2, 4, 5)).eval(), target,
                              aux=[2, 4, 5])


REFUSALS = {
    "unknown format": (lambda f: (f / "config.json").write_text(json.dumps({"model_type": "bert"})),
                       r"no head of a known format: looked for a specheads head .*speculators_model_type eagle3.*"
                       r"LlamaForCausalLMEagle3.*DFlashDraftModel.*medusa_num_heads.*EagleLlamaForCausalLM"),
    "other algorithm": (lambda f: _edit_config(f, speculators_model_type="dflash2"),
                        r"speculators_model_type 'dflash2': only speculators' eagle3, dflash, peagle and dspark heads "
                        r"are read"),
    "missing tensor": (lambda f: _edit_weights(f, lambda w: w.pop("lm_head.weight")),
                       r"missing key\(s\) \['lm_head.weight'\]"),
    "unknown tensor": (lambda f: _edit_weights(f, lambda w: w.update({"layers.0.self_attn.q_norm.weight":
                                                                      torch.ones(16, dtype=torch.bfloat16)})),
                       r"unknown key\(s\) \['layers.0.self_attn.q_norm.weight'\]"),
    "wrong shape": (lambda f: _edit_weights(f, lambda w: w.update({"norm.weight": torch.ones(H + 1,
                                                                                             dtype=torch.bfloat16)})),
                    r"'norm.weight' has shape \[65\], expected \[64\]"),
    "float d2t": (lambda f: _edit_weights(f, lambda w: w.update({"d2t": w["d2t"].to(torch.bfloat16)})),
                  r"'d2t' has dtype BF16, expected I64"),
    "hidden size": (lambda f: _edit_config(f, transformer_layer_config={"hidden_size": 32, "head_dim": 8}),
                    r"head hidden_size 32 != target tiny hidden_size 64"),
    "vocabulary": (lambda f: _edit_config(f, transformer_layer_config={"vocab_size": 512}),
                   r"head vocab_size 512 != target tiny vocab_size 256"),
    "aux out of range": (lambda f: _edit_config(f, eagle_aux_hidden_state_layer_ids=[2, 4, 8]),
                         r"aux layers \[8\] do not exist in target tiny \(8 layers\)"),
    "qwen3 layer without its q/k norms": (lambda f: _edit_config(f, transformer_layer_config={"model_type": "qwen3"}),
                                          r"missing key\(s\) \['layers.0.self_attn.k_norm.weight', "
                                          r"'layers.0.self_attn.q_norm.weight'\]"),
    "no layer type (qwen3) without q/k norms": (lambda f: _edit_config(f, replace={"transformer_layer_config": {
                                                    k: v for k, v in _llama_layer().items() if k != "model_type"}}),
                                                r"missing key\(s\) \['layers.0.self_attn.k_norm.weight'"),
    "chunked layer": (lambda f: _edit_config(f, transformer_layer_config={"layer_types": ["chunked_attention"]}),
                      r"layer_types \['chunked_attention'\]: the specheads head's draft layers attend"),
    "two layers": (lambda f: _edit_config(f, transformer_layer_config={"num_hidden_layers": 2}),
                   r"EAGLE-3 heads have one layer"),
    "norm_before_fc without its norm": (lambda f: _edit_config(f, norm_before_fc=True),
                                        r"missing key\(s\) \['input_norm.weight'\]"),
    "maps disagree": (lambda f: _edit_weights(f, lambda w: w["d2t"].__setitem__(0, w["d2t"][0] + 1)),
                      r"d2t and t2d disagree"),
}


def assert_refused(read, folder: Path, edit, message: str, fmt: str) -> None:
    """``read(folder)`` succeeds; after ``edit(folder)`` it fails in one line naming the folder, its format and (the
    pattern ``message``) the fault: each refusal shown to come from its own check."""
    read(folder)
    edit(folder)
    with pytest.raises(ForeignHeadError, match=message) as e:
        read(folder)
    assert str(folder) in str(e.value) and fmt in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_folder_and_the_fault(case, spec_dir):
    edit, message = REFUSALS[case]
    edit(spec_dir)
    with pytest.raises(ForeignHeadError, match=message) as e:
        read_foreign_head(spec_dir, INFO)
    assert str(spec_dir) in str(e.value) and "\n" not in str(e.value)


def test_no_aux_ids_on_a_target_too_shallow_for_the_default(target, tmp_path):
    folder = speculators_folder(tmp_path / "spec", make_head("eagle3", target, aux=(2, 4, 5)).eval(), target)
    read_foreign_head(folder, INFO)
    with pytest.raises(ForeignHeadError, match=r"names no aux layers .* at least 7 layers \(target tiny: 6\)"):
        read_foreign_head(folder, TargetInfo("tiny", H, V, 6))


def test_an_embedding_other_than_the_targets_is_refused(target, tmp_path):
    head = make_head("eagle3", target, aux=(2, 4, 5)).eval()
    folder = speculators_folder(tmp_path / "spec", head, target, aux=[2, 4, 5])
    load_foreign_head(folder, target)
    _edit_weights(folder, lambda w: w.update({"embed_tokens.weight": w["embed_tokens.weight"] + 1.0}))
    with pytest.raises(ForeignHeadError, match=r"embed_tokens.weight differs from target .*'s token embedding"):
        load_foreign_head(folder, target)


def test_no_weights_is_refused(spec_dir):
    (spec_dir / "model.safetensors").unlink()
    with pytest.raises(ForeignHeadError, match=r"no weights \(looked for \*.safetensors, then pytorch_model\*.bin, "
                                               r"then medusa_lm_head.pt\)"):
        read_foreign_head(spec_dir, INFO)
    shutil.rmtree(spec_dir)


def _qwen3_sliding_layer(window: int | None, model_type: str | None = "qwen3") -> dict:
    """speculators' default draft layer (``create_transformer_layer_config``): a Qwen3 config (``--draft-arch qwen3``;
    no ``model_type`` reads as Qwen3 too) whose layers are ``sliding_attention`` with ``use_sliding_window``."""
    layer = {k: v for k, v in _llama_layer().items() if k != "model_type"}
    if model_type is not None:
        layer["model_type"] = model_type
    if window is not None:
        layer.update(sliding_window=window, use_sliding_window=True, layer_types=["sliding_attention"])
    return layer


@pytest.mark.parametrize("model_type,window", [("qwen3", 2), (None, None), ("llama", 2), ("qwen3", None)])
def test_a_speculators_folder_with_a_window_or_a_qwen3_layer_reads_into_the_same_head(model_type, window, target,
                                                                                      tmp_path):
    """speculators' default recipe (sliding window 2048 here 2, shorter than the 4 positions compared; Qwen3 layers
    with ``self_attn.q_norm`` / ``k_norm``) is read as the head's options: the same tensors and logits."""
    qk = model_type in ("qwen3", None)
    opts = {**({"sliding_window": window} if window else {}), "qk_norm": qk}
    head = _norm_head(target, **opts)
    if qk:
        with torch.no_grad():
            head.midlayer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    head = head.to(torch.bfloat16)
    layer = _qwen3_sliding_layer(window, model_type)
    folder = speculators_folder(tmp_path / "spec", head, target, aux=[2, 4, 5], transformer_layer_config=layer)
    model = load_foreign_head(folder, target)
    assert (model.config.sliding_window, model.config.layer_types, model.config.qk_norm) == (
        window, ["sliding_attention"] if window else None, qk)
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    _same_logits(head.float(), model.float(), target)


def test_a_qwen3_layer_without_use_sliding_window_attends_to_everything(target, tmp_path):
    """transformers' Qwen3Config drops ``sliding_window`` without ``use_sliding_window`` (so do speculators and vLLM,
    which read the parsed config): such a folder is a full-attention head."""
    head = _norm_head(target, qk_norm=True).to(torch.bfloat16)
    layer = dict(_qwen3_sliding_layer(2), use_sliding_window=False)
    model = load_foreign_head(speculators_folder(tmp_path / "s", head, target, aux=[2, 4, 5],
                                                 transformer_layer_config=layer), target)
    assert model.config.sliding_window is None and model.sliding_window is None


@pytest.mark.parametrize("engine,fmt", [("speculators", "speculators"), ("vllm", "eagle3")])
def test_our_window_and_qwen3_exports_read_back_as_foreign_heads(engine, fmt, target, target_dir, tmp_path):
    """A head with a sliding window and q/k norms, exported (vLLM: ``Eagle3Qwen3ForCausalLM``) without our own
    export record, is read back as the same head."""
    head = _norm_head(target, sliding_window=2, qk_norm=True)
    with torch.no_grad():
        head.midlayer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    folder = foreign_export(head, engine, tmp_path, target_dir)
    assert foreign_format(folder) == fmt
    model = load_foreign_head(folder, target)
    assert (model.config.sliding_window, model.config.qk_norm) == (2, True)
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name].float(), t.float()), name
    _same_logits(head, model.float(), target)


# --------------------------------------------------------------------------- NVIDIA ModelOpt's export

MODELOPT_EXPORT_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}


def modelopt_folder(root: Path, head: Eagle3Model, rope_scaling: dict | None = MODELOPT_EXPORT_ROPE) -> Path:
    """ModelOpt 0.47's ``export_speculative_decoding``: float32 ``layers.0.*`` weights, ``d2t`` (a reduced vocabulary
    only) in another order than the target ids' (its calibration's: by frequency) with ``lm_head``'s rows alike, no
    ``t2d``, ``torch_dtype`` bfloat16 whatever the weights, the aux ids as decoder-layer outputs in ``eagle_config`` with
    ModelOpt's settings, and the YaRN ``rope_scaling`` its export adds to a head trained without scaling."""
    root.mkdir(parents=True)
    c = head.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": 0.01,
           "rope_scaling": rope_scaling, "rope_theta": c.rope_parameters["rope_theta"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers],
                            "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                            "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                            "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}}
    (root / "config.json").write_text(json.dumps(cfg))
    w = {n.replace("midlayer.", "layers.0."): t for n, t in _weights(head, torch.float32).items() if n != "t2d"}
    if c.draft_vocab_size == c.vocab_size:
        del w["d2t"]
    else:
        order = torch.randperm(c.draft_vocab_size, generator=torch.Generator().manual_seed(5))
        ids = torch.arange(c.draft_vocab_size) + w["d2t"]
        w["d2t"], w["lm_head.weight"] = ids[order] - torch.arange(c.draft_vocab_size), w["lm_head.weight"][order]
    save_file(w, str(root / "model.safetensors"))
    return root


def modelopt_layer(head: Eagle3Model, hidden, ids, pos) -> torch.Tensor:
    """The draft layer as ModelOpt's HF EAGLE-3 computes it, spelt out: its decoder layer norms the hidden state with
    ``input_layernorm`` and its attention pre-hook then applies ``hidden_norm`` to that."""
    layer = head.midlayer
    cos, sin = head.rotary_emb(hidden, pos)
    x = torch.cat([layer.input_layernorm(head.embed(ids)), layer.hidden_norm(layer.input_layernorm(hidden))], -1)
    h = hidden + layer.self_attn(x, cos, sin, 0, None, None, None)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _theta_head(target, theta: float, **kw) -> Eagle3Model:
    """``make_head``'s head with another RoPE base than the target's."""
    head = make_head("eagle3", target, aux=(2, 4, 5), **kw)
    config = head.config
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    model = Eagle3Model(config)
    model.load_state_dict(head.state_dict())
    return model.eval()


def _draft_chain(head: Eagle3Model, feats, ids, pos, steps: int = 3) -> list[torch.Tensor]:
    """Greedy target ids of ``steps`` draft steps from every position (each step fed the last one's output)."""
    out, hidden = [], head.fuse(feats)
    for k in range(steps):
        hidden, logits = head.step(hidden, ids, pos + k)
        out.append(head.to_target_ids(logits.argmax(-1)))
    return out


def test_a_modelopt_folder_reads_back_as_the_head_and_drafts_the_same_tokens(target, tmp_path):
    """The aux ids (outputs) one more, the RoPE base from the config without the YaRN the export adds, the draft rows in
    target-id order from a frequency-ordered d2t with no t2d: tensor-equal, and (its first layer's input norm uniform,
    so ModelOpt's norm order changes nothing) the same draft tokens over three steps."""
    head = _theta_head(target, 5e5).attach(target)
    with torch.no_grad():
        head.midlayer.input_layernorm.weight.fill_(1.3)
    folder = modelopt_folder(tmp_path / "mo", head)
    assert foreign_format(folder) == "modelopt" and not torch.equal(load_file(str(folder / "model.safetensors"))[
        "d2t"], head.d2t)
    model = load_foreign_head(folder, target).attach(target)
    assert model.config.aux_layers == [2, 4, 5] and model.fc.weight.dtype == torch.float32
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    for name, t in head.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    g = torch.Generator().manual_seed(6)
    feats, ids = torch.randn(2, 6, 3 * H, generator=g), torch.randint(0, V, (2, 6), generator=g)
    with torch.no_grad():
        for a, b in zip(_draft_chain(head, feats, ids, torch.arange(6).expand(2, 6)),
                        _draft_chain(model, feats, ids, torch.arange(6).expand(2, 6))):
            assert torch.equal(a, b)


def test_a_modelopt_head_norms_the_hidden_state_as_modelopt_does(target, tmp_path):
    """A trained (non-uniform) first-layer input norm: the head read from the folder computes ModelOpt's
    ``hidden_norm(input_layernorm(h))``, not the single norm our head and the engines apply; its state dict is the
    head's."""
    head = _theta_head(target, 1e4).attach(target)
    model = load_foreign_head(modelopt_folder(tmp_path / "mo", head), target).attach(target)
    assert list(model.state_dict()) == list(head.state_dict())
    g = torch.Generator().manual_seed(7)
    hidden, ids, pos = torch.randn(1, 5, H, generator=g), torch.randint(0, V, (1, 5), generator=g), torch.arange(5)[None]
    with torch.no_grad():
        theirs, ours = model.decode(hidden, ids, pos), head.decode(hidden, ids, pos)
        torch.testing.assert_close(theirs, modelopt_layer(head, hidden, ids, pos))
    assert not torch.allclose(theirs, ours, atol=1e-3)
    # the head's config says so (a saved copy computes the same), and no engine's layout takes it
    assert model.config.hidden_after_input_norm and not head.config.hidden_after_input_norm
    from specheads.export.layouts import LayoutError, build_layout

    for engine in ("vllm", "sglang", "speculators"):
        with pytest.raises(LayoutError, match="hidden_after_input_norm: no engine"):
            build_layout("eagle3", engine, model.config.to_dict(), INFO)


@pytest.mark.parametrize("rope,expected", [
    (None, {"rope_type": "default"}),
    ({"rope_type": "default", "rope_theta": 5e5}, {"rope_type": "default"}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 5e5},
     {"rope_type": "yarn", "factor": 4.0})])
def test_a_modelopt_rope_scaling_trained_with_is_kept(rope, expected, target, tmp_path):
    """A ``rope_scaling`` written with its ``rope_theta`` is what ModelOpt trained with (its export adds one only to a
    head trained without, as given, without ``rope_theta``): read as written, as the YaRN head computes it."""
    model = load_foreign_head(modelopt_folder(tmp_path / "mo", _theta_head(target, 5e5), rope_scaling=rope), target)
    assert {k: model.config.rope_parameters[k] for k in expected} == expected
    assert model.config.rope_parameters["rope_theta"] == 5e5


def test_a_modelopt_full_vocabulary_and_specforge_eagle_config_stay_apart(target, tmp_path):
    """A full draft vocabulary (no d2t; the lm_head ModelOpt copies) reads as the identity; SpecForge's eagle_config
    (ids and use_aux_hidden_state, which SGLang reads too) is still the original format."""
    head = _theta_head(target, 1e4, draft_vocab=V)
    model = load_foreign_head(modelopt_folder(tmp_path / "mo", head), target)
    assert not model.d2t.any() and bool(model.t2d.all()) and torch.equal(model.lm_head.weight, head.lm_head.weight)
    sf = specforge_folder(tmp_path / "sf", head, {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                  "use_aux_hidden_state": True})
    assert foreign_format(sf) == "eagle3"


MODELOPT_REFUSALS = {
    "use_aux_hidden_state": (False, r"eagle_config.use_aux_hidden_state false \(no fc over the aux states\)"),
    "use_input_layernorm_in_first_layer": (False, r"use_input_layernorm_in_first_layer false \(no input norm"),
    "use_last_layernorm": (False, r"use_last_layernorm false \(no final norm before lm_head\); the specheads "
                                  r"EAGLE-3 head computes true only"),
    "use_mtp_layernorm": (True, r"use_mtp_layernorm true \(MTP-style norms\)"),
    "parallel_draft_step": (3, r"parallel_draft_step 3 \(several tokens drafted per step\); .* computes 1 only"),
}


@pytest.mark.parametrize("key", list(MODELOPT_REFUSALS))
def test_modelopt_settings_the_head_does_not_compute_are_refused(key, target, tmp_path):
    value, message = MODELOPT_REFUSALS[key]
    folder = modelopt_folder(tmp_path / "mo", _theta_head(target, 1e4))
    assert_refused(lambda f: read_foreign_head(f, INFO), folder, lambda f: _edit_config(f, eagle_config={key: value}),
                   message, "ModelOpt")
