"""The router stage of an MoE layer (gate GEMM + expert selection), per number of tokens.

    python benchmarks/router_stage.py --out router-out [--shapes DeepSeek-V3,Kimi-K2,Qwen3-MoE]
        [--m 1,2,4,8,16,64,256,1024,4096] [--rounds 3]

Methods (each a CUDA graph of calls over rotated weights and activations, weights out of L2; per
M the methods take turns, in a rotated order each round; the median over rounds):
- ``ours (route op)``: ``router_ext::route`` in ``fp32``: our GEMM, then our routing kernel (after
  the GEMV a programmatic dependent launch on Hopper);
- ``ours fused, one launch``: decode's GEMV and the routing in one launch (larger M as the op);
- ``ours GEMM + routing, plain launches``: ``router_gemm`` then the routing kernel, no PDL;
- ``ours GEMM + vLLM top-k`` and ``stock (vLLM)``: with vLLM importable, the router vLLM builds
  for the routing (its factory, the model's arguments; ``select_experts``: the grouped top-k CUDA
  kernel for DeepSeek-V3, ``fused_topk_bias`` for Kimi-K2's one group, ``fused_topk`` for softmax)
  on our fp32 logits, and on the bf16 logits of stock's GEMM (``F.linear`` in bf16, the gate
  DeepSeek-V3's ``GateLinear`` runs without ``moe_router_dtype``);
- ``cuBLAS bf16 GEMM``: stock's GEMM alone, the stage's lower bound without fusion.
Writes ``router_stage.json`` and ``router_stage.png``; prints one table per shape with each
method's time and its ratio to stock (or, without vLLM, to the cuBLAS GEMM alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from csrc_triton.dispatch import route_cuda
from csrc_triton.problem import Precision
from csrc_triton.routing import Routing, Scoring, route_logits
from vllm_router_ext.bench import environment
from vllm_router_ext.bench_harness import rotation_copies, time_graph
from vllm_router_ext.ops.route import route
from vllm_router_ext.ops.router_gemm import router_gemm


@dataclass(frozen=True)
class StageShape:
    name: str
    hidden: int
    experts: int
    routing: Routing


SHAPES = {
    s.name: s
    for s in (
        StageShape("DeepSeek-V3", 7168, 256, Routing(8, Scoring.SIGMOID, 8, 4, True, True, 2.5)),
        StageShape("Kimi-K2", 7168, 384, Routing(8, Scoring.SIGMOID, 1, 1, True, True, 2.827)),
        StageShape("Qwen3-MoE", 4096, 128, Routing(8, Scoring.SOFTMAX, renormalize=True)),
    )
}
MS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
STOCK = "stock (vLLM)"
CUBLAS = "cuBLAS bf16 GEMM"
OURS = "ours (route op)"
ONE_LAUNCH = "ours fused, one launch"
PLAIN = "ours GEMM + routing, plain launches"


def vllm_topk() -> tuple[Callable | None, str]:
    """vLLM's router for a routing, built by vLLM's own factory with the arguments DeepSeek-V3 /
    Kimi-K2 / Qwen3-MoE's ``FusedMoE`` passes, as ``fn(x, logits, routing, bias) -> (weights, ids)``;
    or None and why."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router
    except Exception as e:  # noqa: BLE001 -- any import failure means "not here"
        return None, f"vLLM's top-k skipped: vLLM is not importable ({type(e).__name__}: {e})"
    routers: dict[tuple, object] = {}

    def router_for(routing: Routing, n: int, bias: torch.Tensor | None):
        key = (routing, n, None if bias is None else bias.data_ptr())
        if key not in routers:
            grouped = routing.scoring is Scoring.SIGMOID  # the DeepSeek-V3 family's FusedMoE
            with set_current_vllm_config(VllmConfig()):
                routers[key] = create_fused_moe_router(
                    top_k=routing.top_k,
                    global_num_experts=n,
                    renormalize=routing.renormalize,
                    use_grouped_topk=grouped,
                    num_expert_group=routing.n_group if grouped else None,
                    topk_group=routing.topk_group if grouped else None,
                    scoring_func="sigmoid" if routing.scoring is Scoring.SIGMOID else "softmax",
                    routed_scaling_factor=routing.routed_scaling_factor,
                    e_score_correction_bias=bias,
                )
        return routers[key]

    def fn(x: torch.Tensor, logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None):
        return router_for(routing, logits.shape[1], bias).select_experts(x, logits)

    return fn, "vLLM's top-k: the router vLLM's create_fused_moe_router builds for the routing"


def methods(topk: Callable | None) -> dict[str, Callable]:
    """name -> fn(x, w, bias, routing)."""

    def ours(x, w, bias, routing):
        return route(x, w, routing, "fp32", bias=bias)

    def ours_one_launch(x, w, bias, routing):
        return route_cuda(x, w, Precision.FP32, routing, bias, False, fused=True)[:2]

    def ours_plain(x, w, bias, routing):
        logits = router_gemm(x, w, "fp32")
        weights = torch.empty((x.shape[0], routing.top_k), device=x.device)
        ids = torch.empty((x.shape[0], routing.top_k), dtype=torch.int32, device=x.device)
        route_logits(logits, routing, bias, weights, ids)
        return weights, ids

    def cublas(x, w, bias, routing):
        return torch.nn.functional.linear(x, w)

    out = {OURS: ours, ONE_LAUNCH: ours_one_launch, PLAIN: ours_plain, CUBLAS: cublas}
    if topk is not None:
        out["ours GEMM + vLLM top-k"] = lambda x, w, b, r: topk(x, router_gemm(x, w, "fp32"), r, b)
        out[STOCK] = lambda x, w, b, r: topk(x, torch.nn.functional.linear(x, w), r, b)
    return out


def measure(shape: StageShape, ms, rounds: int, table: dict[str, Callable]) -> list[dict]:
    rows = []
    for m in ms:
        copies = rotation_copies(m, shape.hidden, shape.experts)
        g = torch.Generator(device="cuda").manual_seed(m)
        k, n = shape.hidden, shape.experts
        xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(copies)]
        ws = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16() for _ in range(copies)]
        bias = (torch.randn(n, device="cuda", generator=g) * 0.05) if shape.routing.bias else None
        # every path of ours routes exactly alike
        outs = [table[t](xs[0], ws[0], bias, shape.routing) for t in (OURS, ONE_LAUNCH, PLAIN)]
        for other in outs[1:]:
            if not (torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1])):
                raise SystemExit(f"router_stage: {shape.name} M={m}: our routing paths differ")
        names = list(table)
        times: dict[str, list[float]] = {t: [] for t in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(time_graph(_calls(table[name], xs, ws, bias, shape.routing)))
        row = {"shape": shape.name, "m": m, "us": {n: statistics.median(t) for n, t in times.items()}}
        rows.append(row)
        print(f"  {shape.name} M={m}: " + ", ".join(f"{n} {v:.2f}" for n, v in row["us"].items()), flush=True)
    return rows


def _calls(fn: Callable, xs, ws, bias, routing) -> list[Callable]:
    return [lambda x=x, w=w: fn(x, w, bias, routing) for x, w in zip(xs, ws, strict=True)]


def print_table(rows: list[dict]) -> None:
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        names = list(sub[0]["us"])
        base = STOCK if STOCK in names else CUBLAS
        print(f"\n{shape}: µs per router stage (x {base})")
        print("| M | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for r in sub:
            cells = [f"{r['us'][n]:.2f} ({r['us'][n] / r['us'][base]:.2f}x)" for n in names]
            print(f"| {r['m']} | " + " | ".join(cells) + " |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        sub = [r for r in rows if r["shape"] == shape]
        for name in sub[0]["us"]:
            ax.plot([r["m"] for r in sub], [r["us"][name] for r in sub], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs", title=f"router stage, {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for router_stage.json and router_stage.png")
    allowed = ", ".join(SHAPES)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated; allowed: {allowed}")
    p.add_argument("--m", default=",".join(map(str, MS)), help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the methods taking turns (median)")
    args = p.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        print(f"router_stage: unknown shape {bad[0]!r}; allowed: {', '.join(SHAPES)}")
        return 2
    if not torch.cuda.is_available():
        print("router_stage: needs a CUDA GPU (this machine has none)")
        return 2
    topk, note = vllm_topk()
    print(note)
    table = methods(topk)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        rows += measure(SHAPES[name], [int(v) for v in args.m.split(",")], args.rounds, table)
        record = {"environment": environment(), "note": note, "rows": rows}
        (out / "router_stage.json").write_text(json.dumps(record, indent=1))
    print_table(rows)
    plot(rows, out / "router_stage.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
