#!/usr/bin/env bash
# One device call: GPU tests, then (optionally) tuning and the benchmark. Runs without vLLM.
#   bash scripts/gpu_check.sh [tests] [tune] [bench]      (outputs under $OUT, default ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py \
             tests/test_router_gemm_op.py tests/test_selfcheck.py 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    tune) timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune.py --out "$OUT/nvidia_h200.json" 2>&1 \
             | tee "$OUT/tune.log" | grep -E "M=(1|16|256|16384):|batch-invariant|done|wrote|Error|error"
          cp "$OUT/nvidia_h200.json" csrc_triton/configs/nvidia_h200.json ;;
    bench) python3 -m vllm_router_ext.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -120 ;;
    *) echo "unknown step $step (tests, tune, bench)"; exit 2 ;;
  esac
done
