"""Kernel-level numbers for the small-M router GEMM under Nsight Compute (no clock control).

    ncu --clock-control none --profile-from-start off --metrics ... python3 benchmarks/ncu_probe.py

Profiles one call each (after warm-up) of our dispatch and cuBLAS on the DeepSeek-V3 shape at
M = 1 and 16, so graph-replay times can be split into kernel time and launch/drain overhead.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_router_ext.ops import router_gemm  # noqa: E402

w = (torch.randn(256, 7168, device="cuda") / 84.7).to(torch.bfloat16)
cases = []
for m in (1, 16):
    x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
    cases += [
        (f"ours bf16-fp32out M={m}", lambda x=x: router_gemm(x, w, "bf16-fp32out")),
        (f"ours fp32 M={m}", lambda x=x: router_gemm(x, w, "fp32")),
        (f"cublas M={m}", lambda x=x: torch.mm(x, w.T, out_dtype=torch.float32)),
    ]
for _, fn in cases:
    for _ in range(3):
        fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, fn in cases:
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
torch.cuda.cudart().cudaProfilerStop()
print("profiled:", [n for n, _ in cases])
