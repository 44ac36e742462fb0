"""Answers regenerated through a real serving engine: `transformers serve` (an OpenAI-compatible server) started
here on the embedded SmolLM2, asked over HTTP by specheads.data.endpoint, resumable from the journal."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from specheads.data import endpoint as endpoint_mod
from specheads.data.endpoint import EndpointError
from specheads.data.regenerate import RegenerateConfig, count_retokenized, read_journal, regenerate
from specheads.data.render import ChatRenderer, prompt_ids
from specheads.data.sources import Conversation
from specheads.targets import Target, load_target, resolve_target_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """`transformers serve` with the embedded SmolLM2 preloaded, on a free local port."""
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    assert exe, "the transformers command is installed with transformers"
    model = resolve_target_path("smollm2")
    port = free_port()
    log = open(Path(model).parent / f"serve-{port}.log", "w")
    proc = subprocess.Popen([exe, "serve", model, "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except OSError:
                assert proc.poll() is None, f"transformers serve exited: see {log.name}"
                assert time.time() < deadline, "transformers serve did not come up in 240 s"
                time.sleep(1)
        yield url, model
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def chats(n: int) -> list[Conversation]:
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                 "Say hello in Spanish.", "What is the boiling point of water in Celsius?"]
    return [Conversation(f"c{i}", [{"role": "user", "content": questions[i]},
                                   {"role": "assistant", "content": "old answer"},
                                   {"role": "user", "content": "Thanks. Say it again, shorter."},
                                   {"role": "assistant", "content": "old answer 2"}]) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_target():
    from specheads.targets import load_tokenizer

    return Target.tokenizer_only(load_tokenizer("smollm2"), "smollm2")


def endpoint_cfg(url, **kw):
    return RegenerateConfig(batch_size=4, max_new_tokens=12, max_turns=2,
                            endpoint={"url": url, "concurrency": 4, "retries": 1, **kw})


@pytest.mark.slow  # the module's server takes ~30 s to start
def test_answers_come_from_the_served_target_and_resume_from_the_journal(server, tokenizer_target, tmp_path,
                                                                        monkeypatch):
    url, model = server
    asked = []
    real = endpoint_mod.EndpointClient.complete
    monkeypatch.setattr(endpoint_mod.EndpointClient, "complete",
                        lambda self, prompt, *a, **k: asked.append(tuple(prompt)) or real(self, prompt, *a, **k))
    full = regenerate(tokenizer_target, chats(4), tmp_path / "full.jsonl", endpoint_cfg(url))
    assert [c.id for c in full] == ["c0", "c1", "c2", "c3"]
    tok = tokenizer_target.tokenizer
    for conv in full:
        answers = [m for m in conv.messages if m["role"] == "assistant"]
        assert answers and all(m["content"] not in ("old answer", "old answer 2") for m in answers)
        for m in answers:  # the ids are the answer: re-tokenized from the engine's text, which they give back
            assert m["retokenized"] and tok.decode(m["token_ids"]).strip() == m["content"].strip()
    assert count_retokenized(full)["retokenized"] == 4

    # the engine answered the template's prompts: its first answer token is the target's own greedy choice
    target = load_target("smollm2")
    renderer = ChatRenderer(tok)
    for conv in full:
        prompt = prompt_ids(conv.messages[:1], renderer, conv_id=conv.id)
        with torch.no_grad():
            first = int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())
        assert conv.messages[1]["token_ids"][0] == first, conv.id

    # an interrupted run: two chats in the journal; the re-run asks the server only for the others
    journal = tmp_path / "resumed.jsonl"
    journal.write_text("".join((tmp_path / "full.jsonl").read_text().splitlines(keepends=True)[:2]))
    done = set(read_journal(journal))
    first_prompts = {tuple(prompt_ids(c.messages[:1], renderer, conv_id=c.id)): c.id for c in chats(4)}
    asked.clear()
    resumed = regenerate(tokenizer_target, chats(4), journal, endpoint_cfg(url))
    assert [c.id for c in resumed] == [c.id for c in full]
    assert asked and not {first_prompts[p] for p in asked if p in first_prompts} & done, "finished chats were redone"
    assert len(read_journal(journal)) == 4


def test_an_unreachable_endpoint_fails_before_any_work(tokenizer_target, tmp_path):
    cfg = RegenerateConfig(endpoint={"url": f"http://127.0.0.1:{free_port()}/v1", "retries": 0, "timeout_s": 5})
    with pytest.raises(EndpointError, match=r"127\.0\.0\.1:\d+/v1/models failed after 1 tries .*regenerate\.endpoint\.url"):
        regenerate(tokenizer_target, chats(2), tmp_path / "j.jsonl", cfg)
    assert not (tmp_path / "j.jsonl").exists()


@pytest.mark.slow  # the module's server takes ~30 s to start
def test_a_refused_request_names_the_server_and_its_reason(server, tokenizer_target, tmp_path):
    url, _ = server  # transformers serve refuses fields it does not know, as a strict engine does
    cfg = endpoint_cfg(url, extra_body={"no_such_field": 1})
    with pytest.raises(EndpointError, match=r"refused the request \(HTTP 4\d\d\).*no_such_field"):
        regenerate(tokenizer_target, chats(1), tmp_path / "j.jsonl", cfg)


@pytest.mark.slow  # the module's server takes ~30 s to start
def test_prepare_through_the_cli_records_the_endpoint_and_the_retokenized_count(server, tmp_path):
    url, _ = server
    out = subprocess.run([sys.executable, "-m", "specheads.cli", "prepare", "regenerate=endpoint",
                          f"regenerate.endpoint.url={url}", "regenerate.max_new_tokens=8", "data.num_samples=3",
                          f"output_dir={tmp_path / 'prepared'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    meta = json.loads((tmp_path / "prepared" / "specheads_meta.json").read_text())
    assert meta["regenerated"] and meta["regenerate"]["endpoint"]["url"] == url
    assert meta["regenerated_retokenized"]["retokenized"] == meta["source"]["kept"] - meta["skipped"].get(
        "no regenerated answer (prompt over regenerate.max_prompt_tokens, or empty answer)", 0) > 0
