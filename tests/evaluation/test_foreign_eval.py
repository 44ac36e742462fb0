"""The evaluator on EAGLE-3 heads trained elsewhere (``head_dir`` in speculators', the original EAGLE-3 or ModelOpt's format):
the same tokens and acceptance as the specheads head they hold, where the head came from in the report, no
training-time figures, ``head_shape=auto`` refused; through the CLI, a bad folder refused before the target loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.decoding.drafters import TreeShape
from specheads.errors import ConfigError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.report import write_report
from specheads.evaluation.shape_choice import train_tau
from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate, head_source, plan_methods
from specheads.export import export_head
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.targets import Target
from tests.conftest import make_tiny_model
from tests.evaluation.test_suite import _constant_target
from tests.export.test_foreign import modelopt_folder
from tests.test_cli_errors import one_line, specheads

DV, TOKEN = 1000, 100


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    """A tiny target with the real tokenizer that always emits ``TOKEN`` (``_constant_target``)."""
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=4, seed=0)
    return _constant_target(Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab"), TOKEN)


def agreeing_head(target, aux=(3, 0, 1), **norms) -> Eagle3Model:
    """An EAGLE-3 head that always drafts ``TOKEN``: its final norm zeroed, all draft logits tie and draft id 0 wins,
    which the draft vocabulary maps to ``TOKEN``. norms: speculators' normalisation options."""
    torch.manual_seed(0)
    head = Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=aux, **norms))
    with torch.no_grad():
        head.norm.weight.zero_()
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[TOKEN:TOKEN + DV] = True
    head.set_draft_vocab(torch.full((DV,), TOKEN, dtype=torch.long), t2d)
    return head


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """{name: head_dir}: the specheads head (a train_summary.json beside it), and its speculators and vLLM exports
    with specheads_export.json removed, each in a folder whose parent holds a train_summary.json too; the same head
    (on layers ModelOpt can name: outputs of decoder layers) as ModelOpt exports it."""
    root = tmp_path_factory.mktemp("foreign")
    target.model.save_pretrained(root / "target")
    agreeing_head(target).save_pretrained(root / "train" / "head")
    out = {"ours": root / "train"}
    for engine in ("speculators", "vllm"):
        folder = export_head(root / "train" / "head", root / engine, engine, str(root / "target"))
        (folder / "specheads_export.json").unlink()
        (folder.parent / "train_summary.json").write_text(json.dumps({"tau_estimate": 9.9, "eval": {
            "measured_reach1": 0.9}}))
        out[engine] = folder
    (root / "train" / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.5}))
    out["modelopt"] = modelopt_folder(root / "modelopt", agreeing_head(target, aux=(1, 2, 3)))
    return out


def test_a_foreign_head_decodes_like_the_head_it_holds(target, heads, tmp_path, monkeypatch):
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    methods = [MethodSpec(name, "eagle3", TreeShape("chain", k=3), head_dir=str(path)) for name, path in heads.items()]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=9, temperatures=(0.0,), batch_sizes=(1,),
                                         repeats=1))
    rows = {m["name"]: m for m in report["methods"]}
    assert {n: m["head_source"] for n, m in rows.items()} == {"ours": "specheads", "speculators": "speculators",
                                                              "vllm": "eagle3", "modelopt": "modelopt"}
    assert {n: m["train_tau"] for n, m in rows.items()} == {"ours": 1.5, "speculators": None, "vllm": None,
                                                            "modelopt": None}
    figures = {}
    for name, m in rows.items():
        assert m["lossless"]["exact"], name
        r = m["by_temperature"]["0.0"]["all"]
        figures[name] = (r["tau"], r["alpha"], r["alpha_by_position"], r["new_tokens"], r["target_forwards"])
    assert figures["ours"] == figures["speculators"] == figures["vllm"] == figures["modelopt"]
    assert figures["ours"][2] == [1.0, 1.0, 1.0]  # every draft accepted: the acceptance compared is not zero
    md = (Path(write_report(report, tmp_path / "report")["markdown"])).read_text()
    assert "Head trained elsewhere: vLLM speculators' format" in md and "original EAGLE-3 / SpecForge format" in md
    assert "NVIDIA ModelOpt's EAGLE-3 export" in md and md.count("Head trained elsewhere") == 3


def test_a_speculators_folder_with_its_normalisations_decodes_losslessly(target, tmp_path, monkeypatch):
    """speculators' default normalisations (norm_before_residual, norm_before_fc, norm_output) on: the folder is read
    (no refusal), the head drafts with them, and the output is the target's own, every draft accepted."""
    import specheads.evaluation.suite as suite

    norms = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    target.model.save_pretrained(tmp_path / "target")
    agreeing_head(target, **norms).save_pretrained(tmp_path / "head")
    folder = export_head(tmp_path / "head", tmp_path / "spec", "speculators", str(tmp_path / "target"))
    (folder / "specheads_export.json").unlink()
    assert all(json.loads((folder / "config.json").read_text())[k] for k in norms)
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:1])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig([MethodSpec("spec", "eagle3", TreeShape("chain", k=3),
                                                     head_dir=str(folder))], spec, max_new_tokens=9,
                                         temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    (row,) = report["methods"]
    assert row["head_source"] == "speculators" and row["lossless"]["exact"]
    assert row["by_temperature"]["0.0"]["all"]["alpha_by_position"] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("options", [{"sliding_window": 3, "qk_norm": True}, {"sliding_window": 3}])
def test_a_speculators_folder_with_a_window_and_qwen3_layer_decodes_losslessly(options, target, tmp_path, monkeypatch):
    """speculators' default draft layer (a sliding window, here 3 positions, shorter than the prompts; Qwen3 q/k norms):
    the folder is read (no refusal), the drafter runs the window over its tree masks, and the output is the target's
    own, every draft accepted."""
    import specheads.evaluation.suite as suite

    target.model.save_pretrained(tmp_path / "target")
    agreeing_head(target, **options).save_pretrained(tmp_path / "head")
    folder = export_head(tmp_path / "head", tmp_path / "spec", "speculators", str(tmp_path / "target"))
    (folder / "specheads_export.json").unlink()
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert layer["sliding_window"] == 3 and layer["model_type"] == ("qwen3" if "qk_norm" in options else "llama")
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:1])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig([MethodSpec("spec", "eagle3", TreeShape("dynamic", depth=3, topk=2,
                                                                                total_tokens=6),
                                                     head_dir=str(folder))], spec, max_new_tokens=9,
                                         temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    (row,) = report["methods"]
    assert row["head_source"] == "speculators" and row["lossless"]["exact"]
    assert row["by_temperature"]["0.0"]["all"]["alpha_by_position"][0] == 1.0


def test_training_time_figures_are_absent_and_auto_shape_refused(heads):
    for name in ("speculators", "vllm", "modelopt"):
        assert train_tau(str(heads[name])) is None  # though a train_summary.json sits beside the folder
        with pytest.raises(ConfigError, match=r"head_shape=auto .* does not have \(a head trained elsewhere"):
            plan_methods("eagle3", str(heads[name]), [], head_shape="auto")
        assert [m.name for m in plan_methods("eagle3", str(heads[name]), [])] == ["eagle3-tree", "eagle3-sglang",
                                                                                 "eagle3-vllm"]
    assert head_source(str(heads["ours"])) == "specheads" and train_tau(str(heads["ours"])) == 1.5


# --------------------------------------------------------------------------- through `specheads evaluate`


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """A tiny Llama folder of 8 layers with a word-level tokenizer and chat template, and a speculators folder of an
    EAGLE-3 head for it trained on the default layers (no aux ids written)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("foreign_cli")
    model = make_tiny_model("llama", vocab=256, hidden=64, layers=8)
    model.save_pretrained(root / "tiny-llama")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    tok.save_pretrained(root / "tiny-llama")
    target = Target(model, tok, name="tiny")
    head = Eagle3Model(Eagle3Config.from_target(target, 64, aux_layers=(2, 4, 5)))
    head.set_draft_vocab(torch.zeros(64, dtype=torch.long), torch.arange(256) < 64)  # the first 64 ids
    head.save_pretrained(root / "train" / "head")
    folder = export_head(root / "train" / "head", root / "export", "speculators", str(root / "tiny-llama"))
    (folder / "specheads_export.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = None  # speculators' record of the default layers (2, N//2, N-3)
    (folder / "config.json").write_text(json.dumps(cfg))
    return {"head": folder, "target": [f"target.name_or_path={root / 'tiny-llama'}", "target.dtype=float32",
                                       "target.device=cpu"]}


def test_the_cli_refuses_a_foreign_head_before_loading_the_target(cli, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in cli["head"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["transformer_layer_config"]["vocab_size"] = 512
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "eval"
    line = one_line(specheads("evaluate", f"head_dir={bad}", *cli["target"], "eval=tiny", f"output_dir={out}",
                              cwd=tmp_path), "evaluate")
    assert str(bad) in line and "vLLM speculators' format" in line and "vocab_size 512 != target" in line
    assert not out.exists()
    line = one_line(specheads("evaluate", f"head_dir={cli['head']}", "head_shape=auto", *cli["target"],
                              f"output_dir={out}", cwd=tmp_path), "evaluate")
    assert "head_shape=auto" in line and "set head_shape=tree" in line and not out.exists()


@pytest.mark.slow
def test_the_cli_evaluates_a_speculators_folder(cli, tmp_path):
    out = tmp_path / "eval"
    proc = specheads("evaluate", f"head_dir={cli['head']}", *cli["target"], "eval=tiny", "eval.mtbench_per_category=0",
                     "temperatures=[0.0]", "batch_sizes=[1]", "baselines=[]", "serving.engines=[]",
                     f"output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    (row,) = report["methods"]
    assert row["name"] == "eagle3-tree" and row["head_source"] == "speculators" and row["train_tau"] is None
    assert row["lossless"]["exact"]
    assert "aux layers [2, 4, 5]" in proc.stdout + proc.stderr  # the default layers of an 8-layer target, logged first


# --------------------------------------------------------------------------- DFlash, Medusa, EAGLE-1 trained elsewhere


def agreeing_family_head(method: str, target):
    """A head of ``method`` that always drafts ``TOKEN`` on the constant target (whose final state is zero)."""
    torch.manual_seed(0)
    if method == "dflash":  # its norm zeroed: the target's LM head (biased to TOKEN) reads zeros
        from specheads.models.dflash import DFlashConfig, DFlashModel

        head = DFlashModel(DFlashConfig.from_target(target, num_layers=1, block_size=4, aux_layers=(1, 3)))
        with torch.no_grad():
            head.norm.weight.zero_()
        return head
    if method == "eagle1":  # every weight zero: its state is zero, the target's LM head reads it
        from specheads.models.eagle1 import Eagle1Config, Eagle1Model

        head = Eagle1Model(Eagle1Config.from_target(target))
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()
        return head
    from specheads.models.medusa import MedusaConfig, MedusaHeads  # x = 0: blocks give silu(1), LM heads row TOKEN

    head = MedusaHeads(MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=3,
                                    num_hidden_layers=1))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.zero_()
            if name.endswith("bias"):
                p.fill_(1.0)
            elif name.startswith("lm_heads"):
                p[TOKEN] = 1.0
    return head


@pytest.mark.parametrize("method,engines", [("dflash", ("vllm", "speculators")), ("medusa", ("medusa",)),
                                            ("eagle1", ("vllm", "sglang"))])
def test_other_families_decode_like_the_heads_they_hold(method, engines, target, tmp_path, monkeypatch):
    """Each family's exports with specheads_export.json removed: the same tokens, acceptance and target forwards as the
    specheads head, every draft accepted, head_source set, no training-time figures."""
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    target.model.save_pretrained(tmp_path / "target")
    agreeing_family_head(method, target).save_pretrained(tmp_path / "train" / "head")
    (tmp_path / "train" / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.5}))
    dirs = {"ours": tmp_path / "train"}
    for engine in engines:
        folder = export_head(tmp_path / "train" / "head", tmp_path / engine, engine, str(tmp_path / "target"))
        (folder / "specheads_export.json").unlink()
        dirs[engine] = folder
    shape = TreeShape("chain", k=3) if method != "medusa" else TreeShape("static", choices=((0,), (0, 0), (0, 0, 0)))
    methods = [MethodSpec(name, method, shape, head_dir=str(path)) for name, path in dirs.items()]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=9, temperatures=(0.0,), batch_sizes=(1,),
                                         repeats=1))
    rows = {m["name"]: m for m in report["methods"]}
    formats = {"vllm": "eagle1" if method == "eagle1" else "dflash", "sglang": "eagle1", "speculators": "speculators",
               "medusa": "medusa"}
    assert {n: m["head_source"] for n, m in rows.items()} == {"ours": "specheads", **{e: formats[e] for e in engines}}
    assert {n: m["train_tau"] for n, m in rows.items()} == {"ours": 1.5, **dict.fromkeys(engines)}
    figures = {}
    for name, m in rows.items():
        assert m["lossless"]["exact"], name
        r = m["by_temperature"]["0.0"]["all"]
        figures[name] = (r["tau"], r["alpha"], r["alpha_by_position"], r["new_tokens"], r["target_forwards"])
    assert all(f == figures["ours"] for f in figures.values()), figures
    assert figures["ours"][2] == [1.0, 1.0, 1.0]  # every draft accepted: the acceptance compared is not zero


# --------------------------------------------------------------------------- P-EAGLE and DSpark in speculators' format


def agreeing_parallel_head(method: str, target):
    """A P-EAGLE or DSpark head that always drafts ``TOKEN`` on the constant target: its final norm zeroed (P-EAGLE's
    draft id 0 maps to ``TOKEN``, as ``agreeing_head``'s; DSpark's Markov bias starts at zero and the target's LM head,
    biased to ``TOKEN``, reads zeros)."""
    torch.manual_seed(0)
    if method == "peagle":
        from specheads.models.peagle import PEagleConfig, PEagleModel

        head = PEagleModel(PEagleConfig.from_target(target, DV, aux_layers=(3, 0, 1), num_layers=2, num_depths=3))
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[TOKEN:TOKEN + DV] = True
        head.set_draft_vocab(torch.full((DV,), TOKEN, dtype=torch.long), t2d)
    else:
        from specheads.models.dspark import DSparkConfig, DSparkModel

        head = DSparkModel(DSparkConfig.from_target(target, num_layers=1, block_size=4, aux_layers=(1, 3),
                                                    markov_rank=8))
    with torch.no_grad():
        head.norm.weight.zero_()
    return head


@pytest.mark.parametrize("method", ["peagle", "dspark"])
def test_parallel_drafters_in_speculators_format_decode_like_the_heads_they_hold(method, target, tmp_path, monkeypatch):
    """The speculators export with specheads_export.json removed: the same tokens, acceptance and target forwards as
    the specheads head, every draft accepted, head_source speculators, no training-time figures, head_shape=auto
    refused and the chain read from the folder (P-EAGLE's K from speculative_tokens, DSpark's B from block_size)."""
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    target.model.save_pretrained(tmp_path / "target")
    agreeing_parallel_head(method, target).save_pretrained(tmp_path / "train" / "head")
    (tmp_path / "train" / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.5}))
    folder = export_head(tmp_path / "train" / "head", tmp_path / "speculators", "speculators", str(tmp_path / "target"))
    (folder / "specheads_export.json").unlink()
    dirs = {"ours": tmp_path / "train", "speculators": folder}
    planned = {n: [m.name for m in plan_methods(method, str(p), [], dspark_threshold=0.5)] for n, p in dirs.items()}
    assert planned["ours"] == planned["speculators"] == ({"peagle": ["peagle-chain3"],
                                                          "dspark": ["dspark-chain3", "dspark-sched0.5"]}[method])
    with pytest.raises(ConfigError, match=r"head_shape=auto .* does not have \(a head trained elsewhere"):
        plan_methods(method, str(folder), [], head_shape="auto")
    methods = [MethodSpec(name, method, TreeShape("chain", k=3), head_dir=str(path)) for name, path in dirs.items()]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=9, temperatures=(0.0,), batch_sizes=(1,),
                                         repeats=1))
    rows = {m["name"]: m for m in report["methods"]}
    assert {n: m["head_source"] for n, m in rows.items()} == {"ours": "specheads", "speculators": "speculators"}
    assert {n: m["train_tau"] for n, m in rows.items()} == {"ours": 1.5, "speculators": None}
    figures = {}
    for name, m in rows.items():
        assert m["lossless"]["exact"], name
        r = m["by_temperature"]["0.0"]["all"]
        figures[name] = (r["tau"], r["alpha"], r["alpha_by_position"], r["new_tokens"], r["target_forwards"])
    assert figures["ours"] == figures["speculators"]
    assert figures["ours"][2] == [1.0, 1.0, 1.0]  # every draft accepted: the acceptance compared is not zero
