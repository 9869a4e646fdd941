"""Is the op's cuBLAS path at 16384 tokens slower than calling cuBLAS directly, or is the benchmark's
large-M ratio noise? The op (whose table routes bf16-fp32out there to ``torch.mm(..., out_dtype=fp32)``)
and the same ``torch.mm`` called directly, twice as two separate methods, taking turns for six
rounds in the benchmark's harness (CUDA graph, rotated copies).

    python benchmarks/probe_cublas_noise.py
"""

from __future__ import annotations

import torch

from vllm_router_ext.benchmarking import SHAPE_BY_NAME, make_inputs, rotation_copies, time_rotated
from vllm_router_ext.ops import router_gemm


def main() -> None:
    for name in ("DeepSeek-V3", "GLM-5", "Kimi-K2"):
        shape = SHAPE_BY_NAME[name]
        for m in (4096, 16384):
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
            methods = {
                "op": lambda x, w: router_gemm(x, w, "bf16-fp32out"),
                "mm A": lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32),
                "mm B": lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32),
            }
            times = {k: [] for k in methods}
            for _ in range(6):
                for k, fn in methods.items():
                    times[k].append(time_rotated(fn, xs, ws, warmup=10, rep=50))
            best = {k: min(v) for k, v in times.items()}
            print(f"{name} M={m}: " + "  ".join(f"{k} {min(v):.1f} [{' '.join(f'{t:.1f}' for t in v)}]"
                                                 for k, v in times.items())
                  + f"  op/mmA {best['op'] / best['mm A']:.3f} mmB/mmA {best['mm B'] / best['mm A']:.3f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
