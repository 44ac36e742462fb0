"""Exact forwards under every instruction set this CPU has: PyTorch's dispatch held to AVX2 or AVX-512, oneDNN's to
AVX2, AVX-512 or AVX-512 with bfloat16, float32 and bfloat16 models wide enough for the kernels that move with the row
count. In each, the measured row floor makes every node of random draft trees bitwise what one-token forwards give
(``exact.prove_exact``).

oneDNN's setting is a cap, but PyTorch's ``ATEN_CPU_CAPABILITY`` is an order it takes without looking at the CPU: a
set the CPU lacks dies of SIGILL. So a set is forced only where ``hardware.cpu_can_run`` finds its flags in
/proc/cpuinfo, and the skip reason names the flags missing (on an AVX2-only CPU the AVX-512 cases skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.hardware import cpu_can_run, cpu_flags

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
def test_exact_forwards_hold_under_each_forced_instruction_set(isa, tmp_path):
    runs, why = cpu_can_run(isa)
    if not runs:
        pytest.skip(why)
    # a cache of its own: the floors are measured under the forced set, none remembered from an earlier run
    env = {**os.environ, **ISAS[isa], "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "SPECHEADS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("float32", "bfloat16"):
        r = out[name]
        assert r["proven"] and r["nodes"] == 42 and r["unequal"] == 0, (isa, out)


# the flags line of a 2-core AMD EPYC with AVX2 only (no AVX-512), where forcing AVX-512 killed this test's process
AVX2_EPYC = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
             "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid "
             "tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
             "hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext "
             "invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 rdseed adx smap clflushopt "
             "clwb sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr arat npt nrip_save umip rdpid")


def test_an_avx2_only_cpu_forces_avx2_and_skips_each_avx512_set(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {AVX2_EPYC}\n\n"
                       f"processor\t: 1\nflags\t\t: {AVX2_EPYC}\n")
    flags = cpu_flags(str(cpuinfo))
    assert "avx2" in flags and "avx512f" not in flags
    assert cpu_can_run("avx2", flags) == (True, "")
    for isa in ("avx512", "avx512_bf16"):
        runs, why = cpu_can_run(isa, flags)
        assert not runs and "avx512f" in why and "SIGILL" in why, (isa, why)
    assert "avx512_bf16" in cpu_can_run("avx512_bf16", flags | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})[1]
    assert cpu_can_run("avx512", frozenset())[0] is False
    assert cpu_flags(str(tmp_path / "missing")) is None  # not Linux on x86: nothing is forced
