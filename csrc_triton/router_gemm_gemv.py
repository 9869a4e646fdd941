"""CUDA-core (FMA) router GEMV for the smallest M: decode with a handful of tokens.

Invariant: each output element is one fp32 sum of exact products over K in an order fixed by
(K_PER_SPLIT, BLOCK_K, num_warps) alone: every program keeps a [BLOCK_M, BLOCK_N, BLOCK_K] fp32
accumulator, adds chunk after chunk of K elementwise (fp32 FMA), and reduces it along K once at the
end. With SPLIT_K > 1 the per-split partials are added in split order 0..S-1 by the last program of
the tile (``finish_split``, shared with the split-K kernel); SPLIT_K = 1 has no reduction at all.

Why not tensor cores: at M <= 16 an MMA pads the tokens to 16 rows and its operands go through
shared memory; what limits the kernel is the latency of reading the weight, not arithmetic. Here
each program streams its BLOCK_N weight rows with 16-byte loads in fully unrolled chunks straight
into registers, and with SPLIT_K = 1 nothing waits on another program (no partials, no ticket):
the whole kernel is one round trip to HBM plus the store.

bf16 x bf16 products are exact in fp32 and accumulate in IEEE fp32 (no TF32, no long MMA chain),
so the same kernel serves the ``fp32`` mode at fp32-upcast accuracy. No ``tl.dot``: it runs
unchanged under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.router_gemm_splitk import finish_split, reduce_partials, split_workspace


@triton.jit
def _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, k0, K, BLOCK_K: tl.constexpr):
    """``acc`` plus the exact products of the chunk of K from ``k0`` (one fp32 FMA per element)."""
    offs_k = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
    mask_k = offs_k < K
    w = tl.load(w_rows + offs_k, mask=w_mask & mask_k, other=0.0)
    x = tl.load(x_rows + offs_k, mask=x_mask & mask_k, other=0.0)
    return acc + x.to(tl.float32) * w.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    out_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ps,
    stride_pm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TICKET: tl.constexpr,
    COPY_STAGES: tl.constexpr,
):
    # Token blocks vary fastest: programs that read the same weight rows run side by side.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_begin = pid_s * K_PER_SPLIT
    # 3-D pointers ([M, 1, K] and [1, N, K]): both loads get the same layout as the accumulator
    # (8 consecutive K per thread, threads and warps along K), so nothing is shuffled between
    # layouts through shared memory inside the loop.
    x_rows = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
    x_mask = mask_m[:, None, None]
    w_mask = mask_n[None, :, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if COPY_STAGES == 0:
        for c in tl.static_range(K_PER_SPLIT // BLOCK_K):  # unrolled: all loads can be in flight at once
            acc = _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, k_begin + c * BLOCK_K, K, BLOCK_K)
    else:  # the same chunks in the same order, COPY_STAGES - 1 of them ahead through shared memory
        for c in tl.range(0, K_PER_SPLIT // BLOCK_K, num_stages=COPY_STAGES):
            acc = _add_chunk(acc, x_rows, w_rows, x_mask, w_mask, k_begin + c * BLOCK_K, K, BLOCK_K)
    logits = tl.sum(acc, axis=2)

    finish_split(
        logits, part_ptr, out_ptr, ticket_ptr, pid_n * tl.num_programs(0) + pid_m, pid_s,
        offs_m, offs_n, mask_m[:, None] & mask_n[None, :], stride_ps, stride_pm, stride_om, SPLIT_K, TICKET,
        False,  # FIXED_POINT: the GEMV's splits are added in split order
    )  # fmt: skip


def gemv_block_k(x: torch.Tensor, w: torch.Tensor, num_warps: int) -> int:
    """BLOCK_K = one 16-byte load (8 bf16 or 4 fp32 values) per thread: with exactly that width the
    activation and weight loads get the accumulator's layout, whatever BLOCK_M and BLOCK_N are."""
    vec = 16 // max(x.element_size(), w.element_size())
    return vec * 32 * num_warps


def gemv_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    k_per_split: int = 0,
    num_warps: int = 4,
    num_stages: int = 1,
    ticket: bool = True,
    maxnreg: int = 0,
    copy_stages: int = 0,
) -> torch.Tensor:
    """Write ``x @ w.T`` into ``out`` [M, N]. x, w: unit stride along K; any float dtypes.
    ``k_per_split`` is rounded up to whole BLOCK_K chunks; 0 (or >= K) means one split.
    ``maxnreg`` > 0 gives ptxas that register budget: with it, ptxas issues every chunk's loads
    before the first FMA instead of holding some back until registers free up (a second trip to
    memory); 0 leaves the budget to ptxas. ``copy_stages`` > 0 runs the chunk loop as a cp.async
    pipeline with that many stages (capped at the chunk count); 0 unrolls it."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return out
    block_k = gemv_block_k(x, w, num_warps)
    k_per_split = cdiv(k_per_split if 0 < k_per_split < K else K, block_k) * block_k
    split_k = cdiv(K, k_per_split)
    copy_stages = min(copy_stages, k_per_split // block_k)  # never more stages than chunks
    grid = (cdiv(M, block_m), cdiv(N, block_n), split_k)
    part, tickets, use_ticket = split_workspace(out, split_k, grid[0] * grid[1], ticket)
    _gemv_kernel[grid](
        x,
        w,
        part,
        out,
        tickets,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        part.stride(0) if split_k > 1 else 0,
        part.stride(-2),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_PER_SPLIT=k_per_split,
        SPLIT_K=split_k,
        TICKET=use_ticket,
        COPY_STAGES=copy_stages,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    if split_k > 1 and not use_ticket:
        reduce_partials(part, out)
    return out
