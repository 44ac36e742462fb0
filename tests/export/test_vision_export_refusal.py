"""A head for a vision-language target that vLLM cannot hand its auxiliary hidden states (Gemma 3 multimodal,
``Gemma3ForConditionalGeneration``: vLLM 0.32's class implements no ``SupportsEagle3``) is refused for vLLM's
layouts in one line before anything is written, naming the class and what to do; the SGLang layout, a Qwen2.5-VL
target and Gemma 3's text model (a warning only) are not refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from specheads.errors import UserError
from specheads.export import export_head
from specheads.export.engine_targets import VLLM_AUX_STATE_TARGETS, vision_export_refusal
from specheads.targets import Target
from tests.export.test_export import H, LAYERS, V, make_head, save_head
from tests.test_cli_errors import one_line, specheads

GEMMA3_MM = "Gemma3ForConditionalGeneration"
VLLM_SOURCE = Path(__file__).resolve().parents[2] / ".venv-vllm"


def _gemma3_vision_model():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=H // 4, max_position_embeddings=512, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=V - 6,
                          boi_token_index=V - 5, eoi_token_index=V - 4)
    return Gemma3ForConditionalGeneration(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def gemma3_mm(tmp_path_factory):
    """(a saved tiny Gemma 3 multimodal folder, an EAGLE-3 head trained-shaped for it)."""
    root = tmp_path_factory.mktemp("gemma3mm")
    model = _gemma3_vision_model()
    model.save_pretrained(root / "target")
    head = save_head(make_head("eagle3", Target(model, name=str(root / "target"))), root)
    return root / "target", head


def test_vllm_032_source_gives_gemma3_multimodal_no_eagle3_interface():
    """The fact the refusal rests on, read from the vLLM wheel installed beside (skipped where it is not): its
    Gemma 3 multimodal class's bases name no SupportsEagle3, Qwen2.5-VL's do."""
    found = sorted(VLLM_SOURCE.glob("lib/python3*/site-packages/vllm/model_executor/models"))
    if not found:
        pytest.skip("no vLLM wheel in .venv-vllm (scripts/setup_engine.sh)")
    bases = {}
    for file, cls in (("gemma3_mm.py", GEMMA3_MM), ("qwen2_5_vl.py", "Qwen2_5_VLForConditionalGeneration")):
        text = (found[0] / file).read_text()
        bases[cls] = re.search(rf"^class {cls}\((.*?)\):", text, flags=re.M | re.S)[1]
    assert "SupportsEagle3" not in bases[GEMMA3_MM] and "SupportsEagle3" in bases["Qwen2_5_VLForConditionalGeneration"]
    assert GEMMA3_MM not in VLLM_AUX_STATE_TARGETS["0.32.0"]


def test_export_for_vllm_of_a_gemma3_multimodal_target_is_refused_before_writing(gemma3_mm, tmp_path):
    target, head = gemma3_mm
    for engine in ("vllm", "all", "speculators"):
        with pytest.raises(UserError) as e:
            export_head(head, tmp_path / engine, engine, str(target))
        msg = str(e.value)
        assert "\n" not in msg and GEMMA3_MM in msg and "SupportsEagle3" in msg and f"engine={engine}" in msg
        assert "specheads evaluate" in msg and "engine=sglang" in msg
        assert not (tmp_path / engine).exists()
    out = export_head(head, tmp_path / "sglang", "sglang", str(target))  # SGLang's layout: not refused
    assert (out / "config.json").is_file()


def test_the_cli_says_it_in_one_line(gemma3_mm, tmp_path):
    target, head = gemma3_mm
    line = one_line(specheads("export", f"head_dir={head}", f"output_dir={tmp_path / 'out'}", "engine=vllm",
                              f"target.name_or_path={target}", cwd=tmp_path), "export")
    assert GEMMA3_MM in line and "specheads evaluate" in line and not (tmp_path / "out").exists()


def test_only_a_vision_target_vllm_refuses_is_refused():
    assert vision_export_refusal("eagle3", (GEMMA3_MM,), True, ("vllm",))
    assert vision_export_refusal("dflash", (GEMMA3_MM,), True, ("speculators",))
    assert vision_export_refusal("eagle3", (GEMMA3_MM,), True, ("sglang",)) is None
    assert vision_export_refusal("eagle3", ("Gemma3ForCausalLM",), False, ("vllm",)) is None  # text: a warning
    assert vision_export_refusal("eagle3", ("Qwen2_5_VLForConditionalGeneration",), True, ("vllm",)) is None
    assert vision_export_refusal("eagle3", ("Llama4ForConditionalGeneration",), True, ("vllm",)) is None
    assert vision_export_refusal("eagle1", (GEMMA3_MM,), True, ("vllm",)) is None  # drafts from the last state


def test_a_run_for_such_a_target_is_refused_before_its_first_stage(gemma3_mm, tmp_path, capsys):
    """`specheads run` knows the head and the export's engines before it starts: with a Gemma 3 multimodal folder
    it ends in one line before prepare; asking for the SGLang layout only (or only the evaluator) runs."""
    from tests.test_overrides import pipeline

    target, _ = gemma3_mm
    p = pipeline()
    run = [f"target.name_or_path={target}", f"run_dir={tmp_path / 'run'}", "serve=false"]
    with pytest.raises(SystemExit) as e:
        p.check_stages(p.stage_arguments([*run, "head=eagle3"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and err.startswith("specheads run: error: the export stage: engine=")
    assert GEMMA3_MM in err and "specheads evaluate" in err and not (tmp_path / "run").exists()
    p.check_stages(p.stage_arguments([*run, "head=eagle3", "export.engine=sglang"]))
    p.check_stages(p.stage_arguments([*run, "head=eagle3", "only=evaluate"]))
    p.check_stages(p.stage_arguments([*run, "head=eagle1"]))  # drafts from the last state: vLLM serves it
