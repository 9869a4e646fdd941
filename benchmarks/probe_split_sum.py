"""Design probe (one device call): the split-order sum of K-split partials (``reduce_partials``,
the second launch of every K-split config), alone and inside the op.

    python benchmarks/probe_split_sum.py [--out DIR]

Variants of ``_splitk_reduce_kernel``: logits per program (BLOCK), warps, and whether the
destination is addressed flat (``CONTIGUOUS``: 16-byte stores) or by row and column (an integer
division per logit). Shapes are the H200 table's K-split ``wgmma_ws`` buckets (S partials of
[M, N]). Each variant's output must equal the current kernel's bitwise (same order of adds).
Then the whole op (``fp32`` and ``bf16-fp32out``) at those M with 1024-logit programs for every
split count ("current": the sum as it was at ``ac3687d``) and with the best variant. Times are CUDA-graph
medians over rotated copies (not L2-resident), cuBLAS's bf16 GEMM in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import csrc_triton.router_gemm_splitk as sk  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_graph,
    time_rotated,
)
from vllm_router_ext.ops.router_gemm import router_gemm  # noqa: E402

#: (shape, M, splits): the table's K-split wgmma_ws buckets
CASES = [("Kimi-K2", 2048, 4), ("DeepSeek-V3", 1024, 7), ("DeepSeek-V3", 2048, 4), ("DeepSeek-V3", 4096, 2),
         ("GLM-5", 1024, 6), ("Kimi-K2", 4096, 2), ("Kimi-K2", 256, 14)]  # fmt: skip
#: (logits per program, warps, flat destination); the first is the kernel as it was
VARIANTS = [(1024, 4, False), (1024, 4, True), (2048, 4, True), (2048, 8, True), (4096, 8, True),
            (512, 4, True)]  # fmt: skip


def _key(block: int, warps: int, contiguous: bool) -> str:
    return f"block={block},warps={warps},{'flat' if contiguous else 'row-col'}"


def _launch(part, out, block, warps, contiguous):
    s, m, n = part.shape
    sk._splitk_reduce_kernel[(sk.cdiv(m * n, block),)](
        part, out, m, n, part.stride(0), out.stride(0), SPLIT_K=s, BLOCK=block, CONTIGUOUS=contiguous,
        PDL=False, num_warps=warps,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe-out")
    args = ap.parse_args()
    rows = []
    for name, m, s in CASES:
        n = SHAPE_BY_NAME[name].n
        copies = 8
        parts = [torch.randn(s, m, n, device="cuda") for _ in range(copies)]
        outs = [torch.empty(m, n, device="cuda") for _ in range(copies)]
        ref = torch.empty(m, n, device="cuda")
        _launch(parts[0], ref, 1024, 4, False)
        row = {"shape": name, "m": m, "splits": s}
        for variant in VARIANTS:
            check = torch.full_like(ref, float("nan"))
            _launch(parts[0], check, *variant)
            row[_key(*variant) + " equal"] = bool(torch.equal(check, ref))
            calls = [lambda p=p, o=o, v=variant: _launch(p, o, *v) for p, o in zip(parts, outs, strict=True)]
            row[_key(*variant)] = time_graph(calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = min(VARIANTS, key=lambda v: sum(r[_key(*v)] for r in rows))
    print("best variant (sum over cases):", best, flush=True)
    ops = []
    for name, m, _ in CASES:
        shape = SHAPE_BY_NAME[name]
        xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
        row = {"shape": name, "m": m}
        row["cublas"] = time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
        for label, (block, warps) in (("current", (1024, 4)), ("best", best[:2])):
            saved = sk._REDUCE_BLOCK, sk._REDUCE_BLOCK_MANY, sk._REDUCE_WARPS
            sk._REDUCE_BLOCK, sk._REDUCE_BLOCK_MANY, sk._REDUCE_WARPS = block, block, warps
            for mode in ("fp32", "bf16-fp32out"):
                row[f"{mode} {label}"] = time_rotated(lambda x, w, mode=mode: router_gemm(x, w, mode), xs, ws)
            sk._REDUCE_BLOCK, sk._REDUCE_BLOCK_MANY, sk._REDUCE_WARPS = saved
        ops.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe-split-sum.json").write_text(json.dumps({"reduce": rows, "best": best, "op": ops}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
