#!/usr/bin/env bash
# Every stage of specheads on one CUDA GPU as a user calls it, failing on a silent CPU fallback
# (scripts/gpu_pipeline.py run: prepare, collect, train EAGLE-3 / DFlash / Medusa-2, evaluate, export, and
# accelerate launch with one process under FSDP, DeepSpeed ZeRO-2 and ZeRO-3; the gpu tests of
# tests/test_gpu_pipeline.py). Timeouts hold it under 8 minutes (7.5 at most); nothing is reached over the network.
#
#   bash scripts/gpu_wheels.sh                  # first, here: .gpu-wheels/bundle.tar.xz (about 52 MiB: carry it)
#   bash scripts/gpu_pipeline.sh                # on the GPU machine (its Python has torch, triton, transformers)
#   bash scripts/gpu_pipeline.sh --cpu-smoke    # the same on the CPU: a tiny target, FSDP left out (needs CUDA)
#   bash scripts/gpu_pipeline.sh --cpu-smoke --in-venv   # no install: PYTHON as it is (CI: the project's .venv)
#   bash scripts/gpu_pipeline.sh --install-only # the install below, then stop (scripts/gpu_suite.sh runs its parts
#                                               # in .gpu-venv, the tokenizer kept at .gpu-venv/smollm2-tokenizer)
#
# Install (unless --in-venv): a venv (.gpu-venv) over the machine's Python with --system-site-packages (its torch,
# triton and transformers), the bundle's wheels installed with pip --no-index (only what that Python lacks), then
# specheads from the working tree without dependencies. A part that cannot install is said in one line and only
# the stages needing it are skipped.
# Exit status: 0 every stage ran on the device and matched; 1 a stage failed or ran on the wrong device; 3 nothing
# failed but something could not run (no CUDA without --cpu-smoke, no bundle, a missing package).
# Environment: PYTHON (default python3, or .venv/bin/python with --in-venv), OUT (gpu_pipeline.{json,md} and logs;
# default a temporary folder), GPU_PIPELINE_BUDGET (seconds for the stages at most, default 360; less what the install
# took of 450), GPU_PIPELINE_STAGE_TIMEOUT
# (seconds per stage, default 150), GPU_WHEELS_DIR (default .gpu-wheels), GPU_PIPELINE_TOKENIZER (with --in-venv: a
# folder of SmolLM2's tokenizer files, instead of the installed asset package's).
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0 IN_VENV=0 INSTALL_ONLY=0
for a in "$@"; do
  case $a in
    --cpu-smoke) SMOKE=1 ;;
    --in-venv) IN_VENV=1 ;;
    --install-only) INSTALL_ONLY=1 ;;
    *) echo "gpu_pipeline.sh: unknown option $a (see --help)"; exit 2 ;;
  esac
done
OUT_DIR=${OUT:-$(mktemp -d -t gpu_pipeline.XXXXXX)}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WHEELS=${GPU_WHEELS_DIR:-.gpu-wheels}
t0=$(date +%s)
if (( IN_VENV )); then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
echo "gpu_pipeline.sh: python $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY), results in $OUT_DIR"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

incomplete=0
note() { echo "gpu_pipeline.sh: $*" | tee -a "$OUT_DIR/install.log"; }
TMP=$(mktemp -d -t gpu_pipeline_w.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
TOKENIZER=$TMP/assets/smollm2-tokenizer
if (( IN_VENV )); then
  RUN_PY=$PY
  if [[ -n ${GPU_PIPELINE_TOKENIZER:-} ]]; then
    TOKENIZER=$(cd "$GPU_PIPELINE_TOKENIZER" && pwd)
  else
    "$RUN_PY" scripts/gpu_pipeline.py assets --out "$TOKENIZER" > /dev/null || { note "no SmolLM2 tokenizer"; exit 3; }
  fi
else
  VENV=${GPU_PIPELINE_VENV:-.gpu-venv}
  rm -rf "$VENV"
  PIP=("$VENV/bin/python" -m pip)
  if ! "$PY" -m venv --system-site-packages "$VENV" >> "$OUT_DIR/install.log" 2>&1; then
    # a Python without ensurepip (Debian's without python3-venv): the venv without pip, filled by this Python's pip
    rm -rf "$VENV"
    "$PY" -m venv --system-site-packages --without-pip "$VENV" || { note "cannot make a venv with $PY"; exit 3; }
    PIP=("$PY" -m pip --python "$VENV/bin/python")
  fi
  RUN_PY=$VENV/bin/python
  if [[ $("$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)') == True ]]; then
    # PYTHON is itself a venv, whose packages --system-site-packages does not reach: a .pth file adds them
    # (after the new venv's own, so what the bundle installs comes first)
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
      > "$("$RUN_PY" -c 'import site; print(site.getsitepackages()[0])')/gpu_pipeline_base.pth"
  fi
  if [[ ! -f $WHEELS/bundle.tar.xz ]]; then
    note "no $WHEELS/bundle.tar.xz: run 'bash scripts/gpu_wheels.sh' where the network is and carry $WHEELS here"
    exit 3
  fi
  "$RUN_PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$WHEELS/bundle.tar.xz" "$TMP"
  have=$("$RUN_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  built=$(cat "$WHEELS/python-version" 2>/dev/null || echo unknown)
  if [[ $have != "$built" ]]; then
    note "the carried wheels are for CPython $built, this machine runs $have: run 'bash scripts/gpu_wheels.sh --python $have' and carry $WHEELS again"
    exit 3
  fi
  pipi() { timeout 100 "${PIP[@]}" install -q --no-index --find-links "$TMP/wheels" "$@" >> "$OUT_DIR/install.log" 2>&1; }
  # one part at a time: a part that cannot install leaves the others (and the stages that need only them) running
  pipi $("$RUN_PY" scripts/gpu_pipeline.py names core) || { note "the core wheels did not install (log: $OUT_DIR/install.log; its end below)"; tail -5 "$OUT_DIR/install.log"; exit 3; }
  pipi $("$RUN_PY" scripts/gpu_pipeline.py names deepspeed) || { note "DeepSpeed did not install: its launches are skipped"; incomplete=1; }
  pipi --no-deps $("$RUN_PY" scripts/gpu_pipeline.py names assets) || { note "the MT-bench/HumanEval files did not install"; exit 3; }
  pipi --no-deps --no-build-isolation "$ROOT" || { note "specheads did not install from $ROOT"; exit 3; }
  rm -rf "$ROOT/build"
  note "installed in $(( $(date +%s) - t0 )) s: $("$RUN_PY" -c 'import torch, transformers, datasets, hydra; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, datasets {datasets.__version__}")')"
  if (( INSTALL_ONLY )); then
    cp -r "$TOKENIZER" "$VENV/smollm2-tokenizer"
    note "install only: $RUN_PY, the tokenizer in $VENV/smollm2-tokenizer"
    exit $(( incomplete ? 3 : 0 ))
  fi
fi

[[ $RUN_PY == */* ]] && RUN_PY=$(cd "$(dirname "$RUN_PY")" && pwd)/$(basename "$RUN_PY") || RUN_PY=$(command -v "$RUN_PY")
# the stages get what is left of 450 s after the install (at most GPU_PIPELINE_BUDGET), and 30 s more to write up
BUDGET=$(( 450 - 30 - ($(date +%s) - t0) ))
(( BUDGET > ${GPU_PIPELINE_BUDGET:-360} )) && BUDGET=${GPU_PIPELINE_BUDGET:-360}
ARGS=(run --tokenizer "$TOKENIZER" --out "$OUT_DIR" --work "$TMP/run" --budget-s "$BUDGET"
      --stage-timeout "${GPU_PIPELINE_STAGE_TIMEOUT:-150}")
(( SMOKE )) && ARGS+=(--cpu-smoke)
# the stages run from a folder outside the checkout, so the installed specheads (not the working tree) is imported
(cd "$TMP" && timeout $(( BUDGET + 30 )) "$RUN_PY" "$ROOT/scripts/gpu_pipeline.py" "${ARGS[@]}") 2>&1 \
  | tee "$OUT_DIR/gpu_pipeline.log"
rc=${PIPESTATUS[0]}
case $rc in
  0|1|3) ;;
  124) echo "gpu_pipeline.py: TIMED OUT"; rc=1 ;;
  *) rc=1 ;;
esac
(( rc == 0 && incomplete )) && rc=3
ok="ALL ON THE GPU"; (( SMOKE )) && ok="ALL MATCH (CPU smoke)"
echo "gpu_pipeline.sh: $(( $(date +%s) - t0 )) s in all -> $( ((rc == 0)) && echo "$ok" || ( ((rc == 1)) && echo "FAILED" || echo "INCOMPLETE" ))"
exit $rc
