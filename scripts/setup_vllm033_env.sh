#!/usr/bin/env bash
# Create (or reuse) the second test environment in $VENV (default .venv-vllm033): the CUDA wheel of
# vLLM 0.33 (there is no CPU build of 0.33), this package with no extras (a plain install: no
# matplotlib) and pytest. On a machine without a GPU it imports with VLLM_TARGET_DEVICE=cpu:
# argument parsing, the model registry, plugin loading and layer construction work; an engine
# does not start (the wheel has no CPU kernels). About 4 minutes and 9 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm033}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
if ! VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[setup-0.33] installing vllm 0.33 (CUDA wheel; about 4 minutes)"
  "$VENV/bin/pip" install -q "vllm==0.33.*" 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "[setup-0.33] installing vllm-router-ext (no extras) and pytest"
"$VENV/bin/pip" install -q --no-build-isolation . pytest 2>&1 | grep -v "^\s*$" | grep -iv "warning\|!!\|\*\*\*\*" || true
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm_router_ext, vllm; print('[setup-0.33] ready: vllm', vllm.__version__)"
