"""The start-up warm-up's cost and completeness, on a GPU: for each gate and mode, in a fresh
process with an empty Triton cache (cold) and again with the cache it filled (warm), the wall time
of ``warm_up_gate`` for M 1..max and the kernels it compiled; then every M from 1 to max through
the op, counting what compiles after the warm-up (the target: nothing).

    python benchmarks/warmup_cost.py --out bench-out [--max-m 8192]

Prints a table and writes ``warmup-cost.json``. Targets: cold <= 30 s for DeepSeek-V3 in every
mode, warm <= 2 s, 0 compiles after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: (label, K, N, mode, batch-invariant, weight dtype)
CASES = [
    ("DeepSeek-V3", 7168, 256, "fp32", False, "bfloat16"),
    ("DeepSeek-V3", 7168, 256, "bf16-fp32out", False, "bfloat16"),
    ("DeepSeek-V3", 7168, 256, "fp32", True, "bfloat16"),
    ("Kimi-K2", 7168, 384, "fp32", False, "bfloat16"),
    ("MiniMax-M2", 3072, 256, "fp32", False, "float32"),
]


def child(k: int, n: int, mode: str, bi: bool, weight_dtype: str, max_m: int) -> dict:
    """In this process: the warm-up, then the sweep; compiles counted by Triton's post-compile hook."""
    import torch
    import triton
    from triton import knobs

    from vllm_router_ext.ops.router_gemm import fp32_weight_terms, router_gemm
    from vllm_router_ext.ops.warmup import warm_up_gate
    from vllm_router_ext.precision import RouterPrecision

    compiled: list[str] = []

    def hook(**kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))

    knobs.runtime.jit_post_compile_hook = hook
    precision = RouterPrecision(mode)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(getattr(torch, weight_dtype))
    terms = fp32_weight_terms(w) if w.dtype == torch.float32 and precision is RouterPrecision.FP32 else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    launches = warm_up_gate(w, precision, bi, torch.bfloat16, max_m, None if bi else terms)
    warm_s = time.perf_counter() - start
    warm_compiles = list(compiled)
    compiled.clear()
    x = torch.randn(max_m, k, device="cuda").to(torch.bfloat16)
    for m in range(1, max_m + 1):
        router_gemm(x[:m], w, precision, batch_invariant=bi, weight_terms=None if bi else terms)
    torch.cuda.synchronize()
    return {
        "warm_up_s": warm_s,
        "launches": launches,
        "compiles": len(warm_compiles),
        "by_kernel": {name: warm_compiles.count(name) for name in sorted(set(warm_compiles))},
        "compiles_after": len(compiled),
        "after_kernels": sorted(set(compiled)),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


def run_case(case: tuple, max_m: int, cache: str) -> dict:
    _, k, n, mode, bi, weight_dtype = case
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import warmup_cost as w; "
    code += f"print('RESULT', json.dumps(w.child({k}, {n}, {mode!r}, {bi}, {weight_dtype!r}, {max_m})))"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{case}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-m", type=int, default=8192)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'gate':12} {'mode':22} {'launches':>8} {'cold s':>7} {'compiles':>8} {'warm s':>7} {'after':>6}")
    for case in CASES:
        with tempfile.TemporaryDirectory() as cache:
            cold = run_case(case, args.max_m, cache)
            warm = run_case(case, args.max_m, cache)
        label, k, n, mode, bi, weight_dtype = case
        mode_text = mode + (" batch-invariant" if bi else "")
        row = {"gate": label, "k": k, "n": n, "mode": mode, "batch_invariant": bi, "weight": weight_dtype,
               "max_m": args.max_m, "cold": cold, "warm": warm}  # fmt: skip
        rows.append(row)
        after = cold["compiles_after"] + warm["compiles_after"]
        print(
            f"{label:12} {mode_text:22} {cold['launches']:8d} {cold['warm_up_s']:7.1f} "
            f"{cold['compiles']:8d} {warm['warm_up_s']:7.2f} {after:6d}",
            flush=True,
        )
    (args.out / "warmup-cost.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    first = rows[0]["cold"]
    print(f"wrote {args.out / 'warmup-cost.json'} ({first['gpu']}, triton {first['triton']})")


if __name__ == "__main__":
    main()
