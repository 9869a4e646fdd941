"""Design probe (one device call): which kernel structures are worth putting in the tuner.

    python benchmarks/probe.py [--out DIR] [--sections gemv,fp32mid,bi]

- gemv: the CUDA-core GEMV over (BLOCK_M, BLOCK_N, splits, warps) at small M vs cuBLAS and the
  current dispatch, bf16-fp32out (and the fp32 mode at a few M).
- fp32mid: the fp32 mode at 256..4096 tokens: pipelined split-K with large tiles vs the tiled kernel.
- bi: batch-invariant candidates at large M: pipelined split-K with large tiles per K split, and
  whether they are bitwise equal to the small-tile unrolled reference of the same K split.
- bismall: batch-invariant candidates at small M with no ticket: one program per 16-32 experts runs
  every K split of its tile (``splits_in_program``) in a deep software pipeline (many bytes in
  flight per SM instead of many programs), checked bitwise against the K split 512 reference.
Every candidate is checked against fp64 before it is timed. Prints the best few per case; writes
``probe.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.configs import KernelConfig, splitk_config  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402
from vllm_router_ext.ops.dispatch import dot_mode_for, run_config  # noqa: E402


def rel_err(cfg, x, w) -> float:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=x.device)
    res = run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
    ref = x.double() @ w.double().T
    return ((res.double() - ref).norm() / ref.norm()).item()


def time_fn(fn, xs, ws) -> float:
    return time_rotated(fn, xs, ws, warmup=10, rep=30)


def time_cfg(cfg, xs, ws) -> float:
    dm = dot_mode_for(xs[0].dtype, ws[0].dtype)
    return time_rotated_into(lambda x, w, o: run_config(cfg, x, w, o, dm), xs, ws, warmup=10, rep=30)


def run_case(label, cands, xs, ws, limit, refs, results, top=6):
    timed = []
    for cfg in cands:
        try:
            err = rel_err(cfg, xs[0], ws[0])
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            print(f"  skip {cfg.describe()}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        if not err <= limit:
            print(f"  reject {cfg.describe()}: rel err {err:.1e}", flush=True)
            continue
        timed.append((time_cfg(cfg, xs, ws), err, cfg))
    timed.sort(key=lambda t: t[0])
    base = refs.get("cuBLAS") or next(iter(refs.values()))
    print(f"{label}: " + "  ".join(f"{k} {v:.2f}" for k, v in refs.items()), flush=True)
    for t, err, cfg in timed[:top]:
        print(f"    {t:7.2f} us  {t / base:5.2f}x  err {err:.1e}  {cfg.describe()}", flush=True)
    results.append(
        {
            "case": label,
            "refs": refs,
            "cands": [{"us": t, "err": e, "kernel": c.kernel, **c.params} for t, e, c in timed],
        }
    )


def gemv_cands(m: int) -> list[KernelConfig]:
    p2 = 1 << (m - 1).bit_length()
    out = []
    for bm in sorted({min(p2, 16), min(p2, 4), min(p2, 2), min(p2, 1)}):
        for bn in (1, 2, 4):
            if bm * bn > 16:
                continue
            for splits in (1, 2, 4):
                for warps in (4, 8) if bm * bn <= 2 else (4,):
                    out.append(
                        KernelConfig(
                            "gemv", dict(block_m=bm, block_n=bn, k_per_split=-splits, num_warps=warps)
                        )
                    )
    return out


def resolve(cfg: KernelConfig, k: int) -> KernelConfig:
    """k_per_split given as -S means 'S splits of K'."""
    kps = cfg.params.get("k_per_split", 0)
    if kps < 0:
        return KernelConfig(cfg.kernel, {**cfg.params, "k_per_split": 0 if kps == -1 else -(-k // -kps)})
    return cfg


def section_gemv(results):
    plan = {
        "DeepSeek-V3": (1, 4, 16, 32),
        "Kimi-K2": (1, 16),
        "DeepSeek-V2": (1, 16),
        "DeepSeek-V2-Lite": (4,),
    }
    for name, ms in plan.items():
        s = SHAPE_BY_NAME[name]
        for m in ms:
            xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n), seed=m)
            refs = {
                "cuBLAS": time_fn(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws),
                "dispatch": time_fn(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws),
                "dispatch-fp32": time_fn(lambda x, w: router_gemm(x, w, "fp32"), xs, ws),
            }
            cands = [resolve(c, s.k) for c in gemv_cands(m)]
            run_case(f"gemv {name} M={m}", cands, xs, ws, 1e-6, refs, results)


def big_splitk(mode: str, kps_list, stages=3) -> list[KernelConfig]:
    out = []
    for bm, bn, warps in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (128, 256, 8)):
        for kps in kps_list:
            for bk in (64,) if mode == "fp32" else (64, 128):
                c = splitk_config(bm, bn, bk, kps, mode, warps)
                out.append(KernelConfig("splitk", {**c.params, "num_stages": stages}))
    return out


def section_fp32mid(results):
    s = SHAPE_BY_NAME["DeepSeek-V3"]
    for m in (256, 1024, 4096, 16384):
        xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n), seed=m)
        refs = {
            "cuBLAS": time_fn(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws),
            "dispatch-fp32": time_fn(lambda x, w: router_gemm(x, w, "fp32"), xs, ws),
        }
        cands = big_splitk("fp32", (1024, 2048, 3584, 7168))
        for bm, bn, warps, stages, pc in (
            (64, 64, 4, 3, 2),
            (64, 128, 4, 3, 2),
            (128, 64, 4, 4, 2),
            (128, 128, 8, 3, 2),
            (128, 128, 8, 3, 4),
            (128, 256, 8, 3, 2),
            (64, 256, 8, 3, 2),
        ):
            cands.append(
                KernelConfig(
                    "tiled",
                    dict(
                        block_m=bm,
                        block_n=bn,
                        block_k=64,
                        promote_chunks=pc,
                        group_m=8,
                        num_warps=warps,
                        num_stages=stages,
                    ),
                )
            )
        run_case(f"fp32mid DeepSeek-V3 M={m}", cands, xs, ws, 1e-6, refs, results)


def bi_refs(mode: str, xs, ws) -> dict[str, float]:
    """cuBLAS, the fastest dispatch and the current batch-invariant dispatch, timed alike."""
    return {
        "cuBLAS": time_fn(lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws),
        "fastest": time_fn(lambda x, w: router_gemm(x, w, mode), xs, ws),
        "BI now": time_fn(lambda x, w: router_gemm(x, w, mode, batch_invariant=True), xs, ws),
    }


def bitwise_admitted(ref_cfg, cands, probe_x, probe_w, label: str) -> list[KernelConfig]:
    """The candidates whose logits on the probe batch equal ``ref_cfg``'s bitwise."""
    dm = dot_mode_for(probe_x.dtype, probe_w.dtype)
    n = probe_w.shape[0]
    ref = run_config(ref_cfg, probe_x, probe_w, torch.empty(probe_x.shape[0], n, device="cuda"), dm)
    admitted = []
    for c in cands:
        try:
            out = run_config(c, probe_x, probe_w, torch.empty(probe_x.shape[0], n, device="cuda"), dm)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"  skip {c.describe()}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        if torch.equal(out, ref):
            admitted.append(c)
        else:
            print(f"  {label}: {c.describe()} differs bitwise from the reference", flush=True)
    return admitted


def section_bi(results):
    s = SHAPE_BY_NAME["DeepSeek-V3"]
    probe_x = torch.randn(300, s.k, device="cuda").to(torch.bfloat16)
    probe_w = (torch.randn(s.n, s.k, device="cuda") / s.k**0.5).to(torch.bfloat16)
    for mode in ("bf16-fp32out", "fp32"):
        for kps in (1024, 2048):
            ref_cfg = splitk_config(16, 16, 128 if mode != "fp32" else 64, kps, mode, 4)
            cands = [
                c
                for c in [ref_cfg] + big_splitk(mode, (kps,)) + big_splitk(mode, (kps,), stages=1)[:2]
                if c.params["block_k"] == ref_cfg.params["block_k"]
            ]
            cands = bitwise_admitted(ref_cfg, cands, probe_x, probe_w, f"BI {mode} kps={kps}")
            for m in (1, 256, 4096, 16384):
                xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n), seed=m)
                refs = bi_refs(mode, xs, ws)
                run_case(f"bi {mode} kps={kps} M={m}", cands, xs, ws, 1e-5, refs, results, top=3)


def section_bismall(results, names=("DeepSeek-V3", "Kimi-K2"), ms=(1, 4, 16, 64, 256)):
    for name in names:
        s = SHAPE_BY_NAME[name]
        probe_x = torch.randn(300, s.k, device="cuda").to(torch.bfloat16)
        probe_w = (torch.randn(s.n, s.k, device="cuda") / s.k**0.5).to(torch.bfloat16)
        for mode in ("bf16-fp32out", "fp32"):
            cands = [
                splitk_config(bm, bn, bk, 512, mode, warps, num_stages=stages, splits_in_program=True)
                for bm, bn, warps in ((16, 16, 4), (64, 16, 4), (16, 16, 2), (16, 32, 4))
                for stages in (3, 5, 8)
                for bk in ((128, 256) if mode != "fp32" else (64,))
            ]
            ref_cfg = splitk_config(16, 16, 128, 512, mode, 4)
            cands = bitwise_admitted(ref_cfg, cands, probe_x, probe_w, f"bismall {name} {mode}")
            for m in ms:
                xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n), seed=m)
                refs = bi_refs(mode, xs, ws)
                run_case(f"bismall {name} {mode} M={m}", cands, xs, ws, 1e-5, refs, results, top=4)


SECTIONS = {"gemv": section_gemv, "fp32mid": section_fp32mid, "bi": section_bi, "bismall": section_bismall}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe-out")
    p.add_argument("--sections", default="gemv,fp32mid,bi")
    args = p.parse_args()
    results: list[dict] = []
    t0 = time.time()
    for name in args.sections.split(","):
        SECTIONS[name](results)
        print(f"[probe] {name} done at {time.time() - t0:.0f}s", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
