"""MTP fine-tuning for the Qwen3-Next / Qwen3.5 layout (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.layers.{i}.*``,
``mtp.norm`` in the target's own safetensors, the names vLLM 0.32 loads): tiny targets built by transformers, MTP
tensors made here. The layer equals the family's formula with transformers' own Qwen3-Next decoder layer (dense and
sparse-MoE MLPs), names map both ways, training lowers the loss, drafting is lossless on an attention-only target,
the stitched export replaces the MTP tensors and nothing else, and a hybrid target (linear-attention layers) is
refused by the evaluator in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from specheads.methods import build_method
from specheads.models.mtp_checkpoint import LAYOUTS, MTPCheckpointError, check_mtp_tensors, read_mtp_tensors
from specheads.targets import Target
from tests.methods.test_mtp import greedy_rows  # the same vocabulary (V): the target's own greedy continuations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))  # decoding_helpers

V, H = 256, 64


def make_qwen3_next(folder, layer_types=("full_attention", "full_attention"), experts=0, seed=0, vocab=V,
                    heads=2, head_dim=32, arch="Qwen3NextForCausalLM", with_mtp=True):
    """A tiny Qwen3-Next target saved by transformers plus hand-made ``mtp.*`` tensors (MTP layer 0: a MoE with
    ``experts`` experts when > 0, else dense; the main layers are MoE likewise except layer 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_next", vocab_size=vocab, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, layer_types=list(layer_types),
        num_experts=experts, num_experts_per_tok=min(2, experts) or 1, moe_intermediate_size=H,
        shared_expert_intermediate_size=H, mlp_only_layers=[] if experts else [0], linear_num_key_heads=1,
        linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # peaked, context-dependent next tokens (greedy decoding exercises the masks)
        model.lm_head.weight.mul_(20.0)
        for name, p in model.named_parameters():
            if "self_attn" in name and name.endswith("proj.weight"):
                p.mul_(4.0)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [arch]
    config["mtp_num_hidden_layers" if arch.startswith("Qwen3_5") else "num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if with_mtp:
        g = torch.Generator().manual_seed(seed + 1)
        sd = load_file(str(folder / "model.safetensors"))
        last = len(layer_types) - 1
        for k, v in list(sd.items()):  # layer 0 of the block: a perturbed copy of the last layer (full attention)
            if k.startswith(f"model.layers.{last}.") and ".linear_attn." not in k:
                sd["mtp.layers.0." + k[len(f"model.layers.{last}."):]] = (v + 0.02 * torch.randn(v.shape, generator=g))
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            sd[f"mtp.{n}.weight"] = 0.1 * torch.randn(H, generator=g)
        sd["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    return folder


def load(folder) -> Target:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    model.config._attn_implementation = "eager"
    return Target(model, None, name=str(folder))


@pytest.fixture(scope="module", params=[0, 4], ids=["dense", "moe"])
def qwen(request, tmp_path_factory):
    folder = make_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "target", experts=request.param)
    return folder, load(folder)


def test_the_checkpoint_names_are_vllms_and_map_both_ways(qwen):
    folder, target = qwen
    layout, _, names = check_mtp_tensors(folder)
    assert layout is LAYOUTS["Qwen3NextForCausalLM"] and layout.family == "qwen3_next"
    moe = target.config.num_experts > 0
    assert ("mtp.layers.0.mlp.experts.3.down_proj.weight" in names) == moe
    assert ("mtp.layers.0.mlp.shared_expert_gate.weight" in names) == moe
    assert ("mtp.layers.0.mlp.gate_proj.weight" in names) != moe
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_norm.weight"} <= set(names)
    model = build_method("mtp", num_steps=2).build(target)
    assert sorted(layout.checkpoint_key(k) for k in model.state_dict()) == sorted(names)
    assert all(layout.checkpoint_key(layout.module_key(n)) == n for n in names)
    assert layout.module_key("mtp.layers.1.mlp.gate.weight", 1) == "layers.0.layers.0.mlp.gate.weight"
    assert layout.checkpoint_key("layers.0.layers.0.mlp.gate.weight", 1) == "mtp.layers.1.mlp.gate.weight"
    assert layout.checkpoint_key("layers.0.fc.weight", 1) == "mtp.fc.weight"


def test_layer_is_the_families_formula_with_transformers_own_decoder_layer(qwen):
    """decode(post-norm) == norm(Qwen3NextDecoderLayer(fc([norm_e(embed); norm_h(post-norm)]))), the layer's tensors
    read from the checkpoint (transformers' layer: gated attention, partial RoPE, offset norms, MoE or dense)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    folder, target = qwen
    model = build_method("mtp", num_steps=1).build(target)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    post = target.model(ids, output_hidden_states=True).hidden_states[-1]
    pos = torch.arange(9).expand(2, 9)
    nxt = torch.roll(ids, -1, 1)
    ours = model.decode(model.fuse(post), nxt, pos)

    t = read_mtp_tensors(folder)
    cfg = target.config
    layer_idx = 1  # a full-attention layer of this config, MoE exactly when the MTP layer is
    block = Qwen3NextDecoderLayer(cfg, layer_idx=layer_idx).eval()
    state = {k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")}
    if cfg.num_experts:  # transformers keeps the experts fused: [E, 2I, H] and [E, H, I]
        E = cfg.num_experts
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                    state.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                         for e in range(E)])
        state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    block.load_state_dict(state, strict=True)

    def norm(name):
        n = Qwen3NextRMSNorm(H, cfg.rms_norm_eps)
        n.weight.data = t[f"mtp.{name}.weight"]
        return n

    emb = target.model.model.embed_tokens(nxt)
    x = torch.cat([norm("pre_fc_norm_embedding")(emb), norm("pre_fc_norm_hidden")(post)], -1) @ t["mtp.fc.weight"].T
    cos, sin = target.model.model.rotary_emb(x, pos)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    ref = norm("norm")(block(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos))
    assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def trained(qwen, tmp_path_factory):
    from tests.methods.test_mtp import train_briefly

    folder, target = qwen
    losses, head, model, _ = train_briefly(build_method("mtp", num_steps=3, labels="target"), target,
                                           greedy_rows(target), tmp_path_factory)
    return losses, head, model


def test_training_lowers_the_loss(trained):
    losses, head, _ = trained
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses
    assert json.loads((head / "config.json").read_text())["family"] == "qwen3_next"


def test_drafting_is_lossless_and_accepts(qwen, trained):
    from decoding_helpers import reference_greedy
    from specheads.decoding.drafters import TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.mtp_drafter import load_mtp_drafter
    from specheads.decoding.runner import TargetRunner

    folder, target = qwen
    _, head, _ = trained
    prompts = [r[:4] for r in greedy_rows(target)["input_ids"][:3].tolist()]
    res = speculative_generate(TargetRunner(target.model), load_mtp_drafter(head, target, TreeShape("chain", k=3)),
                               prompts, 16)
    for p, got in zip(prompts, res.tokens):
        assert list(got) == reference_greedy(target.model, p, 16)
    assert sum(r.emitted for r in res.stats) / sum(r.steps for r in res.stats) > 1.3


def test_stitched_export_carries_the_tuned_layer_and_only_it(qwen, trained, tmp_path):
    from specheads.export import export_head

    folder, _ = qwen
    _, head, model = trained
    out = export_head(head, tmp_path / "stitched", engine="vllm", target=str(folder))
    orig, new = load_file(str(folder / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(orig) == set(new)
    layout = LAYOUTS["Qwen3NextForCausalLM"]
    for k, v in model.state_dict().items():
        assert torch.equal(new[layout.checkpoint_key(k)], v), k
    changed = [k for k in orig if not torch.equal(orig[k], new[k])]
    assert changed and all(k.startswith("mtp.") for k in changed)


def test_qwen3_5_names_its_layer_count_otherwise(tmp_path):
    folder = make_qwen3_next(tmp_path / "q35", arch="Qwen3_5ForCausalLM")
    layout, _, names = check_mtp_tensors(folder)
    assert layout.count_key == "mtp_num_hidden_layers" and "mtp.layers.0.self_attn.q_norm.weight" in names
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MTPCheckpointError, match="declares no MTP layer"):
        check_mtp_tensors(folder)


def test_a_hybrid_target_is_refused_by_the_evaluator_in_one_line(tmp_path):
    from specheads.decoding.runner import HybridTargetError, TargetRunner

    folder = make_qwen3_next(tmp_path / "hybrid", layer_types=("linear_attention", "full_attention"), with_mtp=False)
    with pytest.raises(HybridTargetError) as e:
        TargetRunner(load(folder).model)
    msg = str(e.value)
    assert "\n" not in msg and "linear_attention" in msg and "serve-eval" in msg
