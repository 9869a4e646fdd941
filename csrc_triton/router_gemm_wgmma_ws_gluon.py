"""The Gluon kernels of the warp-specialised wgmma router GEMM (Hopper, sm_90; Gluon with warp
specialisation: Triton >= 3.6). Imported only where :func:`csrc_triton.capability.gluon_available`
says this Triton has it; the sums they compute and the launcher are in ``router_gemm_wgmma_ws.py``.
"""

import functools

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
from triton.language.core import _aggregate as aggregate

from csrc_triton.launches import WGMMA_WS_BLOCK_M as BLOCK_M
from csrc_triton.launches import WGMMA_WS_PDL_EARLY, WGMMA_WS_PDL_LATE

# Triton 3.6 calls the TMA load async_copy_global_to_shared; 3.9 renamed it async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_HALF = gl.constexpr(BLOCK_M // 2)  # rows per consumer warpgroup
_PDL_EARLY = gl.constexpr(WGMMA_WS_PDL_EARLY)
_PDL_LATE = gl.constexpr(WGMMA_WS_PDL_LATE)


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


def tma_descriptor(t: torch.Tensor, block_rows: int, block_k: int):
    """A TMA descriptor reading [block_rows, block_k] blocks of the 2-D row-major ``t``."""
    layout = _smem_layout(block_rows, block_k, t.dtype)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, block_k], layout)
