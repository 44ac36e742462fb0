"""scripts/bench/bench_train.py measures what the CLI runs: its precision, device and dtype default to the CLI's
``auto`` (it once timed fp32 where `specheads train` trains bf16), and it reports TFLOP/s from the FLOP count."""

from __future__ import annotations

import pytest

from specheads.methods import build_method
from tests.conftest import load_script


def _bench():
    return load_script("scripts/bench/bench_train.py")


def test_defaults_are_the_clis():
    args = _bench().parse_args(["--methods", "eagle3"])
    assert (args.mixed_precision, args.device, args.dtype) == ("auto", "auto", "auto")


def test_a_run_trains_in_the_precision_the_clis_rule_picks_and_counts_its_flops(tmp_path, monkeypatch):
    import specheads.hardware as hardware

    asked = []

    def pick(requested, shapes=None, rows=2048, reps=2, probe=True):  # the CLI's rule, its answer fixed here
        asked.append((requested, bool(shapes), probe))
        return hardware.Choice("bf16", "test")

    monkeypatch.setattr(hardware, "choose_mixed_precision", pick)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    bench = _bench()
    prepared = str(bench.write_synthetic(tmp_path / "prepared", 1000))
    args = bench.parse_args(["--one", "medusa1", "--target", "tiny", "--prepared", prepared, "--steps", "2",
                             "--warmup", "1", "--max-tokens", "512", "--out", str(tmp_path / "out")])
    result = bench.run_one(args)
    assert asked == [("auto", True, True)]  # on a CPU: a probe of the head's layer shapes, as `specheads train`
    assert result["mixed_precision"] == "bf16" and result["device"] == "cpu" and result["share_of_peak"] is None
    assert result["trainable_params"] > 0
    per_token = bench.flops_per_token(bench.load_bench_target("tiny"), build_method("medusa1"), result["trainable_params"])
    assert result["tflops"] == pytest.approx(per_token * result["tokens_per_s"] / 1e12)


def test_the_json_report_is_a_train_bench_record(tmp_path):
    import json

    from specheads.record import Checkout, record

    bench = _bench()
    args = bench.parse_args(["--methods", "eagle3", "dflash", "--target", "shape:llama-3.2-1b"])
    row = {"method": "eagle3", "device": "NVIDIA H200", "tokens_per_s": 1.0, "share_of_peak": 0.5}
    bench.write_report(str(tmp_path / "t.json"), args, [row])
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps({"runs": []}))
    entry = record(tmp_path / "t.json", results, Checkout("1" * 40, True))
    assert json.loads(results.read_text())["train_benches"] == [entry]
    assert entry["machine"] == "NVIDIA H200" and entry["rows"] == [row] and entry["failed"] == ["dflash"]
    assert entry["commit"] == "1" * 40 and entry["dirty"] is True


def test_a_method_that_trains_the_target_counts_its_backward_and_reference_forward():
    from specheads.targets.shapes import forward_flops_per_token

    bench = _bench()
    target = bench.load_bench_target("tiny")
    fwd = forward_flops_per_token(target.config)
    assert bench.flops_per_token(target, build_method("medusa1"), 100) == fwd + 600
    assert bench.flops_per_token(target, build_method("medusa2"), 100) == 4 * fwd + 600  # KL: the original's too
    assert bench.flops_per_token(target, build_method("medusa2", target_loss="lm"), 100) == 3 * fwd + 600


@pytest.mark.parametrize("name", ["eagle3", "dflash", "eagle1"])
def test_heads_fed_from_the_targets_layers_count_their_flops_unbound(name):
    """The FLOP count reads the feature spec of a method built fresh (not bound to a target): EAGLE-3 and DFlash
    runs once failed there after their training had finished, and the suite still reported the part as ok."""
    from specheads.targets.shapes import forward_flops_per_token

    bench = _bench()
    target = bench.load_bench_target("tiny")
    assert bench.flops_per_token(target, build_method(name), 100) >= forward_flops_per_token(target.config) + 600


def test_a_failed_method_fails_the_run(tmp_path, monkeypatch, capsys):
    bench = _bench()
    row = {"method": "medusa1", "device": "cpu", "num_processes": 1, "tokens_per_s": 1.0, "tflops": 0.0,
           "peak_rss_mib_per_process": [1.0]}
    monkeypatch.setattr(bench, "_bench", lambda m, n, args, tmp: dict(row) if m == "medusa1" else None)
    monkeypatch.setattr(bench, "write_synthetic", lambda path, vocab: path)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--methods", "medusa1", "eagle3", "--target", "tiny", "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 1 and "FAILED: eagle3 x1" in capsys.readouterr().out
    bench.main(["--methods", "medusa1", "--target", "tiny"])  # all ran: no exit
