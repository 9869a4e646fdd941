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
either. Measured on the H200: 0.73-0.77x the Triton fp32
kernel's time at 8192-16384 tokens, 1.01-1.24x cuBLAS's bf16 GEMM.

More forms, with the same chains and adds per logit: a tile of 128 + a 16/32-column tail (160
experts in one tile; the tail is carried by the default partition, which grows to 256 registers
with ``setmaxnreg``); 128 + a 64-column tail (192-wide tiles: each consumer carries the tail for
its own 64 rows, the second one raised to 232 registers, the loader lowered to 24); one 8-warp
consumer partition (``consumers=1``: both warpgroups in the default partition); and stream-K
(groups of programs share the row blocks' chains evenly; shared tiles' partials are added in K
order by a fixup kernel). The K-split sum and the fixup may be programmatic dependent launches
(``pdl``: let go at the start of this kernel or once each partition has issued its last work).

Gluon kernels compile for the GPU only (no ``TRITON_INTERPRET=1``): CPU CI compiles them for
sm_90 (``python -m vllm_router_ext.testing.aot``); the GPU tests check their numbers.
"""

import functools

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.capability import gluon_available, wgmma_ws_problem
from csrc_triton.configs import FP32_MAX_BLOCK_K
from csrc_triton.configs import WGMMA_WS_BLOCK_M as BLOCK_M  # two consumer warpgroups x one m64 wgmma
from csrc_triton.pdl import launch_options, pdl_enabled, wait_for_primary

MAX_CHAIN = 2 * FP32_MAX_BLOCK_K  # the fp32 mode's longest MMA chain along K
#: ``pdl`` values: where the K-split kernel lets its split sum launch (programmatic dependent
#: launch): at its start, or once each partition has issued its last load / chain. On the H200 the
#: early trigger slowed launches that fill >= 112 of the 132 SMs.
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
                         TAIL: gl.constexpr, REGS: gl.constexpr, ONE_CONSUMER: gl.constexpr,
                         SPLIT_TAIL: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
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
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=1 if ONE_CONSUMER else 2)  # each consumer releases

        worker_args = (x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N,
                       stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end,
                       _Plan(K, PROMOTE, N_CHUNKS, STAGES, TAIL, SPLIT_TAIL, PDL == _PDL_LATE))  # fmt: skip
        # fmt: off
        # The default partition's constexpr arguments are written in place: gathered in a tuple
        # variable first, they would arrive as runtime integers.
        if ONE_CONSUMER:  # 8 warps, all 128 rows: up to 240 registers each (a 64-column tail)
            gl.warp_specialize(
                [
                    (_consumer, (a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N, stride_os,
                                stride_om, off_m, off_n, pid_s, 0, BM, PROMOTE, N_CHUNKS, STAGES,
                                TAIL, BM, PDL == _PDL_LATE)),
                    (_loader, worker_args),
                ],
                [1],
                [40],
            )
        else:
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
        # fmt: on

    # Stream-K form: G groups of tiles_n programs (one per SM in all) share the 128-row blocks'
    # chains evenly. Group g runs the chains [g * U // G, (g + 1) * U // G) of the U = row blocks x
    # CHAINS in row order, so it covers the end of one row block, whole ones and the start of
    # another; its tiles_n programs (adjacent program ids, launched together) do so for each
    # column tile, reading the same activation chunks at the same time (one HBM read, as in the
    # one-tile-per-program form). A tile run by one group is stored as logits; a tile shared by
    # several is stored as one partial per group (slot = g - the row block's first group) and
    # added in slot order (= K order) by _streamk_fixup_kernel. Without it, 192 tiles (Kimi-K2,
    # 8192 tokens) take two full waves on 132 SMs.

    @aggregate
    class _StreamPlan:
        """Compile-time structure of the stream-K partitions (see _Plan)."""

        K: gl.constexpr
        PROMOTE: gl.constexpr
        CHAINS: gl.constexpr
        STAGES: gl.constexpr

        @triton.constexpr_function
        def __init__(self, K, PROMOTE, CHAINS, STAGES):
            self.K = gl.constexpr(K)
            self.PROMOTE = gl.constexpr(PROMOTE)
            self.CHAINS = gl.constexpr(CHAINS)
            self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def _sk_consumer(a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N, stride_om, stride_ws,
                     stride_wm, units, tiles_n, ROW0: gl.constexpr, PROMOTE: gl.constexpr,
                     CHAINS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Rows ROW0 .. ROW0+63 of every tile segment of this program, in chains of PROMOTE."""
        BN: gl.constexpr = b_bufs.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        g = gl.program_id(0) // tiles_n
        groups = gl.num_programs(0) // tiles_n
        u0 = g * units // groups
        u1 = (g + 1) * units // groups
        acc = gl.zeros((_HALF, BN), gl.float32, mma)
        i = 0
        for t in range(u0 // CHAINS, (u1 - 1) // CHAINS + 1):  # row blocks
            c0 = gl.maximum(u0 - t * CHAINS, 0)
            c1 = gl.minimum(u1 - t * CHAINS, CHAINS)
            total = gl.zeros((_HALF, BN), gl.float32, mma)
            for _c in range(c0, c1):
                acc, _ = _chain(a_bufs, b_bufs, b_bufs, ready, empty, i, acc, acc, ROW0, _HALF,
                                PROMOTE, STAGES, 0, 0)  # fmt: skip
                total = total + acc
                i += PROMOTE
            off_m = t * (2 * _HALF) + ROW0
            off_n = (gl.program_id(0) % tiles_n) * BN
            if (c0 == 0) & (c1 == CHAINS):
                _store(out_ptr, total, M, N, 0, stride_om, off_m, off_n, 0, mma)
            else:
                slot = g - ((t * CHAINS + 1) * groups - 1) // units
                _store(ws_ptr, total, M, N, stride_ws, stride_wm, off_m, off_n, slot, mma)

    @gluon.jit
    def _sk_loader(x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N, stride_om,
                   stride_ws, stride_wm, units, tiles_n, plan):  # fmt: skip
        """One warp: TMA loads of every chunk of this program's chains, in the consumers' order."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        STAGES: gl.constexpr = plan.STAGES
        g = gl.program_id(0) // tiles_n
        groups = gl.num_programs(0) // tiles_n
        u0 = g * units // groups
        u1 = (g + 1) * units // groups
        off_n = (gl.program_id(0) % tiles_n) * BN
        i = 0
        for t in range(u0 // plan.CHAINS, (u1 - 1) // plan.CHAINS + 1):
            c0 = gl.maximum(u0 - t * plan.CHAINS, 0)
            c1 = gl.minimum(u1 - t * plan.CHAINS, plan.CHAINS)
            off_m = t * BM
            for q in range((c1 - c0) * plan.PROMOTE):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                k = (c0 * plan.PROMOTE + q) * BK
                k = gl.where(k < plan.K, k, plan.K)  # past K: zeros (a last, shorter chain)
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                _tma_load(x_desc, [off_m, k], ready.index(s), a_bufs.index(s))
                _tma_load(w_desc, [off_n, k], ready.index(s), b_bufs.index(s))
                i += 1

    @gluon.jit
    def _sk_second_consumer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N,
                            stride_om, stride_ws, stride_wm, units, tiles_n, plan):  # fmt: skip
        _sk_consumer(a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N, stride_om, stride_ws,
                     stride_wm, units, tiles_n, _HALF, plan.PROMOTE, plan.CHAINS, plan.STAGES)  # fmt: skip

    @gluon.jit
    def _wgmma_ws_streamk_kernel(x_desc, w_desc, out_ptr, ws_ptr, M, N, stride_om, stride_ws,
                                 stride_wm, units, tiles_n, K: gl.constexpr, PROMOTE: gl.constexpr,
                                 STAGES: gl.constexpr, REGS: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
        _launch_dependents(PDL)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        CHAINS: gl.constexpr = (K + PROMOTE * BK - 1) // (PROMOTE * BK)
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=2)
        plan = _StreamPlan(K, PROMOTE, CHAINS, STAGES)
        worker_args = (x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N, stride_om,
                       stride_ws, stride_wm, units, tiles_n, plan)  # fmt: skip
        # fmt: off
        gl.warp_specialize(
            [
                (_sk_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, M, N, stride_om,
                               stride_ws, stride_wm, units, tiles_n, 0, PROMOTE, CHAINS, STAGES)),
                (_sk_second_consumer, worker_args),
                (_sk_loader, worker_args),
            ],
            [4, 1],
            [REGS, 40],
        )
        # fmt: on


@triton.jit
def _streamk_fixup_kernel(ws_ptr, out_ptr, M, N, stride_ws, stride_wm, stride_om, units, groups,
                          tiles_n, CHAINS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          SUB_M: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One program per SUB_M rows of a tile: a tile shared by several stream-K groups gets its
    partials added in slot order (its groups' order, i.e. K order); a tile run by one group is
    already stored. The slot loads are unrolled (masked past the tile's count) so that they are
    all in flight at once: a loop of dependent loads measured ~1 µs per slot."""
    wait_for_primary(PDL)  # launched early (PDL): the slots are complete only past this
    pid = tl.program_id(0)
    tile = pid // (BM // SUB_M)
    t = tile // tiles_n  # row block
    first = ((t * CHAINS + 1) * groups - 1) // units
    count = ((t + 1) * CHAINS * groups - 1) // units - first + 1
    if count > 1:
        cols = (tile % tiles_n) * BN + tl.arange(0, BN)
        rows = t * BM + (pid % (BM // SUB_M)) * SUB_M + tl.arange(0, SUB_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * stride_wm + cols[None, :]
        total = tl.load(ws_ptr + offs, mask=mask)
        for j in tl.static_range(1, SLOTS):
            rows_j = tl.where(count > j, M, 0)  # no rows past the tile's last slot
            mask_j = (rows[:, None] < rows_j) & (cols[None, :] < N)
            total += tl.load(ws_ptr + j * stride_ws + offs, mask=mask_j, other=0.0)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], total, mask=mask)


def streamk_schedule(units: int, groups: int, chains: int) -> list[list[tuple[int, int]]]:
    """Per row block, the (group, chains) segments of a stream-K launch, in K order: the kernels'
    arithmetic written out (for the tests)."""
    tiles: list[list[tuple[int, int]]] = [[] for _ in range(units // chains)]
    for p in range(groups):
        u0, u1 = p * units // groups, (p + 1) * units // groups
        for t in range(u0 // chains, (u1 - 1) // chains + 1) if u1 > u0 else ():
            c0, c1 = max(u0 - t * chains, 0), min(u1 - t * chains, chains)
            tiles[t].append((p, c1 - c0))
    return tiles


@functools.cache  # once per token count: the dispatch calls it on every launch
def streamk_slots(units: int, groups: int, chains: int) -> int:
    """Most groups sharing one row block: the partial slots of the workspace (as the kernels count)."""
    return max(
        ((t + 1) * chains * groups - 1) // units - ((t * chains + 1) * groups - 1) // units + 1
        for t in range(units // chains)
    )


def unsupported_reason(x: torch.Tensor, w: torch.Tensor, capability: int) -> str | None:
    """Why this kernel cannot run these operands here (None: it can): not under the interpreter
    (Gluon kernels have none), the GPU, Triton and dtype rule (``capability.wgmma_ws_problem``),
    then TMA-compatible layouts: unit stride along K, 16-byte-aligned row strides and addresses."""
    from csrc_triton.environment import interpreting

    if interpreting():
        return "TRITON_INTERPRET=1 (Gluon kernels have no interpreter)"
    problem = wgmma_ws_problem(capability, x.dtype, w.dtype)
    if problem is not None:
        return problem
    for name, t in (("x", x), ("weight", w)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} layout (stride {tuple(t.stride())}, not 16-byte aligned rows)"
    return None


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
#: total). With ``consumers=1`` the default partition is both consumer warpgroups (8 warps, all
#: 128 rows) and takes the rest of the file, 240 registers a thread.
WORKER_REGISTERS = 168

#: Tail widths (columns beyond the 128-wide accumulator) and consumer-partition counts.
TAILS = (0, 16, 32, 64)
CONSUMERS = (1, 2)
#: A 64-column tail with two consumer partitions is split between them (each its own 64 rows):
#: the second consumer then holds 192 accumulator registers, so it is raised to 232 and the
#: loader lowered to 24 (128 x (256 + 232 + 24) = the whole file; the launch stays at 168).
SPLIT_TAIL_REGISTERS = 232


def wgmma_ws_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    block_n: int,
    block_k: int,
    promote_chunks: int,
    num_stages: int,
    k_per_split: int = 0,
    block_n_tail: int = 0,
    stream_k: int = 0,
    consumers: int = 2,
    pdl: int = 0,
) -> torch.Tensor:
    """Write ``x @ w.T`` (fp32-mode sums) into the fp32 ``out`` [M, N] (unit stride along N).
    ``k_per_split`` 0 or >= K: no split; else fp32 partials [S, M, N] added in split order.
    ``block_n_tail`` (0, 16, 32 or 64): each tile is block_n + block_n_tail columns wide, the
    last ones on a second, narrower accumulator (160 = 128 + 32 and 192 = 128 + 64 experts in one
    tile; tile widths must otherwise be powers of two). ``consumers``: 2 consumer partitions of
    64 rows each (a 16/32-column tail on the first for all 128 rows, a 64-column one split
    between them), or 1 of 8 warps for all 128 rows. ``stream_k`` > 0: that many programs (at
    most one per SM: the ring fills shared memory) share the tiles' chains evenly instead (no K
    split, no tail, two consumers). ``pdl`` (:data:`PDL_EARLY` or :data:`PDL_LATE`; 0: off): the
    partials' sum (or stream-K fixup) is a programmatic dependent launch where the GPU has it
    (``csrc_triton/pdl.py``), let go at the start of the first kernel or once its last loads and
    chains are issued (stream-K: at its start). The same bits either way."""
    from csrc_triton.router_gemm_splitk import reduce_partials

    M, K = x.shape
    N = w.shape[0]
    if out.dtype != torch.float32:
        raise ValueError(f"wgmma_ws writes fp32 logits; got out dtype {out.dtype}")
    if promote_chunks < 2 or promote_chunks * block_k > MAX_CHAIN:
        raise ValueError(
            f"promote_chunks={promote_chunks} with block_k={block_k}: chains must be 2..{MAX_CHAIN} "
            "along K in at least two chunks"
        )
    if consumers not in CONSUMERS:
        raise ValueError(f"consumers={consumers}; allowed: {', '.join(map(str, CONSUMERS))}")
    if block_n_tail not in TAILS or block_n_tail >= block_n:
        allowed = ", ".join(map(str, TAILS))
        raise ValueError(f"block_n_tail={block_n_tail}; allowed: {allowed} (below block_n={block_n})")
    if stream_k and (block_n_tail or 0 < k_per_split < K or consumers != 2):
        raise ValueError(
            f"stream_k={stream_k} shares whole tiles' chains: k_per_split and block_n_tail must be 0, "
            "consumers 2"
        )
    if pdl not in (0, PDL_EARLY, PDL_LATE):
        raise ValueError(f"pdl={pdl}; allowed: 0 (off), {PDL_EARLY} (early), {PDL_LATE} (late)")
    if M == 0:
        return out
    if stream_k:
        return _streamk_launch(x, w, out, block_n, block_k, promote_chunks, num_stages, stream_k, pdl)
    split_tail = consumers == 2 and block_n_tail > 32
    kps = k_per_split if 0 < k_per_split < K else K
    n_chunks = cdiv(kps, block_k)
    split = cdiv(K, kps)
    part = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    x_desc = _tma_descriptor(x, BLOCK_M, block_k)
    w_desc = _tma_descriptor(w, block_n, block_k)
    t_desc = _tma_descriptor(w, block_n_tail, block_k) if block_n_tail else w_desc
    grid = (cdiv(N, block_n + block_n_tail), cdiv(M, BLOCK_M), split)
    pdl = pdl if pdl and split > 1 and pdl_enabled(out.device) else 0
    _wgmma_ws_kernel[grid](
        x_desc, w_desc, t_desc, part, M, N, part.stride(0) if split > 1 else 0, part.stride(-2),
        K, n_chunks * block_k, promote_chunks, num_stages, block_n_tail,
        SPLIT_TAIL_REGISTERS if split_tail else WORKER_REGISTERS, consumers == 1, split_tail, pdl,
        num_warps=8 if consumers == 1 else 4, maxnreg=WORKER_REGISTERS,
    )  # fmt: skip
    if split > 1:
        reduce_partials(part, out, pdl > 0)
    return out


_FIXUP_ROWS = 16  # rows per fixup program: 16 x BN fp32 per slot, 16 values a thread at BN=128


def _streamk_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    block_n: int,
    block_k: int,
    promote: int,
    stages: int,
    programs: int,
    pdl: int,
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    chains = cdiv(K, promote * block_k)
    tiles_n = cdiv(N, block_n)
    units = cdiv(M, BLOCK_M) * chains  # row blocks x chains
    groups = min(max(1, programs // tiles_n), units)
    slots = streamk_slots(units, groups, chains)
    ws = torch.empty((slots, M, N), dtype=torch.float32, device=out.device) if slots > 1 else out
    x_desc = _tma_descriptor(x, BLOCK_M, block_k)
    w_desc = _tma_descriptor(w, block_n, block_k)
    pdl = bool(pdl) and slots > 1 and pdl_enabled(out.device)
    _wgmma_ws_streamk_kernel[(groups * tiles_n,)](
        x_desc, w_desc, out, ws, M, N, out.stride(0), ws.stride(0) if slots > 1 else 0, ws.stride(-2),
        units, tiles_n, K, promote, stages, WORKER_REGISTERS, pdl, num_warps=4, maxnreg=WORKER_REGISTERS,
    )  # fmt: skip
    if slots > 1:
        _streamk_fixup_kernel[(cdiv(M, BLOCK_M) * tiles_n * (BLOCK_M // _FIXUP_ROWS),)](
            ws, out, M, N, ws.stride(0), ws.stride(1), out.stride(0), units, groups, tiles_n,
            CHAINS=chains, BM=BLOCK_M, BN=block_n, SUB_M=_FIXUP_ROWS, SLOTS=slots, PDL=pdl, num_warps=4,
            **launch_options(pdl),
        )  # fmt: skip
    return out
