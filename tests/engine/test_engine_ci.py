"""CI's real-engine test: a head made here, exported, and decoded by vLLM's CPU build (the real engine, not a
stand-in), with a control that fails on an export that loads and serves but drafts garbage.

The head is P-EAGLE's (EAGLE-3's export plus the parallel-drafting slots: a chain of 3 in one forward). So that
it drafts well after a few CPU steps, it is trained on the very prompts served: the training chats are those
prompts with the target's own greedy answers (``regenerate=greedy``), which the head learns by heart (the target's
states collected once, so that the steps run the head alone). Then:

* the evaluator measures the head's chain of 3 on those prompts (``specheads evaluate``, greedy, float32 as the
  engine serves);
* vLLM serves the export on the same prompts (``specheads serve-eval``), plainly and speculatively: greedy outputs
  identical, the engine's counters read back (chains of 3, accepted tokens per position adding up), its log
  showing ``eagle3`` with ``parallel_drafting``;
* the engine accepts what the evaluator measured: at each position and for τ, no difference beyond 3 standard
  errors of the difference (``serve_eval.compare``: binomial per position, τ's from each side's accepted-length
  distribution, the errors from each side's counts), and its τ is at least ``MIN_TAU``, so the comparison has
  something to compare;
* the control: the same export with its weights shuffled (``shuffle_weights``: same shapes and draft vocabulary,
  it loads and serves, its drafts are noise) drops to τ ≈ 1 in the engine (at most ``MAX_TAU_SHUFFLED``) and the
  same comparison flags it. It is served without a plain engine (an engine load saved): a head that accepts
  next to nothing emits the target's own verdicts, so its decodes are only checked to be as long as plain
  decoding's.

Three engine loads with ``enforce_eager``, the evaluator and four short stages (prepare, collect, 30 steps, export):
about 3 to 4 minutes on 2 cores. The engine tier (``scripts/engine_tests.sh``, by hand) serves heads trained on
other data."""

from __future__ import annotations

import json
import time

import pytest

from tests.engine.conftest import assert_accepts_as_evaluated, evaluator_comparison, shuffle_weights, specheads

pytestmark = [pytest.mark.engine_ci, pytest.mark.slow]

# the served prompts, which are also the training chats
PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is.",
    "List the first ten prime numbers.",
]
# training leaves the last chat by id out (the evaluator's held-out chat slice): a filler that is not served
FILLER = {"id": "zz-filler", "messages": [{"role": "user", "content": "Say hello."},
                                          {"role": "assistant", "content": "Hello!"}]}
MAX_NEW = 24
MIN_TAU = 1.5           # the trained head's τ in the engine, at least (measured 2.54; the evaluator's 2.45)
MAX_TAU_SHUFFLED = 1.1  # the shuffled head's, at most (measured 1.01: 1 draft of 91 accepted)
F32 = "target.dtype=float32"  # every stage in the precision the engine serves in
HEAD = ["method=peagle", "method.num_depths=3", "method.draft_vocab_size=512"]
TRAIN = ["data.max_tokens=1024", "data.eval_samples=0", "train.max_steps=30", "train.max_minutes=null",
         "train.eval_every=0", "train.save_every=0", "train.measure_prompts=0", "train.progress=false",
         "optim.lr=3e-3", "optim.warmup_steps=0"]


def test_a_head_exported_here_is_served_by_the_real_vllm_as_the_evaluator_measured_and_a_shuffled_one_is_caught(
        tmp_path):
    seconds = {}
    t = time.perf_counter()

    def stage(name):
        nonlocal t
        seconds[name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    prompts, chats = tmp_path / "prompts.jsonl", tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "served", "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    chats.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p},
                                                                     {"role": "assistant", "content": "-"}]}) + "\n"
                             for i, p in enumerate(PROMPTS)) + json.dumps(FILLER) + "\n")
    evalset = ["eval=tiny", "eval.mtbench_per_category=0", "eval.humaneval=0", f"eval.jsonl={prompts}",
               f"eval.max_new_tokens={MAX_NEW}"]
    specheads("prepare", F32, "data=jsonl", f"data.path={chats}", "regenerate=greedy",
              f"regenerate.max_new_tokens={MAX_NEW + 8}", f"output_dir={tmp_path / 'prepared'}", cwd=tmp_path)
    stage("prepare")
    # the target's states stored once: the steps then run the head alone
    specheads("collect", F32, *HEAD, "collect.dtype=float32", f"prepared_dir={tmp_path / 'prepared'}",
              f"output_dir={tmp_path / 'features'}", cwd=tmp_path)
    stage("collect")
    specheads("train", F32, *HEAD, *TRAIN, f"features_dir={tmp_path / 'features'}",
              f"prepared_dir={tmp_path / 'prepared'}", f"output_dir={tmp_path / 'train'}", cwd=tmp_path)
    stage("train")
    specheads("export", f"head_dir={tmp_path / 'train'}", f"output_dir={tmp_path / 'export'}", "engine=vllm",
              "eval_report=null", cwd=tmp_path)
    shuffled_export = shuffle_weights(tmp_path / "export", tmp_path / "export-shuffled")
    stage("export")
    # the evaluator's chain of 3 (the head's own: K = 3) on the same prompts; its acceptance is the fast pass's
    # (the exact pass adds only the lossless verdict, which the engine's own greedy identity stands for here)
    evaluated = tmp_path / "eval" / "report.json"
    specheads("evaluate", F32, f"head_dir={tmp_path / 'train'}", *evalset, "baselines=[]", "temperatures=[0.0]",
              "batch_sizes=[1]", "serving.engines=[vllm]", "serving.vllm_num_speculative_tokens=3",
              "cpu_linears=plain", "exact_forward=off", f"output_dir={evaluated.parent}", cwd=tmp_path)
    stage("evaluate")
    serve = ["serve-eval", *evalset, f"eval_report={evaluated}", "num_speculative_tokens=3", "vllm.enforce_eager=true"]
    specheads(*serve, f"export_dir={tmp_path / 'export'}", f"output_dir={tmp_path / 'serve'}", cwd=tmp_path)
    stage("serve")
    # the shuffled head alone (no plain engine: see the module's doc)
    specheads(*serve, f"export_dir={shuffled_export}", "plain=false", f"output_dir={tmp_path / 'serve-shuffled'}",
              cwd=tmp_path)
    stage("serve shuffled")

    reports = {}
    for name in ("serve", "serve-shuffled"):
        report = reports[name] = json.loads((tmp_path / name / "serve_report.json").read_text())
        assert report["num_prompts"] == len(PROMPTS)
        spec = report["domains"]["all"]["spec"]
        assert spec["drafts"] > 0 and spec["draft_tokens"] == 3 * spec["drafts"]  # the engine drafted chains of 3
        assert len(spec["accepted_per_pos"]) == 3 and sum(spec["accepted_per_pos"]) == spec["accepted"]
        assert spec["tau"] == pytest.approx(1 + spec["accepted"] / spec["drafts"])
        # the engine was asked for P-EAGLE's parallel drafting, and said so in its own log
        log = (tmp_path / name / "engine_spec.log").read_text()
        assert "'parallel_drafting': True" in log and "method='eagle3'" in log
    every = reports["serve"]["domains"]["all"]
    assert every["compared"] == every["identical"] == len(PROMPTS)  # greedy: speculative == plain
    assert every["spec"]["new_tokens"] == every["plain"]["new_tokens"] > 0
    # the shuffled head's decodes as long as plain decoding's
    assert [p["spec_tokens"] for p in reports["serve-shuffled"]["per_prompt"]] == \
        [p["plain_tokens"] for p in reports["serve"]["per_prompt"]]
    row, shuffled_row = evaluator_comparison(reports["serve"]), evaluator_comparison(reports["serve-shuffled"])
    measured = {"evaluator tau": row["tau_evaluator"], "engine tau": row["tau_engine"],
                "shuffled engine tau": shuffled_row["tau_engine"], "evaluator steps": row["evaluator_steps"],
                "engine drafts": row["engine_drafts"], "seconds": seconds}
    print(json.dumps(measured))
    # the engine accepts what the evaluator measured, and that is well above nothing
    assert_accepts_as_evaluated(row)
    assert row["tau_engine"] >= MIN_TAU and row["tau_evaluator"] >= MIN_TAU, measured
    # the control: a head drafting noise accepts next to nothing, and the same comparison flags it
    assert shuffled_row["tau_engine"] <= MAX_TAU_SHUFFLED, measured
    assert shuffled_row["tau_flagged"] and shuffled_row["positions"][0]["flagged"], shuffled_row
