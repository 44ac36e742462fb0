#!/usr/bin/env bash
# Fetch here, with the network, what scripts/gpu_pipeline.sh installs offline on a GPU machine that has only
# torch, triton, transformers and pytest: .gpu-wheels/bundle.tar.xz (ignored by git; carry that folder there).
#
#   bash scripts/gpu_wheels.sh                 # for CPython 3.12, the python3 of the GPU machines this project borrows
#   bash scripts/gpu_wheels.sh --python 3.11   # for another CPython (binary wheels differ per version; on the GPU
#                                              # machine, gpu_pipeline.sh names the version it needs in one line)
#
# The bundle: the distributions of scripts/gpu_pipeline.py's CARRY (datasets and pyarrow, Hydra, Accelerate, PEFT,
# matplotlib, DeepSpeed, ... and theirs) and ASSETS (the MT-bench and HumanEval files) at the versions installed in
# this checkout's .venv (the tested set); binary wheels for manylinux x86_64 and the given Python; DeepSpeed and
# antlr4 (sdists on the index) built here into pure wheels (DeepSpeed without prebuilt ops, as scripts/setup.sh
# builds it); repacked by `gpu_pipeline.py bundle` (tests, headers and unused pyarrow libraries left out, one xz
# archive); plus the embedded SmolLM2's tokenizer files. The device machine carries at most 64 MiB.
# Exit status: 0 written and under the limit; 1 a download or build failed; 3 written but over the limit.
# Environment: GPU_WHEELS_DIR (default .gpu-wheels), PYTHON (default .venv/bin/python: needs specheads set up).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYVER=3.12  # the borrowed GPU machines' image: python3 is CPython 3.12 (torch, triton, transformers installed there)
while (( $# )); do
  case $1 in
    --python) PYVER=$2; shift 2 ;;
    *) echo "gpu_wheels.sh: unknown option $1 (see --help)"; exit 2 ;;
  esac
done
OUT_DIR=${GPU_WHEELS_DIR:-.gpu-wheels}
DL=$(mktemp -d -t gpu_wheels.XXXXXX)
trap 'rm -rf "$DL"' EXIT
t0=$(date +%s)
pip() { "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }

mapfile -t PINS < <("$PY" scripts/gpu_pipeline.py pins)
BUILT=() FETCHED=()
for pin in "${PINS[@]}"; do
  case ${pin%%==*} in
    deepspeed|antlr4-python3-runtime) BUILT+=("$pin") ;;
    *) FETCHED+=("$pin") ;;
  esac
done
echo "[gpu_wheels] ${#FETCHED[@]} wheels for CPython $PYVER (manylinux x86_64), ${#BUILT[@]} built here: ${BUILT[*]}"
ABI=cp${PYVER/./}
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 \
    manylinux_2_5 manylinux1; do PLATFORMS+=(--platform "${p}_x86_64"); done
pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" \
  --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DL" "${FETCHED[@]}"
# datasets needs huggingface-hub>=1.31, transformers 5.x before 5.2x needs <2: the newest 1.x, installed on the
# GPU machine only where its own hub is older than datasets accepts
pip download -q --no-deps --only-binary=:all: -d "$DL" "huggingface-hub>=1.31,<2"
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w "$DL" "${BUILT[@]}"

mkdir -p "$OUT_DIR"
rm -rf "$DL/assets"
"$PY" scripts/gpu_pipeline.py assets --out "$DL/assets/smollm2-tokenizer"
rc=0
"$PY" scripts/gpu_pipeline.py bundle --wheels "$DL" --assets "$DL/assets" --out "$OUT_DIR/bundle.tar.xz" || rc=$?
echo "$PYVER" > "$OUT_DIR/python-version"
size=$(du -b "$OUT_DIR" | cut -f1)
echo "[gpu_wheels] $OUT_DIR: $(( size / 1048576 )) MiB in all, in $(( $(date +%s) - t0 )) s"
case $rc in
  0) ;;
  4) echo "[gpu_wheels] OVER the 64 MiB carry limit: the GPU machine cannot receive it whole"; exit 3 ;;
  *) exit 1 ;;
esac
