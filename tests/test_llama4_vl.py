"""A tiny random Llama 4 (transformers' own ``Llama4Config`` with its vision config) through the stages that run on
this machine: 1-D positions (no M-RoPE), chunked attention on three of its four layers (chunks of ``CHUNK`` tokens)
and a NoPE full-attention layer.

Transformers builds Llama 4's image processor (``Llama4ImageProcessor``, which tiles an image and lays its tokens
out per tile) only on torchvision, which set-up does not install: image conversations are refused at prepare in
one line. The collection forward and the evaluator's prefill of an image prompt are checked with tiles made here
in the processor's layout (``(tiles, 3, image_size, image_size)``), the language side (text chats prepared, collected, an EAGLE-3 head
evaluated lossless) end to end. The reference for decoding is the model's own uncached forward: transformers'
cached ``generate`` does not reproduce it on these chunked layers (its chunked cache drifts after a few chunks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.decoding import runner as runner_mod
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.targets import Target, load_target, load_tokenizer
from tests.decoding.decoding_helpers import SiblingOracle

CHUNK = 16
IMAGE_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>")
CHATML = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
NEW = 40  # the prompt and its answer span several chunks


def _tokenizer():
    tok = load_tokenizer("smollm2")
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.chat_template = CHATML
    return tok


def _model(tok, moe: bool = True):
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in
           (("boi_token_index", "<|image_start|>"), ("eoi_token_index", "<|image_end|>"),
            ("image_token_index", "<|patch|>"))}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                moe_layers=[1, 3] if moe else [], attention_chunk_size=CHUNK, max_position_embeddings=512,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # layers 1 and 3 of mixture-of-experts MLPs (Maverick's interleaving); 56-pixel tiles of 14-pixel patches: 16 patches, 4 tokens after the pixel shuffle (ratio 0.5)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    config = Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config._attn_implementation = "eager"
    model = Llama4ForConditionalGeneration(config).eval().requires_grad_(False)
    for layer in model.language_model.model.layers:  # random weights attend almost uniformly: make masks matter
        layer.self_attn.q_proj.weight.mul_(10.0)
        layer.self_attn.k_proj.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(the saved target folder, the loaded target, the prepared folder of its text chats)."""
    from specheads.data import images as img
    from specheads.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("llama4")
    tok = _tokenizer()
    _model(tok).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    chats = [{"id": f"c{i:02d}", "messages": [
        {"role": "user", "content": f"Question {i}: tell me about number {i * 7} and its neighbours."},
        {"role": "assistant", "content": f"Number {i * 7} sits between {i * 7 - 1} and {i * 7 + 1}."}]}
        for i in range(12)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    folder = str(root / "target")
    tok = load_tokenizer(folder)
    prepare(Target.tokenizer_only(tok, folder), PrepareConfig(source="jsonl", path=str(root / "c.jsonl"), num_proc=1),
            root / "prepared", img.load_vision(folder, tok))
    return root / "target", load_target(folder, dtype="float32", device="cpu"), root / "prepared"


def _uncached_greedy(model, prompt: list[int], n: int = NEW) -> list[int]:
    """Greedy decoding by the model's own forward over the whole sequence each step (no cache)."""
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq[0, len(prompt):].tolist()


def test_the_target_loads_whole_with_1d_positions_and_chunked_layers(llama4):
    _, target, _ = llama4
    assert type(target.model).__name__ == "Llama4ForConditionalGeneration" and target.vision_language
    assert target.num_layers == 4 and target.hidden_size == 32
    assert runner_mod.AttentionLayout.of(target.config) == runner_mod.AttentionLayout(None, True, CHUNK)


def test_prepare_keeps_text_chats_and_refuses_image_chats_in_one_line(llama4, tmp_path):
    from specheads.data import images as img
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare
    from specheads.errors import UserError

    folder, target, prepared = llama4
    ds, _ = load_prepared(prepared)
    assert len(ds) == 12 and "images" not in ds.column_names
    photo = tmp_path / "p.png"
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 30, 30)).save(photo)
    (tmp_path / "i.jsonl").write_text(json.dumps({"id": "img", "image": str(photo), "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Red."}]}) + "\n")
    vision = img.load_vision(str(folder), target.tokenizer)
    assert vision is not None and vision.refusal and "llama4" in vision.refusal
    with pytest.raises(UserError) as e:
        prepare(Target.tokenizer_only(target.tokenizer, str(folder)),
                PrepareConfig(source="jsonl", path=str(tmp_path / "i.jsonl"), num_proc=1), tmp_path / "out", vision)
    assert "\n" not in str(e.value) and "shows images" in str(e.value)


def test_collection_reads_the_language_models_states_with_and_without_tiles(llama4):
    """Aux and last states are the model's own ``hidden_states`` (1-D positions: none recorded), also where a
    prompt's image tokens are filled from pixel tiles by the vision tower."""
    _, target, _ = llama4
    cfg = target.config
    tile = [cfg.boi_token_index] + [cfg.image_token_index] * 4 + [cfg.eoi_token_index]
    text = torch.tensor([list(range(20, 60))])
    ids = torch.tensor([[5, 6, 7] + tile + list(range(20, 60))])
    pixels = torch.randn(2, 1, 3, 56, 56)
    for row, kwargs in ((text, {}), (ids, {"pixel_values": pixels[0]})):
        got = target.forward_features(row, aux_layers=(1, 2, 3), **kwargs)
        with torch.no_grad():
            want = target.model(input_ids=row, use_cache=False, output_hidden_states=True, **kwargs).hidden_states
        assert got.positions is None
        assert all(torch.allclose(got.aux[i], want[layer]) for i, layer in enumerate((1, 2, 3)))
        assert torch.allclose(got.last, want[-1])
    a, b = (target.forward_features(ids, aux_layers=(1,), pixel_values=p).aux[0] for p in pixels)
    assert not torch.allclose(a[0, 4:8], b[0, 4:8]) and torch.equal(a[0, :4], b[0, :4])  # the tile fills its tokens
    with pytest.raises(ValueError, match="no pixel inputs"):
        target.forward_features(ids, aux_layers=(1,))


def test_its_prepared_chats_are_collected_as_its_own_forward_gives_them(llama4, tmp_path):
    """collect on the prepared text chats: a store of EAGLE-3's fused layers and the last state, no positions
    (1-D), each row's states the model's own ``hidden_states``."""
    from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states, spec_for_method
    from specheads.data.prepare import load_prepared

    _, target, prepared = llama4
    dataset, _ = load_prepared(prepared)
    spec = spec_for_method("eagle3", target.num_layers)
    summary = collect_hidden_states(target, dataset, spec, tmp_path / "store",
                                    CollectOptions(dtype="float32", estimate_time=False, progress=False))
    assert not summary["manifest"].get("positions")
    rows = {r["id"]: r for r in dataset}
    store = FeatureDataset(tmp_path / "store")
    assert len(store) == len(rows)
    for item in store:
        ids = torch.tensor([rows[item["id"]]["input_ids"]])
        with torch.no_grad():
            want = target.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        torch.testing.assert_close(item["hidden_last"], want[-1][0], rtol=1e-5, atol=1e-5)
        aux = item["hidden_aux"].view(ids.shape[1], len(spec.aux_layers), -1)
        for k, layer in enumerate(sorted(spec.aux_layers)):
            torch.testing.assert_close(aux[:, k], want[layer][0], rtol=1e-5, atol=1e-5)


def test_plain_and_tree_decoding_are_the_models_own_greedy_across_chunks(llama4):
    _, target, _ = llama4
    prompt = list(range(30, 30 + 2 * CHUNK + 3))
    want = _uncached_greedy(target.model, prompt)
    plain = speculative_generate(TargetRunner(target.model), None, [prompt], NEW, 0.0, "greedy", ()).tokens[0]
    assert plain == want
    res = speculative_generate(TargetRunner(target.model), SiblingOracle([want], [len(prompt)]), [prompt], NEW, 0.0,
                               "greedy", ())
    assert res.tokens[0] == want and res.target_forwards < NEW


def test_an_image_prompt_is_prefilled_with_its_tiles_and_decoded_as_the_models_own_greedy(llama4):
    """An image prompt (tiles made here in the processor's layout, no grids): the prefill runs the whole model with
    the pixels at 1-D positions (no M-RoPE table), plain and tree decoding give the uncached model's greedy output,
    which the pixels change."""
    from specheads.decoding.vision_prompts import ImagePrompt

    _, target, _ = llama4
    cfg = target.config
    tile = [cfg.boi_token_index] + [cfg.image_token_index] * 4 + [cfg.eoi_token_index]
    ids = [5, 6, 7] + tile + list(range(30, 30 + CHUNK + 3))
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 56, 56)
    prompt = ImagePrompt(ids, pixel_values=pixels, refs=["tile"])
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NEW):
            nxt = target.model(input_ids=seq, pixel_values=pixels, use_cache=False,
                               logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    want = seq[0, len(ids):].tolist()
    runner = TargetRunner(target.model)
    assert speculative_generate(runner, None, [prompt], NEW, 0.0, "greedy", ()).tokens[0] == want
    assert runner.mrope is None
    res = speculative_generate(TargetRunner(target.model), SiblingOracle([want], [len(ids)]), [prompt], NEW, 0.0,
                               "greedy", ())
    assert res.tokens[0] == want and res.target_forwards < NEW
    other = ImagePrompt(ids, pixel_values=torch.randn(1, 3, 56, 56) * 3, refs=["tile"])
    assert speculative_generate(TargetRunner(target.model), None, [other], NEW, 0.0, "greedy", ()).tokens[0] != want


def test_a_chunked_layer_given_the_full_mask_is_caught(llama4, monkeypatch):
    """The check above fails when the chunked layers attend past their chunk (the full mask handed to them)."""
    _, target, _ = llama4
    prompt = list(range(30, 30 + 2 * CHUNK + 3))
    want = _uncached_greedy(target.model, prompt)
    full = runner_mod.TargetRunner._masks

    def unchunked(self, allowed, pos):
        masks = full(self, allowed, pos)
        return {**masks, "chunked_attention": masks["full_attention"]}

    monkeypatch.setattr(runner_mod.TargetRunner, "_masks", unchunked)
    assert speculative_generate(TargetRunner(target.model), None, [prompt], NEW, 0.0, "greedy", ()).tokens[0] != want


def _evaluate(target, prepared, head: Path, exact_forward: str = "auto") -> dict:
    from specheads.evaluation.prompts import BenchmarkSpec
    from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model

    torch.manual_seed(0)
    Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64)).save_pretrained(head)
    methods = [MethodSpec("eagle3", "eagle3", TreeShape("dynamic", depth=2, topk=2, total_tokens=4),
                          head_dir=str(head)),
               MethodSpec("ngram", "ngram", TreeShape("chain", k=3))]
    spec = BenchmarkSpec(mtbench_per_category=0, humaneval=0, chat=None, chat_dir=str(prepared))
    return evaluate(target, EvalConfig(methods, spec, max_new_tokens=NEW, temperatures=(0.0,), batch_sizes=(1,),
                                       repeats=1, cpu_linears="plain", cpu_threads=1, exact_forward=exact_forward))


def test_evaluate_an_eagle3_head_on_its_held_out_chats_lossless_in_exact_forwards(llama4, tmp_path):
    """The evaluator's exact pass on the dense Llama 4 (every MLP dense): plain, EAGLE-3 and n-gram rows on the
    held-out chats decode alike, bitwise."""
    folder, moe_target, prepared = llama4
    dense = Target(_model(moe_target.tokenizer, moe=False), moe_target.tokenizer, name=str(folder))
    report = _evaluate(dense, prepared, tmp_path / "head")
    assert report["prompt_ids"] and report["passes"]["exact"] is not None
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["lossless"]["pass"] == "exact" and not m["lossless"]["divergences"]


def test_its_experts_are_not_proven_exact_and_the_evaluator_says_so_in_one_line(llama4, tmp_path):
    """Llama 4's experts multiply their raw weights with ``torch.bmm`` (``Llama4TextExperts``), which the exact
    forwards' row floor (on linear layers) does not pad: the exact pass refuses in one line, naming
    exact_forward=off, with which the evaluator compares speculative and plain decoding in the kernels' own
    arithmetic (the tree and chain tests above are that comparison, decoded alike)."""
    from specheads.errors import UserError

    folder, _, prepared = llama4
    target = load_target(str(folder), dtype="float32", device="cpu")  # the evaluator sets its kernels on it
    report = _evaluate(target, prepared, tmp_path / "head", exact_forward="off")
    for m in report["methods"]:
        assert not m["lossless"]["divergences"]
    with pytest.raises(UserError) as e:
        _evaluate(target, prepared, tmp_path / "head2")
    assert "\n" not in str(e.value) and "exact_forward=off" in str(e.value)
