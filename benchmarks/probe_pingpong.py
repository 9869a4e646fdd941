"""Design probe (one device call): hide the fp32 mode's promotion behind a second warpgroup.

    python benchmarks/probe_pingpong.py [--out DIR] [--shapes ...] [--m ...]
    python benchmarks/probe_pingpong.py --compile-only 90     # local: sm_90 registers, ptxas notes

The ``fp32`` mode adds every MMA chain of <= 256 along K into an fp32 register total
("promotion"); the add must wait for the chain's last wgmma, so the tensor cores drain each time:
~28 % at large M in every Triton form tried, ~15-25 % in a Gluon kernel with two chains in one
warpgroup (ptxas serialises those wgmmas, C7514; ``probe_gluon.py``). DeepGEMM's answer is two
consumer warpgroups: while one drains and adds, the other's wgmmas keep the tensor cores busy.

This kernel (Gluon, ``gl.warp_specialize``): one producer warp streams TMA loads of a
[128, BK] activation block and a [BN, BK] weight block into a STAGES-deep ring; two consumer
warpgroups each own 64 rows of the 128 x BN output tile and read the same weight block. Each
consumer runs its own promoted chains (wgmma async, wait 0 at the chain's end, add into its
total, release the stage). With ``offset`` the second consumer's chains start half a chain
later, so the two never drain at the same time. ``nopromo``: one chain over the whole K (the
loop's own speed, not fp32-accurate). Optional K split: partials [S, M, N] summed by torch
(its time included).
"""

import argparse
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
from triton.language.core import _aggregate as aggregate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Triton 3.6 calls the TMA load async_copy_global_to_shared; 3.9 renamed it async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
HALF = gl.constexpr(64)  # rows per consumer warpgroup (one m64 wgmma)


@aggregate
class Plan:
    """Compile-time loop structure, passed to the worker partitions (a worker's plain constexpr
    arguments arrive there as runtime integers; an aggregate's constexpr fields do not)."""

    K: gl.constexpr
    LEAD2: gl.constexpr
    PROMOTE: gl.constexpr
    N_CHUNKS: gl.constexpr
    STAGES: gl.constexpr

    @triton.constexpr_function
    def __init__(self, K, LEAD2, PROMOTE, N_CHUNKS, STAGES):
        self.K = gl.constexpr(K)
        self.LEAD2 = gl.constexpr(LEAD2)
        self.PROMOTE = gl.constexpr(PROMOTE)
        self.N_CHUNKS = gl.constexpr(N_CHUNKS)
        self.STAGES = gl.constexpr(STAGES)


@gluon.jit
def _chain(a_bufs, b_bufs, ready, empty, i0, acc, ROW0: gl.constexpr, LEN: gl.constexpr,
           STAGES: gl.constexpr):  # fmt: skip
    """One fresh MMA chain over chunks i0 .. i0+LEN-1; every stage is released once its wgmma
    has retired. Returns the chain's sum (all wgmmas retired)."""
    for j in gl.static_range(LEN):
        i = i0 + j
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        a = a_bufs.index(s).slice(ROW0, HALF, dim=0)
        b = b_bufs.index(s).permute((1, 0))
        acc = warpgroup_mma(a, b, acc, use_acc=j > 0, is_async=True)
        if j > 0:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((i0 + LEN - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om, off_m, off_n, pid_s,
              ROW0: gl.constexpr, LEAD: gl.constexpr, PROMOTE: gl.constexpr, N_CHUNKS: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    """Rows ROW0 .. ROW0+63 of the tile: a first chain of LEAD chunks, chains of PROMOTE, then the
    rest; each chain added into the total."""
    BN: gl.constexpr = b_bufs.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    FULL: gl.constexpr = (N_CHUNKS - LEAD) // PROMOTE
    REST: gl.constexpr = N_CHUNKS - LEAD - FULL * PROMOTE
    acc = gl.zeros((HALF, BN), gl.float32, mma)
    total = _chain(a_bufs, b_bufs, ready, empty, 0, acc, ROW0, LEAD, STAGES)
    for c in range(FULL):
        acc = _chain(a_bufs, b_bufs, ready, empty, LEAD + c * PROMOTE, acc, ROW0, PROMOTE, STAGES)
        total = total + acc
    if REST > 0:
        acc = _chain(a_bufs, b_bufs, ready, empty, N_CHUNKS - REST, acc, ROW0, REST, STAGES)
        total = total + acc
    offs_m = off_m + ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    gl.store(ptrs, total, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@gluon.jit
def _producer_part(x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om,
                   off_m, off_n, pid_s, k_begin, k_end, plan):  # fmt: skip
    """One warp: TMA loads of every chunk of this split into the ring (chunks past the split's end
    are loaded from column K, out of bounds: zeros)."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    STAGES: gl.constexpr = plan.STAGES
    for i in range(plan.N_CHUNKS):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        k = k_begin + i * BK
        k = gl.where(k < k_end, k, plan.K)
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(x_desc, [off_m, k], ready.index(s), a_bufs.index(s))
        _tma_load(w_desc, [off_n, k], ready.index(s), b_bufs.index(s))


@gluon.jit
def _second_consumer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om,
                     off_m, off_n, pid_s, k_begin, k_end, plan):  # fmt: skip
    _consumer(a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om, off_m, off_n, pid_s,
              HALF, plan.LEAD2, plan.PROMOTE, plan.N_CHUNKS, plan.STAGES)  # fmt: skip


@gluon.jit
def _pingpong_kernel(x_desc, w_desc, out_ptr, M, N, stride_os, stride_om,
                     K: gl.constexpr, K_PER_SPLIT: gl.constexpr, PROMOTE: gl.constexpr,
                     LEAD2: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr):  # fmt: skip
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    N_CHUNKS: gl.constexpr = K_PER_SPLIT // BK
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    off_m = pid_m * BM
    off_n = pid_n * BN
    k_begin = pid_s * K_PER_SPLIT
    k_end = gl.minimum(k_begin + K_PER_SPLIT, K)

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)  # both consumers release a stage

    worker_args = (x_desc, w_desc, a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om,
                   off_m, off_n, pid_s, k_begin, k_end,
                   Plan(K, LEAD2, PROMOTE, N_CHUNKS, STAGES))  # fmt: skip
    # fmt: off
    # (the default partition's constexpr arguments must be written in place: a tuple variable
    # turns them into runtime integers)
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, M, N, stride_os, stride_om, off_m,
                         off_n, pid_s, 0, PROMOTE, PROMOTE, N_CHUNKS, STAGES)),
            (_second_consumer, worker_args),
            (_producer_part, worker_args),
        ],
        [4, 1],
        [REGS, 40],
    )
    # fmt: on


def pingpong(x, w, out, *, block_n=128, block_k=64, promote=4, offset=True, stages=4, k_per_split=0,
             regs=232, maxnreg=168):  # fmt: skip
    """out [S, M, N] fp32 (S = 1: the result). promote = chunks per chain (0: one chain)."""
    M, K = x.shape
    N = w.shape[0]
    kps = k_per_split if 0 < k_per_split < K else K
    n_chunks = -(-kps // block_k)
    promote = promote or n_chunks
    lead2 = max(promote // 2, 1) if offset else promote
    split = -(-K // kps)
    xl = gl.NVMMASharedLayout.get_default_for([128, block_k], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [128, block_k], xl)
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k], wl)
    grid = (-(-N // block_n), -(-M // 128), split)
    _pingpong_kernel[grid](
        xd, wd, out, M, N, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        K, n_chunks * block_k, promote, lead2, stages, regs, num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip
    return out


VARIANTS = [
    # (block_n, block_k, promote, offset, stages)
    (128, 64, 4, True, 4),
    (128, 64, 4, False, 4),
    (128, 64, 4, True, 6),
    (128, 128, 2, True, 3),
    (128, 64, 2, True, 4),
    (128, 64, 0, False, 4),  # no promotion: the loop's own speed
]


def _compile_only(arch: int) -> int:
    """Compile the variants for sm_<arch> on CPU tensors (no GPU): registers, spills, ptxas notes."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from vllm_router_ext.testing.aot import _resources

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = _pingpong_kernel
    x = torch.empty(4096, 7168, dtype=torch.bfloat16)
    w = torch.empty(256, 7168, dtype=torch.bfloat16)
    for bn, bk, pc, off, st in VARIANTS:
        xl = gl.NVMMASharedLayout.get_default_for([128, bk], gl.bfloat16)
        wl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
        xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [128, bk], xl)
        wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk], wl)
        n_chunks = 7168 // bk
        promote = pc or n_chunks
        lead2 = max(promote // 2, 1) if off else promote
        out = torch.empty(4096, 256)
        args = (xd, wd, out, 4096, 256, 0, 256, 7168, 7168, promote, lead2, st, 232)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binder(*args, num_warps=4, maxnreg=168)
        options, sig, constexprs, attrs = fn._pack_args(backend, {"num_warps": 4, "maxnreg": 168},
                                                        bound, spec, options)  # fmt: skip
        src = GluonASTSource(fn, sig, constexprs, attrs)
        tag = f"{bn}x{bk} pc{pc} off{int(off)} st{st}"
        try:
            k = triton.compile(src, target=target, options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 -- report and go on
            print(f"{tag}: {type(exc).__name__}: {str(exc)[-3000:]}")
            continue
        regs, stack = _resources(k)
        sass_waits = re.findall(r"WARPGROUP.DEPBAR[^\n]*", k.asm.get("sass", "") or "")
        ptx_waits = re.findall(r"wgmma.wait_group.sync.aligned \d+", k.asm["ptx"])
        print(f"{tag}: regs {regs} stack {stack} smem {k.metadata.shared} "
              f"ptx waits {sorted(set(ptx_waits))} sass depbar {len(sass_waits)}")  # fmt: skip
    return 0


def _probe_point(shape, m: int, splits: list[int]) -> dict:
    from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph
    from vllm_router_ext.ops import router_gemm
    from vllm_router_ext.precision import RouterPrecision

    xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
    ref = xs[0].double() @ ws[0].double().T
    scale = ref.norm().item()
    pairs = list(zip(xs, ws, strict=True))

    def err(o: torch.Tensor) -> float:
        return ((o.double() - ref).norm() / scale).item()

    t_cublas = time_graph([lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32) for x, w in pairs])
    t_ours = time_graph([lambda x=x, w=w: router_gemm(x, w, RouterPrecision.FP32) for x, w in pairs])
    e_ours = err(router_gemm(xs[0], ws[0], RouterPrecision.FP32))
    e_cublas = err(torch.mm(xs[0], ws[0].T, out_dtype=torch.float32))
    row = {"shape": shape.name, "m": m, "cublas_us": t_cublas, "cublas_err": e_cublas,
           "ours_fp32_us": t_ours, "ours_fp32_err": e_ours, "variants": []}  # fmt: skip
    print(f"{shape.name} M={m}: cuBLAS {t_cublas:.2f} (err {e_cublas:.1e})  shipped fp32 {t_ours:.2f} "
          f"({t_ours / t_cublas:.2f}x, err {e_ours:.1e})", flush=True)  # fmt: skip
    best = None
    for kps in splits:
        split = -(-shape.k // kps) if kps else 1
        parts = [torch.empty(split, m, shape.n, device="cuda") for _ in xs]
        for bn, bk, pc, off, st in VARIANTS:
            if kps and pc == 0:
                continue
            cfg = dict(block_n=bn, block_k=bk, promote=pc, offset=off, stages=st, k_per_split=kps)
            tag = f"{bn}x{bk} pc{pc} off{int(off)} st{st} kps{kps}"

            def call(x, w, p, c=cfg, split=split):
                pingpong(x, w, p, **c)
                return p[0] if split == 1 else p.sum(0)

            try:
                parts[0].fill_(float("nan"))
                e = err(call(xs[0], ws[0], parts[0]))
                calls = [lambda x=x, w=w, p=p: call(x, w, p) for (x, w), p in zip(pairs, parts, strict=True)]
                t = time_graph(calls)
            except Exception as exc:  # noqa: BLE001 -- a variant that does not build is reported
                print(f"  {tag}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"  {tag}: {t:.2f} us ({t / t_cublas:.2f}x cuBLAS, {t / t_ours:.2f}x shipped) err {e:.1e}",
                  flush=True)  # fmt: skip
            row["variants"].append({"cfg": tag, "us": t, "err": e})
            if pc and e < 1e-6 and (best is None or t < best[0]):
                best = (t, tag)
    if best:
        print(f"  best promoted: {best[1]} {best[0]:.2f} us = {best[0] / t_cublas:.2f}x cuBLAS, "
              f"{best[0] / t_ours:.2f}x shipped", flush=True)  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-pingpong-out")
    ap.add_argument("--shapes", default="DeepSeek-V3,Kimi-K2")
    ap.add_argument("--m", default="16384,8192,4096,2048,1024")
    ap.add_argument("--splits", default="0", help="K per split, 0 = none (partials summed by torch)")
    ap.add_argument("--compile-only", type=int, default=0, metavar="ARCH")
    args = ap.parse_args()
    if args.compile_only:
        return _compile_only(args.compile_only)
    from vllm_router_ext.benchmarking import SHAPE_BY_NAME

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = [int(v) for v in args.splits.split(",")]
    rows = []
    for name in args.shapes.split(","):
        for m in [int(v) for v in args.m.split(",")]:
            rows.append(_probe_point(SHAPE_BY_NAME[name], m, splits))
            (out_dir / "probe-pingpong.json").write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
