"""Tune the router GEMM configs for the GPU this runs on; writes csrc_triton/configs/<gpu>.json.

    python benchmarks/tune.py [--out FILE] [--shapes DeepSeek-V3,...] [--quick]

For every shape, mode (bf16-fp32out, fp32) and M of the benchmark's list, times a pruned set of
split-K and tiled candidates (and cuBLAS for bf16-fp32out) with the benchmark's method (CUDA
graph of R calls over rotated weights, do_bench median) and keeps the fastest; buckets are
looked up by the first ``max_m`` >= M. Batch-invariant: one split-K config per shape and mode,
the one whose worst slowdown against the best non-invariant time over a spread of M is smallest.
Each candidate is checked against an fp64 reference before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.configs import CONFIG_DIR, KernelConfig, device_key  # noqa: E402
from vllm_router_ext.benchmarking import M_LIST, SHAPES, make_inputs, rotation_copies, time_graph  # noqa: E402
from vllm_router_ext.ops.dispatch import dot_mode_for, run_config  # noqa: E402

SPLITK_SHAPES = [  # (block_n, k_per_split, block_k, num_warps); every one single-launch (ticket)
    (16, 512, 128, 4),
    (16, 512, 256, 4),
    (16, 512, 512, 4),
    (32, 512, 128, 4),
    (32, 512, 256, 4),
    (16, 256, 128, 4),
    (32, 256, 128, 4),
    (32, 1024, 128, 4),
    (64, 512, 128, 4),
    (16, 1024, 256, 8),
]
TILED = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
]
BI_M = (1, 16, 64, 256, 4096)


def splitk_candidates(m: int, mode: str, fixed_block_m: int | None = None) -> list[KernelConfig]:
    out = []
    block_ms = [fixed_block_m] if fixed_block_m else sorted({min(64, max(16, 1 << (m - 1).bit_length())), 16 if m <= 64 else 64})
    for block_m in block_ms:
        for block_n, kps, block_k, warps in SPLITK_SHAPES:
            if mode == "fp32":
                block_k = min(block_k, 64)
                promote = 128 // block_k
            else:
                promote = 0
            out.append(
                KernelConfig("splitk", dict(block_m=block_m, block_n=block_n, block_k=block_k, k_per_split=kps,
                                            promote_chunks=promote, num_warps=warps, num_stages=1))
            )
    return out


def tiled_candidates(m: int, mode: str) -> list[KernelConfig]:
    out = []
    for block_m, block_n, block_k, warps, stages in TILED:
        if block_m > 64 and m <= 64:
            continue
        out.append(
            KernelConfig("tiled", dict(block_m=block_m, block_n=block_n, block_k=block_k,
                                       promote_chunks=(128 // block_k) if mode == "fp32" else 0,
                                       group_m=8, num_warps=warps, num_stages=stages))
        )
    return out


def _check(cfg: KernelConfig, x, w, mode: str) -> bool:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")
    try:
        res = run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
    except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
        print(f"    skip {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
        return False
    ref = x.double() @ w.double().T
    rel = ((res.double() - ref).norm() / ref.norm()).item()
    limit = 1e-6 if mode == "fp32" else 1e-5
    if not rel <= limit:
        print(f"    reject {cfg.describe()}: rel err {rel:.2e} > {limit:.0e}")
        return False
    return True


def time_config(cfg: KernelConfig, xs, ws, mode: str) -> float:
    dot_mode = dot_mode_for(xs[0].dtype, ws[0].dtype)
    outs = [torch.empty((x.shape[0], w.shape[0]), device="cuda") for x, w in zip(xs, ws, strict=True)]
    calls = [lambda x=x, w=w, o=o: run_config(cfg, x, w, o, dot_mode) for x, w, o in zip(xs, ws, outs, strict=True)]
    return time_graph(calls, warmup=10, rep=40)


def tune_shape(shape, mode: str, ms) -> tuple[list[dict], dict[int, float]]:
    best_by_m: dict[int, tuple[float, KernelConfig]] = {}
    for m in ms:
        xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
        cands = []
        if m <= 512:
            cands += splitk_candidates(m, mode)
        if m >= 32:
            cands += tiled_candidates(m, mode)
        if mode == "bf16-fp32out":
            cands.append(KernelConfig("cublas"))
        if m <= 16:  # the two-launch split-K form, for the record
            cands.append(KernelConfig("splitk", {**cands[0].params, "ticket": False}))
        results = []
        for cfg in cands:
            if cfg.kernel != "cublas" and not _check(cfg, xs[0], ws[0], mode):
                continue
            results.append((time_config(cfg, xs, ws, mode), cfg))
        results.sort(key=lambda r: r[0])
        best_by_m[m] = results[0]
        cub = next((t for t, c in results if c.kernel == "cublas"), None)
        two = next((t for t, c in results if c.params.get("ticket") is False), None)
        print(f"  {shape.name} {mode} M={m}: best {results[0][0]:.2f} µs {results[0][1].describe()}"
              + (f"  (cuBLAS {cub:.2f})" if cub else "") + (f"  (two-launch split-K {two:.2f})" if two else ""),
              flush=True)
    buckets = []
    for m in ms:
        t, cfg = best_by_m[m]
        entry = {"max_m": m, "kernel": cfg.kernel, **cfg.params, "us": round(t, 3)}
        if buckets and {k: v for k, v in buckets[-1].items() if k not in ("max_m", "us")} == {
            k: v for k, v in entry.items() if k not in ("max_m", "us")
        }:
            buckets[-1]["max_m"] = m
            continue
        buckets.append(entry)
    buckets[-1]["max_m"] = None
    return buckets, {m: best_by_m[m][0] for m in ms}


def tune_batch_invariant(shape, mode: str, best: dict[int, float]) -> dict:
    scored = []
    inputs = {m: make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m) for m in BI_M}
    for cfg in splitk_candidates(1, mode, fixed_block_m=64):
        if not _check(cfg, inputs[BI_M[-1]][0][0][:300], inputs[BI_M[-1]][1][0], mode):
            continue
        times = {m: time_config(cfg, *inputs[m], mode) for m in BI_M}
        worst = max(times[m] / best.get(m, times[m]) for m in BI_M)
        scored.append((worst, cfg, times))
    scored.sort(key=lambda s: s[0])
    worst, cfg, times = scored[0]
    print(f"  {shape.name} {mode} batch-invariant: {cfg.describe()} worst ratio {worst:.2f} "
          + " ".join(f"M={m}:{t:.2f}" for m, t in times.items()), flush=True)
    return {"max_m": None, "kernel": cfg.kernel, **cfg.params, "worst_ratio": round(worst, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    p.add_argument("--m", default=",".join(map(str, M_LIST)))
    args = p.parse_args(argv)
    name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else CONFIG_DIR / f"{device_key(name)}.json"
    ms = [int(m) for m in args.m.split(",")]
    table = {"device": name, "tuned": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "shapes": {}}
    import triton

    table["triton"] = triton.__version__
    t0 = time.time()
    for shape in SHAPES:
        if shape.name not in args.shapes.split(","):
            continue
        entry = table["shapes"].setdefault(f"{shape.k}x{shape.n}", {"model": shape.name})
        for mode in ("bf16-fp32out", "fp32"):
            buckets, best = tune_shape(shape, mode, ms)
            entry[mode] = buckets
            entry[f"{mode}/batch_invariant"] = [tune_batch_invariant(shape, mode, best)]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(table, indent=1))  # keep what is done if the run is cut short
        print(f"[tune] {shape.name} done at {time.time() - t0:.0f}s", flush=True)
    print(f"[tune] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
