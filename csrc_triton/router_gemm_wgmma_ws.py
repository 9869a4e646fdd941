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

Gluon kernels compile for the GPU only (no ``TRITON_INTERPRET=1``): CPU CI compiles them for
sm_90 (``python -m vllm_router_ext.testing.aot``); the GPU tests check their numbers.
"""

import functools

import torch
import triton

from csrc_triton import cdiv
from csrc_triton.capability import gluon_available
from csrc_triton.launches import WGMMA_WS_BLOCK_M as BLOCK_M  # two consumer warpgroups x one m64 wgmma
from csrc_triton.launches import WGMMA_WS_BLOCK_MS, WgmmaWsLaunch
from csrc_triton.pdl import pdl_enabled

MAX_CHAIN = 256  # the fp32 mode's longest MMA chain along K
#: ``pdl`` values: where the K-split kernel lets its split sum launch (programmatic dependent
#: launch): at its start, or once each partition has issued its last load / chain (the early
#: trigger slows launches that fill most SMs; the tuner times both).
PDL_EARLY = 1
PDL_LATE = 2

try:  # Gluon with Hopper warp specialisation: Triton >= 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate as aggregate

    GLUON = gluon_available()
except ImportError:  # an older Triton: the dispatch never selects this kernel
    GLUON = False

if GLUON:
    # Triton 3.6 calls the TMA load async_copy_global_to_shared; 3.9 renamed it async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _HALF = gl.constexpr(BLOCK_M // 2)  # rows per consumer warpgroup
    _PDL_EARLY = gl.constexpr(PDL_EARLY)
    _PDL_LATE = gl.constexpr(PDL_LATE)

    @gluon.jit
    def _launch_dependents(PDL: gl.constexpr):
        """The split sum after us may launch now (PDL; it waits for our writes): Gluon's form of
        ``csrc_triton.pdl.launch_dependents``."""
        if PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // dummy $0",
                "=r",
                [],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
            )

    @aggregate
    class _Plan:
        """Compile-time loop structure for the worker partitions (there, plain constexpr
        arguments arrive as runtime integers; an aggregate's constexpr fields do not)."""

        K: gl.constexpr
        PROMOTE: gl.constexpr
        N_CHUNKS: gl.constexpr
        STAGES: gl.constexpr
        TAIL: gl.constexpr
        SPLIT_TAIL: gl.constexpr
        LATE_TRIGGER: gl.constexpr

        @triton.constexpr_function
        def __init__(self, K, PROMOTE, N_CHUNKS, STAGES, TAIL, SPLIT_TAIL, LATE_TRIGGER):
            self.K = gl.constexpr(K)
            self.PROMOTE = gl.constexpr(PROMOTE)
            self.N_CHUNKS = gl.constexpr(N_CHUNKS)
            self.STAGES = gl.constexpr(STAGES)
            self.TAIL = gl.constexpr(TAIL)
            self.SPLIT_TAIL = gl.constexpr(SPLIT_TAIL)
            self.LATE_TRIGGER = gl.constexpr(LATE_TRIGGER)

    @gluon.jit
    def _chain(a_bufs, b_bufs, t_bufs, ready, empty, i0, acc, acc_t, ROW0: gl.constexpr,
               ROWS: gl.constexpr, LEN: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr,
               TAIL_ROWS: gl.constexpr):  # fmt: skip
        """One MMA chain from zero over chunks i0 .. i0+LEN-1 for rows ROW0 .. ROW0+ROWS-1 (one
        chunk's wgmmas in flight; with a tail, also its TAIL last columns, for all 128 rows or
        for the same rows: TAIL_ROWS); each ring stage is released once the wgmmas that read it
        have retired. ``acc_t`` is unused without a tail."""
        for j in gl.static_range(LEN):
            i = i0 + j
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            a = a_bufs.index(s).slice(ROW0, ROWS, dim=0)
            acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, use_acc=j > 0, is_async=True)
            if TAIL > 0:
                b_t = t_bufs.index(s).permute((1, 0))
                a_t = a_bufs.index(s) if TAIL_ROWS == 2 * _HALF else a
                acc_t = warpgroup_mma(a_t, b_t, acc_t, use_acc=j > 0, is_async=True)
            if j > 0:
                if TAIL > 0:
                    acc, acc_t = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_t))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        if TAIL > 0:
            acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc_t = acc
        mbarrier.arrive(empty.index((i0 + LEN - 1) % STAGES), count=1)
        return acc, acc_t

    @gluon.jit
    def _store(out_ptr, total, M, N, stride_os, stride_om, off_m, off_n, pid_s, layout: gl.constexpr):
        offs_m = off_m + gl.arange(0, total.shape[0], layout=gl.SliceLayout(1, layout))
        offs_n = off_n + gl.arange(0, total.shape[1], layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + pid_s * stride_os + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :]
        gl.store(ptrs, total, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @gluon.jit
    def _consumer(a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om, off_m,
                  off_n, pid_s, ROW0: gl.constexpr, ROWS: gl.constexpr, PROMOTE: gl.constexpr,
                  N_CHUNKS: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr,
                  TAIL_ROWS: gl.constexpr, LATE_TRIGGER: gl.constexpr):  # fmt: skip
        """Rows ROW0 .. ROW0+ROWS-1 of the tile's first BN columns (one warpgroup per 64 rows),
        and with TAIL > 0 its last TAIL columns, for all 128 rows or for the same rows
        (TAIL_ROWS): chains of PROMOTE chunks (the last one shorter), each added into the fp32
        total, which is stored once."""
        BN: gl.constexpr = b_bufs.shape[1]
        WARPS: gl.constexpr = ROWS // 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16]
        )
        FULL: gl.constexpr = N_CHUNKS // PROMOTE
        REST: gl.constexpr = N_CHUNKS - FULL * PROMOTE
        acc = gl.zeros((ROWS, BN), gl.float32, mma)
        total = gl.zeros((ROWS, BN), gl.float32, mma)
        if TAIL > 0:  # the tile's last TAIL columns: a second accumulator pair
            mma_t: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, TAIL, 16]
            )
            acc_t = gl.zeros((TAIL_ROWS, TAIL), gl.float32, mma_t)
            total_t = gl.zeros((TAIL_ROWS, TAIL), gl.float32, mma_t)
        else:
            acc_t = acc
            total_t = total
        for c in range(FULL):
            acc, acc_t = _chain(a_bufs, b_bufs, t_bufs, ready, empty, c * PROMOTE, acc, acc_t, ROW0,
                                ROWS, PROMOTE, STAGES, TAIL, TAIL_ROWS)  # fmt: skip
            total = total + acc
            if TAIL > 0:
                total_t = total_t + acc_t
        if REST > 0:
            acc, acc_t = _chain(a_bufs, b_bufs, t_bufs, ready, empty, FULL * PROMOTE, acc, acc_t,
                                ROW0, ROWS, REST, STAGES, TAIL, TAIL_ROWS)  # fmt: skip
            total = total + acc
            if TAIL > 0:
                total_t = total_t + acc_t
        _launch_dependents(LATE_TRIGGER)
        _store(out_ptr, total, M, N, stride_os, stride_om, off_m + ROW0, off_n, pid_s, mma)
        if TAIL > 0:
            tail_m = off_m if TAIL_ROWS == 2 * _HALF else off_m + ROW0
            _store(out_ptr, total_t, M, N, stride_os, stride_om, tail_m, off_n + BN, pid_s, mma_t)

    @gluon.jit
    def _loader(x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N,
                stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end, plan):  # fmt: skip
        """One warp: TMA loads of every chunk of this split into the ring. A chunk past the
        split's end is loaded from column K, wholly out of bounds: TMA fills it with zeros."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        STAGES: gl.constexpr = plan.STAGES
        NBYTES: gl.constexpr = (
            x_desc.block_type.nbytes
            + w_desc.block_type.nbytes
            + (t_desc.block_type.nbytes if plan.TAIL > 0 else 0)
        )
        for i in range(plan.N_CHUNKS):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            k = k_begin + i * BK
            k = gl.where(k < k_end, k, plan.K)
            mbarrier.expect(ready.index(s), NBYTES)
            _tma_load(x_desc, [off_m, k], ready.index(s), a_bufs.index(s))
            _tma_load(w_desc, [off_n, k], ready.index(s), b_bufs.index(s))
            if plan.TAIL > 0:
                _tma_load(t_desc, [off_n + w_desc.block_type.shape[0], k], ready.index(s), t_bufs.index(s))
        _launch_dependents(plan.LATE_TRIGGER)

    @gluon.jit
    def _second_consumer(x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M,
                         N, stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end, plan):  # fmt: skip
        _consumer(a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om, off_m,
                  off_n, pid_s, _HALF, _HALF, plan.PROMOTE, plan.N_CHUNKS, plan.STAGES,
                  plan.TAIL if plan.SPLIT_TAIL else 0, _HALF, plan.LATE_TRIGGER)  # fmt: skip

    @gluon.jit
    def _wgmma_ws_kernel(x_desc, w_desc, t_desc, out_ptr, M, N, stride_os, stride_om, K: gl.constexpr,
                         K_PER_SPLIT: gl.constexpr, PROMOTE: gl.constexpr, STAGES: gl.constexpr,
                         TAIL: gl.constexpr, REGS: gl.constexpr, SPLIT_TAIL: gl.constexpr,
                         PDL: gl.constexpr):  # fmt: skip
        _launch_dependents(PDL == _PDL_EARLY)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        N_CHUNKS: gl.constexpr = K_PER_SPLIT // BK
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_s = gl.program_id(2)
        off_m = pid_m * BM
        off_n = pid_n * (BN + TAIL)
        k_begin = pid_s * K_PER_SPLIT
        k_end = gl.minimum(k_begin + K_PER_SPLIT, K)

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        if TAIL > 0:
            t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES, TAIL, BK], t_desc.layout)
        else:
            t_bufs = b_bufs  # never read
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        CONSUMERS: gl.constexpr = BM // _HALF
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=CONSUMERS)  # each consumer releases

        worker_args = (x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N,
                       stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end,
                       _Plan(K, PROMOTE, N_CHUNKS, STAGES, TAIL, SPLIT_TAIL, PDL == _PDL_LATE))  # fmt: skip
        # fmt: off
        # The default partition's constexpr arguments are written in place: gathered in a tuple
        # variable first, they would arrive as runtime integers.
        if CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_consumer, (a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N, stride_os,
                                stride_om, off_m, off_n, pid_s, 0, _HALF, PROMOTE, N_CHUNKS, STAGES,
                                TAIL, _HALF if SPLIT_TAIL else BM, PDL == _PDL_LATE)),
                    (_second_consumer, worker_args),
                    (_loader, worker_args),
                ],
                [4, 1],
                [REGS, 24 if SPLIT_TAIL else 40],  # 128 x (256 + 232 + 24): the whole file
            )
        else:  # a 64-row tile: one consumer warpgroup, no tail
            gl.warp_specialize(
                [
                    (_consumer, (a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N, stride_os,
                                stride_om, off_m, off_n, pid_s, 0, _HALF, PROMOTE, N_CHUNKS, STAGES,
                                0, _HALF, PDL == _PDL_LATE)),
                    (_loader, worker_args),
                ],
                [1],
                [40],
            )
        # fmt: on


@functools.cache  # per launch otherwise: host time on every eager call
def _smem_layout(rows: int, block_k: int, dtype: torch.dtype):
    """The swizzled shared-memory layout TMA and wgmma use for a [rows, block_k] 16-bit block."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, block_k], gl_dtype)


def _tma_descriptor(t: torch.Tensor, block_rows: int, block_k: int):
    """A TMA descriptor reading [block_rows, block_k] blocks of the 2-D row-major ``t``."""
    layout = _smem_layout(block_rows, block_k, t.dtype)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, block_k], layout)


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
    for all 128 rows, a 64-column one split between the two. ``pdl`` (:data:`PDL_EARLY` or
    :data:`PDL_LATE`; 0: off): the partials' sum is a programmatic dependent launch where the GPU
    has it (``csrc_triton/pdl.py``), let go at the start of the first kernel or once its last
    loads and chains are issued. The same bits either way. ``block_m`` 128 (two consumer
    warpgroups) or 64 (one; no tail): the same sums per logit."""
    from csrc_triton.router_gemm_splitk import reduce_partials

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
    if lc.pdl not in (0, PDL_EARLY, PDL_LATE):
        raise ValueError(f"pdl={lc.pdl}; allowed: 0 (off), {PDL_EARLY} (early), {PDL_LATE} (late)")
    if M == 0:
        return out
    split_tail = lc.block_n_tail > 32
    kps = lc.k_per_split if 0 < lc.k_per_split < K else K
    n_chunks = cdiv(kps, lc.block_k)
    split = cdiv(K, kps)
    part = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    x_desc = _tma_descriptor(x, lc.block_m, lc.block_k)
    w_desc = _tma_descriptor(w, lc.block_n, lc.block_k)
    t_desc = _tma_descriptor(w, lc.block_n_tail, lc.block_k) if lc.block_n_tail else w_desc
    grid = (cdiv(N, lc.block_n + lc.block_n_tail), cdiv(M, lc.block_m), split)
    regs = WORKER_REGISTERS if lc.block_m == BLOCK_M else ONE_CONSUMER_REGISTERS
    pdl = lc.pdl if lc.pdl and split > 1 and pdl_enabled(out.device) else 0
    _wgmma_ws_kernel[grid](
        x_desc, w_desc, t_desc, part, M, N, part.stride(0) if split > 1 else 0, part.stride(-2),
        K, n_chunks * lc.block_k, lc.promote_chunks, lc.num_stages, lc.block_n_tail,
        SPLIT_TAIL_REGISTERS if split_tail else WORKER_REGISTERS, split_tail, pdl,
        num_warps=4, maxnreg=regs,
    )  # fmt: skip
    if split > 1:
        reduce_partials(part, out, pdl > 0)
    return out
