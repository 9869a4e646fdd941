#!/usr/bin/env bash
# One device call: any of the steps below, in order. Runs without vLLM; outputs under $OUT.
#   bash scripts/gpu_check.sh [tests] [tests-parallel] [tests-gpu] [tune] [tune-rest] [tune-shapes] [tune-targeted] [tune-fp32] [tune-bi] [tests-k] [bench]
# The bench step times the peer kernel too: FlashInfer's when it imports, else $PEER (a Python file
# defining peer_mm(x, w), SHAPES and MS) when that exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TABLE=csrc_triton/configs/nvidia_h200.json
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py \
             tests/test_router_gemm_op.py tests/test_selfcheck.py 2>&1 | tee "$OUT/pytest.log" | grep -vE "^DEBUG|^\s*$" | tail -25 ;;
    tests-parallel) # the same tests in $SHARDS processes sharing the GPU (compiling is what takes the time)
           n=${SHARDS:-4}; pids=()
           for i in $(seq 0 $((n - 1))); do
             timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider --shard "$i/$n" tests/test_kernels_gpu.py \
               tests/test_kernels.py tests/test_router_gemm_op.py tests/test_selfcheck.py > "$OUT/pytest-shard$i.log" 2>&1 &
             pids+=($!)
           done
           for p in "${pids[@]}"; do wait "$p"; done
           cat "$OUT"/pytest-shard*.log > "$OUT/pytest.log" && rm "$OUT"/pytest-shard*.log
           grep -E "passed|failed|error|FAILED|ERROR" "$OUT/pytest.log" | grep -vE "^DEBUG" | tail -25 ;;
    tests-gpu) timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 \
             | tee "$OUT/pytest.log" | grep -vE "^DEBUG|^\s*$" | tail -25 ;;
    tune) timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune.py --out "$OUT/nvidia_h200.json" 2>&1 \
             | tee "$OUT/tune.log" | grep -E "M=(1|16|256|16384):|batch-invariant|done|wrote|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tune-rest) # finish the shapes missing from the committed table, and retune batch invariance for all
          timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune.py --merge "$TABLE" --out "$OUT/nvidia_h200.json" \
             --shapes GLM-5,DeepSeek-V2-Lite 2>&1 | tee "$OUT/tune.log" | grep -E "M=(1|16|256|16384):|batch-invariant|done|Error|error"
          timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune.py --merge "$OUT/nvidia_h200.json" --out "$OUT/nvidia_h200.json" \
             --shapes DeepSeek-V3,Kimi-K2,DeepSeek-V2 --bi-only 2>&1 | tee -a "$OUT/tune.log" | grep -E "batch-invariant|differs|done|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tune-shapes) # the full search for SHAPES (names, e.g. Qwen3-30B-A3B,gpt-oss-120b), merged into the committed table;
          # every shape's candidates compiled first, one process a shape (TUNE_ARGS: e.g. --no-bi, --m)
          start=$SECONDS; pids=()
          for s in ${SHAPES//,/ }; do
            timeout "${COMPILE_TIMEOUT:-240}" python3 benchmarks/tune.py --compile-only --shapes "$s" ${TUNE_ARGS:-} \
              > "$OUT/compile-$s.log" 2>&1 & pids+=($!)
          done
          for p in "${pids[@]}"; do wait "$p"; done
          cat "$OUT"/compile-*.log > "$OUT/compile.log"; rm -f "$OUT"/compile-*.log
          echo "[tune] candidates compiled in $((SECONDS - start)) s"
          left=$(( ${TUNE_TIMEOUT:-540} - (SECONDS - start) )); [ "$left" -gt 0 ] || left=1  # timeout 0 = none
          timeout "$left" python3 benchmarks/tune.py --merge "$TABLE" \
             --out "$OUT/nvidia_h200.json" --shapes "${SHAPES:?SHAPES=name,...}" ${TUNE_ARGS:-} 2>&1 \
             | tee "$OUT/tune.log" | grep -E "M=(1|16|256|4096|16384):|batch-invariant|done|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tune-targeted) # the full search's winners at small M (all modes) and mid M (fp32)
          timeout "${TUNE_TIMEOUT:-220}" python3 benchmarks/tune.py --merge "$TABLE" --out "$OUT/nvidia_h200.json" --targeted \
             --m 1,2,4,8,16,128,256,512,1024,2048,4096,8192 2>&1 | tee "$OUT/tune.log" | grep -E "M=(1|16|1024):|done|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tune-fp32) # the fp32 mode from 512 tokens, with the Hopper wgmma_ws kernel
          timeout "${TUNE_TIMEOUT:-370}" python3 benchmarks/tune.py --merge "$TABLE" --out "$OUT/nvidia_h200.json" --targeted \
             --modes fp32 --m 512,1024,2048,4096,8192,16384 2>&1 | tee "$OUT/tune.log" | grep -E "M=|done|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tune-bi) # batch-invariant buckets only (TUNE_ARGS: --shapes, --m), merged into the committed table
          timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune.py --merge "$TABLE" --out "$OUT/nvidia_h200.json" --bi-only \
             ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/tune.log" | grep -E "batch-invariant|differs|done|Error|error"
          cp "$OUT/nvidia_h200.json" "$TABLE" ;;
    tests-k) timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "${TESTS_K}" 2>&1 \
             | tee "$OUT/pytest-k.log" | grep -vE "^DEBUG|^\s*$" | tail -25 ;;
    bench) peer=(); [ -f "${PEER:-}" ] && peer=(--peer "$PEER")
           timeout "${BENCH_TIMEOUT:-600}" python3 -m vllm_router_ext.bench --out "$OUT" "${peer[@]}" ${BENCH_ARGS:-} 2>&1 \
             | tee "$OUT/bench.log" | grep -vE "^\s+[A-Za-z0-9-]+ M=" | tail -150 ;;
    *) echo "unknown step $step (tests, tests-parallel, tests-gpu, tests-k, tune, tune-rest, tune-shapes, tune-targeted, tune-fp32, tune-bi, bench)"; exit 2 ;;
  esac
done
