"""Design probe (one device call): can a Gluon wgmma kernel hide the fp32 mode's promotion?

    python benchmarks/probe_gluon.py [--out DIR] [--shapes ...] [--m ...]

The ``fp32`` mode accumulates bf16 x bf16 MMAs in chains of <= 256 along K and adds each chain
into an fp32 register total ("promotion"). In Triton (``tl.dot``) every promotion waits for its
chain's last wgmma, so the tensor cores drain each time: ~28 % at large M in every form tried
(docs/benchmarks.md). Gluon (Triton's lower-level dialect, ``triton.experimental.gluon``) exposes
the asynchronous wgmma and its wait directly, so this kernel keeps two chain accumulators: chain A
runs on the tensor cores while the finished chain B is added into the total (and vice versa), and
a wait never retires the MMA just issued. Loads are TMA into a STAGES-deep shared-memory ring.

Variants, timed against cuBLAS bf16 (``torch.mm(..., out_dtype=fp32)``) and the shipped ``fp32``
op in the same run (CUDA graph, rotated weights): ``promoted`` (chains of PROMOTE chunks,
overlapped) and ``unpromoted`` (one chain over the whole K: the loop's own speed, not
fp32-accurate). Not used by the plugin.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.constexpr_function
def _warps_per_cta(block_m, num_warps):
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@triton.constexpr_function
def _instr_n(block_m, block_n, num_warps):
    m_reps = -(-block_m // 16)
    n_reps = -(-num_warps // m_reps)
    max_n = max(block_n // n_reps, 8)
    n = 256
    while n > max_n or block_n % n != 0:
        n -= 8
    return n


@gluon.jit
def _load_chunk(
    x_desc, w_desc, a_bufs, b_bufs, ready, j, off_m, off_n, k_begin, k_end,
    K: gl.constexpr, TOTAL: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """TMA loads of chunk ``j`` (nothing past TOTAL) into its ring stage. A chunk past this split's
    end is loaded from column K (entirely out of bounds): TMA fills it with zeros, which add
    exactly nothing."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    s = j % STAGES
    k = k_begin + j * BK
    k = gl.where(k < k_end, k, K)
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=j < TOTAL)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], ready.index(s), a_bufs.index(s), pred=j < TOTAL)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], ready.index(s), b_bufs.index(s), pred=j < TOTAL)


@gluon.jit
def _promoted_wgmma_kernel(
    x_desc, w_desc, out_ptr, M, N, stride_os, stride_om,
    K: gl.constexpr, K_PER_SPLIT: gl.constexpr, PROMOTE: gl.constexpr, STAGES: gl.constexpr,
    NO_PROMOTE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    PAIR: gl.constexpr = 2 * PROMOTE
    N_PAIRS: gl.constexpr = (K_PER_SPLIT + PAIR * BK - 1) // (PAIR * BK)
    TOTAL: gl.constexpr = N_PAIRS * PAIR

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    off_m = pid_m * BM
    off_n = pid_n * BN
    k_begin = pid_s * K_PER_SPLIT
    k_end = gl.minimum(k_begin + K_PER_SPLIT, K)

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_warps_per_cta(BM, num_warps),
        instr_shape=[16, _instr_n(BM, BN, num_warps), 16],
    )
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)

    # Prologue: chunks 0 .. STAGES-2 in flight.
    for pre in gl.static_range(STAGES - 1):
        _load_chunk(
            x_desc, w_desc, a_bufs, b_bufs, ready, pre, off_m, off_n, k_begin, k_end, K, TOTAL, STAGES
        )

    acc_a = gl.zeros((BM, BN), gl.float32, mma)
    acc_b = gl.zeros((BM, BN), gl.float32, mma)
    total = gl.zeros((BM, BN), gl.float32, mma)
    for p in range(N_PAIRS):
        for c in gl.static_range(PAIR):
            i = p * PAIR + c
            si = i % STAGES
            mbarrier.wait(ready.index(si), (i // STAGES) & 1)
            a = a_bufs.index(si)
            b = b_bufs.index(si).permute((1, 0))
            if NO_PROMOTE:
                acc_a = warpgroup_mma(a, b, acc_a, is_async=True)
            elif c < PROMOTE:
                acc_a = warpgroup_mma(a, b, acc_a, use_acc=c > 0, is_async=True)
            else:
                acc_b = warpgroup_mma(a, b, acc_b, use_acc=c > PROMOTE, is_async=True)
            # Retire every MMA but the one just issued: the previous chunk's stage is free again,
            # and at a chain's first chunk the other chain is complete and is added into the total
            # while this chain's MMA runs (at p == 0 chain B is still zeros: + 0 exactly).
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a, acc_b))
            if not NO_PROMOTE:
                if c == 0:
                    total = total + acc_b
                if c == PROMOTE:
                    total = total + acc_a
            _load_chunk(
                x_desc, w_desc, a_bufs, b_bufs, ready, i + STAGES - 1, off_m, off_n, k_begin, k_end, K,
                TOTAL, STAGES,
            )  # fmt: skip

    acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
    if NO_PROMOTE:
        total = acc_a
    else:
        total = total + acc_b
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))

    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    gl.store(ptrs, total, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def promoted_wgmma(x, w, out, *, block_m, block_n, block_k, promote, stages, num_warps,
                   k_per_split=0, no_promote=False):  # fmt: skip
    """out [S, M, N] fp32 partials (S = 1: the result)."""
    M, K = x.shape
    N = w.shape[0]
    kps = k_per_split if 0 < k_per_split < K else K
    split = -(-K // kps)
    xl = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k], xl)
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k], wl)
    grid = (-(-N // block_n), -(-M // block_m), split)
    _promoted_wgmma_kernel[grid](
        xd, wd, out, M, N, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        K, kps, promote, stages, no_promote, num_warps=num_warps,
    )  # fmt: skip
    return out


VARIANTS = [
    # (block_m, block_n, block_k, promote, stages, num_warps)
    (128, 128, 64, 4, 4, 8),
    (128, 128, 128, 2, 3, 8),
    (128, 128, 64, 4, 3, 8),
    (64, 128, 64, 4, 4, 4),
    (64, 128, 128, 2, 3, 4),
    (128, 64, 64, 4, 4, 4),
    (64, 64, 128, 2, 4, 4),
]


def _probe_point(shape, m: int, splits: list[int]) -> dict:
    from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph
    from vllm_router_ext.ops import router_gemm
    from vllm_router_ext.precision import RouterPrecision

    xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
    ref = xs[0].double() @ ws[0].double().T
    scale = ref.abs().max().item()
    pairs = list(zip(xs, ws, strict=True))

    def err(o: torch.Tensor) -> float:
        return ((o.double() - ref).abs().max() / scale).item()

    t_cublas = time_graph([lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32) for x, w in pairs])
    t_ours = time_graph([lambda x=x, w=w: router_gemm(x, w, RouterPrecision.FP32) for x, w in pairs])
    e_ours = err(router_gemm(xs[0], ws[0], RouterPrecision.FP32))
    row = {
        "shape": shape.name,
        "m": m,
        "cublas_us": t_cublas,
        "ours_fp32_us": t_ours,
        "ours_fp32_err": e_ours,
    }
    print(
        f"{shape.name} M={m}: cuBLAS {t_cublas:.2f}  shipped fp32 {t_ours:.2f} "
        f"({t_ours / t_cublas:.2f}x, err {e_ours:.1e})",
        flush=True,
    )
    best = None
    for kps in splits:
        split = -(-shape.k // kps) if kps else 1
        parts = [torch.empty(split, m, shape.n, device="cuda") for _ in xs]
        for (bm, bn, bk, pc, st, nw), no_promote in itertools.product(VARIANTS, (False, True)):
            cfg = dict(block_m=bm, block_n=bn, block_k=bk, promote=pc, stages=st, num_warps=nw)
            cfg.update(k_per_split=kps, no_promote=no_promote)
            tag = f"{bm}x{bn}x{bk} pc{pc} st{st} w{nw} kps{kps}{' nopromo' if no_promote else ''}"
            try:
                parts[0].fill_(float("nan"))
                promoted_wgmma(xs[0], ws[0], parts[0], **cfg)
                e = err(parts[0].sum(0))
                calls = [
                    lambda x=x, w=w, p=p, c=cfg: promoted_wgmma(x, w, p, **c)
                    for (x, w), p in zip(pairs, parts, strict=True)
                ]
                t = time_graph(calls)
            except Exception as exc:  # noqa: BLE001 -- a variant that does not build is reported
                print(f"  {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            print(
                f"  {tag}: {t:.2f} us ({t / t_cublas:.2f}x cuBLAS, {t / t_ours:.2f}x shipped) err {e:.1e}",
                flush=True,
            )
            row.setdefault("variants", []).append({"cfg": tag, "us": t, "err": e})
            if not no_promote and e < 1e-6 and (best is None or t < best[0]):
                best = (t, tag)
    if best:
        print(f"  best promoted: {best[1]} {best[0]:.2f} us = {best[0] / t_cublas:.2f}x cuBLAS", flush=True)
    return row


def main() -> int:
    from vllm_router_ext.benchmarking import SHAPE_BY_NAME

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-gluon-out")
    ap.add_argument("--shapes", default="DeepSeek-V3,Kimi-K2")
    ap.add_argument("--m", default="1024,2048,4096,8192,16384")
    ap.add_argument("--splits", default="0", help="K per split, 0 = none (partials summed by torch)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = [int(v) for v in args.splits.split(",")]
    rows = []
    for name in args.shapes.split(","):
        for m in [int(v) for v in args.m.split(",")]:
            rows.append(_probe_point(SHAPE_BY_NAME[name], m, splits))
            torch.cuda.empty_cache()
    (out_dir / "probe-gluon.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
