"""EAGLE-3 on a vision-language target's image rows, trained as vLLM's EAGLE-3 draft reads them when serving.

vLLM 0.32/0.33 serve a Qwen2.5-VL/Qwen3-VL target's EAGLE-3 draft as ``Eagle3LlamaForCausalLM`` (the
``Eagle3Qwen2_5vlForCausalLM`` / ``Eagle3Qwen3vlForCausalLM`` architectures map to it). That class declares no
multimodal-embedding support, so the proposer hands it token ids: at slot ``t`` the embedding (the target's table)
of token ``ids[t+1]``, the image pad's row at an image slot; its positions are the target's 3-D M-RoPE positions
at step 0, then the temporal position + i on every axis. The draft rotates by the config's ``mrope_section``.
"""

import json

import pytest
import torch

from specheads.data.features import (CollectOptions, FeatureDataset, collate_features, collect_hidden_states,
                                     spec_for_method)
from specheads.data.store import StoreMismatchError
from specheads.methods.eagle3 import Eagle3Method
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.mrope import MRotaryEmbedding
from specheads.targets import Target, load_target

from tests.data.vision_targets import prepare_image_chats, save_vision_target

pytest.importorskip("skimage", reason="scikit-image (the dev extra) holds the sample photographs")

FAMILIES = ["qwen3_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def vl_target(request, tmp_path_factory):
    """(family, loaded tiny random target) of each family."""
    root = tmp_path_factory.mktemp(request.param)
    return request.param, load_target(str(save_vision_target(root / "target", request.param)), dtype="float32",
                                      device="cpu")


@pytest.fixture(scope="module")
def image_store(tmp_path_factory):
    """(target, prepared folder, store folder) of a tiny random Qwen3-VL target: a chat with two images in its
    first turn and one in a later turn, a one-image ShareGPT4V chat, a text chat."""
    root = tmp_path_factory.mktemp("images")
    folder = save_vision_target(root / "target", "qwen3_vl")
    prepare_image_chats(root, folder)
    target = load_target(str(folder), dtype="float32", device="cpu")
    from specheads.data.prepare import load_prepared

    dataset, _ = load_prepared(root / "prepared")
    collect_hidden_states(target, dataset, spec_for_method("eagle3", target.num_layers), root / "store",
                          CollectOptions(dtype="float32", estimate_time=False, progress=False))
    return target, root / "prepared", root / "store"


def _draft(target: Target, seed: int = 0) -> Eagle3Model:
    torch.manual_seed(seed)
    return Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64)).attach(target)


def test_the_draft_rotates_as_the_targets_language_model(vl_target):
    """M-RoPE in the draft: its (cos, sin) at 3-D positions are the target's own rotary embedding's, and its attention
    equals one computed by hand with transformers' rotation of the target family; 1-D positions rotate as RoPE."""
    family, target = vl_target
    draft = _draft(target)
    rope = target.config.get_text_config().rope_parameters
    assert draft.config.rope_parameters["mrope_section"] == rope["mrope_section"]
    assert bool(draft.config.rope_parameters.get("mrope_interleaved")) == (family == "qwen3_vl")
    assert isinstance(draft.rotary_emb, MRotaryEmbedding)
    B, T, H = 2, 7, draft.config.hidden_size
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 40, (B, T, 3), generator=g)  # time, height and width apart, as inside an image
    x = torch.randn(B, T, 2 * H, generator=g)
    cos, sin = draft.rotary_emb(x, pos)
    want_cos, want_sin = target.decoder.rotary_emb(x, pos.permute(2, 0, 1))  # the target's: (3, B, T) positions
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)

    attn, D = draft.midlayer.self_attn, draft.config.head_dim
    modeling = __import__(type(target.decoder).__module__, fromlist=["apply_rotary_pos_emb"])
    q = attn.q_proj(x).view(B, T, -1, D).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, D).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)
    q, k = modeling.apply_rotary_pos_emb(q, k, want_cos, want_sin)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    by_hand = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(attn(x, cos, sin, 0, None, None), by_hand, rtol=1e-5, atol=1e-5)

    flat = torch.arange(T).expand(B, T)  # a text row: the three axes equal, plain RoPE
    text_cos, text_sin = draft.rotary_emb(x, flat)
    torch.testing.assert_close(text_cos, target.decoder.rotary_emb(x, flat[None].expand(3, B, T))[0])
    torch.testing.assert_close(text_sin, target.decoder.rotary_emb(x, flat[None].expand(3, B, T))[1])


def test_the_draft_config_keeps_the_mrope_settings(vl_target, tmp_path):
    _, target = vl_target
    draft = _draft(target)
    draft.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert saved["mrope_section"] == target.config.get_text_config().rope_parameters["mrope_section"]
    again = Eagle3Model.from_pretrained(tmp_path).attach(target)
    assert isinstance(again.rotary_emb, MRotaryEmbedding)
    assert torch.equal(again.rotary_emb.axes(), draft.rotary_emb.axes())
    # drafters trained at 1-D positions (text rows only) keep plain RoPE: vLLM hands them the temporal positions,
    # and refuses M-RoPE for drafts with extra input slots (P-EAGLE, DFlash)
    from specheads.models.dflash import DFlashConfig
    from specheads.models.peagle import PEagleConfig, PEagleModel

    peagle = PEagleConfig.from_target(target, draft_vocab_size=64, num_depths=2)
    for config in (peagle, DFlashConfig.from_target(target, block_size=4)):
        assert "mrope_section" not in config.rope_parameters
        assert config.rope_parameters["rope_theta"] == target.config.get_text_config().rope_parameters["rope_theta"]
    assert not isinstance(PEagleModel(peagle).rotary_emb, MRotaryEmbedding)


def _batch(store, target, ids=None):
    data = FeatureDataset(store, spec=spec_for_method("eagle3", target.num_layers), target=target)
    items = [data[i] for i in range(len(data)) if ids is None or data[i]["id"] in ids]
    return collate_features(items)


def _method(prepared, target) -> Eagle3Method:
    """EAGLE-3 over the whole vocabulary: the random target's argmax anywhere in it is a trained row."""
    return Eagle3Method(draft_vocab_size=target.vocab_size, vocab_data=str(prepared), ttt_steps=2)


def test_the_drafts_inputs_at_image_slots_are_the_engines(image_store):
    """At every slot (image slots included) the draft reads what vLLM's proposer builds for it: the token embedding
    of the next token (the image pad's at an image slot: the draft takes no vision features) and the target's
    M-RoPE positions, then the temporal position + step."""
    target, prepared, store = image_store
    batch = _batch(store, target)
    method = _method(prepared, target)
    model = method.build(target)
    image = target.config.image_token_id
    ids, positions = batch["input_ids"], batch["positions"]
    assert bool((ids == image).any()) and positions.shape == (*ids.shape, 3)
    seen = []
    embed_hook = model.midlayer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.append(("embeds", a[0])))
    rope_hook = model.rotary_emb.register_forward_pre_hook(lambda m, a: seen.append(("positions", a[1])))
    try:
        out = method.loss(model, batch, target)
    finally:
        embed_hook.remove(), rope_hook.remove()
    assert torch.isfinite(out.loss)
    embeds = [t for name, t in seen if name == "embeds"]  # input_layernorm reads the embeddings, once a step
    steps = [t for name, t in seen if name == "positions"]
    assert len(steps) == len(embeds) == method.ttt_steps
    table = target.embed_tokens.weight
    for i, (e, p) in enumerate(zip(embeds, steps)):
        nxt = torch.zeros_like(ids)  # vLLM's shift: slot t reads token t+1+i
        nxt[:, : ids.shape[1] - 1 - i] = ids[:, 1 + i:]
        torch.testing.assert_close(e, table[nxt])
        at_image = nxt == image
        assert bool(at_image.any())
        torch.testing.assert_close(e[at_image], table[image].expand(int(at_image.sum()), -1))
        want = positions if i == 0 else (positions[..., :1] + i).expand_as(positions)
        assert torch.equal(p, want)
    inside = positions[..., 1] != positions[..., 0]  # image slots: height/width differ from time
    assert bool(inside.any())


def test_a_training_step_on_image_rows(image_store):
    target, prepared, store = image_store
    batch = _batch(store, target)
    method = _method(prepared, target)
    model = method.build(target)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(3):
        out = method.loss(model, batch, target)
        assert torch.isfinite(out.loss)
        opt.zero_grad()
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert float(model.fc.weight.grad.abs().sum()) > 0
        assert float(model.midlayer.self_attn.q_proj.weight.grad.abs().sum()) > 0
        opt.step()
    assert losses[-1] < losses[0]
    # 1-D positions (a trainer that dropped the store's) give other draft states at the image rows' positions
    model.eval()
    with torch.no_grad():
        h0 = model.fuse(batch["hidden_aux"])
        flat = model.decode(h0, batch["input_ids"], torch.arange(h0.shape[1]).expand(h0.shape[:2]))
        mrope = model.decode(h0, batch["input_ids"], batch["positions"])
    assert not torch.allclose(flat, mrope)


def test_other_methods_refuse_image_rows_in_one_line(image_store):
    target, _, store = image_store
    from specheads.methods.peagle import PEagleMethod

    peagle = PEagleMethod(vocab_data="unused").bind(target)
    for spec in (spec_for_method("eagle1", target.num_layers), peagle.feature_spec):
        with pytest.raises(StoreMismatchError, match="holds 2 image rows .* train EAGLE-3 \\(method=eagle3\\)") as e:
            FeatureDataset(store, spec=spec, target=target)
        assert "\n" not in str(e.value)


def test_the_train_and_export_recipes_take_an_image_store(image_store, tmp_path):
    """The train recipe trains EAGLE-3 from the image store; the vLLM layout's config carries the target's M-RoPE
    settings, which make vLLM's draft (Eagle3LlamaForCausalLM, the class its Eagle3Qwen2_5vl/Eagle3Qwen3vl
    architectures and LlamaForCausalLMEagle3 all load) rotate by the target's 3-D positions; speculators' too."""
    from tests.test_hydra_configs import load_recipe
    from tests.test_long_rows import compose

    target, prepared, store = image_store
    t = ["target=hf", f"target.name_or_path={target.name}", "target.dtype=float32", "target.device=cpu"]
    summary = load_recipe("train.py").run(compose("train", [
        *t, "method=eagle3", f"features_dir={store}", f"prepared_dir={prepared}", f"output_dir={tmp_path / 'train'}",
        f"method.draft_vocab_size={target.vocab_size}", "train.max_steps=2", "data.eval_samples=0",
        "train.measure_prompts=0", "train.progress=false", "wandb.mode=disabled"]))
    assert summary["steps"] == 2 and 0 < summary["final_loss"] < float("inf")
    load_recipe("export.py").run(compose("export", [*t, f"head_dir={tmp_path / 'train' / 'head'}",
                                                    f"output_dir={tmp_path / 'export'}"]))
    rope = target.config.get_text_config().rope_parameters
    vllm = json.loads((tmp_path / "export" / "vllm" / "config.json").read_text())
    speculators = json.loads((tmp_path / "export" / "speculators" / "config.json").read_text())
    assert vllm["architectures"] == ["LlamaForCausalLMEagle3"]
    for config in (vllm, speculators["transformer_layer_config"]):
        assert config["rope_parameters"]["mrope_section"] == rope["mrope_section"] == [2, 1, 1]
        assert config["rope_parameters"]["mrope_interleaved"] is True


def test_the_measured_decode_during_training_leaves_image_prompts_out(image_store):
    """Training's measured decode runs the target's language model on token ids (no pixels): image prompts are left
    out, the text chat's is kept."""
    from specheads.training.acceptance import held_out_prompts

    target, _, store = image_store
    batch = _batch(store, target)
    assert len(held_out_prompts([batch], 5)) == 3
    (kept,) = held_out_prompts([batch], 5, image_token=target.config.image_token_id)
    assert target.config.image_token_id not in kept and target.config.vision_start_token_id not in kept


def test_loss_rows_all_never_labels_an_image_token(image_store):
    from specheads.methods.eagle3 import every_row

    target, prepared, store = image_store
    batch = _batch(store, target)
    mask = every_row(batch, target)
    image = batch["input_ids"] == target.config.image_token_id
    assert not bool(mask[image].any()) and bool(mask[~image & (batch["attention_mask"] > 0)].all())
    method = Eagle3Method(draft_vocab_size=target.vocab_size, vocab_data=str(prepared), ttt_steps=2, loss_rows="all")
    assert torch.isfinite(method.loss(method.build(target), batch, target).loss)
