"""Launch helpers and evidence readers for the multi-process tests (CPU, gloo, ``accelerate launch``).

Every test here starts real processes through the real entry point, as a user does:

    accelerate launch --config_file conf/launcher/cpu_ddp.yaml --num_processes 2 recipes/train.py method=... \\
        target.name_or_path=<tiny Llama folder> prepared_dir=<prepared folder> output_dir=<run>

on a tiny Llama target (hidden 32, 4 layers, vocab 256, a word-level tokenizer) saved as a local
model folder, and a tiny prepared set (every row the same length, so per-token means over any split
of the rows are equal: see test_equivalence.py). A launch is costly on a 2-core machine (each process
imports torch, transformers and datasets: ~10-20 s of CPU), so each launch is a module-scoped fixture
that several tests read evidence from (world size, per-rank files, partitions, the saved head).

Launches use ``OMP_NUM_THREADS=1``, ``WANDB_MODE=disabled`` and ``DS_ACCELERATOR=cpu``, and run with
the run folder's parent as working directory (Hydra writes its ``train.log`` there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "train.py"
LAUNCHERS = REPO / "conf" / "launcher"
ENTRY = Path(__file__).with_name("train_entry.py")  # recipes/train.py plus test-only knobs (sleep, no grad sync)

VOCAB, HIDDEN, LAYERS = 256, 32, 4
ROW_LEN, PROMPT = 24, 4  # every row: 24 tokens, the first 4 not counted (loss_mask 0)
NUM_ROWS = 37  # 36 training rows (the evaluator's held-out chat row is always moved out) = 4 x 9
PER_RANK_BATCH = 9  # b: 2 processes x 9 rows x grad_accum 2 = one optimizer step = one epoch
LAUNCH_TIMEOUT = 900  # s; a launch takes ~20-60 s on an idle 2-core machine, far more when it is shared


# --------------------------------------------------------------------------- assets


def equal_length_rows(n: int = NUM_ROWS, seed: int = 0) -> dict[str, list]:
    """Arithmetic progressions mod VOCAB (stride 1-3), all ROW_LEN tokens with the same loss mask, so every
    micro-batch of k rows counts exactly k * (ROW_LEN - PROMPT) labels. Ids sort in row order."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for i in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids.append([(start + (1 + i % 3) * j) % VOCAB for j in range(ROW_LEN)])
    return {"id": [f"r{i:03d}" for i in range(n)], "input_ids": ids,
            "loss_mask": [[0] * PROMPT + [1] * (ROW_LEN - PROMPT)] * n, "domain": ["synthetic"] * n}


@dataclass(frozen=True)
class Assets:
    """A tiny Llama model folder (with a tokenizer) and a prepared set tokenized 'by' it."""

    model_dir: Path
    prepared_dir: Path


# --------------------------------------------------------------------------- launching

METHOD_ARGS = {  # the smallest settings of each method that still exercise its whole loss
    "medusa1": ["method.num_heads=2"],
    "medusa2": ["method.num_heads=2", "method.lora_r=4", "method.lora_alpha=8"],
    "eagle1": ["method.eval_steps=2"],
    "eagle3": ["method.ttt_steps=2"],
    "dflash": ["method.block_size=4", "method.anchors=4"],
    "dspark": ["method.block_size=4", "method.anchors=4"],
    "peagle": ["method.num_depths=3"],
}


# The equivalence runs (test_equivalence.py, test_resume.py): no held-out split (every row but the
# evaluator's held-out chat row trains: 36 = 2 processes x 9 rows x grad_accum 2, so one optimizer step is
# one whole epoch on any number of processes), a learning rate that moves the weights in 6 steps.
EQUIV_STEPS = 6
EQUIV_ARGS = ["data.eval_samples=0", "train.grad_accum=2", f"train.max_steps={EQUIV_STEPS}", "train.save_every=2",
              "train.keep_checkpoints=0", "optim.lr=1e-2", "optim.warmup_steps=0"]


def train_args(assets: Assets, out: Path, method: str, *extra: str) -> list[str]:
    """Hydra overrides of recipes/train.py for a tiny run (later entries of ``extra`` win)."""
    return [f"method={method}", *METHOD_ARGS[method], f"target.name_or_path={assets.model_dir}",
            "target.dtype=float32", f"prepared_dir={assets.prepared_dir}", f"output_dir={out}",
            "data.max_tokens=null", f"data.batch_size={PER_RANK_BATCH}", "data.eval_samples=4",
            "train.max_steps=3", "train.save_every=3", "train.eval_every=0", "train.log_every=1",
            "train.mixed_precision=no", "train.progress=false", "train.measure_prompts=1",
            "train.measure_tokens=8", "optim.warmup_steps=0", "wandb.mode=disabled", *extra]


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None) if not torch.cuda.is_available() else None
    env.update(extra)
    return env


def accelerate_cmd(config: str, num_processes: int, script: Path, args: list[str]) -> list[str]:
    """``accelerate launch --config_file conf/launcher/<config> --num_processes N <script> <args>``."""
    exe = Path(sys.executable).with_name("accelerate")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    if exe.exists():
        head.append("launch")
    return head + ["--config_file", str(LAUNCHERS / config), "--num_processes", str(num_processes), str(script), *args]


@dataclass
class Run:
    out: Path
    cmd: list[str]
    returncode: int
    log: str
    seconds: float

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "train_summary.json").read_text())

    def metrics(self) -> list[dict]:
        return [json.loads(ln) for ln in (self.out / "metrics.jsonl").read_text().splitlines() if ln.strip()]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.metrics() if "loss" in r}

    def head_state(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.out / "head" / "model.safetensors"))

    def check(self) -> "Run":
        assert self.returncode == 0, f"{' '.join(self.cmd)}\nexit {self.returncode}; output tail:\n{self.log[-6000:]}"
        return self


def run_cmd(cmd: list[str], out: Path, env: dict | None = None, timeout: float = LAUNCH_TIMEOUT) -> Run:
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=out.parent, env=env or launch_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return Run(out, cmd, proc.returncode, proc.stdout, time.time() - t0)


def launch(config: str, out: Path, args: list[str], num_processes: int = 2, script: Path = RECIPE,
           env: dict | None = None) -> Run:
    return run_cmd(accelerate_cmd(config, num_processes, script, args), out, env)


def single_process(out: Path, args: list[str], env: dict | None = None) -> Run:
    """``python recipes/train.py ...``: the one-process entry point."""
    return run_cmd([sys.executable, str(RECIPE), *args], out, env)


# --------------------------------------------------------------------------- evidence


def zero_files(ckpt: Path) -> dict[str, list[Path]]:
    """DeepSpeed files of an accelerate checkpoint folder (``save_state`` puts them in ``pytorch_model/``)."""
    ds = ckpt / "pytorch_model"
    return {"optim": sorted(ds.glob("*zero_pp_rank_*_optim_states.pt")),
            "model": sorted(ds.glob("*model_states.pt"))}


def zero_partitions(ckpt: Path) -> list[dict]:
    """Per rank: numel of its fp32 master partition and of its Adam moments, read from the per-rank
    ``*_optim_states.pt`` files each rank wrote itself."""
    out = []
    for f in zero_files(ckpt)["optim"]:
        sd = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        stage = int(sd["zero_stage"])
        fp32 = sd["single_partition_of_fp32_groups"] if stage <= 2 else sd["fp32_flat_groups"]
        base = sd["optimizer_state_dict"] if stage == 3 else sd["base_optimizer_state"]
        moments = sum(int(v.numel()) for st in base["state"].values() for k, v in st.items()
                      if k in ("exp_avg", "exp_avg_sq"))
        out.append({"file": f.name, "stage": stage, "fp32_numel": sum(int(t.numel()) for t in fp32),
                    "moments_numel": moments})
    return out


def gathered_fp32(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full fp32 parameters consolidated from the per-rank ZeRO files (DeepSpeed's own zero_to_fp32),
    named as in the trained module (``TrainingModule.model``'s names, ``model.`` prefix stripped)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}


def trainable_numel(run: Run) -> int:
    """Trainable parameters of the run's module, from DeepSpeed's model-states file (its param_shapes)."""
    files = zero_files(run.out / "checkpoints" / final_ckpt_name(run))["model"]
    ms = torch.load(files[0], map_location="cpu", weights_only=False)
    return sum(int(torch.Size(s).numel()) for group in ms["param_shapes"] for s in group.values())


def final_ckpt_name(run: Run) -> str:
    return f"step_{run.summary['steps']:07d}"


def assert_world_of_two(run: Run) -> None:
    """World size 2 from every angle: the summary (rank 0's Accelerator), a per-rank RNG file that each rank
    writes into every checkpoint, the data split (tokens counted over both ranks) and the ranks' log lines."""
    s = run.summary
    assert s["num_processes"] == 2, s
    ckpt = run.out / "checkpoints" / final_ckpt_name(run)
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    # Each rank logs the recipe's data split once: two processes, two lines.
    moved = "row(s) of the evaluator's chat slice left out of training and held-out rows"
    assert run.log.count(moved) == 2, run.log[-3000:]


def assert_rank0_writes_once(run: Run, steps: int) -> None:
    """One run folder for all ranks; metrics.jsonl holds each step once (a second writer would repeat it)."""
    steps_logged = [r["step"] for r in run.metrics() if "loss" in r]
    assert steps_logged == list(range(1, steps + 1)), steps_logged
    assert (run.out / "train_summary.json").is_file() and (run.out / "head" / "config.json").is_file()
    assert sorted(p.name for p in run.out.iterdir()) == ["checkpoints", "head", "metrics.jsonl", "train_summary.json"]
    assert not (run.out.parent / "train.log").exists()  # no rank writes a log file beside the run (Hydra's default)
    assert run.log.count('"final_loss"') == 1  # the main process alone prints the summary
