#!/usr/bin/env bash
# Create (or reuse) a test environment with a CUDA wheel of vLLM (there is no CPU build after 0.32):
#   bash scripts/setup_vllm_wheel_env.sh 0.33    -> .venv-vllm033
#   bash scripts/setup_vllm_wheel_env.sh 0.34    -> .venv-vllm034
# with this package (no extras: no matplotlib) and pytest. On a machine without a GPU it imports with
# VLLM_TARGET_DEVICE=cpu: argument parsing, the model registry, plugin loading and layer
# construction work; an engine does not start (the wheel has no CPU kernels). About 4 minutes and
# 9 GB each the first time.
# vLLM 0.34.0 pins flashinfer-python==0.7.3, which the package index may lack: where a plain install
# cannot resolve, the wheel's own requirements are installed with that pin swapped for the nearest
# release the index has, then the wheel itself without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
SERIES=${1:?usage: setup_vllm_wheel_env.sh 0.33|0.34}
VENV=${VENV:-.venv-vllm${SERIES//./}}
PY=${PYTHON:-python3}
FLASHINFER_SWAP="flashinfer-python==0.7.3 flashinfer-python==0.7.2.post1"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
quiet() { grep -v "^WARNING: Location" || true; }
if ! VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[setup-$SERIES] installing vllm $SERIES (CUDA wheel; about 4 minutes)"
  if ! "$VENV/bin/pip" install -q "vllm==$SERIES.*" 2>&1 | quiet; then :; fi
  if ! VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "[setup-$SERIES] the plain install did not resolve; its requirements with a pin swapped"
    dl=$(mktemp -d)
    "$VENV/bin/pip" download -q --no-deps -d "$dl" "vllm==$SERIES.*" 2>&1 | quiet
    whl=$(ls "$dl"/vllm-*.whl)
    unzip -p "$whl" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v "extra ==" > "$dl/reqs.txt"
    set -- $FLASHINFER_SWAP
    sed -i "s/^$1\$/$2/" "$dl/reqs.txt"
    "$VENV/bin/pip" install -q -r "$dl/reqs.txt" 2>&1 | quiet
    "$VENV/bin/pip" install -q --no-deps "$whl" 2>&1 | quiet
    rm -rf "$dl"
  fi
fi
echo "[setup-$SERIES] installing vllm-router-ext (no extras) and pytest"
"$VENV/bin/pip" install -q --no-build-isolation . pytest 2>&1 | grep -v "^\s*$" | grep -iv "warning\|!!\|\*\*\*\*" || true
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm_router_ext, vllm; print('[setup-$SERIES] ready: vllm', vllm.__version__)"
