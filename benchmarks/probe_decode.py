# ruff: noqa: E501
"""Design rounds for 1-16 tokens: GEMV configs whose loads are all in flight, against the peer.

Question: does the GEMV (one fp32 FMA sum per logit, whole K per program) reach the peer kernel when
every program owns whole weight rows and all of M, and ptxas is given the register budget to issue
every load before the first FMA (``maxnreg``)? Round 2: or with the chunks copied ahead through
shared memory (``copy_stages``: cp.async, no registers held while the loads are in flight)? Times each candidate, the shipped table's choice and
the peer in one CUDA-graph harness (rotated weights), checks each candidate against fp64.

    python benchmarks/probe_decode.py --peer .peers/trtllm_router.py --out DIR [--context]

``--context``: instead, the router GEMM as a decode step runs it, behind the RMSNorm that writes its
input (one Triton kernel, no programmatic dependent launch, like vLLM's): a two-kernel CUDA graph
per call, the shipped op vs the peer, minus the RMSNorm alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton
import triton.language as tl

SHAPES = {"DeepSeek-V3": (7168, 256), "Kimi-K2": (7168, 384), "GLM-5": (6144, 256)}
# M -> (block_m, block_n, num_warps, maxnreg, copy_stages); round 1's winners first
CANDIDATES = {
    1: [(1, 1, 8, 255, 0), (1, 1, 16, 0, 0), (1, 1, 4, 0, 7), (1, 1, 4, 0, 4), (1, 1, 8, 0, 4), (1, 2, 4, 0, 7), (1, 1, 2, 0, 8)],
    2: [(1, 1, 8, 255, 0), (2, 1, 16, 0, 0), (2, 1, 8, 255, 0), (2, 1, 4, 0, 7), (2, 1, 4, 0, 4), (2, 1, 8, 0, 4), (1, 1, 4, 0, 7), (2, 2, 4, 0, 7)],
    4: [(1, 2, 4, 255, 0), (2, 2, 8, 255, 0), (4, 1, 4, 0, 0), (4, 1, 4, 0, 7), (4, 1, 4, 0, 4), (4, 1, 8, 0, 4), (2, 1, 4, 0, 7), (2, 2, 4, 0, 7), (4, 2, 4, 0, 4), (1, 2, 4, 0, 7)],
    8: [(1, 4, 4, 0, 0), (4, 2, 4, 0, 0), (4, 2, 8, 255, 0), (8, 1, 4, 0, 7), (8, 1, 4, 0, 4), (8, 1, 8, 0, 4), (4, 1, 4, 0, 7), (4, 2, 4, 0, 7), (4, 2, 4, 0, 4), (8, 2, 4, 0, 4)],
    16: [(4, 4, 4, 0, 0), (16, 1, 4, 0, 4), (8, 2, 4, 0, 4), (8, 1, 4, 0, 7), (16, 1, 8, 0, 2), (16, 2, 4, 0, 3), (4, 4, 4, 0, 4)],
}  # fmt: skip


def _launch(x, w, out, cfg):
    from csrc_triton.router_gemm_gemv import gemv_launch

    bm, bn, nw, mr, cs = cfg
    return gemv_launch(x, w, out, block_m=bm, block_n=bn, num_warps=nw, maxnreg=mr, copy_stages=cs)


def _compile(jobs):
    """Worker: compile (by running once) every (M, K, cfg) of ``jobs`` into the shared Triton cache."""
    for m, k, cfg in jobs:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(256, k, device="cuda", dtype=torch.bfloat16)
        _launch(x, w, torch.empty(m, 256, device="cuda"), cfg)
    torch.cuda.synchronize()
    return len(jobs)


@triton.jit
def _rms_norm_kernel(h_ptr, g_ptr, x_ptr, K, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * K
    offs = tl.arange(0, BLOCK)
    h = tl.load(h_ptr + row + offs, mask=offs < K, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
    tl.store(x_ptr + row + offs, (h * rstd * g).to(tl.bfloat16), mask=offs < K)


def rms_norm(h, g, x):
    _rms_norm_kernel[(h.shape[0],)](h, g, x, h.shape[1], 1e-6, BLOCK=triton.next_power_of_2(h.shape[1]), num_warps=8)


def context(peer_mm) -> list[dict]:
    from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph
    from vllm_router_ext.ops import router_gemm

    rows = []
    for name, (k, n) in SHAPES.items():
        for m in (1, 2, 4, 8, 16):
            hs, ws = make_inputs(m, k, n, rotation_copies(m, k, n))
            g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            xs = [torch.empty_like(h) for h in hs]
            norm = [lambda h=h, x=x, g=g: rms_norm(h, g, x) for h, x in zip(hs, xs, strict=True)]
            ours = [lambda x=x, w=w: router_gemm(x, w, "bf16-fp32out") for x, w in zip(xs, ws, strict=True)]
            peer = [lambda x=x, w=w: peer_mm(x, w) for x, w in zip(xs, ws, strict=True)]
            alone = time_graph(norm)
            pair_ours = time_graph([c for pair in zip(norm, ours, strict=True) for c in pair])
            pair_peer = time_graph([c for pair in zip(norm, peer, strict=True) for c in pair])
            pair_ours2 = time_graph([c for pair in zip(norm, ours, strict=True) for c in pair])
            o_us, p_us = 2 * min(pair_ours, pair_ours2) - alone, 2 * pair_peer - alone
            print(f"context {name} M={m}: rmsnorm {alone:.2f}, +ours {2 * min(pair_ours, pair_ours2):.2f}, "
                  f"+peer {2 * pair_peer:.2f} -> gemm ours {o_us:.2f} peer {p_us:.2f} ({o_us / p_us:.3f}x)", flush=True)  # fmt: skip
            rows.append(dict(shape=name, m=m, rmsnorm_us=alone, pair_ours_us=2 * min(pair_ours, pair_ours2),
                             pair_peer_us=2 * pair_peer))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--context", action="store_true")
    args = ap.parse_args()
    if args.context:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.peer)))
        import importlib

        peer_mm = importlib.import_module(os.path.splitext(os.path.basename(args.peer))[0]).peer_mm
        rows = context(peer_mm)
        with open(os.path.join(args.out, "probe-context.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
        return
    jobs = sorted({(m, k, c) for m, cs in CANDIDATES.items() for k, _ in SHAPES.values() for c in cs})
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        async_result = pool.map_async(_compile, [jobs[i :: args.workers] for i in range(args.workers)])
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.peer)))
        import importlib

        peer_mm = importlib.import_module(os.path.splitext(os.path.basename(args.peer))[0]).peer_mm
        peer_mm(torch.zeros(1, 7168, device="cuda", dtype=torch.bfloat16),
                torch.zeros(256, 7168, device="cuda", dtype=torch.bfloat16))  # fmt: skip
        compiled = sum(async_result.get())
    print(f"compiled {compiled} launches and the peer in {time.time() - t0:.0f} s", flush=True)

    from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_rotated, time_rotated_into
    from vllm_router_ext.ops import router_gemm

    rows = []
    for name, (k, n) in SHAPES.items():
        for m, cands in CANDIDATES.items():
            xs, ws = make_inputs(m, k, n, rotation_copies(m, k, n))
            ref = xs[0].double() @ ws[0].double().T
            peer = time_rotated(peer_mm, xs, ws)
            table = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
            times = {}
            for cfg in cands:
                out = torch.full((m, n), float("nan"), device="cuda")
                _launch(xs[0], ws[0], out, cfg)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-6, (name, m, cfg, err)
                times[cfg] = time_rotated_into(lambda x, w, o, c=cfg: _launch(x, w, o, c), xs, ws)
            peer2 = time_rotated(peer_mm, xs, ws)
            best = min(times, key=times.get)
            peer_us = min(peer, peer2)
            print(f"{name} M={m}: peer {peer:.2f}/{peer2:.2f} table {table:.2f} ({table / peer_us:.3f}x) "
                  f"best {best} {times[best]:.2f} ({times[best] / peer_us:.3f}x)", flush=True)  # fmt: skip
            print("    " + " ".join(f"{c}={t:.2f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])))
            rows.append(dict(shape=name, m=m, peer_us=[peer, peer2], table_us=table,
                             candidates=[dict(cfg=list(c), us=t) for c, t in times.items()]))  # fmt: skip
    with open(os.path.join(args.out, "probe-decode.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
