"""Serve lines: per method and engine, the draft settings the evaluation recommends for GPU serving, and
exports (cards, specheads_export.json) that name no path of the exporting machine."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from specheads.evaluation.recommend import recommend
from specheads.export import export_head, load_eval_report
from specheads.export.serve import FOLDER_PLACEHOLDER, ServeParams, exported_lines, serve_commands, serve_params
from tests.export.test_export import DV, make_head, save_head, target  # noqa: F401 (a fixture)

CHAIN, TREE = ServeParams(3, 3, 1, 4, "x"), ServeParams(4, 4, 2, 10, "x")


@pytest.mark.parametrize("method,engine,expected", [
    ("eagle3", "vllm", """vllm serve org/t --speculative-config '{"method": "eagle3", "model": "acme/h", """
                       """"num_speculative_tokens": 3}'"""),
    ("eagle3", "speculators", """vllm serve org/t --speculative-config '{"method": "eagle3", "model": "acme/h", """
                              """"num_speculative_tokens": 3}'"""),
    ("eagle1", "vllm", """vllm serve org/t --speculative-config '{"method": "eagle", "model": "acme/h", """
                       """"num_speculative_tokens": 3}'"""),
    ("medusa", "vllm", """vllm serve org/t --speculative-config '{"method": "medusa", "model": "acme/h", """
                       """"num_speculative_tokens": 3}'"""),
    ("dflash", "vllm", """vllm serve org/t --speculative-config '{"method": "dflash", "model": "acme/h", """
                       """"num_speculative_tokens": 3}'"""),
    ("eagle3", "sglang", "python -m sglang.launch_server --model-path org/t --speculative-algorithm EAGLE3 "
                         "--speculative-draft-model-path acme/h --speculative-num-steps 3 --speculative-eagle-topk 1 "
                         "--speculative-num-draft-tokens 4"),
    ("eagle1", "sglang", "python -m sglang.launch_server --model-path org/t --speculative-algorithm EAGLE "
                         "--speculative-draft-model-path acme/h --speculative-num-steps 3 --speculative-eagle-topk 1 "
                         "--speculative-num-draft-tokens 4"),
    ("dflash", "sglang", "python -m sglang.launch_server --model-path org/t --speculative-algorithm DFLASH "
                         "--speculative-draft-model-path acme/h --speculative-num-draft-tokens 4"),
])
def test_serve_lines_per_method_and_engine(method, engine, expected):
    assert serve_commands(method, engine, "org/t", "acme/h", CHAIN)["shell"] == expected


def test_serve_lines_medusa_sglang_tgi_and_adapted_target():
    none = serve_commands("medusa", "sglang", "org/t", "acme/h", CHAIN)["shell"]
    assert none.startswith("# SGLang: no Medusa support") and "launch_server" not in none
    tgi = serve_commands("medusa", "medusa", "org/t", "acme/h", CHAIN)
    assert tgi["tgi"].startswith("text-generation-launcher --model-id acme/h ")
    adapted = serve_commands("medusa", "vllm", "org/t", "./m2", CHAIN, adapted="target")
    assert adapted["shell"].startswith("vllm serve ./m2/target --speculative-config")  # the adapted target is served
    tree = serve_commands("eagle3", "sglang", "$TARGET", "acme/h", TREE)["shell"]
    assert "--model-path $TARGET " in tree and tree.endswith("--speculative-num-steps 4 --speculative-eagle-topk 2 "
                                                              "--speculative-num-draft-tokens 10")
    assert serve_commands("eagle3", "vllm", "$TARGET", "x", CHAIN)["python"].startswith("LLM(model=TARGET, ")


def _measured(steps, accepted, nodes, tau):
    return {"tested": nodes, "accepted": accepted, "nodes_by_depth": [n * steps for n in nodes],
            "target_forwards": steps, "target_time_s": 1.0, "tau": tau, "alpha": 0.5, "cost_ratio_c": 0.1,
            "draft_forwards_per_step": float(len(nodes)), "alpha_by_position": [0.5]}


def write_report(path: Path, sglang_row: bool = True, drafter: str = "eagle3") -> Path:
    """An evaluate report.json with the recommendation ``recommend`` computes from its rows: the chain of 3 and
    the tree of depth 3 accept nothing at depth 3, so the GPU recommendation is depth 2."""
    chain = _measured(10, [8, 5, 0], [1, 1, 1], 2.3)
    tree = _measured(10, [9, 5, 0], [4, 3, 2], 2.4)
    methods = [{"name": f"{drafter}-vllm", "drafter": drafter, "profile": "vllm", "shape": "chain3", "c_gpu": 0.01,
                "by_temperature": {"0.0": {"all": chain, "code": chain}, "1.0": {"all": chain}}}]
    if sglang_row:
        methods.append({"name": f"{drafter}-sglang", "drafter": drafter, "profile": "sglang",
                        "shape": "tree(d3,k2,n9)", "c_gpu": 0.01, "by_temperature": {"0.0": {"all": tree}}})
    report = {"plain": {"all": {"target_forwards": 20, "target_time_s": 1.0}}, "methods": methods}
    report["recommendation"] = recommend(report)
    path.write_text(json.dumps(report))
    return path


def test_recommended_settings_are_read_from_the_report(tmp_path):
    rows = load_eval_report(write_report(tmp_path / "r.json"), "eagle3")
    assert rows[0]["recommendation"]["best_k_gpu"] == 2  # recommend's own choice, not the measured 3
    vllm = serve_params("eagle3", {}, "vllm", rows)
    assert (vllm.tokens, vllm.steps, vllm.topk, vllm.draft_tokens) == (2, 2, 1, 3)
    assert "recommended for GPU serving" in vllm.source and "eagle3-vllm (chain3, T=0.0, all)" in vllm.source
    sgl = serve_params("eagle3", {}, "sglang", rows)  # depth 2 of the tree: 4 + 3 nodes per step on average
    assert (sgl.steps, sgl.topk, sgl.draft_tokens) == (2, 2, 8)
    assert serve_params("eagle3", {}, "speculators", rows).tokens == 2  # served by vLLM
    assert serve_params("eagle3", {}, "vllm", rows, spec_tokens=5).tokens == 5  # spec_tokens wins
    # No SGLang tree measured: SGLang drafts the vLLM row's recommended chain, and says so.
    only_chain = load_eval_report(write_report(tmp_path / "c.json", sglang_row=False), "eagle3")
    sgl = serve_params("eagle3", {}, "sglang", only_chain)
    assert (sgl.steps, sgl.topk, sgl.draft_tokens) == (2, 1, 3) and "measured no SGLang tree" in sgl.source
    # A report without a recommendation (older evaluate): the measured shape; no report: evaluate's defaults.
    old = json.loads((tmp_path / "r.json").read_text())
    del old["recommendation"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    old_rows = load_eval_report(tmp_path / "old.json", "eagle3")
    assert serve_params("eagle3", {}, "vllm", old_rows).tokens == 3
    assert serve_params("eagle3", {}, "sglang", old_rows).draft_tokens == 10
    assert (serve_params("eagle3", {}, "sglang", None).steps, serve_params("medusa", {"num_heads": 2}, "vllm",
                                                                           None).tokens) == (5, 2)
    # DFlash: its chain row's recommendation, within the trained block.
    dflash = load_eval_report(write_report(tmp_path / "d.json", sglang_row=False, drafter="dflash"), "dflash")
    for r in dflash:
        r["profile"], r["name"], r["shape"] = None, "dflash-chain3", "chain3"
    assert serve_params("dflash", {"block_size": 4}, "vllm", dflash).tokens == 2
    assert serve_params("dflash", {"block_size": 4}, "sglang", dflash).draft_tokens == 3
    assert serve_params("dflash", {"block_size": 4}, "vllm", None).tokens == 3


def test_exports_name_no_path_of_the_exporting_machine(target, target_dir, tmp_path, tmp_path_factory):
    """Cards and specheads_export.json name the draft by a placeholder (or the Hub repo when pushed) and the
    head relative to the export folder; the commands use the report's recommendation."""
    run = tmp_path / "run"
    head = save_head(make_head("eagle3", target), run / "train" / "eagle3")
    prepared = run / "prepared"
    prepared.mkdir(parents=True)
    (prepared / "specheads_meta.json").write_text(json.dumps({"target": str(target_dir), "num_samples": 3,
                                                              "source": {"path": "sharegpt"}}))
    report = write_report(tmp_path / "report.json")
    out = export_head(head, run / "export" / "eagle3", "all", str(target_dir), eval_report=report,
                      data=str(prepared))
    machine = str(tmp_path_factory.getbasetemp())  # holds tmp_path and the target folder
    for engine in ("vllm", "sglang", "speculators"):
        card = (out / engine / "README.md").read_text()
        prov_text = (out / engine / "specheads_export.json").read_text()
        assert machine not in card and machine not in prov_text, engine
        prov = json.loads(prov_text)
        assert (out / engine / prov["head_dir"]).resolve() == head.resolve()
        assert prov["head_sha256"] == hashlib.sha256((head / "model.safetensors").read_bytes()).hexdigest()
        assert FOLDER_PLACEHOLDER in card and "$TARGET" in card
    vllm = (out / "vllm" / "README.md").read_text()
    assert ('--speculative-config \'{"method": "eagle3", "model": "<path-or-repo-id-of-this-folder>", '
            '"num_speculative_tokens": 2}\'') in vllm and "recommended for GPU serving" in vllm
    assert "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 8" in \
        (out / "sglang" / "README.md").read_text()
    # What `specheads export` / `specheads run` print: the same settings, naming the folders as they are here.
    lines = exported_lines(out)
    assert lines[0].startswith("TARGET=/path/to/the/target/model   # REPLACE")
    assert (f"""vllm serve $TARGET --speculative-config '{{"method": "eagle3", "model": "{out / 'vllm'}", """
            """"num_speculative_tokens": 2}'""") in lines
    assert (f"python -m sglang.launch_server --model-path $TARGET --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {out / 'sglang'} --speculative-num-steps 2 --speculative-eagle-topk 2 "
            "--speculative-num-draft-tokens 8") in lines
    here = exported_lines(out, target_here=str(target_dir))
    assert not here[0].startswith("TARGET=") and f"vllm serve {target_dir} --speculative-config" in "\n".join(here)


def test_medusa_export_lines_say_sglang_has_none(target, target_dir, tmp_path):
    out = export_head(save_head(make_head("medusa", target), tmp_path), tmp_path / "out", "all", str(target_dir),
                      target_id="org/tiny")
    lines = exported_lines(out)
    assert lines[-1].startswith("# SGLang: no Medusa support") and not any("launch_server" in x for x in lines)
    assert sum(x.startswith("vllm serve org/tiny ") for x in lines) == 2  # the vllm and medusa layouts
    assert any(x.startswith("text-generation-launcher --model-id ") for x in lines)
    assert "# SGLang: no Medusa support" in (out / "vllm" / "README.md").read_text()
