"""P-EAGLE export: vLLM's eagle3 + parallel-drafting folder and speculators' ``peagle`` folder, checked against what
vLLM 0.32.0's code reads (facts from the wheel: ``llm_base_proposer._init_parallel_drafting_params`` looks the mask
token up as ``mask_token_id`` then ``pard_token``; ``llama_eagle3.load_weights`` requires ``mask_hidden`` and views it
as (1, n_aux * H_target), names ``midlayer.*`` ``layers.0.*`` and ``layers.{i}.*`` after it, reads ``fc_norm`` from the
config; ``speculators/algos.update_peagle`` maps ``mask_token_id`` to ``pard_token`` and picks
``PeagleLlamaForCausalLM``; ``build_vllm_speculative_config`` turns ``peagle`` into eagle3 + parallel_drafting) and
round-tripped to an equal model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specheads.export import export_head, head_tensors, load_exported
from specheads.export.serve import serve_commands, serve_params
from specheads.methods import build_method
from tests.conftest import make_tiny_target

V, H, LAYERS, DV = 256, 64, 4, 96
AUX = (3, 1, 2)  # unsorted: mask_hidden's column blocks must follow fc's


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


@pytest.fixture(scope="module")
def exported(target, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peagle")
    method = build_method("peagle", draft_vocab_size=DV, aux_layers=AUX, num_layers=2, num_depths=5, fc_norm=True,
                          vocab_data=[{"input_ids": list(range(V)), "loss_mask": [1] * V}])
    model = method.build(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    method.save(model, str(root / "head"), target)
    out = root / "export"
    export_head(root / "head", out, engine="vllm,speculators", target=str(target_dir))
    return model, out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _tensors(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _mask_token(hf_config: dict) -> int:
    """The parallel-drafting token as vLLM 0.32's proposer looks it up."""
    dflash = hf_config.get("dflash_config") or {}
    for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if key == "mask_token_id" and "mask_token_id" in dflash:
            return dflash["mask_token_id"]
        if hf_config.get(key) is not None:
            return hf_config[key]
    raise AssertionError("vLLM would refuse: no parallel-drafting token in the config")


def _check_weights(names: dict[str, tuple[int, ...]], cfg: dict, num_layers: int) -> None:
    n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    assert names["mask_hidden"] == (1, n_aux * H)  # vLLM: mask_hidden.copy_(w.view(1, -1)) into (1, fc_input_size)
    assert names["fc.weight"] == (H, n_aux * H)
    assert all(names[f"fc_norm.{i}.weight"] == (H,) for i in range(n_aux))
    layer0 = "midlayer" if "midlayer.self_attn.q_proj.weight" in names else "layers.0"
    assert names[f"{layer0}.self_attn.q_proj.weight"] == (H, 2 * H)  # layer 0: [embeds; hidden]
    for i in range(1, num_layers):
        assert names[f"layers.{i}.self_attn.q_proj.weight"] == (H, H)  # later layers: the residual stream
    assert names["lm_head.weight"] == (DV, H) and names["d2t"] == (DV,)


def test_vllm_folder_is_eagle3_plus_parallel_drafting(exported):
    model, out = exported
    folder = out / "vllm"
    c = _config(folder)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]  # eagle3's wrapper keeps a name ending in Eagle3
    assert _mask_token(c) == model.config.mask_token_id < V
    assert c["num_hidden_layers"] == 2 and c["draft_vocab_size"] == DV and c["fc_norm"] is True
    assert c["eagle_aux_hidden_state_layer_ids"] == sorted(AUX)
    _check_weights(_tensors(folder), c, 2)


def test_speculators_folder_converts_like_vllm(exported):
    model, out = exported
    c = _config(out / "speculators")
    assert c["speculators_model_type"] == "peagle" and c["architectures"] == ["PEagleSpeculator"]
    # validate_speculators_config, then build_vllm_speculative_config and update_peagle as vLLM 0.32 does
    spec = c["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1 and "name_or_path" in spec["verifier"]
    vllm_spec = {"method": "eagle3", "parallel_drafting": True} if c["speculators_model_type"] == "peagle" else {}
    assert vllm_spec == {"method": "eagle3", "parallel_drafting": True}
    draft = dict(c["transformer_layer_config"])
    assert draft.get("model_type", "llama") == "llama"  # update_peagle: PeagleLlamaForCausalLM
    draft.update(draft_vocab_size=c["draft_vocab_size"], target_hidden_size=c["target_hidden_size"],
                 norm_before_residual=c.get("norm_before_residual", False), pard_token=c["mask_token_id"],
                 eagle_aux_hidden_state_layer_ids=c["eagle_aux_hidden_state_layer_ids"])
    assert draft["norm_before_residual"] is False  # as trained (EAGLE-3's layer norms after the residual)
    assert draft.get("fc_norm") is True  # update_peagle forwards no fc_norm: the layer config must carry it
    assert _mask_token(draft) == model.config.mask_token_id
    assert draft["num_hidden_layers"] == 2
    names = _tensors(out / "speculators")
    _check_weights(names, draft, 2)
    assert names["embed_tokens.weight"] == (V, H)


@pytest.mark.parametrize("sub", ["vllm", "speculators"])
def test_round_trip_to_an_equal_model(exported, target, sub):
    model, out = exported
    back = load_exported(out / sub)
    assert type(back).__name__ == "PEagleModel"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, msg=k)
    # mask_hidden's blocks follow fc's reordered columns: the fused mask state is unchanged by the export
    with safe_open(str(out / sub / "model.safetensors"), "pt") as f:
        fc, mh = f.get_tensor("fc.weight"), f.get_tensor("mask_hidden")
        norms = [f.get_tensor(f"fc_norm.{i}.weight") for i in range(len(AUX))]
    chunks = mh.chunk(len(AUX), dim=-1)
    normed = torch.cat([_rms(c, w, model.config.rms_norm_eps) for c, w in zip(chunks, norms)], -1)
    with torch.no_grad():
        torch.testing.assert_close(normed @ fc.T, model.mask_state())


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_head_table_matches_the_model(exported):
    model, _ = exported
    table = {k: s.shape for k, s in head_tensors("peagle", model.config.to_dict()).items()}
    assert table == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_serve_lines_ask_for_parallel_drafting(exported):
    model, out = exported
    cfg = model.config.to_dict()
    p = serve_params("peagle", cfg, "vllm", None)
    assert p.tokens == 5  # the head's num_depths
    cmds = serve_commands("peagle", "vllm", "meta/target", str(out / "vllm"), p)
    assert '"method": "eagle3"' in cmds["shell"] and '"parallel_drafting": true' in cmds["shell"]
    assert '"num_speculative_tokens": 5' in cmds["shell"]
    with pytest.raises(ValueError, match="1 to 5"):
        serve_params("peagle", cfg, "vllm", None, spec_tokens=6)
    card = (out / "vllm" / "README.md").read_text()
    assert "P-EAGLE" in card and "parallel_drafting" in card and "SGLang" in card
