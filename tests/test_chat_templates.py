"""target.chat_template: a template for a tokenizer without one, from a file, a shipped name or a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.targets.chat_templates import CHATML, SHIPPED, ChatTemplateError, model_of, resolve, shipped_template
from specheads.targets import load_tokenizer, resolve_target_path, tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[1]


def test_a_file_a_shipped_name_and_a_model_each_give_a_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert resolve(str(f)) == ("{{ messages[0]['content'] }}", str(f.resolve()))
    assert resolve("chatml") == (CHATML, "shipped:chatml")
    text, where = resolve("smollm2")  # a model whose tokenizer has one
    assert "<|im_start|>" in text and where == "smollm2"
    with pytest.raises(ChatTemplateError, match="not a file, a shipped template"):
        resolve(str(tmp_path / "missing.jinja"))


def test_the_shipped_gemma_template_is_gemmas_without_the_redistributors_comments():
    text = shipped_template("gemma3")  # scripts/setup.sh installs the package that ships it
    assert "<start_of_turn>" in text and "<end_of_turn>" in text and "Unsloth" not in text
    assert model_of("gemma3") == "google/gemma-3-270m-it" and model_of("x.jinja") is None
    assert set(SHIPPED) >= {"gemma3", "llama3", "qwen3"}


def test_the_template_replaces_the_tokenizers_own_and_changes_its_fingerprint():
    own = load_tokenizer("smollm2")
    gemma = load_tokenizer("smollm2", "gemma3")
    assert gemma.chat_template == shipped_template("gemma3") != own.chat_template
    assert tokenizer_fingerprint(gemma) != tokenizer_fingerprint(own)
    ids = gemma.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert ids.endswith("<start_of_turn>model\n")


@pytest.mark.slow
def test_prepare_a_target_whose_tokenizer_has_no_template(tmp_path):
    """A base model (its tokenizer without a template) is refused alone and prepared with target.chat_template."""
    folder = tmp_path / "base"
    tok = load_tokenizer("smollm2")
    tok.chat_template = None
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "config.json").write_text((Path(resolve_target_path("smollm2")) / "config.json").read_text())
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer number {i}"}]}) + "\n"
        for i in range(4)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def prepare(*extra):
        return subprocess.run([sys.executable, "-m", "specheads.cli", "prepare", "target=hf",
                               f"target.name_or_path={folder}", "data=jsonl", f"data.path={chats}",
                               f"output_dir={tmp_path / 'prepared'}", *extra], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)

    alone = prepare()
    assert alone.returncode == 2 and "no chat template" in alone.stderr
    done = prepare("target.chat_template=chatml")
    assert done.returncode == 0, done.stderr[-2000:]
    from specheads.data.prepare import load_prepared

    dataset, meta = load_prepared(tmp_path / "prepared")
    assert len(dataset) == 4
    chatml = load_tokenizer(str(folder), "chatml")
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(chatml)
    row = dataset[0]
    answer = chatml.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert answer.startswith("answer number") and answer.endswith("<|im_end|>")
