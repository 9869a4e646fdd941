"""Design probe (one device call): what the cross-program split-K reduction costs at decode sizes.

    python benchmarks/probe_reduce.py [--out DIR]

Same split-K tiles, three epilogues:
- none: each split stores its partial and stops (not a result: the floor of any reduction);
- ticket: the shipped one (store partial, acq_rel ticket, the last program reads the S partials);
- fixed: each split adds its partial as a fixed-point integer into a 64-bit word whose top bits
  count arrivals; the add that brings the count to S knows the exact total and stores it (one
  relaxed atomic round trip; integer sums do not depend on the order of the arrivals).
Prints µs per call against cuBLAS and the current dispatch; checks the results against fp64.
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

from csrc_triton.dot import promoted_group  # noqa: E402
from csrc_triton.router_gemm_splitk import finish_split  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPES,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402

FRAC_BITS = 36
COUNT_SHIFT = 58
BIAS = 1 << 51


@triton.jit
def _probe_kernel(
    x_ptr, w_ptr, part_ptr, out_ptr, ticket_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_ps,
    stride_pm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, REDUCE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    chunks: tl.constexpr = K_PER_SPLIT // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = promoted_group(
        x_rows, w_cols, mask_m, mask_n, pid_s * K_PER_SPLIT, K, acc, BLOCK_K, chunks, 0, False
    )
    mask = mask_m[:, None] & mask_n[None, :]
    tile = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    if REDUCE == 0:
        tl.store(part_ptr + pid_s * stride_ps + tile, acc, mask=mask)
    elif REDUCE == 1:
        finish_split(
            acc, part_ptr, out_ptr, ticket_ptr, pid_m * tl.num_programs(0) + pid_n, pid_s, offs_m,
            offs_n, mask, stride_ps, stride_pm, stride_om, SPLIT_K, True, False,
        )  # fmt: skip
    else:
        q = (acc.to(tl.float64) * (2.0**36)).to(tl.int64)
        inc = q + ((1 << 58) + (1 << 51))
        old = tl.atomic_add(ws_ptr + tile, inc, mask=mask, sem="relaxed", scope="gpu")
        last = mask & ((old >> 58) == SPLIT_K - 1)
        total = (old & ((1 << 58) - 1)) + q + (1 << 51) - SPLIT_K * (1 << 51)
        res = total.to(tl.float32) * (2.0**-36)
        o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o, res, mask=last)
        tl.store(ws_ptr + tile, tl.zeros_like(old), mask=last)


_WS: dict = {}


def launch(x, w, out, bm, bn, bk, kps, reduce, warps):
    M, K = x.shape
    N = w.shape[0]
    S = triton.cdiv(K, kps)
    grid = (triton.cdiv(N, bn), S, triton.cdiv(M, bm))
    key = (M, N, S)
    if key not in _WS:
        _WS[key] = (
            torch.empty(S, M, N, device=x.device),
            torch.zeros(1 << 16, dtype=torch.int32, device=x.device),
            torch.zeros(M, N, dtype=torch.int64, device=x.device),
        )
    part, tickets, ws = _WS[key]
    _probe_kernel[grid](
        x, w, part, out, tickets, ws, M, N, K, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
        out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PER_SPLIT=kps, SPLIT_K=S, REDUCE=reduce,
        num_warps=warps, num_stages=1,
    )  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe-out")
    p.add_argument("--ms", default="1,4,16,32,64,128,256")
    p.add_argument("--tiles", default="16x16x128x512x4,64x32x128x512x4,16x32x256x512x4,32x32x256x512x4")
    args = p.parse_args()
    rows = []
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    for shape in SHAPES[:2]:
        for m in (int(v) for v in args.ms.split(",")):
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
            ref = xs[0].double() @ ws[0].double().T
            cub = time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
            disp = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
            bi = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out", batch_invariant=True), xs, ws)
            line = f"{shape.name} M={m}: cuBLAS {cub:.2f} dispatch {disp:.2f} BI {bi:.2f} |"
            for bm, bn, bk, kps, warps in tiles:
                res = {}
                for reduce, name in ((0, "none"), (1, "ticket"), (2, "fixed")):
                    o = torch.full((m, shape.n), float("nan"), device="cuda")
                    launch(xs[0], ws[0], o, bm, bn, bk, kps, reduce, warps)
                    launch(xs[0], ws[0], o, bm, bn, bk, kps, reduce, warps)  # reset state reused
                    err = ((o.double() - ref).norm() / ref.norm()).item() if reduce else 0.0
                    c = (bm, bn, bk, kps, reduce, warps)
                    t = time_rotated_into(lambda x, w, o, c=c: launch(x, w, o, *c), xs, ws)
                    res[name] = (t, err)
                line += f" {bm}x{bn}x{bk}: " + " ".join(f"{k} {t:.2f}({e:.0e})" for k, (t, e) in res.items())
                rows.append(dict(shape=shape.name, m=m, tile=[bm, bn, bk, kps, warps], cublas=cub, res=res))
            print(line, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe-reduce.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
