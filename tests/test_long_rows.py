"""Long rows through every stage: a tiny random Qwen3-style target with a 65,536-token context and a thinking
template, and a conversation of about 16k tokens (a long document, a long thinking trace, an answer) prepared,
collected, trained on and exported, beside a held-out one whose prompt of more than 4k tokens the evaluator decodes
losslessly; each recipe runs in this process on the real Hydra configs.

The held-out chat's answer is short: the evaluation decodes its prompt only, and a second 16k-token row would double
collection's attention for nothing this test checks. Training takes one step (the whole 16k-token row, three
training-time-test steps). Each stage's seconds are printed.

The second test runs the reasoning preset users would run (``target=qwen3_8b_reasoning``: thinking on, 16k-token
rows, TTT 7, sequence parallel 2) through the same stages on the same target, training under the real launcher."""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.test_hydra_configs import CONF, PRIMARY, load_recipe

pytestmark = pytest.mark.slow

CONTEXT = 65536
ROW_TOKENS = 16384
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud field light "
         "number proof check step then so because first next finally answer").split()


def tiny_tokenizer():
    """A byte-level BPE of about 400 tokens learnt from ``WORDS`` and the template's words, with Qwen3's chat markers as
    special tokens, ``<think>`` tags as ordinary added ones, and a Qwen3-style thinking template: SmolLM2's 49k-token
    vocabulary would make the LM head most of every stage's time on 16k-token rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.data.chat_templates import QWEN3_STYLE

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([" ".join(WORDS), "Read this and sum it up. In short:", "user assistant system"] * 4,
                            trainer)
    bpe.add_tokens(["<think>", "</think>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=QWEN3_STYLE, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", model_max_length=CONTEXT)


def tiny_long_context_target(root: Path, head_dim: int = 16) -> Path:
    """A Qwen3 model folder: 3 layers of hidden 64 (2 attention heads of ``head_dim``, 2 key/value heads: sequence
    parallel 2 divides them; vLLM's CPU attention takes 32 and up), a 65,536-token context, random weights, with
    ``tiny_tokenizer`` saved beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
                                  max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # peaked next-token distributions, so greedy decoding depends on the context
        model.get_output_embeddings().weight.mul_(20.0)
    folder = root / "tiny-qwen3-64k"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def long_chat(i: int, document: int, reasoning: int) -> dict:
    """A conversation: a document of ``document`` words and a request, a thinking trace of ``reasoning`` words, an
    answer (Qwen3's ``reasoning_content``)."""
    rng = random.Random(i)
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    return {"id": f"long{i}", "messages": [
        {"role": "user", "content": f"Read this and sum it up. {say(document)}"},
        {"role": "assistant", "reasoning_content": say(reasoning), "content": f"In short: {say(reasoning // 8)}"}]}


@contextmanager
def timed(times: dict, stage: str):
    t0 = time.perf_counter()
    yield
    times[stage] = round(time.perf_counter() - t0, 1)


def compose(config_name: str, overrides: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return hcompose(config_name, overrides=overrides)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(folder, the tiny target, a JSONL of two chats: ``long0`` of about 15.5k tokens, the held-out ``long1`` whose
    prompt is about 4.5k)."""
    for recipe in PRIMARY:
        load_recipe(recipe)
    root = tmp_path_factory.mktemp("long_rows")
    target = tiny_long_context_target(root)
    chats = root / "chats.jsonl"
    chats.write_text(json.dumps(long_chat(0, 5400, 8500)) + "\n" + json.dumps(long_chat(1, 4200, 64)) + "\n")
    return root, target, chats


def target_overrides(target: Path) -> list[str]:
    return ["target=hf", f"target.name_or_path={target}", "target.dtype=float32", "target.device=cpu",
            "+target.chat_template_kwargs.enable_thinking=true"]


def test_a_16k_token_conversation_goes_through_every_stage(world):
    from specheads.data.prepare import load_prepared
    from specheads.data.store import verify_store

    root, target, chats = world
    t = target_overrides(target)
    prepared, features, trained, report, export = (root / n for n in
                                                    ("prepared", "features", "train", "eval", "export"))
    times: dict[str, float] = {}
    with timed(times, "prepare"):
        load_recipe("prepare_data.py").run(compose("prepare_data", [
            *t, "data=jsonl", f"data.path={chats}", f"data.max_length={ROW_TOKENS}", f"output_dir={prepared}"]))
    ds, meta = load_prepared(prepared)
    rows = {row["id"].split("/")[0]: row for row in ds}
    long_row = rows["long0"]["input_ids"]
    think_end = tiny_tokenizer().convert_tokens_to_ids("</think>")
    assert meta["num_truncated"] == 0 and 15000 < len(long_row) <= ROW_TOKENS, len(long_row)
    assert think_end in long_row and sum(rows["long0"]["loss_mask"]) > 9000  # the thinking trace is trained on

    with timed(times, "collect"):
        load_recipe("collect_hidden_states.py").collect(compose("collect_hidden_states", [
            *t, f"prepared_dir={prepared}", f"output_dir={features}", "method=eagle3", "collect.dtype=float32",
            "collect.batch_tokens=4096"]))  # the 16k-token row is a batch of its own, over the bound
    manifest = verify_store(features)
    assert sorted(sum((s["lengths"] for s in manifest["shards"]), [])) == sorted(len(r) for r in ds["input_ids"])

    with timed(times, "train"):
        summary = load_recipe("train.py").run(compose("train", [
            *t, "method=eagle3", f"features_dir={features}", f"prepared_dir={prepared}", f"output_dir={trained}",
            "method.draft_vocab_size=256", "train.max_steps=1", f"data.max_tokens={ROW_TOKENS}", "data.eval_samples=0",
            "train.measure_prompts=0", "train.progress=false", "wandb.mode=disabled"]))

    with timed(times, "evaluate"):
        result = load_recipe("evaluate.py").run(compose("evaluate", [
            *t, "head_method=eagle3", f"head_dir={trained}", f"output_dir={report}", "eval=tiny",
            "eval.mtbench_per_category=0", "eval.humaneval=0", "eval.chat=1", f"eval.chat_dir={prepared}",
            "eval.max_new_tokens=8", "baselines=[]", "temperatures=[0.0]", "batch_sizes=[1]", "serving.engines=[]",
            "tree.depth=2", "tree.topk=2", "tree.total_tokens=4", "cpu_linears=plain", "cpu_threads=1"]))

    with timed(times, "export"):
        load_recipe("export.py").run(compose("export", [
            *t, f"head_dir={trained / 'head'}", f"output_dir={export}", f"eval_report={report / 'report.json'}"]))
    print(f"long rows, seconds per stage: {times}")
    assert summary["steps"] == 1 and summary["train_tokens"] >= len(long_row) and math.isfinite(summary["final_loss"])
    # the evaluator decoded the held-out prompt of more than 4k tokens, losslessly by its exact pass, and the
    # exact forwards' proof covered that context
    held_out = chats.read_text().splitlines()[1]
    prompt = tiny_tokenizer().apply_chat_template(json.loads(held_out)["messages"][:1], add_generation_prompt=True,
                                                  enable_thinking=True, tokenize=True)["input_ids"]
    (method,) = result["methods"]
    assert result["prompt_ids"] == ["chat/long1"] and len(prompt) > 4096
    assert method["lossless"]["exact"] and method["lossless"]["pass"] == "exact" and method["lossless"]["checked"] == 1
    proof = result["exact_forward"]["proof"]
    assert proof["unequal"] == 0 and max(context for context, _ in proof["cases"]) >= len(prompt) + 8
    for engine in ("vllm", "sglang", "speculators"):
        assert (export / engine / "model.safetensors").is_file() and (export / engine / "config.json").is_file()


def test_the_reasoning_preset_runs_end_to_end(world):
    """``target=qwen3_8b_reasoning`` (thinking on, 16k-token rows, EAGLE-3 with TTT 7, sequence parallel 2) on the
    tiny Qwen3 target: prepare, collect, training under the real launcher (``accelerate launch`` with
    conf/launcher/cpu_ddp.yaml, 2 processes: one group splitting each row), evaluate and export.

    What is overridden, and nothing else of the preset: the target's folder, dtype and device; the lengths
    (data.max_length and data.max_tokens 2048 instead of 16384: rows of about 1.8k tokens, so 2 processes train in
    seconds; the 16k-token rows go through every stage in the test above); the tiny target's shapes (its 3 layers
    as the fused ones, a 256-token draft vocabulary); the run's size (one epoch, no held-out rows or measured
    decode)."""
    from omegaconf import OmegaConf

    from specheads.data.prepare import load_prepared
    from tests.distributed.dist_launch import launch, launch_env

    root, target, _ = world
    base = root / "reasoning"
    chats = base / "chats.jsonl"
    base.mkdir()
    chats.write_text("".join(json.dumps(long_chat(i, 400, 1200)) + "\n" for i in range(3)))
    t = ["target=qwen3_8b_reasoning", f"target.name_or_path={target}", "target.dtype=float32", "target.device=cpu"]
    shapes = ["method.aux_layers=[0,1,2]", "method.draft_vocab_size=256"]
    prepared, features, trained, report, export = (base / n for n in
                                                    ("prepared", "features", "train", "eval", "export"))
    times: dict[str, float] = {}

    cfg = compose("train", [*t, "method=eagle3"])
    assert (cfg.method.ttt_steps, cfg.train.sequence_parallel, cfg.data.max_tokens) == (7, 2, 16384)
    assert OmegaConf.to_container(cfg.target.chat_template_kwargs) == {"enable_thinking": True}
    assert compose("prepare_data", [*t, "data=jsonl", "data.path=x"]).data.max_length == 16384
    with timed(times, "prepare"):
        load_recipe("prepare_data.py").run(compose("prepare_data", [
            *t, "data=jsonl", f"data.path={chats}", "data.max_length=2048", f"output_dir={prepared}"]))
    ds, meta = load_prepared(prepared)
    assert meta["num_truncated"] == 0 and len(ds) == 3
    assert all(tiny_tokenizer().convert_tokens_to_ids("</think>") in ids for ids in ds["input_ids"])

    with timed(times, "collect"):
        load_recipe("collect_hidden_states.py").collect(compose("collect_hidden_states", [
            *t, "method=eagle3", *shapes[:1], f"prepared_dir={prepared}", f"output_dir={features}",
            "collect.dtype=float32"]))

    with timed(times, "train (2 processes)"):
        run = launch("cpu_ddp.yaml", trained, [
            *t, "method=eagle3", *shapes, f"features_dir={features}", f"prepared_dir={prepared}",
            f"output_dir={trained}", "data.max_tokens=2048", "data.epochs=1", "data.eval_samples=0",
            "train.measure_prompts=0", "train.progress=false", "wandb.mode=disabled"], num_processes=2,
            env=launch_env(PYTHONPATH=str(CONF.parent))).check()
    summary = run.summary
    # one group of 2 processes reads both training rows, each split in two: 2 steps for the epoch (2 processes
    # of data parallelism would take one), each with the 7 training-time-test steps' losses
    assert (summary["num_processes"], summary["sequence_parallel"], summary["steps"]) == (2, 2, 2)
    assert math.isfinite(summary["final_loss"]) and "step6_loss" in run.metrics()[-1]

    with timed(times, "evaluate"):
        result = load_recipe("evaluate.py").run(compose("evaluate", [
            *t, "head_method=eagle3", f"head_dir={trained}", f"output_dir={report}", "eval=tiny",
            "eval.mtbench_per_category=0", "eval.humaneval=0", "eval.chat=1", f"eval.chat_dir={prepared}",
            "eval.max_new_tokens=8", "baselines=[]", "temperatures=[0.0]", "batch_sizes=[1]", "serving.engines=[]",
            "tree.depth=2", "tree.topk=2", "tree.total_tokens=4", "cpu_linears=plain", "cpu_threads=1"]))
    (method,) = result["methods"]
    assert result["prompt_ids"] == ["chat/long2"] and method["lossless"]["exact"]

    with timed(times, "export"):
        load_recipe("export.py").run(compose("export", [
            *t, f"head_dir={trained / 'head'}", f"output_dir={export}", f"eval_report={report / 'report.json'}"]))
    assert (export / "vllm" / "model.safetensors").is_file()
    print(f"reasoning preset, seconds per stage: {times}")
