"""Mixtures of sources in one prepared set, and preparation in worker processes (the same rows as one process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specheads.data.prepare import PrepareConfig, load_prepared, prepare
from specheads.data.sources import SourceError, iter_conversations, mixture_counts, mixture_parts
from specheads.targets import Target


@pytest.fixture
def tok_target(smollm2_tokenizer):
    return Target.tokenizer_only(smollm2_tokenizer, "smollm2")


def write_jsonl(path, prompts, domain=None):
    rows = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": f"answer to {p}"}],
             **({"domain": domain} if domain else {})} for p in prompts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_weights_share_the_total_after_the_counted_parts():
    parts = mixture_parts([{"name": "a", "num_samples": 4}, {"name": "b", "weight": 1}, {"name": "c", "weight": 2}])
    assert mixture_counts(parts, 10) == [4, 2, 4]
    assert sum(mixture_counts(mixture_parts([{"name": n, "weight": 1} for n in "xyz"]), 10)) == 10


@pytest.mark.parametrize("parts,num,match", [
    ([{"name": "a", "num_samples": 2}, {"name": "a", "num_samples": 2}], None, "unique names"),
    ([{"name": "a", "weight": 1}], None, "weighted parts need data.num_samples"),
    ([{"name": "a", "num_samples": 2, "weight": 1}], 5, "give num_samples or weight, one of them"),
    ([{"name": "a", "num_samples": -1}], None, "must be positive"),
    ([{"name": "a", "num_samples": 2, "colour": "red"}], None, r"data.parts\[0\]: .*colour"),
    ([], None, "at least one part"),
])
def test_a_bad_mixture_is_refused_before_anything_is_read(parts, num, match):
    with pytest.raises(SourceError, match=match):
        PrepareConfig(source="mixture", parts=parts, num_samples=num)


def test_a_mixture_labels_counts_and_dedups_across_its_sources(tok_target, tmp_path):
    sharegpt_first = next(iter_conversations("sharegpt")).messages[0]["content"]
    code = write_jsonl(tmp_path / "code.jsonl", [f"write function number {i}" for i in range(6)])
    # the second file repeats a ShareGPT prompt and one of the code prompts: both are dropped
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [sharegpt_first, "Write function number 2.", "a new question"],
                        domain="qa")
    cfg = PrepareConfig(source="mixture", num_samples=12, max_length=512, parts=[
        {"name": "sg", "source": "sharegpt", "num_samples": 5},
        {"name": "code", "source": "jsonl", "path": code, "weight": 1, "domain": "code"},
        {"name": "mixed", "source": "jsonl", "path": mixed, "weight": 1}])
    meta = prepare(tok_target, cfg, tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    by_part = {p["name"]: p for p in meta["mixture"]}
    assert [by_part[n]["read"] for n in ("sg", "code", "mixed")] == [5, 4, 3]  # 12 - 5 split 1:1, capped by the file
    assert meta["dedup"]["duplicates_within"] == 2
    assert by_part["mixed"]["chats"] == 1 and by_part["code"]["chats"] == 4
    assert by_part["sg"]["chats"] + by_part["code"]["chats"] + by_part["mixed"]["chats"] == len(
        {i.split("@")[0] for i in ds["id"]})
    domains = dict(zip(ds["id"], ds["domain"]))
    assert {d for i, d in domains.items() if i.startswith("code:")} == {"code"}
    assert {d for i, d in domains.items() if i.startswith("mixed:")} == {"qa"}  # the record's own domain wins
    assert all(i.split(":", 1)[0] in by_part for i in ds["id"])
    assert sum(p["tokens"] for p in meta["mixture"]) == meta["num_tokens"]


def test_worker_processes_write_the_rows_one_process_writes(tok_target, tmp_path):
    one = prepare(tok_target, PrepareConfig(num_samples=120, max_length=256, num_proc=1, chunk_size=16), tmp_path / "a")
    two = prepare(tok_target, PrepareConfig(num_samples=120, max_length=256, num_proc=2, chunk_size=16), tmp_path / "b")
    a, _ = load_prepared(tmp_path / "a")
    b, _ = load_prepared(tmp_path / "b")
    assert two["num_proc"] == 2 and len(a) > 80
    assert a["id"] == b["id"] and a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    drop = ("seconds", "num_proc")
    assert {k: v for k, v in one.items() if k not in drop} == {k: v for k, v in two.items() if k not in drop}


def test_mixture_through_the_cli(tmp_path):
    code = write_jsonl(tmp_path / "code.jsonl", [f"sort list {i}" for i in range(3)])
    out = subprocess.run([sys.executable, "-m", "specheads.cli", "prepare", "data=mixture", "data.num_samples=6",
                          "data.max_length=256",
                          f"data.parts=[{{name: sg, source: sharegpt, weight: 1}}, {{name: code, source: jsonl, path: {code}, num_samples: 3, domain: code}}]",
                          f"output_dir={tmp_path / 'p'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    meta = json.loads((tmp_path / "p" / "specheads_meta.json").read_text())
    assert [(p["name"], p["read"]) for p in meta["mixture"]] == [("sg", 3), ("code", 3)]
    bad = subprocess.run([sys.executable, "-m", "specheads.cli", "prepare", "data=mixture", "data.num_samples=null",
                          f"output_dir={tmp_path / 'q'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "weighted parts need data.num_samples" in bad.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "q").exists()
