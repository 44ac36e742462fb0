"""Vision-language targets × stages, on image conversations: the cells of docs/support_matrix.md's vision-language
section (``vl:<model_type>``; tests/families/support_log.py, scripts/support_matrix.py).

Each Qwen-VL target goes prepare -> collect -> train (EAGLE-3, two steps from the store) -> evaluate (the held-out
image prompt, lossless in the exact pass) -> export (vLLM's layout, with its M-RoPE settings), one test per stage
over one module-scoped run. Llama 4's image conversations and Gemma 3 multimodal's are refused at prepare, and
Gemma 3 multimodal's vLLM export, each in one line the test asserts.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import pytest
import torch

from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states, spec_for_method
from specheads.data.prepare import load_prepared
from specheads.errors import UserError
from specheads.targets import load_target

pytest.importorskip("skimage", reason="scikit-image (the dev extra) holds the sample photographs")

QWEN = ("qwen3_vl", "qwen2_5_vl")
NEW = 12


class QwenRun:
    """One tiny Qwen-VL target's stages, each made once when a test first asks for it."""

    def __init__(self, family: str, root: Path):
        from tests.data.vision_targets import save_vision_target

        self.family, self.root = family, root
        self.folder = save_vision_target(root / "target", family)

    @cached_property
    def prepared(self) -> Path:
        from tests.data.vision_targets import prepare_image_chats

        return prepare_image_chats(self.root, self.folder)

    @cached_property
    def target(self):
        return load_target(str(self.folder), dtype="float32", device="cpu")

    @cached_property
    def store(self) -> Path:
        dataset, _ = load_prepared(self.prepared)
        collect_hidden_states(self.target, dataset, spec_for_method("eagle3", self.target.num_layers),
                              self.root / "store", CollectOptions(dtype="float32", estimate_time=False, progress=False))
        return self.root / "store"

    def settings(self) -> list[str]:
        return ["target=hf", f"target.name_or_path={self.folder}", "target.dtype=float32", "target.device=cpu"]

    @cached_property
    def train(self) -> dict:
        from tests.test_hydra_configs import load_recipe
        from tests.test_long_rows import compose

        return load_recipe("train.py").run(compose("train", [
            *self.settings(), "method=eagle3", f"features_dir={self.store}", f"prepared_dir={self.prepared}",
            f"output_dir={self.root / 'train'}", f"method.draft_vocab_size={self.target.vocab_size}",
            "train.max_steps=2", "data.eval_samples=0", "train.measure_prompts=0", "train.progress=false",
            "wandb.mode=disabled"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    made: dict[str, QwenRun] = {}

    def run(family: str) -> QwenRun:
        if family not in made:
            made[family] = QwenRun(family, tmp_path_factory.mktemp(family))
        return made[family]

    return run


@pytest.mark.parametrize("family", QWEN)
def test_prepare(family, runs, support):
    support("vl:" + family, "vl_prepare")
    dataset, meta = load_prepared(runs(family).prepared)
    images = [r for r in dataset if r["images"]]
    assert len(images) == 2 and meta["images"]["image_token_id"] == runs(family).target.config.image_token_id


@pytest.mark.parametrize("family", QWEN)
def test_collect(family, runs, support):
    support("vl:" + family, "vl_collect")
    run = runs(family)
    from specheads.data.store import read_manifest

    assert len(FeatureDataset(run.store)) == len(load_prepared(run.prepared)[0]) and read_manifest(run.store)["positions"]


@pytest.mark.parametrize("family", QWEN)
def test_train_eagle3(family, runs, support):
    support("vl:" + family, "vl_train_eagle3")
    summary = runs(family).train
    assert summary["steps"] == 2 and 0 < summary["final_loss"] < float("inf")


@pytest.mark.parametrize("family", QWEN)
def test_evaluate(family, runs, support):
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.prompts import BenchmarkSpec
    from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate

    support("vl:" + family, "vl_evaluate")
    run = runs(family)
    run.train  # noqa: B018 - the trained head
    methods = [MethodSpec("eagle3", "eagle3", TreeShape("dynamic", depth=2, topk=2, total_tokens=4),
                          head_dir=str(run.root / "train" / "head"))]
    spec = BenchmarkSpec(mtbench_per_category=0, humaneval=0, chat=None, chat_dir=str(run.prepared))
    report = evaluate(run.target, EvalConfig(methods, spec, max_new_tokens=NEW, temperatures=(0.0,), batch_sizes=(1,),
                                             repeats=1, cpu_linears="plain", cpu_threads=1))
    (m,) = report["methods"]
    assert m["lossless"]["exact"] and m["lossless"]["pass"] == "exact" and "image" in m["by_temperature"]["0.0"]


@pytest.mark.parametrize("family", QWEN)
def test_export_vllm(family, runs, support):
    from specheads.export import export_head

    support("vl:" + family, "vl_export_vllm")
    run = runs(family)
    run.train  # noqa: B018 - the trained head
    out = export_head(run.root / "train" / "head", run.root / "export", "vllm", str(run.folder))
    config = json.loads((out / "config.json").read_text())
    want = run.target.config.get_text_config().rope_parameters["mrope_section"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["rope_parameters"]["mrope_section"] == want


def _image_chat(root: Path) -> Path:
    from tests.data.vision_targets import photo

    photo("chelsea").save(root / "cat.jpg")
    (root / "i.jsonl").write_text(json.dumps({"id": "img", "image": str(root / "cat.jpg"), "conversations": [
        {"from": "human", "value": "<image>\nWhat animal?"}, {"from": "gpt", "value": "A cat."}]}) + "\n")
    return root / "i.jsonl"


def _refused_prepare(folder: Path, root: Path) -> str:
    """The one line prepare refuses an image conversation with, the target's folder written as <target>."""
    from specheads.data import images as img
    from specheads.data.prepare import PrepareConfig, prepare
    from specheads.targets import Target, load_tokenizer

    tok = load_tokenizer(str(folder))
    with pytest.raises(UserError) as e:
        prepare(Target.tokenizer_only(tok, str(folder)),
                PrepareConfig(source="jsonl", path=str(_image_chat(root)), num_proc=1), root / "prepared",
                img.load_vision(str(folder), tok))
    assert "\n" not in str(e.value) and not (root / "prepared").exists()
    return str(e.value).replace(str(folder), "<target>")


def _gemma3_folder(root: Path) -> Path:
    from tests.export.test_vision_export_refusal import _gemma3_vision_model
    from tests.test_llama4_vl import _tokenizer

    _gemma3_vision_model().save_pretrained(root / "gemma3")
    _tokenizer().save_pretrained(root / "gemma3")
    return root / "gemma3"


@pytest.mark.parametrize("family", ["llama4", "gemma3"])
def test_prepare_refused(family, support, tmp_path):
    support("vl:" + family, "vl_prepare")
    if family == "llama4":
        from tests.test_llama4_vl import _model, _tokenizer

        tok = _tokenizer()
        _model(tok).save_pretrained(tmp_path / "llama4")
        tok.save_pretrained(tmp_path / "llama4")
        folder = tmp_path / "llama4"
    else:
        folder = _gemma3_folder(tmp_path)
    line = _refused_prepare(folder, tmp_path)
    assert f"is a {family} vision-language model" in line
    support.refused(line)


@pytest.mark.parametrize("family", ["llama4", "gemma3"])
def test_export_vllm_of_other_families(family, support, tmp_path):
    """Llama 4's vLLM class hands an EAGLE-3 draft its auxiliary states: exported; Gemma 3 multimodal's does
    not: refused in one line before anything is written."""
    from specheads.export import export_head
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.targets import Target

    support("vl:" + family, "vl_export_vllm")
    if family == "llama4":
        from tests.test_llama4_vl import _model, _tokenizer

        model = _model(_tokenizer())
        model.save_pretrained(tmp_path / "target")
    else:
        from tests.export.test_vision_export_refusal import _gemma3_vision_model

        model = _gemma3_vision_model()
        model.save_pretrained(tmp_path / "target")
    from specheads.models.vocab import build_draft_vocab

    torch.manual_seed(0)
    head, target = tmp_path / "head", Target(model, name=str(tmp_path / "target"))
    draft = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64, aux_layers=(0, 1, 2)))
    draft.set_draft_vocab(*build_draft_vocab(torch.randint(0, 1000, (target.vocab_size,)), 64))
    draft.save_pretrained(head)
    if family == "llama4":
        out = export_head(head, tmp_path / "out", "vllm", str(tmp_path / "target"))
        assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
        return
    with pytest.raises(UserError) as e:
        export_head(head, tmp_path / "out", "vllm", str(tmp_path / "target"))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    support.refused(str(e.value))
