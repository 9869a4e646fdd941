"""Design probe (one device call): where should a genuinely fp32 gate weight switch to its terms?

    python benchmarks/probe_fp32_weight.py [--out DIR]

An fp32 weight runs two ways in the ``fp32`` mode: the GEMV / split-K / tiled kernels reading the
fp32 weight and splitting each tile into three bf16 terms in every program (``DOT_SPLIT3``), or
one promoted GEMM on the weight's three bf16 terms made once at load ([3N, K], 1.5x the fp32
bytes) plus hi + mid + lo per logit. Times both through the op at every M of the benchmark (CUDA
graph, rotated weights), with cuBLAS's bf16 GEMM as the yardstick; the dispatch switches at
``FP32_WEIGHT_TERMS_FROM_M``. Not used by the plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_router_ext.ops.dispatch as dispatch  # noqa: E402
from vllm_router_ext.benchmarking import M_LIST, SHAPES, make_inputs, rotation_copies, time_graph  # noqa: E402
from vllm_router_ext.ops import router_gemm  # noqa: E402
from vllm_router_ext.ops.router_gemm import fp32_weight_terms  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-fp32-weight-out")
    ap.add_argument("--m", default=",".join(map(str, M_LIST)))
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    dispatch.FP32_WEIGHT_TERMS_FROM_M = 1  # the terms path whenever terms are given
    rows = []
    for shape in SHAPES:
        for m in [int(v) for v in args.m.split(",")]:
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
            w32s = [(w.float() + torch.randn_like(w, dtype=torch.float32) * 1e-6) for w in ws]
            terms = [fp32_weight_terms(w) for w in w32s]
            cases = zip(xs, ws, w32s, terms, strict=True)
            calls = {"cublas": [], "split in kernel": [], "terms": []}
            for x, w, w32, t in cases:
                calls["cublas"].append(lambda x=x, w=w: torch.mm(x, w.T, out_dtype=torch.float32))
                calls["split in kernel"].append(lambda x=x, w=w32: router_gemm(x, w, "fp32"))
                calls["terms"].append(lambda x=x, w=w32, t=t: router_gemm(x, w, "fp32", weight_terms=t))
            row = {"shape": shape.name, "m": m} | {k: time_graph(v, 10, 50) for k, v in calls.items()}
            ref = xs[0].double() @ w32s[0].double().T
            for key, fn in (("split in kernel", calls["split in kernel"][0]), ("terms", calls["terms"][0])):
                row[f"{key} err"] = ((fn().double() - ref).norm() / ref.norm()).item()
            rows.append(row)
            print(
                f"{shape.name:>17} M={m:>5}: cuBLAS {row['cublas']:7.2f}  split in kernel "
                f"{row['split in kernel']:8.2f} ({row['split in kernel err']:.1e})  "
                f"terms {row['terms']:8.2f} ({row['terms err']:.1e})  "
                f"terms/split {row['terms'] / row['split in kernel']:.2f}",
                flush=True,
            )
            del xs, ws, w32s, terms
    (Path(args.out) / "probe-fp32-weight.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
