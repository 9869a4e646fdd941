"""Design probe (one device call): does programmatic dependent launch (PDL) shorten the GEMV?

    python benchmarks/probe_pdl.py [--out DIR]

At 1-16 tokens the GEMV (``csrc_triton/router_gemm_gemv.py``) is latency-bound: launch (~1.1 µs),
one HBM round trip, 3.7 MB at ~4 TB/s. With PDL (sm_90+) a kernel may be launched before the one
ahead of it in the stream has finished; ``gdc_wait`` then blocks until that kernel's writes are
visible. The gate weight is never written by anyone, so it may be read before the wait; the
activations (written by the previous kernel) and our output (whose memory the allocator may have
just recycled from a buffer the previous kernel still reads) only after it.

Variants of the same GEMV (same tiles, same FMA order): ``plain`` (the shipped launch),
``wait`` (launched with PDL, waits first: launch overlap only), ``prefetch`` (PDL, prefetches its
weight rows into L2 before the wait), ``preload`` (PDL, loads its weight rows into registers
before the wait), ``trigger`` (``preload`` that also lets the next kernel launch at once: the
upper bound when the kernel ahead of us does the same; not a fair standalone number).

Timed two ways, against cuBLAS in the same run: the standalone chain of the benchmark (R calls
back to back, weights rotated), and each call behind a predecessor kernel that writes its ``x``
(a torch elementwise kernel, not PDL-aware: what the router sees in vLLM after RMSNorm),
reported as (pair - predecessor alone). ``--context`` times the public op in every fp32-logit mode
that way instead (no PDL): do the standalone ratios to cuBLAS hold behind a producer kernel?
Not used by the plugin.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_graph,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402
from vllm_router_ext.ops.dispatch import config_for  # noqa: E402
from vllm_router_ext.precision import RouterPrecision  # noqa: E402

PLAIN, WAIT, PREFETCH, PRELOAD, TRIGGER = 0, 1, 2, 3, 4
VARIANTS = {"plain": PLAIN, "wait": WAIT, "prefetch": PREFETCH, "preload": PRELOAD, "trigger": TRIGGER}


@triton.jit
def _prefetch_l2(ptrs, mask):
    # one prefetch per element given: callers pass one pointer per 128-byte line
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gemv_pdl_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    VARIANT: tl.constexpr, LINES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
    x_mask = mask_m[:, None, None]
    w_mask = mask_n[None, :, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if VARIANT == 4:  # upper bound: let the next kernel launch at once (it waits for our writes)
        tl.extra.cuda.gdc_launch_dependents()
    if VARIANT >= 3:  # weight chunks into registers, then wait, then the activations
        ws = ()
        for c in tl.static_range(CHUNKS):
            offs_k = (c * BLOCK_K + tl.arange(0, BLOCK_K))[None, None, :]
            ws = ws + (tl.load(w_rows + offs_k, mask=w_mask & (offs_k < K), other=0.0),)
        tl.extra.cuda.gdc_wait()
        for c in tl.static_range(CHUNKS):
            offs_k = (c * BLOCK_K + tl.arange(0, BLOCK_K))[None, None, :]
            x = tl.load(x_rows + offs_k, mask=x_mask & (offs_k < K), other=0.0)
            acc += x.to(tl.float32) * ws[c].to(tl.float32)
    else:
        if VARIANT == 2:  # one prefetch per 128-byte line of this program's weight rows
            offs_l = tl.arange(0, LINES)[None, :] * 64
            rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
            _prefetch_l2(rows + offs_l, mask_n[:, None] & (offs_l < K))
        if VARIANT >= 1:
            tl.extra.cuda.gdc_wait()
        for c in tl.static_range(CHUNKS):
            offs_k = (c * BLOCK_K + tl.arange(0, BLOCK_K))[None, None, :]
            mask_k = offs_k < K
            w = tl.load(w_rows + offs_k, mask=w_mask & mask_k, other=0.0)
            x = tl.load(x_rows + offs_k, mask=x_mask & mask_k, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)
    logits = tl.sum(acc, axis=2)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, logits, mask=mask_m[:, None] & mask_n[None, :])


def gemv_pdl(x, w, out, variant: int, block_m: int, block_n: int, num_warps: int):
    M, K = x.shape
    N = w.shape[0]
    block_k = 8 * 32 * num_warps
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gemv_pdl_kernel[grid](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, CHUNKS=triton.cdiv(K, block_k),
        VARIANT=variant, LINES=triton.next_power_of_2(triton.cdiv(K, 64)),
        num_warps=num_warps, num_stages=1, launch_pdl=variant != PLAIN,
    )  # fmt: skip
    return out


def _op(x, w, o, *, mode: str, batch_invariant: bool):
    return router_gemm(x, w, RouterPrecision(mode), batch_invariant=batch_invariant)


def _variant(x, w, o, *, v, bm, bn, nw):
    return gemv_pdl(x, w, o, v, bm, bn, nw)


def measure(fn, xs, ws, outs, srcs) -> dict:
    # reference taken here: the predecessor harness below rewrites every x
    ref = xs[0].double() @ ws[0].double().T
    o = outs[0].fill_(float("nan"))
    got = fn(xs[0], ws[0], o).double()
    err = ((got - ref).norm() / ref.norm()).item()
    triples = list(zip(xs, ws, outs, strict=True))
    alone = time_graph([lambda x=x, w=w, o=o: fn(x, w, o) for x, w, o in triples])
    pred = time_graph([lambda x=x, s=s: x.copy_(s) for x, s in zip(xs, srcs, strict=True)])
    pair = time_graph(
        [
            lambda x=x, w=w, o=o, s=s: (x.copy_(s), fn(x, w, o))
            for (x, w, o), s in zip(triples, srcs, strict=True)
        ]
    )
    return {"err": err, "alone_us": alone, "behind_copy_us": pair - pred, "copy_us": pred}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-pdl-out")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="DeepSeek-V3,Kimi-K2,DeepSeek-V2-Lite")
    ap.add_argument("--context", action="store_true", help="the op's modes behind a producer, no PDL")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPE_BY_NAME[name]
        for m in [int(v) for v in args.m.split(",")]:
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
            cfg = config_for(xs[0], ws[0], RouterPrecision.BF16_FP32OUT, False)  # what the op runs
            if cfg.kernel != "gemv" and not args.context:
                print(f"{name} M={m}: table picks {cfg.kernel}, skipped")
                continue
            srcs = [torch.randn_like(x) for x in xs]
            outs = [torch.empty(m, shape.n, device="cuda") for _ in xs]
            methods = {"cuBLAS": lambda x, w, o: torch.mm(x, w.T, out_dtype=torch.float32)}
            if args.context:
                for mode in ("bf16-fp32out", "fp32"):
                    for bi in (False, True):
                        key = f"{'BI ' if bi else ''}{mode}"
                        methods[key] = functools.partial(_op, mode=mode, batch_invariant=bi)
            else:
                p = dict(cfg.params)
                methods["op"] = functools.partial(_op, mode="bf16-fp32out", batch_invariant=False)
                for vname, v in VARIANTS.items():
                    methods[vname] = functools.partial(
                        _variant, v=v, bm=p["block_m"], bn=p["block_n"], nw=p["num_warps"]
                    )
            row = {"shape": name, "m": m, "config": cfg.describe()}
            for meth, fn in methods.items():
                row[meth] = measure(fn, xs, ws, outs, srcs)
                r = row[meth]
                print(
                    f"{name:17s} M={m:4d} {meth:16s} err {r['err']:.1e}  alone {r['alone_us']:6.2f} µs  "
                    f"behind a copy {r['behind_copy_us']:6.2f} µs (copy {r['copy_us']:.2f})",
                    flush=True,
                )
            rows.append(row)
    (out_dir / "probe-pdl.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
