"""Design probe (one device call): how long may a tensor-core accumulation chain be in the ``fp32``
mode, and what does promotion cost?

    python benchmarks/probe_promotion.py [--out DIR] [--sections accuracy,large,mid]

The ``fp32`` mode keeps bf16 operands and adds short MMA chains into an fp32 register accumulator
("promotion"): the H200's MMA accumulation is not IEEE fp32 (a K=7168 chain: ~8e-6 relative
error; chains of 128: ~1.6e-7). When this probe was written every fp32 config used chains of 128
(BLOCK_K <= 64, two chunks per chain), nested as a static inner loop, which makes every wgmma wait
for completion. Its results (benchmarks/results/probe-promotion-h200-971dc71.log) moved the mode to
chains of up to 256 (``FP32_MAX_BLOCK_K`` in csrc_triton/configs.py); the flat loop lost.

- accuracy: relative error vs fp64 and % of tokens whose expert set changes (fp64 routing on each
  path's logits), 8192 tokens, for chains of 128, 256, 512 and K, in the shipped nested form and
  in a flat loop (one chunk per iteration, promotion every PROMOTE_CHUNKS chunks); mma.sync
  (16-row split-K tiles) and wgmma (128-row tiles); torch's fp32 upcast and cuBLAS for scale.
- mid: DeepSeek-V3 at 32..1024 tokens, split-K candidates with chains of 128 vs 256.
- large: DeepSeek-V3 at 2048..16384 tokens, the tiled kernel nested vs flat, chains 128 / 256,
  and without promotion (the speed of light for this kernel, not fp32-accurate).
Every timed candidate is first checked against fp64 (<= 1e-6). Writes ``probe-promotion.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.configs import KernelConfig  # noqa: E402
from csrc_triton.dot import interpreting, mma  # noqa: E402
from csrc_triton.router_gemm_tiled import grouped_tile  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402
from vllm_router_ext.ops.dispatch import run_config  # noqa: E402
from vllm_router_ext.ops.reference import changed_expert_sets, select_experts  # noqa: E402


@triton.jit
def _flat_promoted_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROMOTE_CHUNKS: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The tiled kernel with one chunk per loop iteration and the promotion as a branch
    (PROMOTE_CHUNKS >= 2; 0 = one chain over K)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = c * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        part = mma(a, b, part, 0, UPCAST)
        if PROMOTE_CHUNKS > 0:
            if (c + 1) % PROMOTE_CHUNKS == 0:
                acc = acc + part
                part = tl.zeros_like(part)
    acc = acc + part
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, acc, mask=mask_m[:, None] & mask_n[None, :])


class Flat:
    """A flat-loop tiled candidate (same call shape as a KernelConfig for ``run``)."""

    def __init__(self, bm, bn, bk, pc, warps, stages):
        self.p = dict(
            block_m=bm, block_n=bn, block_k=bk, promote_chunks=pc, num_warps=warps, num_stages=stages
        )

    def describe(self) -> str:
        p = self.p
        chain = p["block_k"] * p["promote_chunks"] or "K"
        return (
            f"flat tiled {p['block_m']}x{p['block_n']}x{p['block_k']} chain {chain} "
            f"w{p['num_warps']} s{p['num_stages']}"
        )

    def __call__(self, x, w, out):
        p = self.p
        M, K = x.shape
        N = w.shape[0]
        grid = (triton.cdiv(M, p["block_m"]) * triton.cdiv(N, p["block_n"]),)
        _flat_promoted_kernel[grid](
            x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
            PROMOTE_CHUNKS=p["promote_chunks"], GROUP_M=8, UPCAST=interpreting(),
            num_warps=p["num_warps"], num_stages=p["num_stages"],
        )  # fmt: skip
        return out


def nested_tiled(bm, bn, bk, pc, warps, stages) -> KernelConfig:
    return KernelConfig(
        "tiled",
        dict(
            block_m=bm,
            block_n=bn,
            block_k=bk,
            promote_chunks=pc,
            group_m=8,
            num_warps=warps,
            num_stages=stages,
        ),
    )


def splitk(bm, bn, bk, pc, kps, warps, stages) -> KernelConfig:
    return KernelConfig(
        "splitk",
        dict(
            block_m=bm,
            block_n=bn,
            block_k=bk,
            k_per_split=kps,
            promote_chunks=pc,
            num_warps=warps,
            num_stages=stages,
        ),
    )


def describe(c) -> str:
    if isinstance(c, Flat):
        return c.describe()
    p = c.params
    chain = p["block_k"] * p["promote_chunks"] if p.get("promote_chunks") else p.get("k_per_split") or "K"
    return f"{c.describe()} chain {chain}"


def run(c, x, w, out):
    return c(x, w, out) if isinstance(c, Flat) else run_config(c, x, w, out, 0)


def rel_err(c, x, w, ref) -> float:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")
    res = run(c, x, w, out)
    return ((res.double() - ref).norm() / ref.norm()).item()


def time_cands(label, cands, m, shape, refs_fns, results, limit=1e-6):
    xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
    ref = xs[0].double() @ ws[0].double().T
    refs = {name: time_rotated(fn, xs, ws, warmup=10, rep=30) for name, fn in refs_fns.items()}
    rows = []
    for c in cands:
        try:
            err = rel_err(c, xs[0], ws[0], ref)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            print(f"  skip {describe(c)}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        us = time_rotated_into(lambda x, w, o, c=c: run(c, x, w, o), xs, ws, warmup=10, rep=30)
        rows.append({"cand": describe(c), "us": us, "err": err, "accurate": err <= limit})
    rows.sort(key=lambda r: r["us"])
    print(f"{label}: " + "  ".join(f"{k} {v:.2f}" for k, v in refs.items()), flush=True)
    for r in rows:
        flag = "" if r["accurate"] else "  (not fp32-accurate)"
        print(
            f"    {r['us']:7.2f} us  {r['us'] / refs['cuBLAS']:5.2f}x  err {r['err']:.1e}  {r['cand']}{flag}",
            flush=True,
        )
    results.append({"case": label, "refs": refs, "cands": rows})


REFS = {
    "cuBLAS": lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32),
    "ours bf16-fp32out": lambda x, w: router_gemm(x, w, "bf16-fp32out"),
    "ours fp32 (shipped)": lambda x, w: router_gemm(x, w, "fp32"),
}


def section_accuracy(results, tokens=8192, seed=7):
    cands = [
        nested_tiled(128, 128, 64, 2, 8, 3),  # shipped fp32 form: chains of 128
        Flat(128, 128, 64, 2, 8, 3),
        Flat(128, 128, 64, 4, 8, 3),
        Flat(128, 128, 128, 2, 8, 3),
        Flat(128, 128, 64, 8, 8, 3),
        Flat(128, 128, 128, 4, 8, 3),
        Flat(128, 128, 64, 0, 8, 3),
        splitk(16, 32, 64, 2, 512, 4, 1),  # mma.sync tiles
        splitk(16, 32, 64, 4, 512, 4, 1),
        splitk(16, 32, 128, 2, 512, 4, 1),
        splitk(16, 32, 128, 4, 512, 4, 1),
    ]
    for name in ("DeepSeek-V3", "GLM-5", "Kimi-K2"):
        shape = SHAPE_BY_NAME[name]
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, shape.k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(shape.n, shape.k, device="cuda", generator=g) / shape.k**0.5).to(torch.bfloat16)
        torch.randn(shape.n, shape.k, device="cuda", generator=g)  # the benchmark's fp32 weight draw
        bias = torch.randn(shape.n, device="cuda", generator=g).double() * 0.01
        ref = x.double() @ w.double().T
        ref_ids = select_experts(ref, shape.routing, bias)[0]
        paths = {
            describe(c): (
                lambda c=c, x=x, w=w, n=shape.n: run(
                    c, x, w, torch.full((tokens, n), float("nan"), device="cuda")
                )
            )
            for c in cands
        }
        paths["torch fp32 upcast"] = lambda x=x, w=w: F.linear(x.float(), w.float())
        paths["cuBLAS bf16->fp32"] = lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32)
        for label, fn in paths.items():
            logits = fn().double()
            rel = ((logits - ref).norm() / ref.norm()).item()
            ids = select_experts(logits, shape.routing, bias)[0]
            changed = changed_expert_sets(ids, ref_ids).float().mean().item() * 100
            print(f"accuracy {name:>12} {label:>58}: rel err {rel:.2e}  changed {changed:.3f} %", flush=True)
            results.append(
                {"case": f"accuracy {name}", "path": label, "rel_err": rel, "changed_pct": changed}
            )


def section_mid(results):
    shape = SHAPE_BY_NAME["DeepSeek-V3"]
    for m in (32, 64):
        cands = [
            splitk(bm, bn, bk, pc, kps, 4, 1)
            for bm, bn in ((16, 32), (32, 32))
            for kps in (256, 512)
            for bk, pc in ((64, 2), (64, 4), (128, 2))
        ]
        time_cands(f"mid DeepSeek-V3 M={m}", cands, m, shape, REFS, results)
    for m in (256, 1024):
        cands = [
            splitk(bm, bn, bk, pc, kps, warps, 3)
            for bm, bn, warps in ((64, 64, 4), (128, 128, 8))
            for kps in (1024, 2048)
            for bk, pc in ((64, 2), (64, 4), (128, 2))
        ]
        cands += [
            Flat(bm, bn, bk, pc, 4, 4) for bm, bn in ((64, 64), (64, 128)) for bk, pc in ((64, 2), (128, 2))
        ]
        time_cands(f"mid DeepSeek-V3 M={m}", cands, m, shape, REFS, results)


def section_large(results):
    shape = SHAPE_BY_NAME["DeepSeek-V3"]
    tiles = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4))
    for m in (2048, 4096, 16384):
        cands = [nested_tiled(bm, bn, 64, 2, warps, stages) for bm, bn, warps, stages in tiles]
        cands += [
            Flat(bm, bn, bk, pc, warps, stages)
            for bm, bn, warps, stages in tiles
            for bk, pc in ((64, 2), (64, 4), (128, 2), (64, 0), (128, 0))
        ]
        time_cands(f"large DeepSeek-V3 M={m}", cands, m, shape, REFS, results)


SECTIONS = {"accuracy": section_accuracy, "mid": section_mid, "large": section_large}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe-out")
    p.add_argument("--sections", default="accuracy,large,mid")
    args = p.parse_args()
    results: list[dict] = []
    t0 = time.time()
    for name in args.sections.split(","):
        SECTIONS[name](results)
        print(f"[probe-promotion] {name} done at {time.time() - t0:.0f}s", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe-promotion.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
