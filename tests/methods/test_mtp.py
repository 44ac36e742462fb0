"""MTP fine-tuning on a tiny MiMo target (Qwen2 + ``model.mtp_layers.0.*`` in its safetensors, as MiMo-7B names
them): the layer equals the family's formula on the checkpoint's tensors (transformers' own Qwen2 layer as the
block), a target or file without the layer is refused, training lowers the loss, drafting is lossless, the
stitched export carries the tuned tensors and nothing else changes."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from specheads.errors import UserError
from specheads.methods import build_method
from specheads.models.mtp_checkpoint import MTPCheckpointError, read_mtp_tensors
from specheads.targets import Target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))  # decoding_helpers

V, H = 256, 64
PREFIX = "model.mtp_layers.0."


def make_mimo(folder, seed=0, with_mtp=True, declare=True, vocab=V, heads=4, kv_heads=2):
    """A tiny MiMoForCausalLM checkpoint folder: a Qwen2 model saved by transformers plus hand-made MTP tensors.
    (vLLM's CPU attention takes head sizes from 32 up: ``heads=1`` gives 64.)"""
    from tests.families.family_models import make_family_model

    model = make_family_model("qwen2", seed=seed, vocab=vocab, hidden=H, layers=2, heads=heads, kv_heads=kv_heads)
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MiMoForCausalLM"]
    if declare:
        cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if with_mtp:
        g = torch.Generator().manual_seed(seed + 1)
        sd = load_file(str(folder / "model.safetensors"))
        layer = {k[len("model.layers.1."):]: v for k, v in sd.items() if k.startswith("model.layers.1.")}
        for k, v in layer.items():  # the block starts as a perturbed copy of the last decoder layer
            sd[PREFIX + k] = (v + 0.02 * torch.randn(v.shape, generator=g)).contiguous()
        for n in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            sd[PREFIX + n + ".weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        sd[PREFIX + "input_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load(folder) -> Target:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    model.config._attn_implementation = "eager"
    return Target(model, None, name=str(folder))


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    folder = make_mimo(tmp_path_factory.mktemp("mimo") / "target")
    return folder, load(folder)


def greedy_rows(target, n=24, prompt=4, new=20, seed=3):
    from decoding_helpers import reference_greedy

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, V, (prompt,), generator=g).tolist() for _ in range(n)]
    ids = torch.tensor([r + reference_greedy(target.model, r, new) for r in rows])
    lm = torch.zeros_like(ids)
    lm[:, prompt:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}


def test_layer_is_the_families_formula_on_the_checkpoint_tensors(mimo):
    """decode(fuse(post-norm)) == final_layernorm(Qwen2 layer(input_proj([hnorm(pre-norm); tnorm(embed)])))."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

    folder, target = mimo
    model = build_method("mtp", num_steps=1).build(target)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    pre = {}
    hook = target.model.model.norm.register_forward_hook(lambda m, a, out: pre.setdefault("x", a[0]))
    out = target.model(ids, output_hidden_states=True)
    hook.remove()
    post = out.hidden_states[-1]
    pos = torch.arange(9).expand(2, 9)
    nxt = torch.roll(ids, -1, 1)
    ours = model.decode(model.fuse(post), nxt, pos)

    t = read_mtp_tensors(folder)
    cfg = target.config
    block = Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    block.load_state_dict({k[len(PREFIX):]: v for k, v in t.items() if k[len(PREFIX):].split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})

    def norm(name):
        n = Qwen2RMSNorm(H, cfg.rms_norm_eps)
        n.weight.data = t[PREFIX + name + ".weight"]
        return n

    emb = target.model.model.embed_tokens(nxt).masked_fill((pos == 0)[..., None], 0)
    x = torch.cat([norm("hidden_layernorm")(pre["x"]), norm("token_layernorm")(emb)], -1) @ t[PREFIX + "input_proj.weight"].T
    cos, sin = target.model.model.rotary_emb(x, pos)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    ref = norm("final_layernorm")(block(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos))
    assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["undeclared", "tensors_missing", "other_family"])
def test_a_target_without_the_mtp_layer_is_refused_before_work(tmp_path, case):
    folder = make_mimo(tmp_path / "t", with_mtp=case != "tensors_missing", declare=case != "undeclared")
    if case == "other_family":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = ["Qwen2ForCausalLM"]
        (folder / "config.json").write_text(json.dumps(cfg))
    method = build_method("mtp")
    target = types.SimpleNamespace(name=str(folder))  # bind reads the files only
    with pytest.raises(MTPCheckpointError, match="MTP") as e:
        method.bind(target)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_step_weights_are_fastmtps():
    from specheads.methods.mtp import step_weights

    assert [round(w, 2) for w in step_weights(3, 0.6)] == [0.51, 0.31, 0.18]


@pytest.fixture(scope="module")
def trained(mimo, tmp_path_factory):
    """Trained for a few steps on the target's own greedy continuations; the losses and the saved head."""
    from specheads.data.features import add_features

    folder, target = mimo
    method = build_method("mtp", num_steps=3)
    losses, head, model, batch = train_briefly(method, target, greedy_rows(target), tmp_path_factory)
    metrics = method.evaluate(model, batch, target)
    return losses, head, metrics, model


def train_briefly(method, target, rows, tmp_path_factory, steps: int = 30):
    """``steps`` AdamW steps of ``method``'s MTP layer on ``rows`` (the target's own continuations); the losses, the
    saved head folder, the model and the batch with its features."""
    from specheads.data.features import add_features

    model = method.bind(target).build(target)
    batch = add_features(rows, target, method.feature_spec)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        out = method.loss(model, batch, target)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    model.eval()
    head = tmp_path_factory.mktemp("head") / "head"
    method.save(model, str(head), target)
    return losses, head, model, batch


def test_the_loss_through_the_frozen_lm_head_equals_the_plain_logits(mimo, monkeypatch):
    """head_cross_entropy (no (N, V) tensor kept for backward) gives the loss, metrics and gradients that
    cross-entropy on ``model.logits`` gives."""
    import specheads.methods.mtp as mtp
    from specheads.data.features import add_features

    folder, target = mimo
    method = build_method("mtp", num_steps=3, head_chunk=8)  # several chunks
    model = method.bind(target).build(target)
    batch = add_features(greedy_rows(target), target, method.feature_spec)

    def run():
        model.zero_grad(set_to_none=True)
        out = method.loss(model, batch, target)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, got_grads = run()
    monkeypatch.setattr(mtp, "frozen_linear", lambda module: None)  # the plain path: hard_cross_entropy
    want, want_grads = run()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got.metrics.keys() == want.metrics.keys() and got_grads.keys() == want_grads.keys() and got_grads
    for key, value in got.metrics.items():
        assert value == pytest.approx(want.metrics[key], rel=1e-5, abs=1e-6), key
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_lowers_the_loss_and_leaves_the_target_alone(mimo, trained):
    folder, target = mimo
    losses, head, metrics, model = trained
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses
    assert {"step0_correct", "step2_total", "joint2_correct"} <= set(metrics)
    assert metrics["step0_correct"] / metrics["step0_total"] > 0.3, metrics
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not any(n.startswith(("embed", "lm_head")) for n in load_file(str(head / "model.safetensors")))


def test_mtp_drafting_is_lossless_and_accepts(mimo, trained):
    from decoding_helpers import reference_greedy
    from specheads.decoding.drafters import TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.runner import TargetRunner
    from specheads.evaluation.suite import build_drafter, plan_methods

    folder, target = mimo
    _, head, _, _ = trained
    specs = plan_methods("mtp", str(head), baselines=())
    assert [s.name for s in specs][:1] == ["mtp-chain3"]
    prompts = [r[:4] for r in greedy_rows(target)["input_ids"][:3].tolist()]  # prompts it was trained after
    for shape in (TreeShape("chain", k=3), TreeShape("dynamic", depth=3, topk=2, total_tokens=6)):
        drafter = build_drafter(specs[0], target) if shape.kind == "chain" else None
        if drafter is None:
            from specheads.decoding.mtp_drafter import load_mtp_drafter

            drafter = load_mtp_drafter(head, target, shape)
        res = speculative_generate(TargetRunner(target.model), drafter, prompts, 16)
        for p, got in zip(prompts, res.tokens):
            assert list(got) == reference_greedy(target.model, p, 16)
        tau = sum(r.emitted for r in res.stats) / sum(r.steps for r in res.stats)
        assert tau > 1.3, (shape, tau)  # the continuations it was trained on: drafts get accepted


def test_stitched_export_carries_the_tuned_layer_and_only_it(mimo, trained, tmp_path):
    from specheads.export import export_head
    from specheads.export.serve import exported_lines

    folder, target = mimo
    _, head, _, model = trained
    out = export_head(head, tmp_path / "stitched", engine="vllm", target=str(folder))
    orig, new = load_file(str(folder / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(orig) == set(new)
    tuned = {("layers.0." + k[len(PREFIX):]): v for k, v in new.items() if k.startswith(PREFIX)}
    for k, v in model.state_dict().items():
        assert torch.equal(tuned[k], v), k
    changed = [k for k in orig if not torch.equal(orig[k], new[k])]
    assert changed and all(k.startswith(PREFIX) for k in changed)
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    rec = json.loads((out / "specheads_export.json").read_text())
    assert rec["serve"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert exported_lines(out)[-1] == (f"vllm serve {out} --speculative-config "
                                        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")
    # the stitched folder trains and evaluates as a target again (its MTP layer is the tuned one)
    assert torch.equal(read_mtp_tensors(out)[PREFIX + "input_proj.weight"], model.layers[0].input_proj.weight)


def test_export_refuses_a_target_without_the_layer(mimo, trained, tmp_path):
    from specheads.export import export_head

    _, head, _, _ = trained
    bare = make_mimo(tmp_path / "bare", with_mtp=False)
    with pytest.raises(MTPCheckpointError, match="lacks"):
        export_head(head, tmp_path / "out", engine="vllm", target=str(bare))
    assert not (tmp_path / "out").exists()


def test_serving_a_stitched_export_that_lost_its_mtp_tensors_is_refused_before_the_engine(mimo, trained, tmp_path):
    """serve-eval reads the export first: vLLM itself would build a random MTP layer from such a folder and serve
    it without a word (0 % acceptance)."""
    from specheads.export import export_head
    from specheads.export.serve import vllm_speculative_config
    from specheads.serving.engine import read_export, speculative_config

    folder, _ = mimo
    _, head, _, _ = trained
    out = export_head(head, tmp_path / "stitched", engine="vllm", target=str(folder))
    served = read_export(out)
    assert served.method == "mtp" and served.adapted_target == str(out)  # the stitched folder is the model served
    assert speculative_config(served, 3) == {"method": "mtp", "model": str(out.resolve()), "num_speculative_tokens": 3}
    assert vllm_speculative_config("mtp", "m", 2)["method"] == "mtp"
    sd = load_file(str(out / "model.safetensors"))
    del sd[PREFIX + "input_proj.weight"]
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MTPCheckpointError, match="lacks 1 of MTP layer 0's tensors") as e:
        read_export(out)
    assert "\n" not in str(e.value)
