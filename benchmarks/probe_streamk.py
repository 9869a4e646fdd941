"""Design probe (one device call): the fp32 mode's wgmma_ws kernel, one tile per program (with
the table's K split) against its stream-K form, where the SMs do not divide the tiles evenly.

    python benchmarks/probe_streamk.py [--out DIR] [--shapes Kimi-K2,...] [--m 2048,...]

Kimi-K2 (384 experts) in 128 x 128 tiles: 96 tiles at 4096 tokens (one wave, 36 SMs idle), 192
at 8192 (two waves, the second 45 % full); a K split only trades the idle SMs for partials. In
the stream-K form G groups of tiles_n programs (one program per SM in all) share the row
blocks' promoted chains evenly; tiles shared by several groups are summed by a fixup kernel.
Times are CUDA-graph medians over rotated copies (not L2-resident), next to cuBLAS's
bf16 x bf16 -> fp32 GEMM in the same run; every config's logits are checked against fp64.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.configs import select_config, wgmma_ws_config  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops.dispatch import run_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe-out")
    ap.add_argument("--shapes", default="Kimi-K2,DeepSeek-V3,GLM-5,DeepSeek-V2")
    ap.add_argument("--m", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name()
    rows = []
    for shape in (SHAPE_BY_NAME[s] for s in args.shapes.split(",")):
        for m in (int(v) for v in args.m.split(",")):
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
            ref = xs[0].double() @ ws[0].double().T
            table = select_config(m, shape.k, shape.n, "fp32", False, name, sms)
            cands = {"table": table}
            for bn in (128, 64) if shape.n % 128 else (128,):
                cands[f"stream-K bn={bn}"] = wgmma_ws_config(bn, 0, stream_k=sms)
            row = {"shape": shape.name, "m": m, "table_config": table.describe()}
            row["cublas"] = time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
            for label, cfg in cands.items():
                out = torch.full((m, shape.n), float("nan"), device="cuda")
                run_config(cfg, xs[0], ws[0], out, 0)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                row[label] = time_rotated_into(lambda x, w, o, c=cfg: run_config(c, x, w, o, 0), xs, ws)
                row[f"{label} err"] = err
            rows.append(row)
            times = "  ".join(
                f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float) and "err" not in k
            )
            errs = max(v for k, v in row.items() if "err" in k)
            print(f"{shape.name} M={m}: {times}  (max err {errs:.1e}; table {table.describe()})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe-streamk.json").write_text(json.dumps({"gpu": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
