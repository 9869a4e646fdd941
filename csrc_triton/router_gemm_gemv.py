"""CUDA-core (FMA) router GEMV for the smallest M: decode with a handful of tokens.

Invariant: each output element is one fp32 sum of exact products over K in an order fixed by
(BLOCK_K, num_warps) alone: every program keeps a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator,
adds chunk after chunk of K elementwise (fp32 FMA), and reduces it along K once at the end. No
program waits on another (no partials, no ticket).

Why not tensor cores: at M <= 16 an MMA pads the tokens to 16 rows and its operands go through
shared memory; what limits the kernel is the latency of reading the weight, not arithmetic. Here
each program streams its BLOCK_N weight rows with 16-byte loads in fully unrolled chunks straight
into registers: the whole kernel is one round trip to HBM plus the store.

bf16 x bf16 products are exact in fp32 and accumulate in IEEE fp32 (no TF32, no long MMA chain),
so the same kernel serves the ``fp32`` mode at fp32-upcast accuracy. No ``tl.dot``: it runs
unchanged under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.launches import GemvLaunch
from csrc_triton.pdl import launch_dependents


@triton.jit
def _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, k0, K, BLOCK_K: tl.constexpr):
    """``acc`` plus the exact products of the chunk of K from ``k0`` (one fp32 FMA per element)."""
    offs_k = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
    mask_k = offs_k < K
    w = tl.load(w_rows + offs_k, mask=w_mask & mask_k, other=0.0)
    x = tl.load(x_rows + offs_k, mask=x_mask & mask_k, other=0.0)
    # an explicit FMA: the same sum as a multiply and an add (a bf16 x bf16 product is exact in fp32),
    # in one instruction whatever Triton's FP-fusion default (announced to turn off in 3.10)
    return tl.fma(x.to(tl.float32), w.to(tl.float32), acc)


@triton.jit
def gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_m, pid_n, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
              COPY_STAGES: tl.constexpr):  # fmt: skip
    """The fp32 logits [BLOCK_M, BLOCK_N] of token block ``pid_m`` and expert block ``pid_n``, with
    their row and column offsets."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # 3-D pointers ([M, 1, K] and [1, N, K]): both loads get the same layout as the accumulator
    # (8 consecutive K per thread, threads and warps along K), so nothing is shuffled between
    # layouts through shared memory inside the loop.
    x_rows = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
    x_mask = (offs_m < M)[:, None, None]
    w_mask = (offs_n < N)[None, :, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if COPY_STAGES == 0:
        for c in tl.static_range(CHUNKS):  # unrolled: all loads can be in flight at once
            acc = _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, c * BLOCK_K, K, BLOCK_K)
    else:  # the same chunks in the same order, COPY_STAGES - 1 of them ahead through shared memory
        for c in tl.range(0, CHUNKS, num_stages=COPY_STAGES):
            acc = _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, c * BLOCK_K, K, BLOCK_K)
    return tl.sum(acc, axis=2), offs_m, offs_n


@triton.jit
def _gemv_kernel(
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
    CHUNKS: tl.constexpr,
    COPY_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch_dependents(PDL)  # a kernel reading these logits may launch now (it waits for us)
    # Token blocks vary fastest: programs that read the same weight rows run side by side.
    logits, offs_m, offs_n = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, tl.program_id(0),
                                       tl.program_id(1), BLOCK_M, BLOCK_N, BLOCK_K, CHUNKS,
                                       COPY_STAGES)  # fmt: skip
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, logits.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def gemv_block_k(x: torch.Tensor, w: torch.Tensor, num_warps: int) -> int:
    """BLOCK_K = one 16-byte load (8 bf16 or 4 fp32 values) per thread: with exactly that width the
    activation and weight loads get the accumulator's layout, whatever BLOCK_M and BLOCK_N are."""
    vec = 16 // max(x.element_size(), w.element_size())
    return vec * 32 * num_warps


def gemv_launch(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, launch: GemvLaunch, pdl: bool = False
) -> torch.Tensor:
    """Write ``x @ w.T`` into ``out`` [M, N]. x, w: unit stride along K; any float dtypes.
    ``maxnreg`` > 0 gives ptxas that register budget: with it, ptxas issues every chunk's loads
    before the first FMA instead of holding some back until registers free up (a second trip to
    memory). ``copy_stages`` > 0 runs the chunk loop as a cp.async pipeline with that many stages
    (capped at the chunk count); 0 unrolls it. ``pdl``: the next kernel on the stream, launched as
    a programmatic dependent (``csrc_triton/pdl.py``), may launch as this one starts."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return out
    block_k = gemv_block_k(x, w, launch.num_warps)
    chunks = cdiv(K, block_k)
    grid = (cdiv(M, launch.block_m), cdiv(N, launch.block_n))
    _gemv_kernel[grid](
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=block_k,
        CHUNKS=chunks,
        COPY_STAGES=min(launch.copy_stages, chunks),  # never more stages than chunks
        PDL=pdl,
        num_warps=launch.num_warps,
        num_stages=1,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}),
    )
    return out
