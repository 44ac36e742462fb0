"""Exact forwards under every instruction set the tests can force on this CPU: PyTorch's dispatch held to AVX2 or
AVX-512, oneDNN's to AVX2, AVX-512 or AVX-512 with bfloat16 (each a cap: a CPU without the set runs the best it
has), float32 and bfloat16 models wide enough for the kernels that move with the row count. In each, the measured
row floor makes every node of random draft trees bitwise what one-token forwards give (``exact.prove_exact``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_tiny_model
from specheads.decoding.exact import make_exact, prove_exact, tree_vs_sequential
out = {{"capability": torch.backends.cpu.get_cpu_capability()}}
for name in ("float32", "bfloat16"):
    model = make_tiny_model("llama", hidden=768, layers=2, heads=4, kv_heads=2, dtype=getattr(torch, name))
    make_exact(model, "auto")
    record = prove_exact(model)
    check = tree_vs_sequential(model, contexts=(40, 150), sizes=(3, 6, 12))
    out[name] = {{"floor": record["row_floor"], "proven": record["proven"], **check}}
print(json.dumps(out))
"""

ISAS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "SPECHEADS_CPU_BF16": "0"},
        "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
        "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


@pytest.mark.parametrize("isa", list(ISAS))
def test_exact_forwards_hold_under_each_forced_instruction_set(isa):
    env = {**os.environ, **ISAS[isa], "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("float32", "bfloat16"):
        r = out[name]
        assert r["proven"] and r["nodes"] == 42 and r["unequal"] == 0, (isa, out)
