#!/usr/bin/env bash
# The engine tier (tests/engine, marker `engine`): a head trained here and served by vLLM's CPU build. Not part
# of CI's default run (15 minutes on 2 cores with a given head: the engine's set-up, the evaluator, three engine
# loads; a head trained here adds SPECHEADS_ENGINE_TRAIN_MINUTES); run it when serving code or export layouts change.
#
#   bash scripts/engine_tests.sh                  # set-up (both venvs, idempotent), then pytest -m engine
#   SPECHEADS_ENGINE_HEAD=runs/x/train/eagle3 bash scripts/engine_tests.sh   # serve that head (default: the
#                                                   # quickstart's, runs/quickstart/train/eagle3, else one trained here)
#   bash scripts/engine_tests.sh -x -k shuffled   # more pytest arguments
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,9p' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
t0=$(date +%s)
[ -x .venv/bin/python ] || bash scripts/setup.sh
bash scripts/setup_engine.sh
SPECHEADS_ENGINE_TESTS=1 .venv/bin/python -m pytest -m engine tests/engine -v "$@"
echo "[engine_tests] done in $(( $(date +%s) - t0 )) s"
