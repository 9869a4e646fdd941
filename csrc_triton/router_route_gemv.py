"""The fused router for decode: gate GEMV, scores, grouped top-k and weights in one launch.

Invariant: the logits are those of the GEMV (``router_gemm_gemv``, same launch, same sums, bit for
bit) and each token's experts are :func:`csrc_triton.routing.route_rows` of them, so the fused
router and "GEMV, then the routing kernel" agree exactly.

Each program computes its [BLOCK_M, BLOCK_N] logits tile, stores it, and takes a ticket for its
token block (an acquire-release atomic): the program that draws the last ticket finds every tile
of those tokens in memory (in L2: the logits never make a round trip to HBM between two kernels),
routes them, and resets the ticket for the next launch. No program waits on another.

The tickets are one int32 per token block, per device and stream (``tickets.py``): launches on one
stream run one after another, so each finds its tickets at zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.launches import GemvLaunch
from csrc_triton.router_gemm_gemv import gemv_block_k, gemv_tile
from csrc_triton.routing import RouteShape, Routing, route_rows, route_rows_per_program, routing_constexprs
from csrc_triton.tickets import zeroed_per_stream


@triton.jit
def _route_gemv_kernel(x_ptr, w_ptr, logits_ptr, bias_ptr, weights_ptr, ids_ptr, tickets_ptr, M, N, K,
                       stride_xm, stride_wn, stride_lm, stride_om, scaling, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                       COPY_STAGES: tl.constexpr, ROWS: tl.constexpr, N_EXPERTS: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                       GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr, K_P: tl.constexpr,
                       SCORING: tl.constexpr, BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    logits, offs_m, offs_n = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_m, pid_n, BLOCK_M,
                                       BLOCK_N, BLOCK_K, CHUNKS, COPY_STAGES)  # fmt: skip
    o = logits_ptr + offs_m[:, None].to(tl.int64) * stride_lm + offs_n[None, :]
    tl.store(o, logits, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    tl.debug_barrier()  # every thread's logits are stored before the ticket is taken
    # Release: this tile is visible before the ticket; acquire: the last sees every tile.
    ticket = tl.atomic_add(tickets_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        for r in tl.static_range(BLOCK_M // ROWS):
            route_rows(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om,
                       pid_m * BLOCK_M + r * ROWS, M, scaling, ROWS, N_EXPERTS, N_GROUP, TOPK_GROUP,
                       TOP_K, GROUPS_P, GROUP_P, K_P, SCORING, BIAS, RENORMALIZE, True)  # fmt: skip
        tl.atomic_xchg(tickets_ptr + pid_m, 0, sem="relaxed", scope="gpu")


#: (device, stream) -> the fused router's tickets (int32, one per token block, zero between launches).
_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def tickets_for(device: torch.device, blocks: int) -> torch.Tensor:
    """The zeroed tickets of the current stream on ``device`` (at least ``blocks`` of them)."""
    return zeroed_per_stream(_TICKETS, device, blocks, torch.int32, 256)


def route_gemv_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    routing: Routing,
    bias: torch.Tensor | None,
    logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    launch: GemvLaunch,
) -> None:
    """Write ``x @ w.T`` into ``logits`` [M, N] fp32 and each token's experts into ``weights``
    [M, top_k] fp32 and ``ids`` [M, top_k] int32 (same row stride), in one launch of ``launch``'s
    GEMV. x, w: unit stride along K; ``bias`` [N] fp32 when ``routing.bias``."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return
    block_k = gemv_block_k(x, w, launch.num_warps)
    chunks = cdiv(K, block_k)
    rows = min(launch.block_m, route_rows_per_program(RouteShape.of(N, routing)))
    grid = (cdiv(M, launch.block_m), cdiv(N, launch.block_n))
    _route_gemv_kernel[grid](
        x,
        w,
        logits,
        bias if routing.bias else logits,
        weights,
        ids,
        tickets_for(x.device, grid[0]),
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        logits.stride(0),
        weights.stride(0),
        float(routing.routed_scaling_factor),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=block_k,
        CHUNKS=chunks,
        COPY_STAGES=min(launch.copy_stages, chunks),
        ROWS=rows,
        **routing_constexprs(N, routing),
        num_warps=launch.num_warps,
        num_stages=1,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}),
    )


__all__ = ["route_gemv_launch", "tickets_for"]
