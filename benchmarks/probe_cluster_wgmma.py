"""Design probe (one device call): ``wgmma_ws``'s K-split sum inside a thread-block cluster.

    python benchmarks/probe_cluster_wgmma.py | tee probe-cluster-wgmma.log

The `fp32` mode's ``wgmma_ws`` buckets at 1024-4096 tokens split K in 2-4 parts so the 128-row
tiles fill the SMs, and add the fp32 partials in split order in a second kernel (Kimi-K2 at 2048
tokens: 4 partials of 2048 x 384, 12.6 MB through L2, and a launch). Here the S split programs of
a tile form one cluster (so they are resident together): each consumer partition stores its
partial rows and adds 1 to the tile's counter (release); the default partition waits until the
counter holds all 2S arrivals of this call (acquire; the counter is never reset, each call adds a
multiple of 2S), then each CTA adds 128 / S of the tile's rows from the S partials in split order
(0 + p0 + p1 + ...: the split sum's order, so the logits must be bitwise the table's) and stores
the logits: one launch. Same trick as ``probe_cluster.py`` to launch in clusters (compiled for one
CTA, the launcher's cluster size set on the compiled kernel): a probe, not a shipped path.

The first version met at the hardware cluster barrier (``barrier.cluster.arrive`` in every
partition, ``wait`` in the default one) and hung (``probe-cluster-wgmma-h200-session16-barrier-hang.log``),
most likely because that barrier waits for every thread that has not exited, and the
warp-specialised kernel has warps that run no partition (Gluon pads the 1-warp loader to a
warpgroup): they wait at the partitions' join barrier and never arrive.

Prints µs per call (CUDA graph, rotated weights): our bf16-fp32out and `fp32` (the table), the
table's ``wgmma_ws`` config with its second-kernel sum, and the clustered form, with the ratio to
bf16-fp32out and whether the logits are bitwise the table's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_cluster import h200_buckets, set_cluster_size  # noqa: E402  (benchmarks/ is on sys.path)
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

import csrc_triton.router_gemm_wgmma_ws as wgmma_ws  # noqa: E402
from csrc_triton import cdiv  # noqa: E402
from csrc_triton.router_gemm_wgmma_ws import (  # noqa: E402
    _HALF,
    BLOCK_M,
    SPLIT_TAIL_REGISTERS,
    WORKER_REGISTERS,
    _consumer,
    _loader,
    _Plan,
    _second_consumer,
    _tma_descriptor,
    mbarrier,
)
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402

_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _arrive(cnt_ptr, tile):
    """One lane of this 4-warp partition adds 1 to the tile's counter after the partition's stores
    (release); returns the counter's value before it (in every thread)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=layout)
    first = lane == 0
    _cta_barrier()  # every thread of the partition has stored its rows
    old = gl.atomic_add(
        cnt_ptr + tile + lane * 0, gl.where(first, 1, 0), mask=first, sem="release", scope="gpu"
    )
    return gl.max(gl.where(first, old, 0), axis=0)


@gluon.jit
def _wait_all(cnt_ptr, tile, old, ARRIVALS: gl.constexpr):
    """Spin until the tile's counter has every arrival of this call (a multiple of ARRIVALS per
    call: never reset). The cluster launch keeps the tile's CTAs resident together."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=layout)
    first = lane == 0
    target = old - old % ARRIVALS + ARRIVALS
    cur = old + 1
    while cur < target:
        seen = gl.atomic_add(cnt_ptr + tile + lane * 0, lane * 0, mask=first, sem="acquire", scope="gpu")
        cur = gl.max(gl.where(first, seen, 0), axis=0)
    _cta_barrier()


@gluon.jit
def _second_consumer_arrive(x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M,
                            N, stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end, plan, cnt_ptr,
                            tile):  # fmt: skip
    _second_consumer(x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, out_ptr, M, N,
                     stride_os, stride_om, off_m, off_n, pid_s, k_begin, k_end, plan)  # fmt: skip
    _arrive(cnt_ptr, tile)


@gluon.jit
def _consumer_sum(a_bufs, b_bufs, t_bufs, ready, empty, part_ptr, out_ptr, M, N, stride_ps, stride_pm,
                  stride_om, off_m, off_n, pid_s, PROMOTE: gl.constexpr, N_CHUNKS: gl.constexpr,
                  STAGES: gl.constexpr, TAIL: gl.constexpr, TAIL_ROWS: gl.constexpr, S: gl.constexpr,
                  WIDTH: gl.constexpr, COLS: gl.constexpr, cnt_ptr, tile):  # fmt: skip
    """The default partition: its 64 rows' chains and partial (as shipped), then its arrival and
    the wait for all 2S (the tile's counter), then rows pid_s * 128 / S ... of the tile summed over
    the S partials in split order."""
    _consumer(a_bufs, b_bufs, t_bufs, ready, empty, part_ptr, M, N, stride_ps, stride_pm, off_m, off_n,
              pid_s, 0, _HALF, PROMOTE, N_CHUNKS, STAGES, TAIL, TAIL_ROWS, False)  # fmt: skip
    old = _arrive(cnt_ptr, tile)
    _wait_all(cnt_ptr, tile, old, 2 * S)  # both consumer partitions of the S CTAs
    ROWS: gl.constexpr = 2 * _HALF // S
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    offs_m = off_m + pid_s * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    offs_n = off_n + cols
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N) & (cols[None, :] < WIDTH)
    tile = offs_m[:, None].to(gl.int64) * stride_pm + offs_n[None, :]
    total = gl.zeros((ROWS, COLS), gl.float32, layout)
    for s in gl.static_range(S):  # split order 0..S-1, as the second kernel's sum
        total += gl.load(part_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg")
    gl.store(out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :], total, mask=mask)


@gluon.jit
def _cluster_kernel(x_desc, w_desc, t_desc, part_ptr, out_ptr, cnt_ptr, M, N, stride_ps, stride_pm, stride_om,
                    K: gl.constexpr, K_PER_SPLIT: gl.constexpr, PROMOTE: gl.constexpr,
                    STAGES: gl.constexpr, TAIL: gl.constexpr, REGS: gl.constexpr,
                    SPLIT_TAIL: gl.constexpr, S: gl.constexpr, COLS: gl.constexpr):  # fmt: skip
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    N_CHUNKS: gl.constexpr = K_PER_SPLIT // BK
    pid = gl.program_id(0)  # ctaid.x: the cluster (one per column tile) pid // S, its rank pid % S
    pid_n = pid // S
    pid_s = pid % S
    pid_m = gl.program_id(1)
    off_m = pid_m * BM
    off_n = pid_n * (BN + TAIL)
    tile = pid_m * gl.num_programs(0) // S + pid_n
    k_begin = pid_s * K_PER_SPLIT
    k_end = gl.minimum(k_begin + K_PER_SPLIT, K)
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    if TAIL > 0:
        t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES, TAIL, BK], t_desc.layout)
    else:
        t_bufs = b_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)
    worker_args = (x_desc, w_desc, t_desc, a_bufs, b_bufs, t_bufs, ready, empty, part_ptr, M, N,
                   stride_ps, stride_pm, off_m, off_n, pid_s, k_begin, k_end,
                   _Plan(K, PROMOTE, N_CHUNKS, STAGES, TAIL, SPLIT_TAIL, False))  # fmt: skip
    second_args = worker_args + (cnt_ptr, tile)
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer_sum, (a_bufs, b_bufs, t_bufs, ready, empty, part_ptr, out_ptr, M, N, stride_ps,
                             stride_pm, stride_om, off_m, off_n, pid_s, PROMOTE, N_CHUNKS, STAGES, TAIL,
                             _HALF if SPLIT_TAIL else BM, S, BN + TAIL, COLS, cnt_ptr, tile)),
            (_second_consumer_arrive, second_args),
            (_loader, worker_args),
        ],
        [4, 1],
        [REGS, 24 if SPLIT_TAIL else 40],
    )
    # fmt: on


_PATCHED: set = set()
_COUNTERS: dict = {}


def kernel_args(x, w, out, cnt, *, block_n, block_k, promote_chunks, num_stages, k_per_split, block_n_tail=0):
    """(``_cluster_kernel``'s arguments, S, tile width) for one call: fresh partials, TMA descriptors."""
    M, K = x.shape
    N = w.shape[0]
    split = cdiv(K, k_per_split)
    assert BLOCK_M % split == 0, split
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    x_desc = _tma_descriptor(x, BLOCK_M, block_k)
    w_desc = _tma_descriptor(w, block_n, block_k)
    t_desc = _tma_descriptor(w, block_n_tail, block_k) if block_n_tail else w_desc
    split_tail = block_n_tail > 32
    width = block_n + block_n_tail
    args = (x_desc, w_desc, t_desc, part, out, cnt, M, N, part.stride(0), part.stride(1), out.stride(0), K,
            cdiv(k_per_split, block_k) * block_k, promote_chunks, num_stages, block_n_tail,
            SPLIT_TAIL_REGISTERS if split_tail else WORKER_REGISTERS, split_tail, split,
            1 << (width - 1).bit_length())  # fmt: skip
    return args, split, width


def counters(device, split: int) -> torch.Tensor:
    """int32 arrival counters, one buffer per split count (each call adds 2S per tile: a buffer
    shared by two split counts would stop being a multiple of either)."""
    key = (device, split)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def cluster_launch(x, w, out, **cfg):
    """``cfg``: the ``wgmma_ws`` bucket's (block_n, block_k, promote_chunks, num_stages,
    k_per_split[, block_n_tail])."""
    M, K = x.shape
    N = w.shape[0]
    args, split, width = kernel_args(x, w, out, counters(x.device, cdiv(K, cfg["k_per_split"])), **cfg)
    grid = (cdiv(N, width), cdiv(M, BLOCK_M), 1)  # x: clusters; the launcher multiplies by S
    key = (tuple(sorted(cfg.items())), M, N, K)
    if key not in _PATCHED:  # compile without launching (unclustered, the counters would wait forever)
        set_cluster_size(
            _cluster_kernel.warmup(*args, grid=grid, num_warps=4, maxnreg=WORKER_REGISTERS), split
        )
        _PATCHED.add(key)
    _cluster_kernel[grid](*args, num_warps=4, maxnreg=WORKER_REGISTERS)
    return out


CASES = (
    ("Kimi-K2", (2048, 1024, 4096)),
    ("DeepSeek-V3", (2048, 1024, 4096)),
    ("GLM-5", (2048, 1024, 4096)),
    ("DeepSeek-V2", (2048, 4096)),
)


def main() -> int:
    print(torch.cuda.get_device_name(), flush=True)
    for name, ms in CASES:
        shape = SHAPE_BY_NAME[name]
        k, n = shape.k, shape.n
        for m in ms:
            bucket = next(b for b in h200_buckets(k, n, "fp32") if b["max_m"] is None or m <= b["max_m"])
            if bucket["kernel"] != "wgmma_ws" or not 0 < bucket["k_per_split"] < k:
                print(f"{name} M={m}: bucket {bucket['kernel']} kps {bucket.get('k_per_split')}: skipped")
                continue
            cfg = {
                key: bucket[key]
                for key in (
                    "block_n",
                    "block_k",
                    "promote_chunks",
                    "num_stages",
                    "k_per_split",
                    "block_n_tail",
                )
                if key in bucket
            }
            if cdiv(k, cfg["k_per_split"]) not in (2, 4, 8) or bucket.get("consumers", 2) != 2:
                print(f"{name} M={m}: {cfg}: split count or consumers not probed")
                continue
            xs, ws = make_inputs(m, k, n, rotation_copies(m, k, n), seed=m + 3)
            ref = router_gemm(xs[0], ws[0], "fp32")
            bf = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
            ours = time_rotated(lambda x, w: router_gemm(x, w, "fp32"), xs, ws)
            two = time_rotated_into(lambda x, w, o, c=cfg: wgmma_ws.wgmma_ws_launch(x, w, o, **c), xs, ws)
            line = f"{name} M={m} {cfg}: bf16-fp32out {bf:.2f} fp32 {ours:.2f} ({ours / bf:.3f}x) "
            line += f"two-kernel {two:.2f} ({two / bf:.3f}x)"
            print(line, "| cluster launch ...", flush=True)
            try:
                o = torch.full((m, n), float("nan"), device="cuda")
                cluster_launch(xs[0], ws[0], o, **cfg)
                torch.cuda.synchronize()
                same = bool(torch.equal(o, ref))
                t = time_rotated_into(lambda x, w, o, c=cfg: cluster_launch(x, w, o, **c), xs, ws)
                line += f" cluster {t:.2f} ({t / bf:.3f}x, {'bitwise =' if same else 'DIFFERS'})"
            except Exception as e:  # noqa: BLE001 - a probe: record and go on
                line += f" cluster: {type(e).__name__}: {str(e)[:160]}"
                torch.cuda.synchronize()
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
