#!/usr/bin/env bash
# The GPU side of the instrument in one command: one CUDA GPU, under 8 minutes, nothing to carry but
# the working tree (no venv: the GPU machine's own Python with torch and triton; transformers for the
# end-to-end part; pytest for the repo's GPU tests; no datasets, Hydra or DeepSpeed needed).
#
#   bash scripts/gpu_check.sh                # on the GPU machine: at most 320 + 140 s (timeouts)
#   bash scripts/gpu_check.sh --cpu-smoke    # without a GPU: the same logic on tiny shapes, kernels in
#                                            # the Triton interpreter (about 2 minutes on 2 cores)
#
# 1. scripts/gpu_check.py: kernel decisions vs the references (V 32k/128k, trees of 8-64 nodes, batch
#    1-64), kernel vs reference timings, and the evaluator end to end with kernels on vs off (same
#    tokens, same α), and the freed target layers' GPU memory; prints the figures table, writes $OUT/gpu_check.{json,md} when OUT is set.
# 2. the repo's GPU tests: pytest -m gpu over tests/kernels, tests/decoding/test_gpu.py, tests/methods/test_ttt.py and test_dflash.py (skipped
#    without CUDA, so the smoke run only proves they are collected and reachable).
# 3. scripts/engine_collect_check.py: collection's states captured in vLLM against the transformers forward on the
#    device (the CPU in the smoke run), and both backends' tokens/s; where no python with vLLM is found, not run.
#
# Exit status: 0 everything ran and matched; 1 a mismatch, a failing GPU test or a crash; 3 nothing
# failed but something could not run (a missing package, no CUDA without --cpu-smoke).
# Environment: PYTHON (interpreter; default .venv/bin/python when it has torch, else python3),
# OUT (where figures go; default a temporary folder), GPU_CHECK_TIMEOUT / GPU_TESTS_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/gpu_python.sh  # PY
OUT_DIR=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$OUT_DIR"
# scripts/ for gpu_check (also the pytest plugin that maps kernels/ to specheads.kernels when specheads
# is not installed), the repository root for specheads itself.
export PYTHONPATH="$ROOT/scripts:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SMOKE=0
for a in "$@"; do [[ $a == --cpu-smoke ]] && SMOKE=1; done
if (( SMOKE )); then export TRITON_INTERPRET=1; fi
echo "gpu_check.sh: python $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY), figures in $OUT_DIR"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

timeout "${GPU_CHECK_TIMEOUT:-320}" "$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@"
rc=$?
if (( rc == 124 )); then echo "gpu_check.py: TIMED OUT"; rc=1; fi

echo
echo "== GPU tests (pytest -m gpu)"
if "$PY" -c "import pytest" 2>/dev/null; then
  # no plugin auto-loading: whatever else the machine has installed stays out of the run; so pyproject's addopts,
  # which name pytest-xdist's options, are cleared (-o addopts=): pytest would refuse them without the plugin
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${GPU_TESTS_TIMEOUT:-140}" "$PY" -m pytest -o addopts= -p gpu_check \
    -p no:cacheprovider -m gpu -q -rs \
    tests/kernels/test_verify_kernels.py tests/decoding/test_gpu.py tests/methods/test_ttt.py tests/methods/test_dflash.py 2>&1 | tee "$OUT_DIR/gpu_tests.log"
  trc=${PIPESTATUS[0]}
  case $trc in
    0) ;;
    5) echo "GPU tests: none collected"; trc=3 ;;
    124) echo "GPU tests: TIMED OUT"; trc=1 ;;
    *) trc=1 ;;
  esac
else
  echo "GPU tests: pytest is not installed on this machine, not run"
  trc=3
fi

echo
echo "== collection through vLLM against the transformers forward (scripts/engine_collect_check.py)"
# runs where a python with vLLM is found (this one, or the engine venv scripts/setup_engine.sh makes); a machine
# without vLLM says so and the rest of the check stands
timeout "${ENGINE_CHECK_TIMEOUT:-300}" "$PY" scripts/engine_collect_check.py $( ((SMOKE)) && echo --device cpu ) \
  2>&1 | tee "$OUT_DIR/engine_collect_check.log"
erc=${PIPESTATUS[0]}
case $erc in
  0) ;;
  3) echo "engine collection check: no vLLM on this machine, not run"; erc=0 ;;
  124) echo "engine collection check: TIMED OUT"; erc=1 ;;
  *) erc=1 ;;
esac

status=0
if (( rc == 1 || trc == 1 || erc == 1 )); then status=1
elif (( rc != 0 || trc != 0 )); then status=3; fi
echo
echo "gpu_check.sh: checks exit $rc, GPU tests exit $trc, engine collection exit $erc -> $( ((status == 0)) && echo "ALL MATCH" || ( ((status == 1)) && echo "FAILED" || echo "INCOMPLETE" ))"
exit $status
