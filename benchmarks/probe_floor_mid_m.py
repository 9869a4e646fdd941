"""Design probe (one device call): floors under the `fp32` mode's missed 5x-upcast points.

    python benchmarks/probe_floor_mid_m.py [--out DIR]

#4 asks the `fp32` mode to be >= 5x faster than torch's fp32 upcast from 256 tokens. It misses
at 256 tokens on DeepSeek-V2 / GLM-5 and on DeepSeek-V2-Lite at 256-1024. This probe measures,
in the benchmark's setting (CUDA graph, rotated copies), at each of those points:

* the upcast (``F.linear(x.float(), w_fp32)``) and so the time 5x asks for;
* a read-only floor: kernels that only stream the operands' bytes (activations + weight, bf16)
  with 16-byte loads, 132-2112 programs x 4-16 warps (``probe_read_floor.read_weight``), and an
  empty kernel;
* structures with no K split (so no split sum): the promoted fp32 tile kernel, one program per
  output tile, over small tiles (16-64 rows x 16-64 experts, 64- or 128-wide chunks, 2-4 stages);
* the table's split-K structure with its partials only (no sum) and the cheapest split sum
  measured so far (``probe_resident_sum.py``), for reference;
* our ops (`fp32`, bf16-fp32out) and cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_cluster import h200_buckets  # noqa: E402  (benchmarks/ is on sys.path)
from probe_read_floor import _empty_kernel, read_weight  # noqa: E402
from probe_resident_sum import resident_splitk  # noqa: E402

from csrc_triton.router_gemm_tiled import tiled_launch  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_graph,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402

CASES = (
    ("DeepSeek-V2-Lite", (256, 512, 768, 1024)),
    ("DeepSeek-V2", (256,)),
    ("GLM-5", (256,)),
)
NO_SPLIT_TILES = [  # (block_m, block_n, block_k, promote_chunks, num_warps, num_stages)
    (bm, bn, bk, 256 // bk, w, st)
    for bm in (16, 32, 64)
    for bn in (16, 32, 64)
    for bk in (64, 128)
    for w in (4,)
    for st in (2, 3, 4)
]


def floors(name: str, m: int) -> dict:
    shape = SHAPE_BY_NAME[name]
    k, n = shape.k, shape.n
    xs, ws = make_inputs(m, k, n, rotation_copies(m, k, n), seed=m + 11)
    w32s = [w.float() for w in ws]
    row: dict = {"shape": name, "m": m}
    row["upcast"] = time_rotated(lambda x, w32: F.linear(x.float(), w32), xs, w32s)
    row["limit_5x"] = row["upcast"] / 5
    row["fp32"] = time_rotated(lambda x, w: router_gemm(x, w, "fp32"), xs, ws)
    row["bf16-fp32out"] = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
    row["cublas"] = time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
    del w32s
    # read-only: the operands' bytes as one flat bf16 buffer per rotated copy
    flats = [torch.cat([x.reshape(-1), w.reshape(-1)]) for x, w in zip(xs, ws, strict=True)]
    outs = [torch.empty(4096, device="cuda") for _ in flats]
    row["empty"] = time_graph([lambda o=o: _empty_kernel[(132,)](o) for o in outs])
    reads = {}
    for programs in (132, 264, 528, 1056, 2112):
        for warps in (4, 8, 16):
            calls = [
                lambda f=f, o=o, p=programs, nw=warps: read_weight(f, o, p, nw)
                for f, o in zip(flats, outs, strict=True)
            ]
            reads[f"{programs}x{warps}"] = time_graph(calls)
    row["read_best"] = min(reads.values())
    row["read_best_config"] = min(reads, key=reads.get)
    del flats
    ref = router_gemm(xs[0], ws[0], "fp32").double()
    no_split = {}
    for bm, bn, bk, pc, w, st in NO_SPLIT_TILES:
        if bm > max(16, m) or bn > max(16, n) or bk * pc > k:
            continue
        cfg = dict(block_m=bm, block_n=bn, block_k=bk, promote_chunks=pc, num_warps=w, num_stages=st)
        try:
            o = torch.full((m, n), float("nan"), device="cuda")
            tiled_launch(xs[0], ws[0], o, dot_mode=0, group_m=8, **cfg)
            torch.cuda.synchronize()
            err = ((o.double() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-6:
                no_split[str(cfg)] = f"error {err:.1e}"
                continue
            no_split[str(cfg)] = time_rotated_into(
                lambda x, w, o, c=cfg: tiled_launch(x, w, o, dot_mode=0, group_m=8, **c), xs, ws
            )
        except Exception as e:  # noqa: BLE001 - a probe: record and go on (e.g. out of shared memory)
            no_split[str(cfg)] = f"{type(e).__name__}"
            torch.cuda.synchronize()
    timed = {c: t for c, t in no_split.items() if isinstance(t, float)}
    row["no_split_best"] = min(timed.values()) if timed else None
    row["no_split_best_config"] = min(timed, key=timed.get) if timed else None
    row["no_split_tried"] = len(no_split)
    bucket = next(b for b in h200_buckets(k, n, "fp32") if b["max_m"] is None or m <= b["max_m"])
    if bucket["kernel"] == "splitk" and not bucket.get("ticket", True):
        cfg = {key: v for key, v in bucket.items() if key not in ("max_m", "kernel", "us", "ticket", "pdl")}
        row["split_partials_alone"] = time_rotated_into(
            lambda x, w, o, c=cfg: resident_splitk(x, w, o, do_sum=False, **c), xs, ws
        )
        row["split_resident_sum"] = time_rotated_into(
            lambda x, w, o, c=cfg: resident_splitk(x, w, o, **c), xs, ws
        )
    row["no_split_all"] = no_split
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for name, ms in CASES:
        for m in ms:
            r = floors(name, m)
            rows.append(r)
            line = (
                f"{name} M={m}: upcast {r['upcast']:.2f} -> 5x needs {r['limit_5x']:.2f} | "
                f"fp32 {r['fp32']:.2f} "
                f"bf16-fp32out {r['bf16-fp32out']:.2f} cuBLAS {r['cublas']:.2f} | empty {r['empty']:.2f} "
                f"read x+w {r['read_best']:.2f} ({r['read_best_config']}) | no split best "
                f"{r['no_split_best']:.2f} of {r['no_split_tried']} ({r['no_split_best_config']})"
            )
            if "split_partials_alone" in r:
                line += f" | table split: partials alone {r['split_partials_alone']:.2f}, "
                line += f"resident sum {r['split_resident_sum']:.2f}"
            print(line, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-floor-mid-m.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
