"""Nothing chosen before scoring reads a scored prompt: the held-out rows whose measured acceptance the
shape choice reads, and the n-gram table a head's lookup branch continues from, leave out the
evaluator's chat slice (every sample of its chats)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specheads.data.prepare import write_prepared
from specheads.errors import UserError
from specheads.evaluation.prompts import load_chat_heldout, scored_chat_ids
from specheads.targets import Target
from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _recipe():
    from tests.training.test_train_recipe import load_recipe

    return load_recipe()


def _prepared(root: Path, n_chats: int = 100) -> Path:
    """Chats c000..c099, one sample each, every row's tokens unique; the evaluator's slice (the last 1%
    of chats: c099) is the shortest row, so a length-ordered read of the held-out rows meets it first."""
    rows = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    for c in range(n_chats):
        length = 6 if c == n_chats - 1 else 12 + c % 5
        rows["id"].append(f"c{c:03d}")
        rows["input_ids"].append([10 + c] * 3 + [(c * 7 + j) % 200 + 2 for j in range(length - 3)])
        rows["loss_mask"].append([0, 0, 0] + [1] * (length - 3))
        rows["domain"].append("chat")
    write_prepared(rows, {"target": "tiny", "tokenizer_fingerprint": "none", "max_length": 32}, root / "prepared")
    return root / "prepared"


def test_the_rows_the_shape_choice_reads_are_never_scored(tmp_path):
    """The trainer's measured acceptance (what ``shape_choice`` reads: ``measured_reach``/``measured_fan``)
    is decoded on the first ``train.measure_prompts`` held-out prompts (``heldout._measured`` ->
    ``held_out_prompts``); none of them may be a prompt the evaluator scores."""
    from specheads.training.acceptance import held_out_prompts

    prepared = _prepared(tmp_path)
    cfg = OmegaConf.create({"features_dir": None, "prepared_dir": str(prepared), "seed": 0,
                            "data": {"eval_samples": 8, "max_tokens": 256, "batch_size": None, "eval_max_tokens": 256,
                                     "max_length": None, "pad_to_multiple_of": 1}})
    recipe = _recipe()
    train_src, eval_src = recipe.build_data(cfg, method=None, target=Target.tokenizer_only(None, "tiny"))
    scored = [p.input_ids for p in load_chat_heldout(prepared, limit=None)]
    assert [p.id for p in load_chat_heldout(prepared, limit=None)] == ["chat/c099"]
    read = held_out_prompts(eval_src.batches(0), 8)  # the main job's train.measure_prompts
    assert len(read) == 8
    assert not [p for p in read if p in scored]
    ids = recipe._row_ids(train_src.dataset)
    assert "c099" not in {ids[i] for i in eval_src.indices} | {ids[i] for i in train_src.indices}
    # what train_summary.json records (the evaluator checks it before reading the acceptance)
    split = recipe.split_record(cfg, train_src, eval_src)
    assert split["rows"] == 100 and split["evaluation_rows_left_out"] == 1
    assert split["train_rows"] + split["heldout_rows"] == 99 and split["heldout_rows"] == 8
    assert split["heldout_excludes_evaluation"] and "c099" not in split["heldout_ids"]


def test_the_evaluator_refuses_acceptance_measured_on_a_scored_chat(tmp_path):
    from specheads.evaluation.shape_choice import check_heldout_split

    head = tmp_path / "run" / "head"
    head.mkdir(parents=True)
    summary = tmp_path / "run" / "train_summary.json"
    summary.write_text(json.dumps({"eval": {"measured_reach1": 0.5}}))  # trained before the split was recorded
    with pytest.raises(UserError, match="retrain the head, or set head_shape=tree"):
        check_heldout_split("eagle3-auto", str(head), set())
    record = {"rows": 100, "train_rows": 91, "heldout_rows": 8, "evaluation_rows_left_out": 1,
              "heldout_excludes_evaluation": True, "heldout_ids": ["c005", "c040@turn3"], "dedup": None}
    summary.write_text(json.dumps({"eval": {"measured_reach1": 0.5}, "heldout_split": record}))
    with pytest.raises(UserError, match=r"include chat\(s\) this evaluation scores \(c040\)"):
        check_heldout_split("eagle3-auto", str(head), {"c040", "c099"})
    ok = check_heldout_split("eagle3-auto", str(head), {"c099"})
    assert ok == {**{k: v for k, v in record.items() if k != "heldout_ids"}, "heldout_chats_scored": 0}


def test_the_lookup_branchs_ngram_table_leaves_out_every_sample_of_a_scored_chat(tmp_path):
    """A chat split into per-turn samples (``<chat>@turn<i>``) is scored on its first sample only; its later
    samples repeat that prompt and continue it, so the n-gram table must not read them either."""
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.suite import MethodSpec, build_drafter

    rows = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    for c in range(100):
        for turn in (1, 3):
            rows["id"].append(f"c{c:03d}@turn{turn}")
            rows["input_ids"].append([2, 3, 4, 5, 6, 7] if c < 99 else [2, 3, 4, 150 + turn, 160 + turn, 170 + turn])
            rows["loss_mask"].append([0, 0, 0, 1, 1, 1])
            rows["domain"].append("chat")
    write_prepared(rows, {"target": "tiny", "tokenizer_fingerprint": "none", "max_length": 32}, tmp_path / "p")
    prompts = load_chat_heldout(tmp_path / "p", limit=1)
    assert [p.id for p in prompts] == ["chat/c099@turn1"] and scored_chat_ids(prompts) == {"c099"}
    target = Target(make_tiny_model(vocab=256, hidden=32, layers=2), None, name="tiny")
    spec = MethodSpec("ee+ngram", "early_exit", TreeShape("chain", k=2), early_exit_layers=1, ngram_branch=2,
                      ngram_extend=1, ngram_table=str(tmp_path / "p"))
    table = build_drafter(spec, target, prompts).table
    assert table.next_token([5, 6]) == 7  # the other chats are read
    assert table.next_token([153, 163]) is None and table.next_token([151, 161]) is None  # c099: neither sample
