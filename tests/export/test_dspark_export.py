"""DSpark export: vLLM's dense ``Qwen3DSparkModel`` folder and speculators' ``dspark`` folder, checked against what
vLLM 0.32.0's code reads (facts from the wheel: ``qwen3_dspark.Qwen3DSparkModel`` builds ``markov_head.markov_w1``
as an embedding (vocab_size, markov_rank), ``markov_w2`` as a head (draft_vocab_size, markov_rank) and, with
``enable_confidence_head``, ``confidence_head.proj`` (1, hidden [+ markov_rank with confidence_head_with_markov])
with a bias; its ``load_weights`` prefixes ``model.`` to every name but ``lm_head``; the DSpark speculator reads
``sample_from_anchor`` (default true); ``eagle3_utils.get_eagle3_aux_layers_from_config`` reads ``target_layer_ids``
plus one; ``SpeculativeConfig`` defaults ``num_speculative_tokens`` to ``block_size``; ``algos.update_dspark`` maps
``aux_hidden_state_layer_ids`` to ``target_layer_ids`` minus one and forwards the DSpark keys), the card's and serve
lines' statement that the CPU build refuses the method, and a round trip to an equal model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specheads.export import export_head, head_tensors, load_exported
from specheads.export.engine_targets import VLLM_CPU_REFUSED
from specheads.export.serve import serve_commands, serve_params, vllm_speculative_config
from specheads.methods import build_method
from tests.conftest import make_tiny_target

V, H, LAYERS, B, R = 256, 64, 4, 5, 16
AUX = (3, 1, 2)  # unsorted: fc's column blocks are reordered


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    target_dir = root / "tiny-llama"
    target.model.save_pretrained(target_dir)
    method = build_method("dspark", block_size=B, aux_layers=AUX, num_layers=2, markov_rank=R)
    model = method.build(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    method.save(model, str(root / "head"), target)
    out = root / "export"
    export_head(root / "head", out, engine="all", target=str(target_dir))
    return model, out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _tensors(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _vllm_module_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The DSpark parameters Qwen3DSparkModel builds from ``cfg`` (names as load_weights sees them, ``model.`` off)."""
    r = cfg["markov_rank"]
    vocab, draft_vocab = cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    out = {"markov_head.markov_w1.weight": (vocab, r), "markov_head.markov_w2.weight": (draft_vocab, r)}
    if cfg.get("enable_confidence_head", False):
        width = cfg["hidden_size"] + (r if cfg.get("confidence_head_with_markov", False) else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


def _check_draft(cfg: dict, names: dict[str, tuple[int, ...]], aux_ids: list[int]) -> None:
    for name, shape in _vllm_module_shapes(cfg).items():
        assert names[name] == shape, name
    assert names["fc.weight"] == (H, len(aux_ids) * H)  # _get_dflash_fc_input_size: n_aux * target_hidden_size
    assert all(names[f"layers.{i}.self_attn.q_norm.weight"] for i in range(2))
    assert cfg["markov_head_type"] == "vanilla" and cfg["mask_token_id"] < V
    assert set(cfg["layer_types"]) == {"full_attention"}  # no causal override: bidirectional, as trained


def test_the_vllm_folder_is_the_dense_dspark_format(exported):
    model, out = exported
    folder = out / "vllm"
    c = _config(folder)
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
    assert c["markov_rank"] == R and c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["sample_from_anchor"] is False and c["dspark_bonus_anchor"] is True  # the anchor is a bonus token
    assert c["block_size"] == B - 1  # vLLM's default num_speculative_tokens: the trained drafts
    aux = [i + 1 for i in c["target_layer_ids"]]  # get_eagle3_aux_layers_from_config
    assert aux == sorted(AUX) and c["mask_token_id"] == model.config.mask_token_id
    _check_draft(c, _tensors(folder), aux)
    assert "embed_tokens.weight" not in _tensors(folder) and "lm_head.weight" not in _tensors(folder)


def test_the_speculators_folder_converts_like_vllm(exported):
    model, out = exported
    c = _config(out / "speculators")
    assert c["speculators_model_type"] == "dspark" and c["architectures"] == ["Qwen3DSparkModel"]
    spec = c["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == B - 1 and "name_or_path" in spec["verifier"]
    # algos.update_dspark, as vLLM 0.32 applies it to the transformer_layer_config
    draft = dict(c["transformer_layer_config"])
    draft.update(architectures=c["architectures"], sample_from_anchor=c.get("sample_from_anchor", False),
                 target_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]])
    draft["dspark_bonus_anchor"] = not draft["sample_from_anchor"]
    for key in ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type",
                "block_size", "enable_confidence_head", "confidence_head_with_markov", "use_aux_hidden_state"):
        if c.get(key) is not None:
            draft[key] = c[key]
    assert draft["dspark_bonus_anchor"] is True and draft["block_size"] == B
    aux = [i + 1 for i in draft["target_layer_ids"]]
    assert aux == sorted(AUX)
    names = _tensors(out / "speculators")
    _check_draft(draft, names, aux)
    assert names["embed_tokens.weight"] == (V, H) and names["lm_head.weight"] == (V, H)


def test_no_sglang_folder_is_written(exported):
    _, out = exported
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["speculators", "vllm"]


@pytest.mark.parametrize("sub", ["vllm", "speculators"])
def test_round_trip_to_an_equal_model(exported, sub):
    model, out = exported
    back = load_exported(out / sub)
    assert type(back).__name__ == "DSparkModel"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, msg=k)


def test_head_table_matches_the_model(exported):
    model, _ = exported
    table = {k: s.shape for k, s in head_tensors("dspark", model.config.to_dict()).items()}
    assert table == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_card_and_serve_lines_say_the_cpu_build_refuses_dspark(exported):
    model, out = exported
    refusal = "Model Runner V1 does not support: dspark speculative decoding"
    assert VLLM_CPU_REFUSED["dspark"] == refusal
    p = serve_params("dspark", model.config.to_dict(), "vllm", None)
    assert p.tokens == B - 1
    assert vllm_speculative_config("dspark", "m", p.tokens) == {
        "method": "dspark", "model": "m", "num_speculative_tokens": B - 1, "enable_adaptive_verification": True}
    cmds = serve_commands("dspark", "vllm", "meta/target", str(out / "vllm"), p)
    assert '"method": "dspark"' in cmds["shell"] and "GPU only" in cmds["shell"] and refusal in cmds["shell"]
    for sub in ("vllm", "speculators"):
        card = (out / sub / "README.md").read_text()
        assert "DSpark" in card and "not vLLM's CPU build" in card and refusal in card and "V2" in card
        assert "Markov head" in card and "rank 16" in card
