#!/usr/bin/env bash
# The main job: build the CPU environment, a tiny DeepSeek-V3 checkpoint and tokenizer, run
# `vllm serve <tiny> --router-precision bf16-fp32out` on 127.0.0.1, query it, print the
# completion and the router-precision log line, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
.venv/bin/python -m vllm_router_ext.tools.demo "$@"
