"""What an export says of its target: the chat template the head was trained with, carried where the
target's own tokenizer lacks it (``chat_template.jinja`` + ``--chat-template``), ``base_model`` in the card, and a
speculators verifier that names a hub id, not the exporting machine's folder, whenever one is known."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specheads.targets.chat_templates import CHATML, TEMPLATE_FILE, template_sha
from specheads.export import ExportError, export_head
from specheads.export.serve import exported_lines
from specheads.export.target import KNOWN_ORIGINS, target_origin
from tests.conftest import make_tiny_target
from tests.export.test_export import H, LAYERS, V, make_head, save_head

FOLDER = "<path-or-repo-id-of-this-folder>"


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return save_head(make_head("eagle3", target), tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def base_dir(target, smollm2_tokenizer, tmp_path_factory):
    """A base model's folder: weights and a tokenizer without a chat template (as a GGUF's conversion gives)."""
    d = tmp_path_factory.mktemp("target") / "tiny-base"
    target.model.save_pretrained(d)
    tok = type(smollm2_tokenizer).from_pretrained(smollm2_tokenizer.name_or_path)
    tok.chat_template = None
    tok.save_pretrained(d)
    (d / TEMPLATE_FILE).unlink(missing_ok=True)
    return d


def _with_own_template(base_dir: Path, where: Path, text: str) -> Path:
    shutil.copytree(base_dir, where)
    (where / TEMPLATE_FILE).write_text(text)
    return where


def _prepared(where: Path, template_text: str) -> Path:
    where.mkdir()
    meta = {"target": "tiny", "num_samples": 4, "num_tokens": 400, "num_loss_tokens": 200, "max_length": 128,
            "regenerated": False, "source": {"source": "jsonl", "path": "chats.jsonl", "split": "train"},
            "chat_template_sha": template_sha(template_text)}
    (where / "specheads_meta.json").write_text(json.dumps(meta))
    return where


# --------------------------------------------------------------------------- the chat template


def test_a_template_the_targets_tokenizer_lacks_travels_with_the_export(head, base_dir, tmp_path):
    out = export_head(head, tmp_path / "out", "all", str(base_dir), chat_template="chatml")
    for engine in ("vllm", "sglang", "speculators"):
        assert (out / engine / TEMPLATE_FILE).read_text() == CHATML
        prov = json.loads((out / engine / "specheads_export.json").read_text())
        assert prov["chat_template"] == {"file": TEMPLATE_FILE, "source": "shipped:chatml", "model": None,
                                         "sha": template_sha(CHATML), "replaces_own": False}
        card = (out / engine / "README.md").read_text()
        assert f"| chat template | `{TEMPLATE_FILE}` in this folder, from `shipped:chatml`" in card
        assert "the target's tokenizer has none" in card and f"`{TEMPLATE_FILE}`." in card  # the files line
    vllm, sgl = (out / "vllm" / "README.md").read_text(), (out / "sglang" / "README.md").read_text()
    assert f"--speculative-config '{json.dumps({'method': 'eagle3', 'model': FOLDER, 'num_speculative_tokens': 3})}'" \
           f" --chat-template {FOLDER}/{TEMPLATE_FILE}\n" in vllm
    assert f"llm.chat([{{'role': 'user', 'content': 'Hello'}}], chat_template=open('{FOLDER}/{TEMPLATE_FILE}')" in vllm
    assert "llm = LLM(model=TARGET" in vllm
    assert f"--speculative-num-draft-tokens 8 --chat-template {FOLDER}/{TEMPLATE_FILE}\n" in sgl
    # The lines printed at the end of `specheads export` / `specheads run` name this machine's folders.
    lines = exported_lines(out, str(base_dir))
    assert sum(f"--chat-template {out / e / TEMPLATE_FILE}" in line for line in lines for e in ("vllm", "sglang",
                                                                                                 "speculators")) == 3


def test_no_template_flag_without_a_template_or_where_the_tokenizer_has_it(head, base_dir, tmp_path):
    plain = export_head(head, tmp_path / "plain", "both", str(base_dir))
    own = _with_own_template(base_dir, tmp_path / "chat-model", CHATML)
    same = export_head(head, tmp_path / "same", "both", str(own), chat_template="chatml")
    for out in (plain, same):
        for engine in ("vllm", "sglang"):
            assert not (out / engine / TEMPLATE_FILE).exists()
            assert "--chat-template" not in (out / engine / "README.md").read_text()
            assert json.loads((out / engine / "specheads_export.json").read_text())["chat_template"] is None
        assert not any("--chat-template" in line for line in exported_lines(out))


def test_a_template_given_in_place_of_the_tokenizers_own_is_carried_and_named_portably(head, base_dir, tmp_path):
    own = _with_own_template(base_dir, tmp_path / "chat-model", CHATML)
    mine = tmp_path / "my" / "plain.jinja"
    mine.parent.mkdir()
    mine.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    out = export_head(head, tmp_path / "out", "vllm", str(own), chat_template=str(mine))
    assert (out / TEMPLATE_FILE).read_text() == mine.read_text()
    card = (out / "README.md").read_text()
    assert "from `plain.jinja`" in card and "a template of its own, another one" in card
    assert str(mine.parent) not in card + (out / "specheads_export.json").read_text()  # no path of this machine


def test_the_template_must_be_the_one_the_data_was_prepared_with(head, base_dir, tmp_path):
    prepared = _prepared(tmp_path / "prepared", CHATML)
    with pytest.raises(ExportError, match="prepared with another chat template .*: no template"):
        export_head(head, tmp_path / "a", "vllm", str(base_dir), data=str(prepared))
    with pytest.raises(ExportError, match="target.chat_template=llama3"):
        export_head(head, tmp_path / "b", "vllm", str(base_dir), data=str(prepared), chat_template="llama3")
    out = export_head(head, tmp_path / "c", "vllm", str(base_dir), data=str(prepared), chat_template="chatml")
    assert (out / TEMPLATE_FILE).is_file()
    own = _with_own_template(base_dir, tmp_path / "chat-model", CHATML)  # the tokenizer's own, as prepared
    assert not (export_head(head, tmp_path / "d", "vllm", str(own), data=str(prepared)) / TEMPLATE_FILE).exists()


def test_a_draft_served_by_its_repo_id_gets_the_template_downloaded(head, base_dir, tmp_path, capsys):
    out = export_head(head, tmp_path / "out", "vllm", str(base_dir), chat_template="chatml",
                      push_to_hub="acme/e3", push_dry_run=True, target_id="acme/base")
    card = (out / "README.md").read_text()
    assert f"huggingface-cli download acme/e3 {TEMPLATE_FILE} --local-dir ./e3" in card
    assert "vllm serve acme/base --speculative-config" in card and f"--chat-template ./e3/{TEMPLATE_FILE}" in card
    assert f"  {TEMPLATE_FILE}" in capsys.readouterr().out  # uploaded with the head


def test_the_export_recipe_passes_the_targets_template(head, base_dir, tmp_path, capsys):
    import runpy

    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[2] / "conf"
    recipe = runpy.run_path(str(conf.parent / "recipes" / "export.py"))
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("export", overrides=[f"head_dir={head}", f"output_dir={tmp_path / 'out'}", "engine=both",
                                           "target=hf", f"target.name_or_path={base_dir}",
                                           "target.chat_template=chatml"])
        path = Path(recipe["run"](cfg))
    printed = capsys.readouterr().out
    assert f"--chat-template {path / 'vllm' / TEMPLATE_FILE}" in printed
    assert f"--chat-template {path / 'sglang' / TEMPLATE_FILE}" in printed


# --------------------------------------------------------------------------- base_model and the verifier


def _speculators_verifier(out: Path) -> str:
    config = json.loads((out / "speculators" / "config.json").read_text())
    return config["speculators_config"]["verifier"]["name_or_path"]


def test_the_embedded_gemma_target_is_named_by_its_hub_id(head, target, tmp_path, monkeypatch):
    """``target=gemma3_270m`` (a dequantized GGUF in this machine's cache): base_model, the warning's suggestion and
    the speculators verifier name google/gemma-3-270m; no file of this machine is named. The tiny folder stands in
    for the converted weights."""
    stand_in = tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m"
    target.model.save_pretrained(stand_in)
    monkeypatch.setattr("specheads.targets.resolve_target_path",
                        lambda name: str(stand_in) if name == "gemma3_270m" else name)
    out = export_head(head, tmp_path / "out", "all", "gemma3_270m")
    for engine in ("vllm", "sglang", "speculators"):
        card = (out / engine / "README.md").read_text()
        assert card.startswith("---\nbase_model: google/gemma-3-270m\n") and str(tmp_path) not in card
        assert "TARGET=google/gemma-3-270m   # REPLACE" in card
    assert _speculators_verifier(out) == "google/gemma-3-270m"
    assert str(tmp_path) not in (out / "speculators" / "config.json").read_text()
    assert "is `google/gemma-3-270m`, the hub model the target was converted from" in \
        (out / "speculators" / "README.md").read_text()


def test_a_gguf_file_names_the_hub_model_it_was_converted_from():
    assert KNOWN_ORIGINS["gemma3_270m"] == "google/gemma-3-270m"
    gemma = target_origin("/data/models/gemma-3-270m-q4_k_m.gguf", "/cache/models/gemma")
    assert gemma.kind == "gguf" and gemma.hub_id is None and gemma.hint == "google/gemma-3-270m"
    assert "quantized copy of `google/gemma-3-270m`" in gemma.warning()
    assert target_origin("/data/models/unknown.Q4_K_M.gguf", None).hint is None  # no such file: no id


def test_a_local_folder_is_named_by_its_configs_hub_id_else_by_nothing(head, target, tmp_path):
    named = tmp_path / "finetuned"
    target.model.save_pretrained(named)
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "_name_or_path": "acme/tiny-chat"}))
    out = export_head(head, tmp_path / "out", "all", str(named))
    card = (out / "vllm" / "README.md").read_text()
    assert card.startswith("---\nbase_model: acme/tiny-chat\n")
    assert "its config names `acme/tiny-chat` as its origin" in card
    assert _speculators_verifier(out) == "acme/tiny-chat"
    assert str(named) not in (out / "speculators" / "config.json").read_text()
    # A folder whose config names no hub id: no base_model; the verifier is the local folder, and the card says so.
    plain = tmp_path / "plain"
    target.model.save_pretrained(plain)
    (plain / "config.json").write_text(json.dumps({**config, "_name_or_path": str(plain)}))
    out = export_head(head, tmp_path / "out2", "all", str(plain))
    card = (out / "speculators" / "README.md").read_text()
    assert "base_model" not in card and _speculators_verifier(out) == str(plain.resolve())
    assert "verifier.name_or_path is the exporting machine's local target folder (`plain`" in card
    # A hub id given with target_id wins over all of it.
    out = export_head(head, tmp_path / "out3", "all", str(named), target_id="acme/exact")
    assert _speculators_verifier(out) == "acme/exact"
    assert (out / "vllm" / "README.md").read_text().startswith("---\nbase_model: acme/exact\n")


def test_a_target_vllm_cannot_hand_auxiliary_states_is_said_on_the_card(tmp_path, caplog):
    """EAGLE-3 and DFlash draft from the target's auxiliary hidden states; vLLM 0.32's Gemma 3 class does not hand
    them over and the engine refuses the head at load: the card's "served by" and the export's log say so, with
    the engine's message; a Llama target's card does not."""
    import logging

    from specheads.export.engine_targets import VLLM_REFUSAL, vllm_refusal

    gemma = make_tiny_target("gemma3_text", vocab=V, hidden=H, layers=LAYERS)
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM"
    head = save_head(make_head("eagle3", gemma), tmp_path / "head")
    with caplog.at_level(logging.WARNING):
        out = export_head(head, tmp_path / "out", "all", gemma)
    served_by = [ln for ln in (out / "vllm" / "README.md").read_text().splitlines() if ln.startswith("| served by |")]
    assert "vLLM 0.32.0 cannot serve this head on this target" in served_by[0] and VLLM_REFUSAL in served_by[0]
    assert "Gemma3ForCausalLM" in served_by[0] and "cannot serve this head" in caplog.text
    assert "cannot serve" not in (out / "sglang" / "README.md").read_text()
    assert vllm_refusal("eagle3", ["LlamaForCausalLM"]) is None and vllm_refusal("eagle1", ["Gemma3ForCausalLM"]) is None
    assert vllm_refusal("dflash", ["Gemma2ForCausalLM"]) is not None
