"""The evaluator on image prompts of tiny random vision-language targets (Qwen3-VL, Qwen2.5-VL) with scikit-image
photographs: the held-out image rows of a prepared set are prefilled with their images at the target's M-RoPE
positions, and every forward after the prefill continues them as transformers' ``generate`` does (index + the
model's ``rope_deltas``), so plain decoding is ``generate``'s output and speculative decoding is plain decoding's.
"""

from __future__ import annotations

import pytest
import torch

from specheads.decoding import vision_prompts
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.head_drafters import EagleDrafter
from specheads.decoding.runner import TargetRunner
from specheads.decoding.vision_prompts import ImagePrompt
from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.prompts import BenchmarkSpec, encode, load_chat_heldout, read_prompt_images
from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.targets import load_target

from tests.data.vision_targets import prepare_image_chats, save_vision_target
from tests.decoding.decoding_helpers import SiblingOracle

pytest.importorskip("skimage", reason="scikit-image (the dev extra) holds the sample photographs")

NEW = 16


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    """(family, target, prepared folder, the held-out image prompt with its pixels) of each family: the held-out
    chat is the one whose first turn shows two photographs."""
    root = tmp_path_factory.mktemp(request.param)
    folder = save_vision_target(root / "target", request.param)
    prepare_image_chats(root, folder)
    target = load_target(str(folder), dtype="float32", device="cpu")
    # random weights of std 0.02 attend almost uniformly, so the positions hardly move the tiny Qwen2.5-VL's tokens:
    # query and key projections 10x larger make every test here see where each token sits (Qwen3-VL normalizes
    # its queries and keys after them: unchanged)
    for layer in target.layers:
        layer.self_attn.q_proj.weight.mul_(10.0)
        layer.self_attn.k_proj.weight.mul_(10.0)
    prompts = load_chat_heldout(root / "prepared", None)
    read_prompt_images(prompts, target)
    return request.param, target, root / "prepared", prompts


def _generate(target, prompt: ImagePrompt, n: int = NEW) -> list[int]:
    """Transformers' own greedy decoding of an image prompt (the reference the runner must reproduce)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                                    mm_token_type_ids=(ids == target.config.image_token_id).int(),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _plain(target, prompt, n: int = NEW) -> list[int]:
    return speculative_generate(TargetRunner(target.model), None, [prompt], n, 0.0, "greedy", ()).tokens[0]


def test_held_out_image_rows_are_image_prompts_with_their_images(vl):
    family, target, _, prompts = vl
    (p,) = prompts  # the last chat by id ("two"), cut at its first answer: its first turn's two photographs
    assert p.id == "chat/two" and p.domain == "image" and isinstance(p.input_ids, ImagePrompt)
    assert len(p.input_ids.refs) == 2 and p.input_ids.image_grid_thw.shape == (2, 3)
    merge = target.config.vision_config.spatial_merge_size
    want = int(p.input_ids.image_grid_thw.prod(-1).sum()) // merge ** 2
    assert sum(t == target.config.image_token_id for t in p.input_ids) == want
    assert p.input_ids.pixel_values.shape[0] == int(p.input_ids.image_grid_thw.prod(-1).sum())


def test_plain_decoding_of_an_image_prompt_is_transformers_generate(vl):
    _, target, _, (p,) = vl
    runner = TargetRunner(target.model)
    got = speculative_generate(runner, None, [p.input_ids], NEW, 0.0, "greedy", ()).tokens[0]
    assert got == _generate(target, p.input_ids)
    assert int(runner.mrope.delta[0]) < 0  # the images' tokens took fewer positions than tokens


def _flat_after_prompt(self, pos):
    """A planted fault: the prompt at its M-RoPE positions, every token after it at its 1-D index (no offset)."""
    pos = pos.to(self.table.device)
    prompt = self.table.gather(2, pos.clamp(0, self.table.shape[2] - 1)[None].expand(3, -1, -1))
    return torch.where((pos < self.lengths[:, None])[None], prompt, pos[None].expand(3, -1, -1))


def test_decoding_after_the_prefill_at_1d_positions_is_caught(vl, monkeypatch):
    """The check above fails when the forwards after the prefill drop the target's position offset."""
    _, target, _, (p,) = vl
    want = _generate(target, p.input_ids)
    monkeypatch.setattr(vision_prompts.MropePositions, "at", _flat_after_prompt)
    assert _plain(target, p.input_ids) != want


def test_draft_trees_after_image_prompts_decode_as_plain(vl, tmp_path):
    """A batch of two image prompts (the held-out one and a one-photograph chat) and a text prompt, verified as
    trees in one forward per step: each row's output is its batch-1 plain output, drafts accepted."""
    _, target, prepared, (p,) = vl
    from specheads.data.prepare import load_prepared

    ds, _ = load_prepared(prepared)
    one = next(r for r in ds if r["id"] == "one")
    cut = list(r for r in one["loss_mask"]).index(1)
    q = ImagePrompt(one["input_ids"][:cut], image_grid_thw=torch.tensor(one["image_grid_thw"]), refs=one["images"])
    read_prompt_images([EvalPrompt("one", "image", input_ids=q)], target)
    text = encode(EvalPrompt("text", "chat", ["Hello there"]), target.tokenizer, {})
    rows = [p.input_ids, q, text]
    plain = [_plain(target, r) for r in rows]
    res = speculative_generate(TargetRunner(target.model), SiblingOracle(plain, [len(r) for r in rows]), rows, NEW,
                               0.0, "greedy", ())
    assert res.tokens == plain
    assert all(sum(s.accepted) > 0 for s in res.stats) and res.target_forwards < NEW


def test_the_eagle3_draft_rotates_by_the_targets_positions(vl):
    """The draft reads the target's 3-D positions at the prompt's slots (as collected for training), then the
    temporal position continued on every axis (the target's index + offset), as vLLM's proposer hands them."""
    _, target, _, (p,) = vl
    torch.manual_seed(0)
    model = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64)).attach(target)
    seen = []
    hook = model.rotary_emb.register_forward_pre_hook(lambda m, a: seen.append(a[1]))
    runner = TargetRunner(target.model)
    try:
        speculative_generate(runner, EagleDrafter(model, TreeShape("chain", k=3), "eagle3"), [p.input_ids], 6,
                             0.0, "greedy", ())
    finally:
        hook.remove()
    ids = torch.tensor([list(p.input_ids)])
    want, delta = target.model.model.get_rope_index(ids, mm_token_type_ids=(ids == target.config.image_token_id).int(),
                                                    image_grid_thw=p.input_ids.image_grid_thw)
    assert all(s.dim() == 3 and s.shape[-1] == 3 for s in seen), "the draft rotated by 1-D positions"
    first, later = seen[0], torch.cat([s.reshape(-1, 3) for s in seen[1:]])
    assert torch.equal(first[0], want[:, 0, : len(p.input_ids) - 1].T)  # image slots: height and width apart
    assert bool((first[0, :, 1] != first[0, :, 0]).any())
    assert torch.equal(later[:, 1], later[:, 0]) and torch.equal(later[:, 2], later[:, 0])
    assert int(later[:, 0].min()) == len(p.input_ids) - 1 + int(delta)


def test_evaluate_an_eagle3_head_on_image_prompts(vl, tmp_path):
    """The whole evaluator: plain, EAGLE-3 and n-gram rows on the held-out image prompt, the exact pass's lossless
    verdict and the fast pass's own comparison, α and τ in an ``image`` domain, the report written."""
    from specheads.evaluation.report import write_report

    _, target, prepared, _ = vl
    torch.manual_seed(0)
    Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64)).save_pretrained(tmp_path / "head")
    methods = [MethodSpec("eagle3", "eagle3", TreeShape("dynamic", depth=2, topk=2, total_tokens=4),
                          head_dir=str(tmp_path / "head")),
               MethodSpec("ngram", "ngram", TreeShape("chain", k=3))]
    spec = BenchmarkSpec(mtbench_per_category=0, humaneval=0, chat=None, chat_dir=str(prepared))
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=NEW, temperatures=(0.0,), batch_sizes=(1,),
                                         repeats=1, cpu_linears="plain", cpu_threads=1))
    assert report["prompt_ids"] == ["chat/two"] and report["passes"]["exact"] is not None
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["lossless"]["pass"] == "exact" and not m["lossless"]["divergences"]
        image = m["by_temperature"]["0.0"]["image"]
        assert image["tau"] >= 1.0 and 0.0 <= image["alpha"] <= 1.0
    write_report(report, tmp_path / "r")
    assert "| image |" in (tmp_path / "r" / "report.md").read_text()


def test_the_evaluate_command_scores_image_prompts(vl, tmp_path):
    """`specheads evaluate` in one command on a vision-language target and its prepared image chats (as the
    evaluation guide shows it): the held-out image prompt decoded with its photographs, lossless, an ``image``
    domain in the report."""
    from tests.test_hydra_configs import load_recipe
    from tests.test_long_rows import compose

    family, target, prepared, _ = vl
    if family != "qwen3_vl":
        pytest.skip("the recipe's path is the same for both families (evaluate runs on each above)")
    torch.manual_seed(0)
    Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64)).save_pretrained(tmp_path / "head")
    report = load_recipe("evaluate.py").run(compose("evaluate", [
        "target=hf", f"target.name_or_path={target.name}", "target.dtype=float32", "target.device=cpu",
        f"head_dir={tmp_path / 'head'}", f"eval.chat_dir={prepared}", "eval.mtbench_per_category=0", "eval.humaneval=0",
        f"eval.max_new_tokens={NEW}", "baselines=[ngram]", "serving.engines=[]", "temperatures=[0.0]",
        "batch_sizes=[1,2]", f"output_dir={tmp_path / 'eval'}"]))
    assert report["prompt_ids"] == ["chat/two"]
    assert [m["name"] for m in report["methods"]] == ["eagle3-tree", "ngram-chain4"]
    for m in report["methods"]:
        assert m["lossless"]["exact"] and "image" in m["by_temperature"]["0.0"]
        assert m["batch"]["2"]["matches_batch1_plain"]
    assert "| image |" in (tmp_path / "eval" / "report.md").read_text()


def test_a_divergence_on_an_image_prompt_is_measured_with_its_images(vl):
    """The margin reported where speculative output leaves plain output is the target's with the prompt's images in
    their tokens (the forward it decoded with), not the text tokens' alone."""
    from specheads.evaluation.passes import first_divergence

    _, target, _, (p,) = vl
    want = _plain(target, p.input_ids, 4)
    got = want[:2] + [(want[2] + 1) % target.vocab_size] + want[3:]
    found = first_divergence(target, p.input_ids, want, got)
    ids = torch.tensor([list(p.input_ids) + want[:2]])
    with torch.no_grad():
        logits = target.model(ids, pixel_values=p.input_ids.pixel_values, image_grid_thw=p.input_ids.image_grid_thw,
                              mm_token_type_ids=(ids == target.config.image_token_id).int()).logits[0, -1]
        blind = target.model(ids).logits[0, -1]
    assert found["index"] == 2 and found["plain"] == want[2]
    assert found["margin_vs_speculative"] == pytest.approx(float(logits[want[2]] - logits[got[2]]), abs=1e-4)
    assert abs(float(blind[want[2]] - blind[got[2]]) - found["margin_vs_speculative"]) > 1e-3  # the images matter
