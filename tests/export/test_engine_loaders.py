"""Exported folders against the engines' loader facts (tests/export/engine_facts.py, read from the wheels).

Issue 14: (1) EAGLE-3 aux ids reach vLLM's V2 runner; (2) a native speculators folder, loaded by
speculators' own ``from_pretrained`` when the package is importable; (3) Medusa layouts and which
engines serve them; (6) docs/export.md states what vLLM 0.32 does with a missing Medusa key.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specheads.export import ExportError, export_head
from tests.conftest import make_tiny_target
from tests.export import engine_facts as facts
from tests.export.test_export import AUX, H, LAYERS, V, make_head, save_head

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


@pytest.fixture(scope="module")
def eagle3_head(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("e3")
    head = make_head("eagle3", target)
    return head, save_head(head, root)


@pytest.fixture(scope="module")
def eagle3_export(eagle3_head, target_dir):
    """vllm/ and sglang/ folders of an EAGLE-3 head on non-default aux layers."""
    head, folder = eagle3_head
    return head, export_head(folder, folder.parent / "both", "both", str(target_dir))


@pytest.fixture(scope="module")
def speculators_export(eagle3_head, target_dir):
    """The speculators/ folder (with the other layouts: engine=all)."""
    head, folder = eagle3_head
    return head, export_head(folder, folder.parent / "all", "all", str(target_dir))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _keys(path: Path) -> dict[str, tuple]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# --------------------------------------------------------------------------- fault 1: aux ids per runner


def test_the_head_layers_are_not_the_default(target):
    """The test layers differ from (2, N//2, N-3), so a runner that falls back to its default is caught."""
    for runner in ("vllm-v1", "vllm-v2", "sglang"):
        default = sorted({i + facts.ID_TO_OURS[runner] for i in facts.DEFAULT_AUX[runner](LAYERS)})
        assert default != sorted(AUX)


@pytest.mark.parametrize("runner", ["vllm-v1", "vllm-v2"])
def test_vllm_runners_capture_the_trained_aux_layers(runner, eagle3_export):
    """Issue 14 fault 1: vLLM's V2 runner (the default with Triton) reads only the top-level key."""
    _, out = eagle3_export
    config = _config(out / "vllm")
    assert facts.captured_layers(runner, config, LAYERS) == sorted(AUX)
    assert facts.fc_aux_count("vllm", config) == len(AUX)


def test_sglang_captures_the_trained_aux_layers(eagle3_export):
    _, out = eagle3_export
    config = _config(out / "sglang")
    assert facts.captured_layers("sglang", config, LAYERS) == sorted(AUX)
    assert facts.fc_aux_count("sglang", config) == len(AUX)


@pytest.mark.parametrize("runner", ["vllm-v1", "vllm-v2"])
def test_vllm_reads_the_speculators_folder_with_the_trained_layers(runner, speculators_export):
    _, out = speculators_export
    config = _config(out / "speculators")
    for path in facts.VLLM_SPECULATORS_REQUIRED:  # validate_speculators_config
        node = config
        for key in path:
            node = node[key]
    draft = facts.vllm_speculators_to_draft_config(config)
    assert draft["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert draft["norm_before_residual"] is False  # vLLM defaults it to True: written explicitly
    assert facts.captured_layers(runner, draft, LAYERS) == sorted(AUX)
    assert facts.fc_aux_count("vllm", {**draft, "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                 draft["eagle_aux_hidden_state_layer_ids"]}}) == 3


# --------------------------------------------------------------------------- fault 2: speculators format


def test_speculators_folder_matches_the_speculators_schema(speculators_export, target):
    head, out = speculators_export
    folder = out / "speculators"
    config = _config(folder)
    spec = facts.SPECULATORS_EAGLE3
    for k, v in spec["config_fields"].items():
        assert config[k] == v
    assert set(spec["schema_fields"]) <= set(config)
    assert set(config["speculators_config"]) == set(spec["speculators_config_fields"])
    assert set(config["speculators_config"]["verifier"]) == set(spec["verifier_fields"])
    assert config["speculators_config"]["verifier"]["name_or_path"]  # required by speculators' from_pretrained
    assert config["eagle_aux_hidden_state_layer_ids"] == sorted(AUX)
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert layer["head_dim"] == H // layer["num_attention_heads"]  # speculators doubles hidden_size for rope
    keys = _keys(folder / "model.safetensors")
    assert set(keys) == set(spec["weights"]) | set(spec["vocab_maps_iff_smaller"])
    assert keys["fc.weight"] == (H, len(AUX) * H) and keys["embed_tokens.weight"] == (V, H)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.model.get_input_embeddings().weight)


def test_speculators_full_vocab_has_no_maps(target, target_dir, tmp_path):
    head = make_head("eagle3", target, draft_vocab=V)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", "speculators", str(target_dir))
    assert not {"d2t", "t2d"} & set(_keys(out / "model.safetensors"))


def test_speculators_needs_the_target_embedding(target, tmp_path):
    head = save_head(make_head("eagle3", target), tmp_path)
    with pytest.raises(ExportError, match="needs the target's embed_tokens.weight"):
        export_head(head, tmp_path / "out", "speculators", target=None)
    assert not (tmp_path / "out").exists()


def _import_speculators():
    extra = os.environ.get("SPECHEADS_SPECULATORS_PATH")  # a --target dir of speculators 0.9.0 (--no-deps)
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    return pytest.importorskip("speculators", reason="speculators not installed (set SPECHEADS_SPECULATORS_PATH)")


def test_speculators_from_pretrained_and_one_forward_equal_ours(speculators_export, target):
    """speculators' own loader reads the folder; its forward gives our draft logits (not CI: needs the package)."""
    _import_speculators()
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    head, out = speculators_export
    folder = out / "speculators"
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    model = SpeculatorModel.from_pretrained(str(folder), config=cfg).eval()
    assert not model.embed_tokens.weight.isnan().any()
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(0)
    T = 7
    feats = {layer: torch.randn(1, T, H, generator=g) for layer in AUX}
    ids = torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(T)[None]
    captured = {}
    model.lm_head.register_forward_hook(lambda m, i, o: captured.__setitem__("logits", o))
    with torch.no_grad():
        model(hidden_states=torch.cat([feats[i] for i in sorted(AUX)], -1), input_ids=ids,
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=pos, ttt_steps=1)
        head.attach(target)
        _, ours = head.step(head.fuse(torch.cat([feats[i] for i in AUX], -1)), ids, pos)
    torch.testing.assert_close(captured["logits"], ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(captured["logits"].argmax(-1), ours.argmax(-1))


# --------------------------------------------------------------------------- fault 3: Medusa


def test_medusa_layouts_load_in_vllm_032_and_tgi(target, target_dir, tmp_path):
    head = make_head("medusa", target)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", "all", str(target_dir), target_id="org/tiny")
    assert sorted(p.name for p in out.iterdir()) == ["medusa", "vllm"]  # no SGLang loader, no speculators model
    for sub, weights in (("vllm", "model.safetensors"), ("medusa", facts.TGI_MEDUSA["weights_file"])):
        raw = _config(out / sub)
        config = facts.vllm032_medusa_config(raw)
        loaded = {facts.vllm032_medusa_name(k): s for k, s in _keys(out / sub / weights).items()}
        assert loaded == facts.vllm032_medusa_params(config), sub  # strict: every parameter loaded, none dropped
    tgi = _config(out / "medusa")
    assert "architectures" not in tgi  # TGI would silently serve without speculation
    assert tgi[facts.TGI_MEDUSA["detect_key"]] == 3 and tgi[facts.TGI_MEDUSA["base_key"]] == "org/tiny"
    n = tgi[facts.TGI_MEDUSA["layers_key"]]
    names = set(_keys(out / "medusa" / facts.TGI_MEDUSA["weights_file"]))
    assert names == {f"{i}.{j}.linear.{p}" for i in range(3) for j in range(n) for p in ("weight", "bias")} | \
        {f"{i}.{n}.weight" for i in range(3)}
    from specheads.export import load_exported

    for sub in ("vllm", "medusa"):
        reloaded = load_exported(out / sub)
        assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in head.state_dict().items())
        card = (out / sub / "README.md").read_text()
        assert "vLLM up to 0.32" in card and "not vLLM 0.33" in card and "not SGLang" in card
    assert "text-generation-launcher --model-id" in (out / "medusa" / "README.md").read_text()
    with pytest.raises(ExportError, match="speculators has no loader for medusa"):
        export_head(save_head(head, tmp_path / "b"), tmp_path / "x", "speculators", str(target_dir))


def test_engine_support_is_stated_in_the_docs():
    doc = " ".join((REPO / "docs" / "export.md").read_text().split())
    assert re.search(r"vLLM 0\.33 has \*\*no Medusa", doc) and "SGLang has never had a Medusa loader" in doc
    lines = (REPO / "docs" / "export.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| Medusa-1 / -2 |"))
    assert "**yes**" in row.split("|")[2] and "**no**" in row.split("|")[3] and "**no**" in row.split("|")[4]
    assert facts.VLLM_MEDUSA["0.33.0"]["loads"] is False and facts.SGLANG_MEDUSA["0.5.23"]["loads"] is False


# --------------------------------------------------------------------------- fault 6: the docs


def _doc_row(label: str) -> list[str]:
    doc = (REPO / "docs" / "export.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_docs_say_a_missing_medusa_key_is_a_load_error_in_vllm_032():
    """Issue 14 fault 6: vLLM 0.32's Medusa load_weights returns the loaded names and the default loader
    raises for any parameter not loaded; the doc said the weight "stays random"."""
    assert facts.VLLM_MEDUSA["0.32.0"]["missing_key"] == "error"
    medusa_cell = _doc_row("missing key")[0]
    assert "load error" in medusa_cell and "random" not in medusa_cell


def test_docs_name_both_vllm_runners_for_aux_ids():
    doc = (REPO / "docs" / "export.md").read_text()
    assert "V2" in doc and "eagle_config.layer_ids" in doc and "top-level" in doc
