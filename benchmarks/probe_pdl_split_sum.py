"""Design probe (one device call): the K-split sum's second launch with programmatic dependent
launch (PDL), against the plain second launch and against the one-launch ticket.

    python benchmarks/probe_pdl_split_sum.py [--out DIR] [--shapes ...]

For each shape and M, the op's config from the H200 table (``config_for``) is run through
``run_config`` with ``VLLM_ROUTER_EXT_PDL`` 0 and 1. Where the config is a split-K one with a
ticket (one launch: the tile's last program adds the partials), it is also run as two launches
(``ticket=False``) with and without PDL. Every variant's logits must equal the table config's
bitwise (the same adds in the same order; PDL only moves the second launch). Times are CUDA-graph
medians over rotated copies (not L2-resident); cuBLAS's bf16 GEMM (fp32 out), the op in
``bf16-fp32out`` mode, and torch's fp32 upcast (``F.linear(x.float(), w.float())``) in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.pdl import ENV_VAR  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    SHAPES,
    make_inputs,
    rotation_copies,
    time_graph,
    time_rotated,
)
from vllm_router_ext.ops.dispatch import config_for, dot_mode_for, run_config  # noqa: E402
from vllm_router_ext.ops.router_gemm import router_gemm  # noqa: E402
from vllm_router_ext.precision import RouterPrecision  # noqa: E402

#: (mode, batch-invariant, M values): where the table runs K-split configs
POINTS = [
    (RouterPrecision.FP32, False, (128, 256, 512, 1024, 2048, 4096)),
    (RouterPrecision.FP32, True, (1, 8, 16, 64, 256, 512)),
    (RouterPrecision.BF16_FP32OUT, True, (1, 8, 16, 64, 256, 512)),
    (RouterPrecision.BF16_FP32OUT, False, (32, 64)),
]


def _time_config(cfg, xs, ws, dot_mode: int, pdl: bool) -> float:
    os.environ[ENV_VAR] = "1" if pdl else "0"
    outs = [torch.empty(x.shape[0], w.shape[0], device="cuda") for x, w in zip(xs, ws, strict=True)]
    calls = [
        lambda x=x, w=w, o=o: run_config(cfg, x, w, o, dot_mode) for x, w, o in zip(xs, ws, outs, strict=True)
    ]
    return time_graph(calls)


def _logits(cfg, x, w, dot_mode: int, pdl: bool) -> torch.Tensor:
    os.environ[ENV_VAR] = "1" if pdl else "0"
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")  # poisoned
    run_config(cfg, x, w, out, dot_mode)
    torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe-out")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPE_BY_NAME[name]
        for mode, bi, ms in POINTS:
            for m in ms:
                xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n))
                dot_mode = dot_mode_for(xs[0].dtype, ws[0].dtype)
                cfg = config_for(xs[0], ws[0], mode, bi)
                if cfg.kernel == "cublas" or cfg.kernel == "gemv":
                    continue
                variants = {"table": (cfg, False), "table+pdl": (cfg, True)}
                if (
                    cfg.kernel == "splitk"
                    and not cfg.params.get("splits_in_program")
                    and not cfg.params.get("fixed_point")
                ):
                    two = dataclasses.replace(cfg, params={**cfg.params, "ticket": False})
                    variants |= {"two-launch": (two, False), "two-launch+pdl": (two, True)}
                ref = _logits(cfg, xs[0], ws[0], dot_mode, False)
                row = {"shape": name, "mode": mode.value, "bi": bi, "m": m, "config": cfg.describe()}
                for label, (c, pdl) in variants.items():
                    row[label + " equal"] = bool(torch.equal(_logits(c, xs[0], ws[0], dot_mode, pdl), ref))
                    row[label] = _time_config(c, xs, ws, dot_mode, pdl)
                os.environ[ENV_VAR] = "1"
                row["cublas"] = time_rotated(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws)
                if mode is RouterPrecision.FP32 and not bi:
                    row["op bf16-fp32out"] = time_rotated(
                        lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws
                    )
                    w32 = [w.float() for w in ws]
                    row["upcast"] = time_graph(
                        [lambda x=x, w=w: F.linear(x.float(), w) for x, w in zip(xs, w32, strict=True)]
                    )
                    del w32
                rows.append(row)
                times = {k: round(v, 2) for k, v in row.items() if isinstance(v, float)}
                equal = all(v for k, v in row.items() if k.endswith(" equal"))
                head = f"{name:17s} {mode.value:12s} bi={int(bi)} M={m:5d} equal={equal}"
                print(head, times, cfg.describe(), flush=True)
                del xs, ws
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe-pdl-split-sum.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
