"""Warp-specialised wgmma router GEMM for the ``fp32`` mode at prefill sizes (Hopper, sm_90).

Invariant: every output element is the sum, in K order, of fp32 totals of MMA chains no longer
than PROMOTE_CHUNKS * BLOCK_K (<= 256) along K: each chain starts from zero on the tensor cores
and is added into an fp32 register total once its last wgmma has retired ("promotion"), as in
the Triton kernels' fp32 mode. With a K split, each split's total is written as a partial and the
partials are added in split order 0..S-1 (deterministic; no atomics).

Why a second kernel for the same sums: in a Triton ``tl.dot`` loop every promotion drains the
tensor cores (the add must wait for its chain), ~28 % at large M. Here (Gluon, Triton's
lower-level dialect) one producer warp streams TMA loads of a [128, BLOCK_K] activation block
and a [BLOCK_N, BLOCK_K] weight block into a num_stages-deep shared-memory ring, and two consumer
warpgroups each own 64 rows of the 128 x BLOCK_N tile (sharing the weight block): while one
drains and adds, the other's wgmmas keep the tensor cores busy, and the loads never wait on
either (times in docs/kernels.md). A 64-row tile has one consumer warpgroup: twice the programs
where 128-row tiles are too few for the SMs, two programs resident on an SM, each the other's
overlap.

More forms, with the same chains and adds per logit: a tile of 128 + a 16/32-column tail (160
experts in one tile; the tail is carried by the default partition, which grows to 256 registers
with ``setmaxnreg``); 128 + a 64-column tail (192-wide tiles: each consumer carries the tail for
its own 64 rows, the second one raised to 232 registers, the loader lowered to 24). The K-split
sum may be a programmatic dependent launch (``pdl``: let go at the start of this kernel or once
each partition has issued its last work).

The Gluon kernels themselves are in ``router_gemm_wgmma_ws_gluon.py`` (imported where this Triton
has Gluon); they compile for the GPU only (no ``TRITON_INTERPRET=1``): CPU CI compiles them for
sm_90 (``python -m vllm_router_ext.tools.compile_check``); the GPU tests check their numbers.
"""

import torch

from csrc_triton import cdiv
from csrc_triton.capability import gluon_available
from csrc_triton.launches import WGMMA_WS_BLOCK_M as BLOCK_M  # two consumer warpgroups x one m64 wgmma
from csrc_triton.launches import WGMMA_WS_BLOCK_MS, WGMMA_WS_PDL_EARLY, WGMMA_WS_PDL_LATE, WgmmaWsLaunch
from csrc_triton.pdl import pdl_enabled
from csrc_triton.split_sum import reduce_partials

MAX_CHAIN = 256  # the fp32 mode's longest MMA chain along K

GLUON = gluon_available()  # the kernels' module imports only where this Triton has Gluon


#: Registers per thread at launch: Gluon pads the loader warp to a warpgroup, so 384 threads x 168
#: fill the 64K register file (a launch cannot reserve more). ``setmaxnreg`` then moves registers
#: between the partitions, as long as they add up: the default partition takes up to 256 and
#: the loader 40, so the default one, not the second consumer, carries a 16/32-column tail for
#: all 128 rows (64 x 128 + 128 x 32 columns: 192 accumulator registers per thread, chain and
#: total).
WORKER_REGISTERS = 168

#: Registers per thread at launch for a 64-row tile (one consumer warpgroup and the loader, 256
#: threads): two programs fit an SM's register file; the consumer takes what the loader gives up.
ONE_CONSUMER_REGISTERS = 128

#: Tail widths (columns beyond the 128-wide accumulator).
TAILS = (0, 16, 32, 64)
#: A 64-column tail is split between the two consumer partitions (each its own 64 rows):
#: the second consumer then holds 192 accumulator registers, so it is raised to 232 and the
#: loader lowered to 24 (128 x (256 + 232 + 24) = the whole file; the launch stays at 168).
SPLIT_TAIL_REGISTERS = 232


def wgmma_ws_launch(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, launch: WgmmaWsLaunch
) -> torch.Tensor:
    """Write ``x @ w.T`` (fp32-mode sums) into the fp32 ``out`` [M, N] (unit stride along N).
    ``k_per_split`` 0 or >= K: no split; else fp32 partials [S, M, N] added in split order.
    ``block_n_tail`` (0, 16, 32 or 64): each tile is block_n + block_n_tail columns wide, the
    last ones on a second, narrower accumulator (160 = 128 + 32 and 192 = 128 + 64 experts in one
    tile; tile widths must otherwise be powers of two): a 16/32-column tail on the first consumer
    for all 128 rows, a 64-column one split between the two. ``pdl`` (``WGMMA_WS_PDL_EARLY`` or
    ``WGMMA_WS_PDL_LATE``; 0: off): the partials' sum is a programmatic dependent launch where the GPU
    has it (``csrc_triton/pdl.py``), let go at the start of the first kernel or once its last
    loads and chains are issued. The same bits either way. ``block_m`` 128 (two consumer
    warpgroups) or 64 (one; no tail): the same sums per logit."""
    from csrc_triton import router_gemm_wgmma_ws_gluon as kernels

    M, K = x.shape
    N = w.shape[0]
    lc = launch
    if out.dtype != torch.float32:
        raise ValueError(f"wgmma_ws writes fp32 logits; got out dtype {out.dtype}")
    if lc.promote_chunks < 2 or lc.promote_chunks * lc.block_k > MAX_CHAIN:
        raise ValueError(
            f"promote_chunks={lc.promote_chunks} with block_k={lc.block_k}: chains must be 2..{MAX_CHAIN} "
            "along K in at least two chunks"
        )
    if lc.block_n_tail not in TAILS or lc.block_n_tail >= lc.block_n:
        allowed = ", ".join(map(str, TAILS))
        raise ValueError(f"block_n_tail={lc.block_n_tail}; allowed: {allowed} (below block_n={lc.block_n})")
    if lc.block_m not in WGMMA_WS_BLOCK_MS or (lc.block_m != BLOCK_M and lc.block_n_tail):
        allowed = ", ".join(map(str, WGMMA_WS_BLOCK_MS))
        raise ValueError(f"block_m={lc.block_m}; allowed: {allowed} (a tail needs {BLOCK_M} rows)")
    if lc.pdl not in (0, WGMMA_WS_PDL_EARLY, WGMMA_WS_PDL_LATE):
        raise ValueError(
            f"pdl={lc.pdl}; allowed: 0 (off), {WGMMA_WS_PDL_EARLY} (early), {WGMMA_WS_PDL_LATE} (late)"
        )
    if M == 0:
        return out
    split_tail = lc.block_n_tail > 32
    kps = lc.k_per_split if 0 < lc.k_per_split < K else K
    n_chunks = cdiv(kps, lc.block_k)
    split = cdiv(K, kps)
    part = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    x_desc = kernels.tma_descriptor(x, lc.block_m, lc.block_k)
    w_desc = kernels.tma_descriptor(w, lc.block_n, lc.block_k)
    t_desc = kernels.tma_descriptor(w, lc.block_n_tail, lc.block_k) if lc.block_n_tail else w_desc
    grid = (cdiv(N, lc.block_n + lc.block_n_tail), cdiv(M, lc.block_m), split)
    regs = WORKER_REGISTERS if lc.block_m == BLOCK_M else ONE_CONSUMER_REGISTERS
    pdl = lc.pdl if lc.pdl and split > 1 and pdl_enabled(out.device) else 0
    kernels._wgmma_ws_kernel[grid](
        x_desc, w_desc, t_desc, part, M, N, part.stride(0) if split > 1 else 0, part.stride(-2),
        K, n_chunks * lc.block_k, lc.promote_chunks, lc.num_stages, lc.block_n_tail,
        SPLIT_TAIL_REGISTERS if split_tail else WORKER_REGISTERS, split_tail, pdl,
        num_warps=4, maxnreg=regs,
    )  # fmt: skip
    if split > 1:
        reduce_partials(part, out, pdl > 0)
    return out
