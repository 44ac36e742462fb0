# Sourced by the GPU scripts (gpu_check.sh, gpu_suite.sh) from the repository root: sets PY to the Python they run,
# PYTHON if set, else the project's .venv/bin/python where it has torch, else python3 (a GPU machine's own).
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
