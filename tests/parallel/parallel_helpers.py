"""Fixtures for the split-target and multi-process tests: a tiny Llama folder, a prepared set, launchers.

Every launched process gets OMP_NUM_THREADS=1; every launch gets a free port of its own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, also for scripts run under torchrun

from tests.conftest import make_tiny_model  # noqa: E402

PYTHON = sys.executable
ACCELERATE = [PYTHON, "-m", "accelerate.commands.launch"]  # `accelerate launch`

# `accelerate launch` on a machine without GPUs: MULTI_GPU is what makes it start N processes through
# torchrun (MULTI_CPU / --cpu starts ONE process without RANK/WORLD_SIZE: measured with accelerate 1.15);
# without CUDA the processes then use gloo. Written per test so no user or default config leaks in.
CPU_LAUNCH_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
gpu_ids: all
mixed_precision: 'no'
rdzv_backend: static
same_network: true
main_training_function: main
downcast_bf16: 'no'
use_cpu: false
"""


def tiny_model_dir(root: Path, layers: int = 6, hidden: int = 64) -> Path:
    """A tiny random Llama (4 heads, 2 KV heads: splits over 2 ranks) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = root / "tiny-llama"
    make_tiny_model("llama", layers=layers, hidden=hidden, vocab=256).save_pretrained(path)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)},
                                                                              unk_token="w0")),
                                  unk_token="w0", eos_token="w1")
    tok.save_pretrained(path)
    return path


def progression_rows(n: int, vocab: int = 256, seed: int = 0) -> dict[str, list]:
    """Arithmetic progressions mod ``vocab`` (stride 1-3, 12-24 tokens; the first 4 unmasked)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    for i in range(n):
        start, length = int(torch.randint(0, vocab, (1,), generator=g)), int(torch.randint(12, 25, (1,), generator=g))
        rows["id"].append(f"s{i}")
        rows["input_ids"].append([(start + (1 + i % 3) * j) % vocab for j in range(length)])
        rows["loss_mask"].append([0] * 4 + [1] * (length - 4))
        rows["domain"].append("synthetic")
    return rows


def prepared_dir(root: Path, model_dir: Path, n: int = 40) -> Path:
    """A prepared folder 'tokenized by' the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    from specheads.data.prepare import write_prepared
    from specheads.targets import tokenizer_fingerprint

    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir))
    path = root / "prepared"
    write_prepared(progression_rows(n), {"target": str(model_dir), "tokenizer_fingerprint": fp, "max_length": 32}, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


def run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """A launcher in the background, its output to ``log``."""
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def wait_all(procs: list[tuple[subprocess.Popen, Path]], timeout: int = 240) -> list[str]:
    """Wait for background launchers; on a failure or timeout stop the others and show the logs."""
    outs, failed = [], False
    for p, log in procs:
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        failed |= rc != 0
    if failed:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for _, log in procs:
        outs.append(log.read_text())
    assert not failed, "\n\n".join(o[-4000:] for o in outs)
    return outs


def store_features(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample of a finished store by id (ids, mask, hidden states as float32)."""
    from specheads.data.features import FeatureDataset

    ds = FeatureDataset(root)
    return {item["id"]: item for item in (ds[i] for i in range(len(ds)))}


def shard_digests(root: Path) -> dict[str, str]:
    manifest = json.loads((root / "manifest.json").read_text())
    return {s["file"]: s["sha256"] for s in manifest["shards"]}
