"""Design probe (one device call): how fast can any kernel read the gate weight at decode?

    python benchmarks/probe_read_floor.py [--out DIR]

The kernels issue's target at 1-16 tokens is 1/3 of cuBLAS (about 2.5 µs on DeepSeek-V3). Every
router GEMM must read the whole weight from HBM (58 layers' gates do not stay in the 60 MB L2).
This probe times kernels that do only that, in a CUDA graph over rotated weight copies as the
benchmark does: P programs each stream a contiguous slice of the weight with 16-byte loads in a
fully unrolled loop (every load issued before the first use), add it up in fp32 and store one
value. The fastest of them is a lower bound for a GEMV at M=1 on this GPU (no activations, no
dot products, no reduction across K), next to an empty kernel (launch alone), our op and cuBLAS,
all in the same run. Not used by the plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_router_ext.benchmarking import SHAPE_BY_NAME, make_inputs, rotation_copies, time_graph  # noqa: E402
from vllm_router_ext.ops import router_gemm  # noqa: E402


@triton.jit
def _read_kernel(w_ptr, out_ptr, numel, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(PER_PROGRAM // BLOCK):  # unrolled: all loads in flight at once
        offs = start + c * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0.0)


def read_weight(w: torch.Tensor, out: torch.Tensor, programs: int, num_warps: int) -> None:
    numel = w.numel()
    block = 8 * 32 * num_warps  # one 16-byte load (8 bf16) per thread per chunk
    per_program = -(-numel // (programs * block)) * block
    grid = (-(-numel // per_program),)
    _read_kernel[grid](w, out, numel, PER_PROGRAM=per_program, BLOCK=block, num_warps=num_warps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-read-floor-out")
    ap.add_argument("--shapes", default="DeepSeek-V3,Kimi-K2")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPE_BY_NAME[name]
        xs, ws = make_inputs(1, shape.k, shape.n, rotation_copies(1, shape.k, shape.n))
        outs = [torch.empty(4096, device="cuda") for _ in ws]
        row = {"shape": name, "weight_MB": shape.n * shape.k * 2 / 1e6}
        row["empty 1 program"] = time_graph([lambda o=o: _empty_kernel[(1,)](o) for o in outs])
        row["empty 264 programs"] = time_graph([lambda o=o: _empty_kernel[(264,)](o) for o in outs])
        row["cuBLAS M=1"] = time_graph(
            [lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32) for x, w in zip(xs, ws, strict=True)]
        )
        row["ours M=1"] = time_graph(
            [lambda x=x, w=w: router_gemm(x, w, "bf16-fp32out") for x, w in zip(xs, ws, strict=True)]
        )
        best = None
        for programs in (132, 264, 528, 1056, 2112):
            for warps in (4, 8, 16):
                key = f"read {programs} programs x {warps} warps"
                calls = [
                    lambda w=w, o=o, p=programs, nw=warps: read_weight(w, o, p, nw)
                    for w, o in zip(ws, outs, strict=True)
                ]
                row[key] = time_graph(calls)
                if best is None or row[key] < row[best]:
                    best = key
        row["best read"] = best
        rows.append(row)
        print(
            f"{name} ({row['weight_MB']:.2f} MB): empty {row['empty 1 program']:.2f}-"
            f"{row['empty 264 programs']:.2f} µs, "
            f"best read-only {row[best]:.2f} µs ({best}), ours M=1 {row['ours M=1']:.2f}, "
            f"cuBLAS M=1 {row['cuBLAS M=1']:.2f} (1/3: {row['cuBLAS M=1'] / 3:.2f})",
            flush=True,
        )
        for key, value in row.items():
            if key.startswith("read "):
                print(f"  {key}: {value:.2f} µs ({row['weight_MB'] / value:.2f} TB/s)", flush=True)
    (Path(args.out) / "probe-read-floor.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
