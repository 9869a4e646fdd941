"""Design probe (one device call): would a TMA-fed, persistent Triton GEMM close the large-M gap?

    python benchmarks/probe_tma.py [--out DIR]

What limits the ``fp32`` mode (and the batch-invariant path) above ~1000 tokens is our Triton
tensor-core loop against cuBLAS: on DeepSeek-V3 at 16384 tokens the best cp.async-pipelined Triton
tile took 122 µs without any promotion, cuBLAS 88 (``probe-promotion-h200-971dc71.log``). This
probe times a kernel whose operands arrive by TMA (host tensor descriptors), optionally persistent
(one program per SM walking the tiles) and warp-specialised, with and without promotion (chains of
two chunks), against cuBLAS and the shipped dispatch. Each candidate is checked against fp64
first. Writes ``probe-tma.json``. Not used by the plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.router_gemm_tiled import grouped_tile  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402


@triton.jit
def _tma_kernel(
    x_desc,
    w_desc,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROMOTE: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLAT: tl.constexpr,
):
    """x_desc: [M, K] blocks [BLOCK_M, BLOCK_K]; w_desc: [N, K] blocks [BLOCK_N, BLOCK_K].
    Programs walk tiles pid, pid + NUM_PROGRAMS, ... (persistent when NUM_PROGRAMS = #SMs)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PROMOTE == 0:
            for kt in range(k_tiles):
                a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
        elif FLAT:  # one chunk per iteration (one stage each), the promotion as a branch
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(k_tiles):
                a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
                part = tl.dot(a, b.T, part)
                if (kt + 1) % PROMOTE == 0:
                    acc = acc + part
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = acc + part
        else:  # nested: PROMOTE chunks per iteration (and per pipeline stage)
            for kg in range(0, k_tiles, PROMOTE):
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(PROMOTE):
                    a = x_desc.load([pid_m * BLOCK_M, (kg + j) * BLOCK_K])
                    b = w_desc.load([pid_n * BLOCK_N, (kg + j) * BLOCK_K])
                    part = tl.dot(a, b.T, part)
                acc = acc + part
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class Tma:
    def __init__(self, bm, bn, bk, stages, warps, promote, persistent, ws, flat=False):
        self.p = (bm, bn, bk, stages, warps, promote, persistent, ws)
        self.flat = flat
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def describe(self) -> str:
        bm, bn, bk, stages, warps, promote, persistent, ws = self.p
        chain = (
            f"{'flat ' if self.flat else ''}chain {bk * promote}"
            if promote
            else "one chain (not fp32-accurate)"
        )
        return (
            f"tma {bm}x{bn}x{bk} s{stages} w{warps} {'persistent' if persistent else 'one tile/program'}"
            f"{' warp-specialised' if ws else ''} {chain}"
        )

    def __call__(self, x, w, out):
        bm, bn, bk, stages, warps, promote, persistent, ws = self.p
        M, K = x.shape
        N = w.shape[0]
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        programs = min(self.sms, tiles) if persistent else tiles
        _tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(w, [bn, bk]),
            out, M, N, K, out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PROMOTE=promote, GROUP_M=8,
            NUM_PROGRAMS=programs, WARP_SPECIALIZE=ws, FLAT=self.flat, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe-out")
    p.add_argument("--m", default="4096,16384")
    args = p.parse_args()
    results = []
    t0 = time.time()
    shape = SHAPE_BY_NAME["DeepSeek-V3"]
    # Shared memory: a stage holds PROMOTE chunks in the nested form, one in the flat form.
    cands = [Tma(128, 128, 64, 4, 8, 0, persistent, False) for persistent in (False, True)]
    cands += [Tma(128, 128, 64, 2, 8, 2, persistent, False) for persistent in (False, True)]
    cands += [
        Tma(bm, bn, bk, stages, 8, promote, persistent, False, flat=True)
        for bm, bn, bk, stages, promote in ((128, 128, 64, 4, 2), (128, 128, 64, 4, 4), (128, 128, 128, 2, 2))
        for persistent in (False, True)
    ]
    for m in [int(v) for v in args.m.split(",")]:
        xs, ws_ = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
        ref = xs[0].double() @ ws_[0].double().T
        refs = {
            "cuBLAS": lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32),
            "ours fp32": lambda x, w: router_gemm(x, w, "fp32"),
            "ours BI bf16-fp32out": lambda x, w: router_gemm(x, w, "bf16-fp32out", batch_invariant=True),
        }
        timed = {k: time_rotated(f, xs, ws_, warmup=10, rep=30) for k, f in refs.items()}
        print(f"DeepSeek-V3 M={m}: " + "  ".join(f"{k} {v:.2f}" for k, v in timed.items()), flush=True)
        rows = []
        for c in cands:
            try:
                out = c(xs[0], ws_[0], torch.full((m, shape.n), float("nan"), device="cuda"))
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = time_rotated_into(c, xs, ws_, warmup=10, rep=30)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"    skip {c.describe()}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            rows.append({"cand": c.describe(), "us": us, "err": err})
        for r in sorted(rows, key=lambda r: r["us"]):
            print(
                f"    {r['us']:7.2f} us  {r['us'] / timed['cuBLAS']:5.2f}x  err {r['err']:.1e}  {r['cand']}",
                flush=True,
            )
        results.append({"M": m, "refs": timed, "cands": rows})
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe-tma.json").write_text(json.dumps(results, indent=1))
    print(f"[probe-tma] done at {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
