"""End to end on a tiny random target with the real SmolLM2 tokenizer (chat template): every
drafter family, lossless check, batching, report files."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_tiny_model
from specheads.decoding.drafters import TreeShape
from specheads.errors import ConfigError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.report import write_report
from specheads.evaluation.suite import EvalConfig, MethodSpec, ServingProfiles, evaluate, plan_methods
from specheads.targets import Target


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    return Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab")


@pytest.fixture(scope="module")
def head_dirs(target, tmp_path_factory):
    from specheads.models.eagle1 import Eagle1Config, Eagle1Model
    from specheads.models.medusa import medusa_for_target

    root = tmp_path_factory.mktemp("heads")
    medusa_for_target(target, num_heads=3).save_pretrained(root / "medusa")
    Eagle1Model(Eagle1Config.from_target(target)).save_pretrained(root / "eagle1")
    (root / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.7}))
    return root


def test_evaluate_every_family(target, head_dirs, tmp_path):
    methods = [MethodSpec("ngram", "ngram", TreeShape("chain", k=3)),
               MethodSpec("ee", "early_exit", TreeShape("chain", k=2), early_exit_layers=1),
               MethodSpec("medusa", "medusa", TreeShape("static"), head_dir=str(head_dirs / "medusa"),
                          medusa_tree_nodes=6),
               MethodSpec("eagle1", "eagle1", TreeShape("dynamic", depth=2, topk=2, total_tokens=4),
                          head_dir=str(head_dirs / "eagle1")),
               plan_methods(None, None, ["lookahead"], lookahead={"window": 3, "ngram": 3, "guesses": 2})[0]]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0)
    cfg = EvalConfig(methods, spec, max_new_tokens=6, temperatures=(0.0, 1.0), batch_sizes=(1, 3), batch_prompts=3,
                     repeats=1)
    # the full MT-bench list is long: keep two categories (both turns) and one HumanEval prompt
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    suite.load_benchmarks = lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:4]
    try:
        report = evaluate(target, cfg)
    finally:
        suite.load_benchmarks = real
    assert report["num_prompts"] == 4
    for m in report["methods"]:
        assert m["lossless"]["exact"], m["name"]
        assert m["batch"]["3"]["target_forwards_per_step"] == 1.0
        assert m["batch"]["3"]["matches_batch1_plain"]
        allrow = m["by_temperature"]["0.0"]["all"]
        # τ = tokens emitted per target forward: the decode's own output length over its step count
        assert allrow["tau"] == pytest.approx(allrow["new_tokens"] / allrow["target_forwards"])
    assert report["plain"]["all"]["tau"] == 1.0  # no drafts: one token per forward, exactly
    assert report["methods"][2]["shape"].startswith("static(")
    for m in report["methods"]:  # recommendations per row kind, never beyond the depth drafted
        if not m["by_temperature"]["0.0"]["all"]["nodes_by_depth"]:
            assert "all" not in report["recommendation"][m["name"]]["0.0"]  # nothing drafted: nothing to predict
            continue
        rec = report["recommendation"][m["name"]]["0.0"]["all"]
        assert rec["kind"] == ("chain" if m["shape"].startswith("chain") else "tree")
        assert max(p["k"] for p in rec["predictions"]) == rec["measured_depth"]
        assert rec["measured_depth"] == len(m["by_temperature"]["0.0"]["all"]["nodes_by_depth"])
    assert report["methods"][3]["train_tau"] == 1.7  # train_summary.json above the head folder
    assert report["methods"][4]["name"] == "lookahead-W3N3G2" and report["methods"][4]["drafter"] == "lookahead"
    paths = write_report(report, tmp_path)
    for key in ("json", "markdown", "alpha_by_domain", "alpha_by_position", "tau_speedup_vs_k"):
        assert (tmp_path / paths[key].split("/")[-1]).exists()
    md = (tmp_path / "report.md").read_text()
    assert "Lossless check" in md and "| all |" in md
    # The summary: one line per method, then τ per domain with one column per method.
    summary = md.split("## Summary")[1].split("\n## ")[0]
    for m in report["methods"]:
        assert f"| {m['name']} | " in summary and m["eval_seconds"] > 0
    tau_rows = [line for line in summary.splitlines() if line.startswith("| coding |")]
    assert len(tau_rows) == 2  # T=0 and T=1
    want = " | ".join(f"{m['by_temperature']['0.0']['coding']['tau']:.2f}" for m in report["methods"])
    assert tau_rows[0] == f"| coding | {want} |"
    assert report["plain_seconds"] > 0


def test_plain_at_each_temperature_warm_up_and_repeated_timing(target, tmp_path, monkeypatch):
    """Issue 12.3: the T=1 speed-up is measured against plain decoding at T=1 (here made 1 s/token
    slower than greedy; the old code divided by the greedy pass). Issue 12.4: the target and each
    drafter decode an untimed warm-up before their first timed pass, every batch-1 speed is timed
    ``repeats`` times, and speeds and speed-ups carry their median and range into JSON and Markdown."""
    import specheads.evaluation.suite as suite

    real_load, real_gen = suite.load_benchmarks, suite.speculative_generate
    calls = []

    def recording(runner, drafter, prompts, max_new_tokens, temperature=0.0, *a, **k):
        res = real_gen(runner, drafter, prompts, max_new_tokens, temperature, *a, **k)
        calls.append((getattr(drafter, "name", None), max_new_tokens, temperature))
        if drafter is None and temperature > 0:
            res.wall_time += 1.0 * sum(map(len, res.tokens))  # an expensive sampler
        return res

    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real_load(s) if p.domain == "coding"][:2])
    monkeypatch.setattr(suite, "speculative_generate", recording)
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=0, chat=0)
    cfg = EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=3))], spec, max_new_tokens=12,
                     temperatures=(0.0, 1.0), batch_sizes=(1,), repeats=3, paired=False)
    report = evaluate(target, cfg)
    # warm-ups: the very first decode, and the drafter's first, are short and untimed
    assert calls[0] == (None, 8, 0.0)
    first_ngram = next(i for i, c in enumerate(calls) if c[0] == "ngram")
    assert calls[first_ngram] == ("ngram", 8, 0.0)
    timed_calls = [c for c in calls if c[1] == 12]
    for who in (None, "ngram"):
        for T in (0.0, 1.0):
            assert sum(c == (who, 12, T) for c in timed_calls) == 3 * 2  # 3 passes x 2 prompts
    assert report["repeats"] == 3
    plain1 = report["plain_by_temperature"]["1.0"]["all"]
    assert plain1["timed_passes"] == 3 and plain1["tokens_per_s"] < 1.5  # the slow sampler is the baseline
    assert report["plain_by_temperature"]["0.0"]["all"]["tokens_per_s"] > 10 * plain1["tokens_per_s"]
    m = report["methods"][0]
    r0, r1 = m["by_temperature"]["0.0"]["all"], m["by_temperature"]["1.0"]["all"]
    assert r1["speedup"] > 10 and r0["speedup"] < 10
    for r in (r0, r1):
        lo, hi = r["speedup_range"]
        assert lo <= r["speedup"] <= hi and r["timed_passes"] == 3
        assert r["tokens_per_s_range"][0] <= r["tokens_per_s"] <= r["tokens_per_s_range"][1]
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    lo, hi = r0["speedup_range"]
    assert f"{r0['speedup']:.2f} ({lo:.2f}–{hi:.2f})" in md.split("## Summary")[1].split("\n## ")[0]
    assert "median of 3 timed pass(es) after a warm-up" in md and "T=1.0" in md.split("Plain decoding:")[1]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["methods"][0]["by_temperature"]["1.0"]["all"]["speedup_range"] == pytest.approx(r1["speedup_range"])


def test_plan_methods_profiles(tmp_path):
    ms = plan_methods("eagle3", str(tmp_path), ["ngram"], chain_k=5, serving=ServingProfiles(4, 6, 8, 32))
    names = {m.name: m for m in ms}
    assert names["eagle3-vllm"].shape.kind == "chain" and names["eagle3-vllm"].shape.k == 4
    sg = names["eagle3-sglang"].shape
    assert (sg.depth, sg.topk, sg.total_tokens) == (6, 8, 31)
    assert names["ngram-chain5"].shape.k == 5
    la = plan_methods(None, None, ["lookahead"], lookahead={"window": 6, "ngram": 3, "guesses": 4})[0]
    assert (la.name, la.drafter, la.lookahead, la.shape.depth) == ("lookahead-W6N3G4", "lookahead", (6, 3, 4), 2)
    only_vllm = [m.name for m in plan_methods("eagle1", str(tmp_path), [], serving=ServingProfiles(engines=["vllm"]))]
    assert only_vllm == ["eagle1-tree", "eagle1-vllm"]
    # settings, so ConfigError: the recipe prints its one line before the target loads (not a traceback)
    with pytest.raises(ConfigError, match="unknown profile"):
        plan_methods("eagle1", str(tmp_path), [], serving=ServingProfiles(engines=["trtllm"]))
    with pytest.raises(ConfigError, match="needs head_dir"):
        plan_methods("medusa", None)
    with pytest.raises(ConfigError, match="baseline 'foo'"):
        plan_methods(None, None, ["foo"])
    with pytest.raises(ConfigError, match="head_shape=chain2: use tree or auto"):
        plan_methods("eagle3", str(tmp_path), [], head_shape="chain2")
    hybrid = plan_methods("eagle3", str(tmp_path), ["ngram"], head_shape="auto", head_ngram=3, ngram_max=2,
                          serving=ServingProfiles(engines=["vllm"]))
    assert [m.name for m in hybrid] == ["eagle3-auto", "eagle3-auto+ngram3", "eagle3-vllm", "ngram-chain4"]
    assert (hybrid[1].ngram_branch, hybrid[1].ngram_max, hybrid[1].auto_shape) == (3, 2, True)
    assert [m.ngram_branch for m in hybrid] == [0, 3, 0, 0]
    with pytest.raises(ValueError, match="prompt-lookup branch goes on"):
        MethodSpec("x", "ngram", ngram_branch=2)
    with pytest.raises(ValueError, match="chain p/q"):
        MethodSpec("x", "eagle3", verify="chain", head_dir=str(tmp_path), ngram_branch=2)
    extended = plan_methods("eagle3", str(tmp_path), [], head_shape="auto", head_ngram=4, head_ngram_extend=1,
                            head_ngram_extend_len=3, head_ngram_table="store", serving=ServingProfiles(engines=[]))
    assert [m.name for m in extended] == ["eagle3-auto", "eagle3-auto+ngram4+x1"]
    assert (extended[1].ngram_extend, extended[1].ngram_extend_len, extended[1].ngram_table) == (1, 3, "store")
    assert extended[0].ngram_table is None and extended[1].shape_label() == "chain1+ngram4+x1.3"
    assert extended[1].ngram_table_tokens == 1_000_000
    with pytest.raises(ValueError, match="ngram_table_tokens must be >= 1"):
        MethodSpec("x", "eagle3", head_dir=str(tmp_path), ngram_branch=2, ngram_table_tokens=0)
    with pytest.raises(ValueError, match="set ngram_branch > 0"):
        MethodSpec("x", "eagle3", head_dir=str(tmp_path), ngram_extend=1)
    with pytest.raises(ValueError, match="ngram_extend_len >= 1"):
        MethodSpec("x", "eagle3", head_dir=str(tmp_path), ngram_branch=2, ngram_extend=1, ngram_extend_len=0)


def test_verifier_for_medusa2_heads_is_their_adapted_target(target, head_dirs, tmp_path):
    from specheads.evaluation.suite import verifier_for
    from specheads.models.medusa import MedusaHeads

    assert verifier_for("medusa", str(head_dirs / "medusa")) is None  # Medusa-1: the original target
    assert verifier_for("eagle1", str(head_dirs / "eagle1")) is None
    heads = MedusaHeads.from_pretrained(head_dirs / "medusa")
    heads.config.adapted_target = "target"
    heads.save_pretrained(tmp_path / "m2")
    with pytest.raises(FileNotFoundError, match="adapted target 'target/'"):
        verifier_for("medusa", str(tmp_path / "m2"))
    target.model.save_pretrained(tmp_path / "m2" / "target")
    assert verifier_for("medusa", str(tmp_path / "m2")) == str((tmp_path / "m2" / "target").resolve())


def test_auto_shape_picks_a_chain_from_the_cost_curve_and_held_out_reach(target, head_dirs, tmp_path, monkeypatch):
    import shutil

    import specheads.evaluation.suite as suite
    from specheads.errors import UserError

    head = tmp_path / "run" / "head"
    shutil.copytree(head_dirs / "eagle1", head)
    split = {"rows": 100, "train_rows": 91, "heldout_rows": 8, "evaluation_rows_left_out": 1,
             "heldout_excludes_evaluation": True, "heldout_ids": ["c001"], "dedup": None}  # as recipes/train.py writes it
    (head.parent / "train_summary.json").write_text(json.dumps({"eval": {"measured_reach1": 0.9, "measured_reach2": 0.8},
                                                                "heldout_split": split}))
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "code"][:1])
    # A cost curve where verifying 3 tokens is dear: one draft wins despite the high reach at depth 2. It is
    # measured in the fast pass's kernels (the target's own attention, no row floor), as the timed decodes run.
    from specheads.decoding.exact import row_floor_is_on

    measured_in = []
    monkeypatch.setattr("specheads.evaluation.shape_choice.verify_costs", lambda runner, prompt, ns, reps=7: (
        measured_in.append((runner.model.config._attn_implementation, row_floor_is_on(runner.model))),
        ({1: 1.0, 2: 1.05, 3: 3.0}, 1.0))[1])
    methods = plan_methods("eagle1", str(head), [], head_shape="auto")
    assert [m.name for m in methods] == ["eagle1-auto", "eagle1-sglang", "eagle1-vllm"]
    cfg = EvalConfig(methods[:1], spec, max_new_tokens=6, temperatures=(0.0,), batch_sizes=(1,), repeats=1)
    report = evaluate(target, cfg)
    ch = report["shape_choice"]["eagle1-auto"]
    assert measured_in == [("eager", False)] and report["exact_forward"]["row_floor"] >= 1
    assert ch["label"] == "chain1" and ch["reach"] == [0.9, 0.8] and ch["c"] > 0
    assert ch["heldout_split"]["heldout_rows"] == 8 and ch["heldout_split"]["heldout_chats_scored"] == 0
    assert report["methods"][0]["shape"] == "chain1" and report["methods"][0]["lossless"]["exact"]
    write_report(report, tmp_path / "r")
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Shape chosen automatically: **chain1**" in md
    assert "held-out prompts (8 held-out rows of 100, none of them a scored prompt or its chat; 1 rows" in md
    assert "Prompts scored: humaneval 1." in md
    # A fan of two first drafts measured well above the chain, on a curve where 3 tokens cost about one:
    # the fan is drafted (one draft forward, a two-leaf tree) and stays lossless.
    (head.parent / "train_summary.json").write_text(json.dumps({"eval": {
        "measured_reach1": 0.3, "measured_reach2": 0.0, "measured_fan2_tau": 1.9}, "heldout_split": split}))
    monkeypatch.setattr("specheads.evaluation.shape_choice.verify_costs",
                        lambda runner, prompt, ns, reps=7: ({n: 1.0 + 0.01 * n for n in ns}, 1.0))
    fan = evaluate(target, EvalConfig(plan_methods("eagle1", str(head), [], head_shape="auto")[:1], spec,
                                      max_new_tokens=6, temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    assert fan["shape_choice"]["eagle1-auto"]["label"] == "fan2"
    assert fan["methods"][0]["shape"] == "tree(d1,k2,n2)" and fan["methods"][0]["lossless"]["exact"]
    # With a prompt-lookup branch: the same head's choice (measured once) and the branch on top, its best
    # first draft continued from the n-gram table of a prepared dataset.
    from tests.data.test_features import make_prepared

    prepared = make_prepared(tmp_path, fingerprint=target.tokenizer_fingerprint())
    calls = []
    monkeypatch.setattr(suite, "_choose_shape", lambda *a, real=suite._choose_shape: calls.append(1) or real(*a))
    built = []
    monkeypatch.setattr(suite, "load_ngram_table", lambda *a, real=suite.load_ngram_table, **k: built.append(a) or
                        real(*a, **k))
    methods = plan_methods("eagle1", str(head), [], head_shape="auto", head_ngram=2, head_ngram_extend=1,
                           head_ngram_table=str(prepared))[:2]
    both = evaluate(target, EvalConfig(methods, spec, max_new_tokens=6, temperatures=(0.0,), batch_sizes=(1,),
                                       repeats=1))
    assert len(calls) == 1 and both["shape_choice"]["eagle1-auto+ngram2+x1"]["label"] == "fan2"
    assert [m["shape"] for m in both["methods"]] == ["tree(d1,k2,n2)", "tree(d1,k2,n2)+ngram2+x1.2"]
    assert [a[0] for a in built] == [str(prepared)]
    ext = both["methods"][1]["ngram_extend"]
    assert (ext["first_drafts"], ext["tokens"], ext["table"]) == (1, 2, str(prepared)) and ext["table_ngrams"] > 0
    write_report(both, tmp_path / "r2")
    assert "Lookup branch extended: the best 1 first draft(s)" in (tmp_path / "r2" / "report.md").read_text()
    assert all(m["lossless"]["exact"] for m in both["methods"])
    (head.parent / "train_summary.json").write_text(json.dumps({"eval": {}, "heldout_split": split}))
    with pytest.raises(UserError, match="measure_prompts"):
        evaluate(target, EvalConfig(plan_methods("eagle1", str(head), [], head_shape="auto")[:1], spec,
                                    max_new_tokens=4, temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    with pytest.raises(ValueError, match="head_shape"):
        plan_methods("eagle1", str(head), [], head_shape="wide")


def test_bfloat16_target_is_evaluated_with_exact_forwards(smollm2_tokenizer, tmp_path, monkeypatch):
    """Issue 13: a bfloat16 target gets batch-invariant forwards before the plain pass (plain and
    speculative decoding alike in the exact pass, which judges), the report says so, and greedy decoding stays exact.
    The timed fast pass leaves the target on its own attention."""
    import torch

    import specheads.evaluation.suite as suite
    from specheads.decoding.exact import ATTENTION_NAME

    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=64, layers=2, seed=1, dtype=torch.bfloat16)
    target = Target(model, smollm2_tokenizer, name="tiny-bf16")
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "coding"][:2])
    methods = [MethodSpec("ngram", "ngram", TreeShape("chain", k=3)),
               plan_methods(None, None, ["lookahead"], lookahead={"window": 3, "ngram": 3, "guesses": 2})[0]]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=0, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=10, temperatures=(0.0,), batch_sizes=(1,),
                                         repeats=1))
    assert model.config._attn_implementation == "eager"  # the fast pass's, as it decodes after the evaluation
    assert report["passes"]["exact"]["attention"] == ATTENTION_NAME and report["passes"]["fast"]["attention"] == "eager"
    assert report["exact_forward"]["attention"] == ATTENTION_NAME and report["target_dtype"] == "torch.bfloat16"
    assert all(m["lossless"]["exact"] and m["lossless"]["pass"] == "exact" for m in report["methods"])
    write_report(report, tmp_path)
    assert ("bfloat16, fast pass attention `eager`, linear layers unpadded; exact pass exact forwards (attention in "
            "float64") in (tmp_path / "report.md").read_text()


def test_float32_cpu_target_decodes_on_the_linear_layout_measured_faster(smollm2_tokenizer, tmp_path, monkeypatch):
    """Issue 13: the evaluator times a one-token forward with oneDNN-prepacked and plain linear layers
    before the plain pass and keeps the faster (plain and speculative decoding alike); the report says so
    and greedy decoding stays exact."""
    import specheads.decoding.cpu_linears as cpu_linears
    import specheads.evaluation.suite as suite
    from specheads.decoding.cpu_linears import can_pack, packed_count

    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=64, layers=2, seed=1)
    if not can_pack(model):
        pytest.fail("this torch build has no oneDNN: the CPU evaluation path under test is missing")
    target = Target(model, smollm2_tokenizer, name="tiny-f32")
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "coding"][:2])
    monkeypatch.setattr(cpu_linears, "_one_token_seconds",
                        lambda runner, token, reps: 0.004 if any(
                            getattr(m, "use_packed", False) for m in runner.model.modules()) else 0.005)
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=0, chat=0)
    report = evaluate(target, EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=3))], spec,
                                         max_new_tokens=10, temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    assert report["cpu_linears"]["linears"] == "packed" and packed_count(model) > 0
    assert report["cpu_linears"]["one_token_ms"] == {"packed": 4.0, "plain": 5.0}
    assert all(m["lossless"]["exact"] for m in report["methods"])
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "linear layers packed (one-token forward measured here 4.0 ms" in md
    ex = report["exact_forward"]  # float32 decodes with exact forwards too, proven on this machine
    assert ex["attention"] == "specheads_exact" and ex["proven"] and ex["proof"]["unequal"] == 0
    size, context = ex["proof"]["cases"][-1][1], ex["proof"]["cases"][-1][0]
    assert (f"proof: {ex['proof']['nodes']} of {ex['proof']['nodes']} nodes of random draft trees (trees of up to "
            f"{max(size, 8)} nodes at contexts of up to {context} tokens") in md


def test_paired_timing_survives_a_machine_that_slows_down(target, tmp_path, monkeypatch):
    """Issue 13: the same head measured 2.00x, then 0.93x, against plain passes timed minutes before it
    on a machine whose speed drifts. Paired timing decodes each prompt plainly right before decoding it
    speculatively; here every decode after the plain passes runs 30x slower, which divides the unpaired
    ratio by ~30 and leaves the paired one where it was."""
    import specheads.evaluation.suite as suite

    real_load, real_gen = suite.load_benchmarks, suite.speculative_generate
    state = {"slow": False, "calls": []}

    def drifting(runner, drafter, prompts, max_new_tokens, temperature=0.0, *a, **k):
        state["slow"] |= drafter is not None  # from the drafter's warm-up on, the machine is 30x slower
        res = real_gen(runner, drafter, prompts, max_new_tokens, temperature, *a, **k)
        if state["slow"]:
            res.wall_time = res.prefill_time + 30 * (res.wall_time - res.prefill_time)
        state["calls"].append((getattr(drafter, "name", None), max_new_tokens, tuple(prompts[0])))
        return res

    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real_load(s) if p.domain == "coding"][:2])
    monkeypatch.setattr(suite, "speculative_generate", drifting)
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=0, chat=0)
    ratios = {}
    for paired in (True, False):
        state.update(slow=False, calls=[])
        cfg = EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=3))], spec, max_new_tokens=10,
                         temperatures=(0.0,), batch_sizes=(1,), repeats=2, paired=paired)
        report = evaluate(target, cfg)
        row = report["methods"][0]["by_temperature"]["0.0"]["all"]
        ratios[paired] = row["speedup"]
        assert report["paired"] is paired and row["speedup_range"][0] <= row["speedup"] <= row["speedup_range"][1]
        if paired:
            timed_calls = [c for c in state["calls"] if c[1] == 10]
            first_method = next(i for i, c in enumerate(timed_calls) if c[0] == "ngram")
            method_calls = timed_calls[first_method - 1:]
            assert len(method_calls) == 2 * 2 * 2  # 2 passes x 2 prompts x (plain, speculative)
            for plain_call, spec_call in zip(method_calls[::2], method_calls[1::2]):
                assert plain_call[0] is None and spec_call[0] == "ngram" and plain_call[2] == spec_call[2]
            assert row["paired_plain_tokens_per_s"] is not None
            write_report(report, tmp_path)
            assert "paired: in each of 2 timed pass(es)" in (tmp_path / "report.md").read_text()
    assert ratios[True] > 5 * ratios[False]


def _dflash_dir(target, root, agree: bool = False):
    """A saved DFlash head (B = 4) for ``target``; ``agree``: its norm zeroed, so it always drafts what the LM head
    prefers for a zero state (pair it with ``_constant_target``)."""
    from specheads.models.dflash import DFlashConfig, DFlashModel

    torch.manual_seed(0)
    m = DFlashModel(DFlashConfig.from_target(target, num_layers=1, block_size=4, aux_layers=(0, 1)))
    if agree:
        with torch.no_grad():
            m.norm.weight.zero_()
    m.save_pretrained(root / "head")
    (root / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.3}))
    return root


def _constant_target(target, token: int = 100) -> Target:
    """``target`` whose final norm is zeroed and whose LM head gains a bias toward ``token``: it always emits it,
    and so does a DFlash head with its norm zeroed (it reads the same LM head), so every draft is accepted."""
    import copy

    model = copy.deepcopy(target.model)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[token] = 5.0
        model.model.norm.weight.zero_()
    model.lm_head = head
    return Target(model, target.tokenizer, name="tiny-constant")


@pytest.fixture(scope="module")
def dflash_dir(target, tmp_path_factory):
    return _dflash_dir(target, tmp_path_factory.mktemp("dflash"))


@pytest.mark.parametrize("agree", [False, True])
def test_evaluate_a_dflash_head_beside_the_baselines(target, tmp_path, monkeypatch, agree):
    """head_method=dflash: the block as a chain of B-1 and a tree of per-slot candidates, lossless, α per block
    position (depths 1..B-1), τ and speed-ups like any head, beside a baseline; B read from the head's config.
    A random head (never accepted) and one that always agrees with its (constant) target."""
    import specheads.evaluation.suite as suite

    if agree:
        target = _constant_target(target)
    dflash_dir = _dflash_dir(target, tmp_path / "dflash", agree)

    methods = plan_methods("dflash", str(dflash_dir), ["ngram"], chain_k=3,
                           tree=TreeShape("dynamic", depth=5, topk=2, total_tokens=8))
    assert [(m.name, m.shape.label()) for m in methods] == [
        ("dflash-chain3", "chain3"), ("dflash-tree", "tree(d3,k2,n8)"), ("ngram-chain3", "chain3")]
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:3])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=9, temperatures=(0.0, 1.0), batch_sizes=(1, 3),
                                         batch_prompts=3, repeats=1))
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["batch"]["3"]["matches_batch1_plain"], m["name"]
        row = m["by_temperature"]["0.0"]["all"]
        assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"]) and "speedup" in row
    chain, tree = report["methods"][:2]
    assert chain["drafter"] == "dflash" and chain["train_tau"] == 1.3
    row = chain["by_temperature"]["0.0"]["all"]
    assert row["draft_forwards_per_step"] == 1.0  # the whole block in one forward
    assert len(tree["by_temperature"]["0.0"]["all"]["nodes_by_depth"]) == 3
    if agree:  # one α per drafted block slot; each step emits the block and the bonus (9 = 4 + 4 + 1)
        assert row["alpha_by_position"] == [1.0, 1.0, 1.0] and row["tau"] == 3.0
        assert chain["by_temperature"]["1.0"]["all"]["alpha_by_position"][:2] == [1.0, 1.0]
    else:
        assert row["alpha_by_position"] == [0.0] and row["tau"] == 1.0
    paths = write_report(report, tmp_path / "report")
    assert "dflash-chain3" in (tmp_path / "report" / "report.md").read_text()


def test_head_kind_is_read_from_the_head_config(dflash_dir, head_dirs, tmp_path):
    from specheads.errors import UserError
    from specheads.evaluation.suite import check_head_kind, head_model_type

    assert head_model_type(str(dflash_dir)) == "specheads_dflash"
    with pytest.raises(UserError, match=r"another family \(dflash"):
        check_head_kind("eagle3", str(dflash_dir))
    with pytest.raises(UserError, match=r"another family \(eagle1"):
        plan_methods("dflash", str(head_dirs / "eagle1"), [])
    # head_shape=auto (the main job's setting) leaves a DFlash head its chain and tree
    assert [m.name for m in plan_methods("dflash", str(dflash_dir), [], head_shape="auto")] == \
        [m.name for m in plan_methods("dflash", str(dflash_dir), [])] == ["dflash-chain3", "dflash-tree"]


def test_the_exact_proof_is_scoped_to_what_the_evaluation_verifies(target, tmp_path, monkeypatch):
    """The proof's scope is the evaluation's own: the largest draft of any method (pending token, tree, prompt-lookup
    branch and its continuation), the largest batch and the longest context (turn 2 counts turn 1's answer), and
    the report's proof lists those cases."""
    import specheads.evaluation.suite as suite
    from specheads.evaluation.suite import draft_rows, proof_scope

    assert draft_rows(MethodSpec("n", "ngram", TreeShape("chain", k=3))) == 4
    assert draft_rows(MethodSpec("t", "early_exit", TreeShape("dynamic", depth=5, topk=4, total_tokens=24),
                                 ngram_branch=4, ngram_extend=1, ngram_extend_len=2)) == 1 + 24 + 4 + 2
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "coding"][:2])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=0, chat=0)
    cfg = EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=5))], spec, max_new_tokens=10,
                     temperatures=(0.0,), batch_sizes=(1, 3), repeats=1)
    prompts = suite.load_benchmarks(spec)
    scope = proof_scope(cfg, prompts, target)
    first = len(suite.encode(prompts[0], target.tokenizer, {}, {}))
    assert scope.size == 6 and scope.batch == 3 and scope.context > first + 10
    cfg.exact_forward = "on"
    report = evaluate(target, cfg)
    assert report["exact_forward"]["proof"]["cases"][-1] == [scope.context, 6]
    assert report["exact_forward"]["proof"]["batch"] == 3 and report["exact_forward"]["proof"]["batch_nodes"] > 0
