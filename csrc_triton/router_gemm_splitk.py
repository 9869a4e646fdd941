"""Split-K router GEMM: decode sizes, the fp32 mode at mid M, and batch-invariant routing.

Invariant: every output element is reduced over K in one order fixed by (K_PER_SPLIT, BLOCK_K,
PROMOTE_CHUNKS) alone: split s covers K[s*K_PER_SPLIT, (s+1)*K_PER_SPLIT) in BLOCK_K chunks, each
split's fp32 partial is written to a workspace, and the partials are added in split order
0, 1, ..., S-1. Rows never interact, so with one K split for every M the result of a row does not
depend on the batch it is in (the batch-invariant path relies on exactly that).

Why split-K: at decode sizes the GEMM is bound by reading the [N, K] weight once. Splitting N *and*
K gives enough programs to fill every SM, and each program loads its whole weight slice in
unrolled chunks, so many bytes are in flight per SM. With large tiles (num_stages > 1) the K loop
of a split is software-pipelined instead; it issues the same MMAs and additions in the same order,
so both forms give bitwise the same result for the same K structure.

Why one launch: each dependent kernel in a CUDA graph costs more launch and drain than reading the
weight (docs/kernels.md). So by default (TICKET) the program that finishes a tile last does the
reduction: each program stores its partial, then takes an integer ticket for
its tile; the one that draws S-1 adds all S partials in split order and resets the ticket to 0
for the next call. The ticket is the only atomic; the floating-point order never depends on which
program came last. ``ticket=False`` keeps the two-launch form (partials, then a reduce kernel);
with ``pdl`` on Hopper+ the reduce kernel is a programmatic dependent launch (``csrc_triton/pdl.py``):
launched while the partials are computed, it hides that launch (the tuner times both forms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.dot import DotMode, load_chunk, mma, promoted_group
from csrc_triton.environment import interpreting
from csrc_triton.launches import SplitKLaunch
from csrc_triton.pdl import launch_dependents, pdl_enabled
from csrc_triton.split_sum import reduce_partials
from csrc_triton.tickets import zeroed_per_stream


@triton.jit
def finish_split(
    acc,
    part_ptr,
    out_ptr,
    ticket_ptr,
    ticket_idx,
    pid_s,
    offs_m,
    offs_n,
    mask,
    stride_ps,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    TICKET: tl.constexpr,
):
    """Store split ``pid_s``'s fp32 tile ``acc``; with TICKET the last split of the tile to finish
    adds all partials in split order 0..S-1 and writes ``out``."""
    tile = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_s * stride_ps + tile, acc, mask=mask)
        if TICKET:
            tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
            ticket = tl.atomic_add(ticket_ptr + ticket_idx, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # fixed order: split 0, 1, ..., S-1
                    # .cg: read from L2, never from a stale L1 line of an earlier call
                    total += tl.load(
                        part_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(ticket_ptr + ticket_idx, 0, sem="relaxed", scope="gpu")


@triton.jit
def _all_splits_in_program(
    x_rows,
    w_cols,
    out_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PROMOTE_CHUNKS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program runs every split of its tile, in split order, and keeps the partials in
    registers: the same MMA chains, the same promotions (``acc + part``) and the same additions
    ``total + partial_s`` as the split programs plus :func:`finish_split`, so bitwise the same
    logits, without S partials per logit going through L2 (what large M pays for).
    One flat, software-pipelined loop over all chunks; the chains restart at the boundaries."""
    CHUNKS: tl.constexpr = K_PER_SPLIT // BLOCK_K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros_like(total)
    part = tl.zeros_like(total)
    for c in range(SPLIT_K * CHUNKS):
        # Split s = c // CHUNKS covers [s * K_PER_SPLIT, ...): chunk c starts at c * BLOCK_K.
        a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, c * BLOCK_K, K, BLOCK_K)
        part = mma(a, b, part, DOT_MODE, UPCAST)
        if PROMOTE_CHUNKS == CHUNKS:
            # One chain per split: the split's partial is 0 + part; neither it nor ``total``
            # (which starts at +0) can be -0, so adding ``part`` directly is bitwise the same
            # and saves a third accumulator tile.
            if (c + 1) % CHUNKS == 0:
                total += part
                part = tl.zeros_like(total)
        else:
            if (c + 1) % PROMOTE_CHUNKS == 0:
                acc = acc + part
                part = tl.zeros_like(total)
            if (c + 1) % CHUNKS == 0:
                total += acc
                acc = tl.zeros_like(total)
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _splitk_partials_kernel(
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
    PROMOTE_CHUNKS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    TICKET: tl.constexpr,
    UNROLL: tl.constexpr,
    SPLITS_IN_PROGRAM: tl.constexpr,
    PDL: tl.constexpr,
    FLAT_CHAIN: tl.constexpr,
):
    launch_dependents(PDL)  # the two-launch form's split sum may launch now (it waits for us)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_begin = pid_s * K_PER_SPLIT
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn

    if SPLITS_IN_PROGRAM:
        _all_splits_in_program(
            x_rows, w_cols, out_ptr, offs_m, offs_n, mask_m, mask_n, K, stride_om,
            BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, SPLIT_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST,
        )  # fmt: skip
    else:
        # Promotion: each group of PROMOTE_CHUNKS chunks is one short MMA chain added into the fp32
        # register accumulator. Unrolled (num_stages=1, small M: every load in flight at once) or a
        # software-pipelined loop (large tiles): the same operations in the same order either way.
        n_groups: tl.constexpr = K_PER_SPLIT // (BLOCK_K * PROMOTE_CHUNKS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if UNROLL:
            for c in tl.static_range(n_groups):
                k0 = k_begin + c * BLOCK_K * PROMOTE_CHUNKS
                acc = promoted_group(
                    x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST
                )
        elif FLAT_CHAIN and n_groups == 1:
            # One chain per split: a flat loop over its chunks, which the compiler pipelines (one
            # group of unrolled chunks leaves nothing to pipeline). The same MMAs into one
            # accumulator as the unrolled group; acc starts at +0, so 0 + chain is bitwise the chain.
            for c in range(K_PER_SPLIT // BLOCK_K):
                a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, k_begin + c * BLOCK_K, K, BLOCK_K)
                acc = mma(a, b, acc, DOT_MODE, UPCAST)
        else:
            for c in range(n_groups):
                k0 = k_begin + c * BLOCK_K * PROMOTE_CHUNKS
                acc = promoted_group(
                    x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST
                )

        finish_split(
            acc,
            part_ptr,
            out_ptr,
            ticket_ptr,
            pid_m * tl.num_programs(0) + pid_n,
            pid_s,
            offs_m,
            offs_n,
            mask_m[:, None] & mask_n[None, :],
            stride_ps,
            stride_pm,
            stride_om,
            SPLIT_K,
            TICKET,
        )


_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def _tickets(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 tickets, one per output tile."""
    return zeroed_per_stream(_TICKETS, device, tiles, torch.int32, 1 << 16)


def split_workspace(
    out: torch.Tensor, split_k: int, tiles: int, ticket: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(fp32 partials [S, M, N] -- or ``out`` itself for one split --, tickets, use_ticket) for a
    launch whose ``tiles`` output tiles are each reduced over ``split_k`` splits."""
    part = out
    if split_k > 1:
        part = torch.empty((split_k, *out.shape), dtype=torch.float32, device=out.device)
    use_ticket = ticket and split_k > 1
    return part, (_tickets(out.device, tiles) if use_ticket else part), use_ticket


def splitk_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, launch: SplitKLaunch) -> torch.Tensor:
    """Write ``x @ w.T`` into ``out`` [M, N] (any float dtype). x, w: unit stride along K.
    ``ticket=False``: two launches (partials, then :func:`reduce_partials`); with ``pdl`` the
    second one is a programmatic dependent launch where the GPU has it (``csrc_triton/pdl.py``).
    ``splits_in_program``: one program per tile runs all its splits (large M); same result.
    ``flat_chain``: a pipelined split that is one MMA chain loops over its chunks instead of
    unrolling them; same result."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return out
    lc = launch
    if lc.promote_chunks < 1 or lc.k_per_split % (lc.block_k * lc.promote_chunks):
        raise ValueError(
            f"k_per_split={lc.k_per_split} must hold whole promotions of promote_chunks={lc.promote_chunks} "
            f"x block_k={lc.block_k}"
        )
    split_k = cdiv(K, lc.k_per_split)
    grid = (cdiv(N, lc.block_n), 1 if lc.splits_in_program else split_k, cdiv(M, lc.block_m))
    if lc.splits_in_program:
        part, tickets, use_ticket = out, out, False
    else:
        part, tickets, use_ticket = split_workspace(out, split_k, grid[0] * grid[2], lc.ticket)
    two_launch = not use_ticket and part is not out
    pdl = lc.pdl and two_launch and pdl_enabled(out.device)
    _splitk_partials_kernel[grid](
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
        part.stride(0) if part is not out else 0,
        part.stride(-2),
        out.stride(0),
        BLOCK_M=lc.block_m,
        BLOCK_N=lc.block_n,
        BLOCK_K=lc.block_k,
        K_PER_SPLIT=lc.k_per_split,
        SPLIT_K=split_k,
        PROMOTE_CHUNKS=lc.promote_chunks,
        DOT_MODE=int(DotMode.of(x.dtype, w.dtype)),
        UPCAST=interpreting(),
        TICKET=use_ticket,
        UNROLL=lc.num_stages == 1,
        SPLITS_IN_PROGRAM=lc.splits_in_program,
        PDL=pdl,
        FLAT_CHAIN=lc.flat_chain,
        num_warps=lc.num_warps,
        num_stages=lc.num_stages,
    )
    if two_launch:
        reduce_partials(part, out, pdl)
    return out
