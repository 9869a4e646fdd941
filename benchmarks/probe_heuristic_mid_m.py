"""Design probe (one device call): what GPUs without a tuned table (the heuristic) should run at
65-512 tokens in the non-invariant modes.

    python benchmarks/probe_heuristic_mid_m.py [--out DIR]

Session 14 found pipelined split-K with the flat chain loop faster than cuBLAS at 65-512 tokens on
the H200 (its table), while the heuristic still calls cuBLAS there in the 16-bit modes and runs
64 x 64 tiles with K split 1024 in 64-wide chunks in the fp32 mode. For every shape and M this
times, in one run: cuBLAS, the H200 table's config, the heuristic's, and candidate rules for the
heuristic (64 x 64 pipelined split tiles, 128-wide chunks, K split 256 / 512 / 1024, the split sum
a second launch with PDL, ``flat_chain`` where a split is one MMA chain). Each candidate is
checked against an fp64 reference first. Times: CUDA-graph medians over rotated copies (not
L2-resident), ratios to cuBLAS's bf16 GEMM with fp32 output of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune import _check, _pipelined, time_config  # noqa: E402

from csrc_triton.configs import KernelConfig, heuristic_config, select_config, splitk_config  # noqa: E402
from vllm_router_ext.benchmarking import SHAPES, make_inputs, rotation_copies  # noqa: E402

MS = (65, 128, 256, 512)
K_SPLITS = (256, 512, 1024, 2048)


def candidates(mode: str) -> dict[str, KernelConfig]:
    return {
        f"split {kps}": _pipelined(splitk_config(64, 64, 128, kps, mode, 4, num_stages=3)) for kps in K_SPLITS
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe-heuristic-mid-m")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    name, sms = torch.cuda.get_device_name(), props.multi_processor_count
    rows = []
    for shape in SHAPES:
        for m in MS:
            xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
            cublas = time_config(KernelConfig("cublas"), xs, ws, "bf16-fp32out")
            for mode in ("bf16-fp32out", "fp32"):
                named = {
                    "table": select_config(m, shape.k, shape.n, mode, False, name, sms),
                    "heuristic": heuristic_config(m, shape.k, shape.n, mode, False, sms, cublas=True),
                    **candidates(mode),
                }
                times = {}
                for label, cfg in named.items():
                    if cfg.kernel == "cublas":
                        times[label] = cublas
                    elif _check(cfg, xs[0], ws[0], mode):
                        times[label] = time_config(cfg, xs, ws, mode)
                row = {"shape": shape.name, "m": m, "mode": mode, "cublas_us": cublas, "us": times,
                       "configs": {k: v.describe() for k, v in named.items()}}  # fmt: skip
                rows.append(row)
                cells = "  ".join(f"{k} {t:.2f} ({t / cublas:.2f}x)" for k, t in times.items())
                print(f"{shape.name:17s} {mode:12s} M={m:4d} cuBLAS {cublas:.2f}  {cells}", flush=True)
    (out / "probe_heuristic_mid_m.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
