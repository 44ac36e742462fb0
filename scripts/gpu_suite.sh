#!/usr/bin/env bash
# The GPU checks and benchmarks in one command that fits a borrowed GPU's time (on the machines this project
# borrows, a command may run 10 minutes and 15 in all, start-up included). Run from the repository root:
#
#   bash scripts/gpu_wheels.sh                      # first, here: .gpu-wheels/ (carry it to the GPU machine)
#   bash scripts/gpu_suite.sh                       # there: every part below, in this order
#   bash scripts/gpu_suite.sh evaluate_t1 pipeline linear_ce checkpoint train_8b   # only these (a second command, if time is left)
#   bash scripts/gpu_suite.sh --cpu-smoke           # here, without a GPU: every part on tiny shapes (CI runs it)
#
# Its Python: PYTHON if set; else .venv/bin/python where it has torch, else python3. On the GPU machine, when that
# Python lacks what the benchmarks import (datasets, accelerate, Hydra, specheads itself), the carried wheels are installed first into
# .gpu-venv over it (scripts/gpu_pipeline.sh --install-only) and every part runs there. Fifteen minutes hold the first
# three parts in one command (check, train, evaluate); the rest fit a second.
#
# Parts, each under its own time cap (a part the rest of the budget cannot hold is skipped, and said so):
#   check       scripts/gpu_check.sh: the kernels against their references, the GPU tests, the engine check
#   train       bench_train.py at shape:llama-3.2-1b: EAGLE-3, DFlash, Medusa-1 and Medusa-2 as `specheads train`
#               runs them (bfloat16 autocast on a GPU): tokens/s, peak GPU memory, TFLOP/s and share of the GPU's peak
#   evaluate    bench_evaluate.py at shape:llama-3.2-1b: a step's draft / forward / verify / rest for batches of
#               1, 8, 64 and trees of 8, 24, 64 nodes, kernels on and off, batched vs row by row vs one row at a time
#   evaluate_t1 the same sampled at T = 1 (batches of 1 and 8): each row verified by the exact walk or the fused call
#   pipeline    scripts/gpu_pipeline.sh: every stage through the specheads command on CUDA, a CPU fallback failing
#   linear_ce   bench_linear_ce.py: Medusa-1's five heads at a 128k vocabulary, whole logits vs the chunked loss
#   checkpoint  bench_checkpoint.py: how long a checkpoint of five 128k-vocabulary heads stalls training
#   train_8b    bench_train.py at shape:llama-3.1-8b: EAGLE-3 and DFlash
#
# Each part's output goes to $OUT/<part>.log (OUT: the device tool's folder; default a temporary one); the JSON
# reports ($OUT/eval_1b.json, eval_1b_t1.json, train_1b.json, train_8b.json) are what `specheads record FILE --checkout .` takes back here.
# GPU_SUITE_BUDGET (seconds; default 540 on a GPU, 1500 for the smoke, which must run every part) bounds the whole
# run. Exit status: 0 every part ran and passed; 1 a part failed; 3 nothing failed but a part was skipped or could
# not run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/gpu_python.sh  # PY
OUT_DIR=${OUT:-$(mktemp -d -t gpu_suite.XXXXXX)}
mkdir -p "$OUT_DIR"
SMOKE=0
PARTS=()
for a in "$@"; do
  case $a in
    --cpu-smoke) SMOKE=1 ;;
    check|evaluate|evaluate_t1|train|linear_ce|checkpoint|pipeline|train_8b) PARTS+=("$a") ;;
    *) echo "gpu_suite.sh: unknown part '$a' (parts: check train evaluate evaluate_t1 pipeline linear_ce checkpoint"\
         "train_8b; or --cpu-smoke)"; exit 2 ;;
  esac
done
((${#PARTS[@]})) || PARTS=(check train evaluate evaluate_t1 pipeline linear_ce checkpoint train_8b)
PIPELINE_ENV=()
start=$SECONDS
if ((SMOKE)); then
  BUDGET=${GPU_SUITE_BUDGET:-1500}
  DEV=(--device cpu)
  TARGET=tiny
else
  BUDGET=${GPU_SUITE_BUDGET:-540}
  if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_suite.sh: no CUDA GPU here ($PY); run it on the GPU machine, or with --cpu-smoke"
    exit 3
  fi
  DEV=(--device cuda)
  TARGET=shape:llama-3.2-1b
  # specheads installed (its kernels are shipped as specheads.kernels: the working tree alone lacks them)
  if [[ -z ${PYTHON:-} ]] && ! "$PY" -c "import datasets, accelerate, hydra, specheads.kernels" 2>/dev/null; then
    echo "== install: the carried wheels into .gpu-venv over $PY (scripts/gpu_pipeline.sh --install-only)"
    if ! PYTHON=$PY OUT="$OUT_DIR/install" bash scripts/gpu_pipeline.sh --install-only; then
      echo "gpu_suite.sh: the install failed (above; $OUT_DIR/install): nothing else can run"
      exit 3
    fi
    PY=$ROOT/.gpu-venv/bin/python
    PIPELINE_ENV=(GPU_PIPELINE_TOKENIZER="$ROOT/.gpu-venv/smollm2-tokenizer")
  fi
fi
echo "gpu_suite.sh: $("$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)') ($PY); budget ${BUDGET} s; parts: ${PARTS[*]}; output in $OUT_DIR"
git -C "$ROOT" rev-parse HEAD 2>/dev/null | sed 's/^/commit /'
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

declare -A RESULT
run_part() {  # run_part NAME CAP_SECONDS MIN_SECONDS COMMAND...: the command under timeout min(cap, budget left)
  local name=$1 cap=$2 least=$3
  shift 3
  local left=$((BUDGET - (SECONDS - start)))
  local t=$((cap < left ? cap : left))
  if ((t < least)); then
    echo "== $name: SKIPPED, ${left} s of the budget left (needs ${least})"
    RESULT[$name]=skipped
    return
  fi
  echo "== $name (at most ${t} s): $*"
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT_DIR/$name.log"
  case $rc in
    0) RESULT[$name]=ok ;;
    3) RESULT[$name]=incomplete ;;
    124) RESULT[$name]=timed-out ;;
    *) RESULT[$name]="failed (exit $rc)" ;;
  esac
  echo "== $name: ${RESULT[$name]} in $((SECONDS - t0)) s"
}

for part in "${PARTS[@]}"; do
  case $part in
    check)
      if ((SMOKE)); then
        run_part check 300 60 env OUT="$OUT_DIR/gpu_check" PYTHON="$PY" bash scripts/gpu_check.sh --cpu-smoke
      else
        run_part check 300 120 env OUT="$OUT_DIR/gpu_check" PYTHON="$PY" GPU_CHECK_TIMEOUT=200 GPU_TESTS_TIMEOUT=90 \
          ENGINE_CHECK_TIMEOUT=60 bash scripts/gpu_check.sh
      fi ;;
    evaluate)
      if ((SMOKE)); then
        run_part evaluate 120 20 "$PY" scripts/bench/bench_evaluate.py --target tiny "${DEV[@]}" --batch 1 4 --nodes 8 \
          --new-tokens 8 --prompt-len 32 --draft-vocab 500 --json "$OUT_DIR/eval_1b.json"
      else
        run_part evaluate 150 60 "$PY" scripts/bench/bench_evaluate.py --target "$TARGET" "${DEV[@]}" \
          --json "$OUT_DIR/eval_1b.json"
      fi ;;
    evaluate_t1)
      if ((SMOKE)); then
        run_part evaluate_t1 120 20 "$PY" scripts/bench/bench_evaluate.py --target tiny "${DEV[@]}" --batch 1 4 --nodes 8 \
          --new-tokens 8 --prompt-len 32 --draft-vocab 500 --temperature 1 --json "$OUT_DIR/eval_1b_t1.json"
      else
        run_part evaluate_t1 120 45 "$PY" scripts/bench/bench_evaluate.py --target "$TARGET" "${DEV[@]}" --batch 1 8 \
          --nodes 8 24 --temperature 1 --json "$OUT_DIR/eval_1b_t1.json"
      fi ;;
    train)
      if ((SMOKE)); then
        run_part train 180 30 "$PY" scripts/bench/bench_train.py --target tiny "${DEV[@]}" --methods eagle3 dflash medusa1 medusa2 \
          --steps 2 --warmup 1 --max-tokens 512 --arg "eagle3:vocab_data={prepared}" --json "$OUT_DIR/train_1b.json"
      else
        run_part train 240 90 "$PY" scripts/bench/bench_train.py --target "$TARGET" "${DEV[@]}" \
          --methods eagle3 dflash medusa1 medusa2 --steps 6 --warmup 2 --max-tokens 8192 --arg "eagle3:vocab_data={prepared}" \
          --json "$OUT_DIR/train_1b.json"
      fi ;;
    train_8b)
      if ((SMOKE)); then
        run_part train_8b 120 20 "$PY" scripts/bench/bench_train.py --target tiny "${DEV[@]}" --methods eagle3 dflash \
          --steps 1 --warmup 1 --max-tokens 256 --arg "eagle3:vocab_data={prepared}" --json "$OUT_DIR/train_8b.json"
      else
        run_part train_8b 240 120 "$PY" scripts/bench/bench_train.py --target shape:llama-3.1-8b "${DEV[@]}" \
          --methods eagle3 dflash --steps 4 --warmup 2 --max-tokens 8192 --arg "eagle3:vocab_data={prepared}" \
          --json "$OUT_DIR/train_8b.json"
      fi ;;
    linear_ce)
      if ((SMOKE)); then
        run_part linear_ce 60 10 "$PY" scripts/bench/bench_linear_ce.py --hidden 64 --vocab 1000 --tokens 256 --heads 2
      else
        run_part linear_ce 90 30 "$PY" scripts/bench/bench_linear_ce.py "${DEV[@]}" --heads 5 --mixed-precision bf16
      fi ;;
    checkpoint)
      if ((SMOKE)); then
        run_part checkpoint 60 10 "$PY" scripts/bench/bench_checkpoint.py --hidden 64 --vocab 1000 --saves 1
      else
        run_part checkpoint 120 40 "$PY" scripts/bench/bench_checkpoint.py "${DEV[@]}" --heads 5 --saves 1
      fi ;;
    pipeline)  # in this run's Python (installed above where needed): gpu_pipeline.sh installs nothing more
      if ((SMOKE)); then
        run_part pipeline 400 120 env PYTHON="$PY" OUT="$OUT_DIR/pipeline" bash scripts/gpu_pipeline.sh --cpu-smoke --in-venv
      else
        run_part pipeline 460 240 env PYTHON="$PY" OUT="$OUT_DIR/pipeline" ${PIPELINE_ENV[@]+"${PIPELINE_ENV[@]}"} \
          bash scripts/gpu_pipeline.sh --in-venv
      fi ;;
  esac
done

status=0
echo
echo "gpu_suite.sh: $((SECONDS - start)) s"
for part in "${PARTS[@]}"; do
  r=${RESULT[$part]:-skipped}
  echo "  $part: $r"
  case $r in
    ok) ;;
    skipped|incomplete) ((status == 0)) && status=3 ;;
    *) status=1 ;;
  esac
done
exit $status
