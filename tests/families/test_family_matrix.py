"""Every architecture family through every stage, on tiny random models (tests/families/family_models.py).

Per family: collect to a store and online (features = the model's own hidden states and logits, padding
and store invariant), train a few steps of each method, evaluate the trained heads with tree and chain
drafting (greedy output token for token the target's plain greedy decode by full recomputation, across
the sliding windows), and export for vLLM and SGLang (the configs the engines read, and the round trip).
Outcomes go to the support log (support_log.py) for docs/support_matrix.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from family_models import FAMILIES, WINDOW, make_family_model
from specheads.targets import Target

PROMPTS = [[5, 9, 13, 2, 7, 1, 3, 8, 100, 200, 3, 17], [40, 41, 42], [7, 7, 90, 12, 64, 3]]
NEW_TOKENS = 14  # the first prompt ends past the window and every output crosses it


class World:
    """One family's target, data and trained heads, built on first use and shared by the module's tests."""

    def __init__(self, family: str, root: Path):
        self.family, self.root = family, root
        self.target = Target(make_family_model(family), tokenizer=None, name=f"tiny-{family}")
        self.heads: dict[str, Path] = {}
        self._reference = None
        self._target_dir = None

    @property
    def reference(self) -> list[list[int]]:
        from tests.decoding.decoding_helpers import reference_greedy

        if self._reference is None:
            self._reference = [reference_greedy(self.target.model, p, NEW_TOKENS) for p in PROMPTS]
        return self._reference

    @property
    def target_dir(self) -> Path:
        if self._target_dir is None:
            self._target_dir = self.root / "target"
            self.target.model.save_pretrained(self._target_dir)
        return self._target_dir

    def head(self, method: str) -> Path:
        if method not in self.heads:
            self.heads[method] = train_head(self, method)
        return self.heads[method]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    made: dict[str, World] = {}

    def get(family: str) -> World:
        if family not in made:
            made[family] = World(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def rows(n: int, seed: int = 0) -> dict[str, list]:
    from tests.training.engine_helpers import progression_rows

    return progression_rows(n, length=24, seed=seed)


def build(method: str):
    from specheads.methods import build_method

    settings = {"medusa1": dict(num_heads=3), "medusa2": dict(num_heads=3, lora_r=4, heads_warmup_steps=1),
                "eagle1": dict(), "eagle3": dict(draft_vocab_size=128, ttt_steps=2)}[method]
    if method == "eagle3":
        data = rows(16)
        settings["vocab_data"] = [{"input_ids": i, "loss_mask": m} for i, m in zip(data["input_ids"], data["loss_mask"])]
    return build_method(method, **settings)


def train_head(world: World, method: str, target: Target | None = None) -> Path:
    """A few optimizer steps of ``method`` on online features; returns the saved head folder."""
    from tests.training.engine_helpers import sources
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train

    train_src, held = sources(n_train=8, n_eval=4, max_tokens=96)
    out = world.root / f"train-{method}"
    cfg = TrainConfig(output_dir=str(out), max_steps=3, eval_every=0, save_every=0, wandb_mode="disabled",
                      progress=False, log_every=1, measure_prompts=2, measure_k=2, measure_tokens=10,
                      measure_fans=(2,))
    summary = train(build(method), target or world.target, train_src, cfg, OptimConfig(lr=1e-3), held)
    assert summary["steps"] == 3
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    return out / "head"


# --------------------------------------------------------------------------- collect


@pytest.mark.parametrize("family", FAMILIES)
def test_collect_store(family, worlds, support, tmp_path):
    """A store's features are the model's own: aux i = hidden_states[i], logits(last) = the model's logits."""
    import datasets

    from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states, spec_for_method
    from specheads.data.store import verify_store

    support(family, "collect_store")
    w = worlds(family)
    spec = spec_for_method("eagle3", w.target.num_layers)
    data = datasets.Dataset.from_dict(rows(6))
    collect_hidden_states(w.target, data, spec, tmp_path / "store",
                          CollectOptions(dtype="float32", shard_bytes=40_000, batch_tokens=64, max_batch_size=4))
    verify_store(tmp_path / "store")
    ds = FeatureDataset(tmp_path / "store", spec=spec, target=w.target)
    sample = ds[0]
    ids = torch.as_tensor(sample["input_ids"]).long()[None]
    assert ids.shape[1] > WINDOW
    ref = w.target.model(ids, output_hidden_states=True)
    aux = torch.cat([ref.hidden_states[i] for i in spec.aux_layers], -1)[0]
    torch.testing.assert_close(torch.as_tensor(sample["hidden_aux"]).float(), aux)
    last = torch.as_tensor(sample["hidden_last"]).float()
    torch.testing.assert_close(w.target.logits(last[None])[0], ref.logits[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_collect_online(family, worlds, support):
    """Online features of a right-padded batch equal each row's features alone (padding never leaks)."""
    from specheads.data.features import collate_features, compute_features, spec_for_method

    support(family, "collect_online")
    w = worlds(family)
    spec = spec_for_method("eagle3", w.target.num_layers)
    data = rows(3, seed=1)
    samples = [{"input_ids": i, "loss_mask": m} for i, m in zip(data["input_ids"], data["loss_mask"])]
    samples[1] = {k: v[:11] for k, v in samples[1].items()}
    batch = compute_features(w.target, collate_features(samples), spec, argmax=True)
    for b, s in enumerate(samples):
        alone = compute_features(w.target, collate_features([s]), spec, argmax=True)
        n = len(s["input_ids"])
        for key in ("hidden_last", "hidden_aux"):
            torch.testing.assert_close(batch[key][b, :n], alone[key][0], atol=1e-5, rtol=1e-4)
        assert torch.equal(batch["target_argmax"][b, :n], alone["target_argmax"][0])
    # What a drafter embeds is the plain table (the engines' target embedding), even where the family's
    # embedding module scales it (Gemma-3)
    ids = batch["input_ids"]
    assert torch.equal(w.target.embed(ids), w.target.embed_tokens.weight[ids])


# --------------------------------------------------------------------------- train


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["medusa1", "eagle1", "eagle3"])
def test_train(family, method, worlds, support):
    support(family, f"train_{method}")
    w = worlds(family)
    head = w.head(method)
    assert (head / "config.json").is_file()
    if method in ("eagle1", "eagle3"):  # the head embeds with the plain table, as the engines give it
        from specheads.models.eagle1 import Eagle1Model
        from specheads.models.eagle3 import Eagle3Model

        model = {"eagle1": Eagle1Model, "eagle3": Eagle3Model}[method].from_pretrained(head).attach(w.target)
        ids = torch.tensor([PROMPTS[0]])
        assert torch.equal(model._embed(ids), w.target.embed_tokens.weight[ids])
    if method == "eagle3":  # its soft labels: the target's logits on the draft vocabulary (soft-capped if capped)
        from specheads.methods.losses import column_logits

        cols = torch.arange(0, 256, 3)
        h = torch.randn(5, 64) * 3
        torch.testing.assert_close(column_logits(w.target, cols)(h), w.target.logits(h)[:, cols])


@pytest.mark.parametrize("family", FAMILIES)
def test_train_medusa2(family, worlds, support):
    """Medusa-2 trains LoRA on the family's linear layers ("all-linear"); the merged adapted target it saves
    gives the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    support(family, "train_medusa2")
    w = worlds(family)
    target = Target(make_family_model(family), tokenizer=None, name=f"tiny-{family}")  # adapted in place
    head = train_head(w, "medusa2", target)
    adapted = AutoModelForCausalLM.from_pretrained(head / "target", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, target.model(ids).logits, atol=1e-4, rtol=1e-4)
    lora = [n for n, _ in target.model.named_modules() if n.endswith("lora_A")]
    assert lora, "no LoRA layer was injected"
    # its target-keeping loss reads the adapted target's logits as the model's forward makes them (soft-capped)
    fresh = Target(make_family_model(family), tokenizer=None, name=f"tiny-{family}")
    model = build("medusa2").build(fresh)
    with torch.no_grad():
        h = model.hidden(ids, torch.ones_like(ids))
        torch.testing.assert_close(model._logits(h), fresh.model(ids).logits)


# --------------------------------------------------------------------------- evaluate


def _decode(world: World, spec, verify_backend=None, target: Target | None = None) -> list[list[int]]:
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.runner import TargetRunner
    from specheads.evaluation.suite import build_drafter

    target = target or world.target
    drafter = build_drafter(spec, target)
    res = speculative_generate(TargetRunner(target.model), drafter, PROMPTS, NEW_TOKENS,
                               verify_backend=verify_backend)
    assert all(s.steps < NEW_TOKENS + 1 for s in res.stats)
    return res.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluate_tree_lossless(family, worlds, support):
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.suite import MethodSpec

    support(family, "evaluate_tree")
    w = worlds(family)
    specs = [MethodSpec("eagle3", "eagle3", TreeShape("dynamic", depth=3, topk=2, total_tokens=6),
                        head_dir=str(w.head("eagle3"))),
             MethodSpec("medusa", "medusa", TreeShape("static"), head_dir=str(w.head("medusa1")), medusa_tree_nodes=6)]
    for spec in specs:
        assert _decode(w, spec) == w.reference, spec.name
    assert _decode(w, specs[0], verify_backend="torch") == w.reference
    # The evaluator's exact forwards (float64 attention, exact_forward=on) keep the family's attention:
    # soft-capped scores, sinks, windows, value heads wider than the keys
    from specheads.decoding.exact import make_exact
    from specheads.decoding.generate import plain_generate
    from specheads.decoding.runner import TargetRunner

    exact = Target(make_family_model(family), tokenizer=None, name=w.target.name)
    make_exact(exact.model, "on")
    assert plain_generate(TargetRunner(exact.model), PROMPTS, NEW_TOKENS).tokens == w.reference
    assert _decode(w, specs[0], target=exact) == w.reference


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluate_chain_lossless(family, worlds, support):
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.suite import MethodSpec

    support(family, "evaluate_chain")
    w = worlds(family)
    for method in ("eagle1", "eagle3"):
        spec = MethodSpec(method, method, TreeShape("chain", k=3), head_dir=str(w.head(method)))
        assert _decode(w, spec) == w.reference, method


# --------------------------------------------------------------------------- export


def _check_export(world: World, method: str, engine: str, out: Path) -> None:
    from transformers import AutoConfig

    from specheads.export.reload import load_exported
    from tests.export.test_export import engine_load, engine_module_params, file_shapes

    config = json.loads((out / "config.json").read_text())
    assert engine_load(method, engine, file_shapes(out)) == engine_module_params(method, engine, config, 256)
    saved = {"medusa": "medusa1"}.get(method, method)
    head_cfg = json.loads((world.head(saved) / "config.json").read_text())
    reloaded = load_exported(out).state_dict()
    from safetensors.torch import load_file

    original = load_file(str(world.head(saved) / "model.safetensors"))
    assert set(reloaded) == set(original)
    for k, v in original.items():
        torch.testing.assert_close(reloaded[k], v, rtol=0, atol=0, msg=k)
    if method == "medusa":
        assert config["architectures"] == ["MedusaModel"] and config["hidden_size"] == 64
        return
    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "llama" and hf.hidden_size == 64 and hf.vocab_size == 256 and not hf.tie_word_embeddings
    rope = world.target.config.rope_parameters
    rope = rope.get("full_attention", rope)  # per layer type (Gemma-3): the draft layer is a full-attention one
    assert hf.rope_parameters == rope and set(config["rope_parameters"]) == set(rope)
    assert hf.architectures == [{("eagle1", "vllm"): "EagleLlamaForCausalLM", ("eagle1", "sglang"): "LlamaForCausalLMEagle"}
                                .get((method, engine), "LlamaForCausalLMEagle3")]
    if method == "eagle3":
        aux = sorted(head_cfg["aux_layers"])
        want = aux if engine == "vllm" else [i - 1 for i in aux]
        assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == want
        assert hf.target_hidden_size == world.target.hidden_size


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export(family, engine, worlds, support):
    from specheads.export import export_head

    support(family, f"export_{engine}")
    w = worlds(family)
    methods = ["medusa", "eagle1", "eagle3"] if engine == "vllm" else ["eagle1", "eagle3"]
    for method in methods:
        head = w.head({"medusa": "medusa1"}.get(method, method))
        out = export_head(head, w.root / f"export-{method}-{engine}", engine=engine, target=str(w.target_dir))
        _check_export(w, method, engine, out)


def test_attention_the_runner_cannot_mask_is_refused_in_one_line():
    """Layer kinds tree verification does not model (linear attention, whose state is no key/value cache) are a
    one-line user error naming the family, before any decoding; the families above all get their layout, and
    chunked attention (Llama 4's) its chunk (tests/test_llama4_vl.py decodes through it)."""
    from transformers import LlamaConfig

    from specheads.decoding.runner import AttentionLayout
    from specheads.errors import UserError, one_line
    from family_models import family_config

    config = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                         attention_chunk_size=8)
    with pytest.raises(UserError, match=r"^llama: .*\['linear_attention'\]") as e:
        AttentionLayout.of(config)
    assert one_line(e.value) == str(e.value)
    config.layer_types = ["chunked_attention", "full_attention"]
    assert AttentionLayout.of(config) == AttentionLayout(None, True, 8)
    layouts = {f: AttentionLayout.of(family_config(f)) for f in FAMILIES}
    assert {f for f, lay in layouts.items() if lay.window == WINDOW} == {"mistral", "gemma2", "gemma3_text", "phi3",
                                                                          "gpt_oss"}
    assert all(layouts[f].per_type for f in ("gemma2", "gemma3_text", "gpt_oss"))
    assert not any(layouts[f].per_type for f in ("mistral", "phi3"))
