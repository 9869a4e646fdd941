"""Host-side cost of one router GEMM call (eager mode, no CUDA graph): what a step pays in Python
and launch overhead when the op runs outside a captured graph (e.g. prefill above vLLM's capture
sizes). Times N back-to-back calls without synchronising, against ``torch.mm(out_dtype=fp32)``;
if the host time per call exceeds the GPU time, the call is host-bound.

    python benchmarks/probe_host_overhead.py [--n 2000] [--profile M]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_router_ext.ops import router_gemm  # noqa: E402


def host_us(fn, n: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n * 1e6
    return host, total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, help="cProfile the op's calls at this M")
    args = ap.parse_args()
    k, n = 7168, 256
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    if args.profile:
        import cProfile
        import pstats

        x = torch.randn(args.profile, k, device="cuda").to(torch.bfloat16)
        host_us(lambda: router_gemm(x, w, "bf16-fp32out"), 20)
        with cProfile.Profile() as prof:
            for _ in range(500):
                router_gemm(x, w, "bf16-fp32out")
            torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
    print("DeepSeek-V3 gate, eager calls: host µs per call / wall µs per call (incl. GPU)")
    for m in (1, 16, 256, 4096):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        methods = {
            "torch.mm out fp32": lambda x=x: torch.mm(x, w.T, out_dtype=torch.float32),
            "op bf16-fp32out": lambda x=x: router_gemm(x, w, "bf16-fp32out"),
            "op fp32": lambda x=x: router_gemm(x, w, "fp32"),
            "op BI fp32": lambda x=x: router_gemm(x, w, "fp32", batch_invariant=True),
        }
        for name, fn in methods.items():
            host, total = host_us(fn, args.n)
            print(f"  M={m:5d} {name:18s} host {host:6.1f}  wall {total:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
