"""Design probe (one device call): the batch-invariant split sum inside a thread-block cluster.

    python benchmarks/probe_cluster.py [--out DIR] [--ms 1,2,4,8,16]

At 1-4 tokens the batch-invariant path is 1.5-2x the GEMV because its K splits live in
different programs: their fp32 partials are added in split order by a second (PDL) launch or by
the last program to take a ticket (an acq_rel atomic round trip plus a gpu-scope fence). Here the
S split programs of one output tile form one thread-block cluster (sm_90): each stores its
partial(s), all meet at one hardware cluster barrier (release / acquire at cluster scope), then
each adds a share of the tile's logits from the S partials in split order 0..S-1. Same K
structure as the table's batch-invariant buckets (K_PER_SPLIT, BLOCK_K, PROMOTE_CHUNKS), same
MMAs, same additions: the logits must be bitwise the table's, at every M.

Triton 3.6 has no cluster launch for a plain ``tl`` kernel except through ``num_ctas`` (which
also re-lays every tensor across the CTAs); the probe compiles with one CTA and sets the
launcher's cluster size on the compiled kernel (``packed_metadata``). Clusters over 8 CTAs are
non-portable: the function attribute is set through the driver. A probe, not a shipped path.

Prints µs per call (CUDA graph, rotated weights) against the table's batch-invariant path, the
fastest non-invariant path (the issue's 1.5x limit) and cuBLAS, and whether the logits are
bitwise the table's batch-invariant ones.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.configs import table_buckets, table_override  # noqa: E402
from csrc_triton.dot import promoted_group  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPES,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402


@triton.jit
def _cluster_sync(x):
    """Every thread of every CTA of the cluster: arrive (release), wait (acquire)."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, $1;",
        "=r,r",
        [x],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _split_partial(
    x_rows, w_cols, mask_m, mask_n, s, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, PROMOTE_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Split ``s``'s fp32 partial: the table's promoted groups (acc starts at +0)."""
    n_groups: tl.constexpr = K_PER_SPLIT // (BLOCK_K * PROMOTE_CHUNKS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(n_groups):
        k0 = s * K_PER_SPLIT + c * BLOCK_K * PROMOTE_CHUNKS
        acc = promoted_group(x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, 0, False)
    return acc


@triton.jit
def _cluster_kernel(
    x_ptr, w_ptr, part_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_ps, stride_pm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, CTAS: tl.constexpr, PROMOTE_CHUNKS: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # ctaid.x: cluster pid // CTAS, rank pid % CTAS
    pid_n = pid // CTAS
    rank = pid % CTAS
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    tile = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    PER_CTA: tl.constexpr = SPLIT_K // CTAS
    # Every split's loads before any partial is stored (a store may alias the next loads, so the
    # compiler keeps them below it). The first run stored each partial before the next split's
    # loads: 2 splits a CTA timed the same (probe-cluster-h200-session16-first.log).
    s0 = rank * PER_CTA
    a0 = _split_partial(
        x_rows, w_cols, mask_m, mask_n, s0, K, BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, PROMOTE_CHUNKS
    )
    a1 = a0
    a2 = a0
    a3 = a0
    if PER_CTA >= 2:
        a1 = _split_partial(
            x_rows, w_cols, mask_m, mask_n, s0 + 1, K, BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, PROMOTE_CHUNKS
        )
    if PER_CTA >= 3:
        a2 = _split_partial(
            x_rows, w_cols, mask_m, mask_n, s0 + 2, K, BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, PROMOTE_CHUNKS
        )
    if PER_CTA >= 4:
        a3 = _split_partial(
            x_rows, w_cols, mask_m, mask_n, s0 + 3, K, BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, PROMOTE_CHUNKS
        )
    tl.store(part_ptr + s0 * stride_ps + tile, a0, mask=mask)
    if PER_CTA >= 2:
        tl.store(part_ptr + (s0 + 1) * stride_ps + tile, a1, mask=mask)
    if PER_CTA >= 3:
        tl.store(part_ptr + (s0 + 2) * stride_ps + tile, a2, mask=mask)
    if PER_CTA >= 4:
        tl.store(part_ptr + (s0 + 3) * stride_ps + tile, a3, mask=mask)
    if SYNC:
        _cluster_sync(pid)
    flat = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mine = mask & ((flat % CTAS) == rank)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order 0..S-1, as the table's split sum
        total += tl.load(part_ptr + s * stride_ps + tile, mask=mine, other=0.0, cache_modifier=".cg")
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, total, mask=mine)


_PATCHED: set = set()
_WS: dict = {}
_CUDA = None


def set_cluster_size(kernel, ctas: int) -> None:
    """Make the launcher start ``kernel`` (a CompiledKernel) in clusters of ``ctas`` along x."""
    global _CUDA
    if ctas > 8:
        if _CUDA is None:
            _CUDA = ctypes.CDLL("libcuda.so.1")
        # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
        rc = _CUDA.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), ctypes.c_int(14), ctypes.c_int(1))
        if rc != 0:
            raise RuntimeError(f"cuFuncSetAttribute(non-portable cluster) = {rc}")
    pm = list(kernel.packed_metadata)
    pm[1] = ctas  # (num_warps, num_ctas, shared, ...): the launcher's gridDimX = gridX * num_ctas
    if len(pm) >= 6:  # older launchers: (..., clusterDimX, clusterDimY, clusterDimZ)
        pm[3] = ctas
    kernel.packed_metadata = tuple(pm)


def h200_buckets(k: int, n: int, mode: str, batch_invariant: bool = False) -> list[dict]:
    """The shipped H200 table's buckets for this shape and mode."""
    with table_override("nvidia_h200"):
        return table_buckets("NVIDIA H200", k, n, mode, batch_invariant)


def launch(x, w, out, bm, bn, bk, kps, promote, ctas, sync=True, warps=4):
    M, K = x.shape
    N = w.shape[0]
    S = K // kps
    key = (M, N, S, x.device)
    if key not in _WS:
        _WS[key] = torch.empty(S, M, N, device=x.device)
    part = _WS[key]
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), 1)  # x: clusters (one per N tile)
    args = (x, w, part, out, M, N, K, x.stride(0), w.stride(0), part.stride(0), part.stride(1), out.stride(0))
    meta = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PER_SPLIT=kps, SPLIT_K=S, CTAS=ctas, PROMOTE_CHUNKS=promote,
        SYNC=sync, num_warps=warps, num_stages=1,
    )  # fmt: skip
    k = _cluster_kernel[grid](*args, **meta)
    if id(k) not in _PATCHED:  # first launch ran unclustered (1/CTAS of the work): patch, rerun
        set_cluster_size(k, ctas)
        _PATCHED.add(id(k))
        k = _cluster_kernel[grid](*args, **meta)
    return out


def _divisors(s: int) -> list[int]:
    ds = [d for d in range(16, 1, -1) if s % d == 0 and s // d <= 4]
    return ds[:2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe-out")
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--shapes", default="")
    args = p.parse_args()
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    rows = []
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    for shape in shapes:
        for mode in ("bf16-fp32out", "fp32"):
            c0 = h200_buckets(shape.k, shape.n, mode, batch_invariant=True)[0]
            bk, kps = c0["block_k"], c0["k_per_split"]
            promote = c0["promote_chunks"] or kps // bk
            S = shape.k // kps
            variants = []
            for ctas in _divisors(S):
                for bn in (16, 32):
                    variants.append((16, bn, ctas, True))
            for ctas in _divisors(S):
                variants.append((16, 16, ctas, False))  # no barrier: wrong sums, the floor
            for m in (int(v) for v in args.ms.split(",")):
                xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m + 7)
                bi_ref = router_gemm(xs[0], ws[0], mode, batch_invariant=True)
                fast = time_rotated(lambda x, w, mode=mode: router_gemm(x, w, mode), xs, ws)
                if mode == "bf16-fp32out":
                    fast = min(
                        fast, time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
                    )
                bi = time_rotated(
                    lambda x, w, mode=mode: router_gemm(x, w, mode, batch_invariant=True), xs, ws
                )
                line = f"{shape.name:17s} {mode:12s} S={S:2d} M={m:3d}: fastest {fast:5.2f} "
                line += f"table-BI {bi:5.2f} ({bi / fast:.2f}x) |"
                res = []
                for bm, bn, ctas, sync in variants:
                    o = torch.full((m, shape.n), float("nan"), device="cuda")
                    try:
                        launch(xs[0], ws[0], o, bm, bn, bk, kps, promote, ctas, sync)
                        torch.cuda.synchronize()
                        same = bool(torch.equal(o, bi_ref))
                        c = (bm, bn, bk, kps, promote, ctas, sync)
                        t = time_rotated_into(lambda x, w, o, c=c: launch(x, w, o, *c), xs, ws)
                    except Exception as e:  # noqa: BLE001 - a probe: record and go on
                        print(f"  {bm}x{bn} C={ctas}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        torch.cuda.synchronize()
                        continue
                    tag = f"{bm}x{bn}/C{ctas}{'' if sync else '/nosync'}"
                    line += f" {tag} {t:5.2f} ({t / fast:.2f}x{' =' if same else ' DIFF'})"
                    res.append(dict(tile=[bm, bn], ctas=ctas, sync=sync, us=t, bitwise_table=same))
                print(line, flush=True)
                rows.append(
                    dict(shape=shape.name, mode=mode, m=m, split_k=S, fastest=fast, table_bi=bi, res=res)
                )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe-cluster.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
