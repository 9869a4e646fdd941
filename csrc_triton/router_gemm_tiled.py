"""Tiled tensor-core router GEMM for large M (prefill).

Invariant: one program owns a [BLOCK_M, BLOCK_N] output tile and reduces the whole K in order,
BLOCK_K at a time, into an fp32 accumulator that is stored once (fp32, or the output's dtype for
the ``bf16`` mode). With PROMOTE_CHUNKS > 0 (the ``fp32`` mode), every PROMOTE_CHUNKS chunks of
MMAs accumulate into a fresh fp32 register tile that is then added into the master accumulator:
tensor-core accumulation chains stay PROMOTE_CHUNKS * BLOCK_K long instead of K long, which is
what brings bf16 operands to fp32-upcast accuracy (~2e-7 at K=7168 instead of ~8e-6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.dot import DotMode, load_chunk, mma, promoted_group
from csrc_triton.environment import interpreting
from csrc_triton.launches import TiledLaunch


@triton.jit
def grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile number ``tile`` in grouped order: GROUP_M row blocks walk the
    N tiles together, so programs that run at the same time share weight tiles in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = (tile // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * num_n)) % size_m, (tile % (GROUP_M * num_n)) // size_m


@triton.jit
def _tiled_kernel(
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
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PROMOTE_CHUNKS == 0:
        for k0 in range(0, K, BLOCK_K):
            a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, k0, K, BLOCK_K)
            acc = mma(a, b, acc, DOT_MODE, UPCAST)
    else:
        for k0 in range(0, K, BLOCK_K * PROMOTE_CHUNKS):
            acc = promoted_group(
                x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST
            )

    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tiled_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, launch: TiledLaunch) -> torch.Tensor:
    """Write ``x @ w.T`` into ``out`` [M, N]. x, w: unit stride along K; out: unit stride along N."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return out
    grid = (cdiv(M, launch.block_m) * cdiv(N, launch.block_n),)
    _tiled_kernel[grid](
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
        BLOCK_K=launch.block_k,
        PROMOTE_CHUNKS=launch.promote_chunks,
        GROUP_M=launch.group_m,
        DOT_MODE=int(DotMode.of(x.dtype, w.dtype)),
        UPCAST=interpreting(),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
