import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_helpers import sources
from specheads.models.medusa import MedusaHeads
from specheads.methods import build_method
from specheads.training.batches import prepare_batch
from specheads.training.config import NonFiniteLossError, OptimConfig, TrainConfig
from specheads.errors import ConfigError
from specheads.training.engine import train
from specheads.acceptance_math import chain_tau
from specheads.training.heldout import estimate_tau, summarize_counts
from specheads.training.run_log import read_losses
from specheads.methods.medusa import Medusa1Method
from specheads.methods.base import FeatureSpec

HELPER = Path(__file__).with_name("engine_helpers.py")


def _cfg(out, **kw):
    base = dict(output_dir=str(out), max_steps=12, save_every=6, eval_every=6, wandb_mode="disabled",
                progress=False, log_every=1)
    return TrainConfig(**{**base, **kw})


def _tiny():
    from tests.conftest import make_tiny_target

    return make_tiny_target("llama", hidden=32, layers=2, vocab=256)


def test_medusa1_trains_and_writes_head_summary_and_metrics(tmp_path):
    train_src, held = sources()
    s = train(Medusa1Method(num_heads=3), _tiny(), train_src, _cfg(tmp_path), OptimConfig(lr=3e-2), held)
    losses = read_losses(tmp_path)
    assert sorted(losses) == list(range(1, 13))
    assert sum(losses[s] for s in (10, 11, 12)) < 0.85 * sum(losses[s] for s in (1, 2, 3))
    ev = s["eval"]
    assert {"head0_top1_acc", "head2_top5_acc", "chain2_acc", "tau_estimate"} <= set(ev)
    assert s["tau_estimate"] == pytest.approx(1 + ev["chain0_acc"] + ev["chain1_acc"] + ev["chain2_acc"])
    assert "conditional" in s["tau_basis"]
    assert json.loads((tmp_path / "train_summary.json").read_text())["steps"] == 12
    assert MedusaHeads.from_pretrained(tmp_path / "head").config.num_heads == 3
    evals = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval/head0_top1_acc" in ln]
    assert [e["step"] for e in evals] == [6]  # the periodic hook (the final one is in the summary)


def test_same_seed_gives_bitwise_equal_losses(tmp_path):
    runs = []
    for name in ("a", "b"):
        train_src, held = sources()
        train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(tmp_path / name, max_steps=5), None, None)
        runs.append(read_losses(tmp_path / name))
    assert runs[0] == runs[1]


def test_background_checkpoints_hold_what_synchronous_ones_hold_and_resume_alike(tmp_path):
    from test_checkpoint import _files_equal

    for mode in ("always", "never"):
        for steps in (6, 9):  # 6 steps, then the same run resumed from its step 6 to step 9
            train_src, _ = sources()
            train(Medusa1Method(num_heads=2), _tiny(), train_src,
                  _cfg(tmp_path / mode, max_steps=steps, save_every=2, keep_checkpoints=0, async_checkpoint=mode))
    ckpts = [p.name for p in (tmp_path / "always" / "checkpoints").iterdir()]
    assert sorted(ckpts) == ["step_0000002", "step_0000004", "step_0000006", "step_0000008", "step_0000009"]
    for name in ckpts:
        _files_equal(tmp_path / "always" / "checkpoints" / name, tmp_path / "never" / "checkpoints" / name,
                     clock=("train_s",))
    assert read_losses(tmp_path / "always") == read_losses(tmp_path / "never")


def _frozen_method(name):
    """Medusa-1 with frozen LM-head copies, or Medusa-2 (LoRA on the frozen target): most weights are frozen."""
    kw = {"medusa1": dict(num_heads=2, train_lm_heads=False), "medusa2": dict(num_heads=2, lora_r=4)}[name]
    return build_method(name, **kw)


class _Interrupted(Exception):
    pass


class _StopAfter:
    """Yields the inner source's first ``n`` batches, then stops the run (as a kill would, minus the process)."""

    def __init__(self, inner, n):
        self.inner, self.left = inner, n

    def batches(self, epoch, start=0):
        for b in self.inner.batches(epoch, start):
            if self.left == 0:
                raise _Interrupted
            self.left -= 1
            yield b


def _run(out, name, stop_after=None):
    """Six steps with a checkpoint every two; ``stop_after`` steps, the run stops there (after its checkpoint)."""
    train_src, _ = sources()
    cfg = _cfg(out, max_steps=6, save_every=2, eval_every=0, keep_checkpoints=0)
    if stop_after is None:
        return train(_frozen_method(name), _tiny(), train_src, cfg)
    with pytest.raises(_Interrupted):
        train(_frozen_method(name), _tiny(), _StopAfter(train_src, stop_after * cfg.grad_accum), cfg)


def _module_bytes_and_keys(name):
    """(bytes of the whole module's state dict, names of its trained parameters) as the engine builds it."""
    from specheads.methods.base import TrainingModule

    method = _frozen_method(name)
    module = TrainingModule(method, method.build(_tiny()), _tiny())
    state = module.state_dict()
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    return sum(v.numel() * v.element_size() for v in state.values()), trained, set(state) - trained


@pytest.mark.parametrize("written", ["now", "before"])  # before: the whole state dict, as checkpoints were written
@pytest.mark.parametrize("name", ["medusa1", "medusa2"])
def test_checkpoints_hold_only_trained_weights_and_resume_bit_for_bit(tmp_path, monkeypatch, name, written):
    """A checkpoint leaves the frozen weights out (the build makes them again); resuming from it, or from one
    written the old way with every frozen copy, reaches the uninterrupted run's losses, weights and Adam state."""
    import specheads.training.checkpoint as ckpt
    from safetensors import safe_open
    from test_checkpoint import _files_equal

    _run(tmp_path / "ref", name)
    with monkeypatch.context() as m:
        if written == "before":
            m.setattr(ckpt, "saved_state", lambda model, state: state)
            m.setattr(ckpt, "frozen_fingerprints", lambda acc: None)
        _run(tmp_path / "run", name, stop_after=4)
    _run(tmp_path / "run", name)  # resumes from step 4
    assert json.loads((tmp_path / "run" / "train_summary.json").read_text())["resumed_from"].endswith("step_0000004")
    assert read_losses(tmp_path / "run") == read_losses(tmp_path / "ref")  # floats compared exactly
    ref, run = tmp_path / "ref" / "checkpoints", tmp_path / "run" / "checkpoints"
    _files_equal(ref / "step_0000006", run / "step_0000006", clock=("train_s",))  # weights and optimizer, bit for bit

    full, trained, frozen = _module_bytes_and_keys(name)
    model_file = run / "step_0000004" / "model.safetensors"
    with safe_open(str(model_file), framework="pt") as f:
        held = set(f.keys())
    if written == "before":
        assert frozen <= held  # the old checkpoint held the frozen copies ...
        return
    assert held == trained and not held & frozen  # ... the new one the trained weights only
    share = model_file.stat().st_size / full
    assert share < {"medusa1": 0.15, "medusa2": 0.5}[name], share
    fingerprints = json.loads((run / "step_0000004" / "frozen.json").read_text())["model.safetensors"]
    assert set(fingerprints) == frozen


def test_a_failed_background_checkpoint_stops_training_with_its_error(tmp_path, monkeypatch):
    import specheads.training.checkpoint as ckpt
    from specheads.training.checkpoint import CheckpointError

    def broken(path, obj, safetensors):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt, "_write_file", broken)
    train_src, _ = sources()
    with pytest.raises(CheckpointError, match="step_0000002 failed in the background: OSError"):
        train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(tmp_path, save_every=2, async_checkpoint="always"))
    assert max(read_losses(tmp_path)) <= 4  # raised at the step after the write failed, or at the next save
    assert not (tmp_path / "head").exists()


class _PoisonAt:
    """Yields the inner batches but puts NaN features in batch ``at`` (0-based)."""

    def __init__(self, inner, at):
        self.inner, self.at = inner, at

    def batches(self, epoch, start=0):
        for i, b in enumerate(self.inner.batches(epoch, start), start):
            b = b() if callable(b) else b
            if epoch == 0 and i == self.at:
                b = dict(b, hidden_last=torch.full((*b["input_ids"].shape, 32), float("nan")))
            yield b


def test_non_finite_loss_stops_naming_the_step_without_saving(tmp_path):
    train_src, _ = sources()
    with pytest.raises(NonFiniteLossError, match="at step 3 "):
        train(Medusa1Method(num_heads=2), _tiny(), _PoisonAt(train_src, 2), _cfg(tmp_path), None, None)
    assert not (tmp_path / "head").exists()
    assert not (tmp_path / "checkpoints").exists()


def test_offline_features_are_used_and_online_ones_match_the_target():
    target = _tiny()
    train_src, _ = sources()
    batch = next(iter(train_src.batches(0)))()
    spec = FeatureSpec(need_last=True)
    online = prepare_batch(batch, target, spec, "cpu")
    feats = target.forward_features(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(online["hidden_last"][real], feats.last[real])
    stored = dict(batch, hidden_last=torch.ones(*batch["input_ids"].shape, 32, dtype=torch.float16))
    offline = prepare_batch(stored, target, spec, "cpu")
    assert offline["hidden_last"].dtype == torch.float32 and bool((offline["hidden_last"] == 1).all())


def test_tau_estimate_and_count_summaries():
    m = summarize_counts({"head0_top1_correct": 3, "head0_top1_total": 4, "kl_sum": 1.0, "kl_count": 4, "x": 2})
    assert m == {"head0_top1_acc": 0.75, "kl": 0.25, "x": 2}
    assert chain_tau([0.5, 0.25], "joint") == 1.75
    assert chain_tau([0.5, 0.5], "marginal") == 1.75
    tau, basis = estimate_tau({"step0_top1_acc": 0.8, "step1_top1_acc": 0.5})
    assert tau == pytest.approx(1 + 0.8 + 0.4) and "marginal" in basis
    assert estimate_tau({"loss": 1.0})[0] is None


def test_method_registry_errors_are_clear():
    assert build_method("medusa1", num_heads=2).num_heads == 2
    with pytest.raises(ValueError, match="unknown method 'medusa9'"):
        build_method("medusa9")
    with pytest.raises(TypeError, match="bad settings for method 'medusa1'"):
        build_method("medusa1", num_headz=2)


def _child(out, steps, sleep, async_checkpoint="auto"):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.Popen([sys.executable, str(HELPER), str(out), str(steps), str(sleep), async_checkpoint], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow  # three fresh Python processes (~30-90 s on a loaded 2-core machine)
def test_sigkill_then_resume_gives_bitwise_equal_losses(tmp_path):
    """The killed and resumed runs write their checkpoints in the background, the reference synchronously."""
    ref = _child(tmp_path / "ref", 10, 0.0, "never")
    victim = _child(tmp_path / "run", 10, 0.12, "always")
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000004"
    deadline = time.time() + 120
    while not (ckpt / "manifest.json").exists():
        assert victim.poll() is None and time.time() < deadline, victim.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    time.sleep(0.3)  # land somewhere inside a later step
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "train_summary.json").exists()
    resumed = _child(tmp_path / "run", 10, 0.0, "always")
    assert resumed.wait(timeout=120) == 0, resumed.stderr.read().decode()[-2000:]
    assert ref.wait(timeout=120) == 0, ref.stderr.read().decode()[-2000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["resumed_from"] is not None
    got, want = read_losses(tmp_path / "run"), read_losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 11))
    assert got == want  # floats compared exactly
    assert all(math.isfinite(v) for v in got.values())


@pytest.mark.slow
def test_two_cpu_processes_under_torchrun(tmp_path):
    """Data sharded over 2 gloo processes, losses reduced, checkpoint with both RNG states (written in the
    background: rank 1's part before rank 0 publishes), ragged eval."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29541", str(HELPER), str(tmp_path), "4", "0", "always"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 4
    from specheads.acceptance_math import estimate_tau

    assert summary["eval"]["tau_estimate"] == pytest.approx(estimate_tau(summary["eval"])[0])  # ragged eval reduced
    ckpt = tmp_path / "checkpoints" / "step_0000004"
    assert (ckpt / "random_states_0.pkl").exists() and (ckpt / "random_states_1.pkl").exists()
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= set(manifest)


def test_time_budget_stops_early_and_still_saves_the_head(tmp_path):
    train_src, held = sources()
    s = train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(tmp_path, max_steps=500, max_minutes=0.002),
              OptimConfig(lr=3e-2), held)
    assert 0 < s["steps"] < 500, "the budget (0.12 s) must stop the run long before 500 steps"
    assert (tmp_path / "head").exists() and sorted(read_losses(tmp_path)) == list(range(1, s["steps"] + 1))
    # The LR decay followed the clock, not the 500 planned steps: the last step ran at the floor.
    lrs = [json.loads(ln)["lr"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"lr"' in ln]
    assert lrs[-1] == pytest.approx(3e-2 * OptimConfig().min_lr_ratio)


def test_summary_reports_anonymous_memory_apart_from_the_mapped_store(tmp_path):
    """peak_anon_mb: the largest RssAnon sampled at the log steps and at the end (ru_maxrss, in
    peak_rss_mb, also counts the pages of a memory-mapped feature store)."""
    from specheads.training.accelerator import rss_anon_mb

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t 9000 kB\nRssAnon:\t    2048 kB\nRssFile:\t 6952 kB\n")
    assert rss_anon_mb(str(status)) == 2.0
    status.write_text("Name:\tpython\n")
    assert rss_anon_mb(str(status)) is None and rss_anon_mb(str(tmp_path / "missing")) is None
    train_src, held = sources()
    out = tmp_path / "run"
    s = train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(out, max_steps=3, log_every=1), OptimConfig(), held)
    sampled = [json.loads(ln).get("rss_anon_mb") for ln in (out / "metrics.jsonl").read_text().splitlines()]
    sampled = [v for v in sampled if v is not None]
    if Path("/proc/self/status").exists():
        assert len(sampled) == 3 and s["peak_anon_mb"] >= max(sampled) > 0
        assert s["peak_anon_mb"] <= s["peak_rss_mb"] * 1.01
    else:
        assert s["peak_anon_mb"] is None and not sampled


def test_trim_heap_returns_the_c_heaps_free_pages(tmp_path):
    """Freed small blocks stay resident in glibc's heap (a live block above them pins its top) until
    trim_heap gives them back; elsewhere trim_heap says it did nothing."""
    import ctypes
    import ctypes.util

    from specheads.training.accelerator import rss_anon_mb, trim_heap

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "malloc_trim") or rss_anon_mb() is None:
        assert trim_heap() is False or rss_anon_mb() is None
        return
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(40_000):  # 2 KiB each (far below the mmap threshold): ~80 MiB of heap, touched
        b = libc.malloc(2048)
        ctypes.memset(b, 1, 2048)
        blocks.append(b)
    pin = libc.malloc(2048)
    for b in blocks:
        libc.free(b)
    held = rss_anon_mb()
    assert trim_heap() is True
    released = held - rss_anon_mb()
    libc.free(pin)
    assert released > 40, released


def test_training_trims_the_heap_every_n_steps_on_cpu(tmp_path, monkeypatch):
    import specheads.training.engine as engine

    calls = []
    monkeypatch.setattr(engine, "trim_heap", lambda: calls.append(1) or True)
    train_src, held = sources()
    train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(tmp_path / "a", max_steps=4), OptimConfig(), held)
    assert calls == []  # 0: never
    train(Medusa1Method(num_heads=2), _tiny(), train_src, _cfg(tmp_path / "b", max_steps=4, malloc_trim_every=2),
          OptimConfig(), held)
    assert len(calls) == 2
    with pytest.raises(ConfigError, match="malloc_trim_every"):
        _cfg(tmp_path / "c", malloc_trim_every=-1)
