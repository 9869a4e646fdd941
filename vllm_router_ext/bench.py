"""Router GEMM benchmark and accuracy audit on one GPU (no vLLM needed).

    python -m vllm_router_ext.bench [--out DIR] [--shapes DeepSeek-V3,...] [--m 1,16,...] [--skip-accuracy]

Speed: every M of ``M_LIST`` on the DeepSeek-family shapes (``--shapes`` also takes the
other families' release gates: Qwen3, gpt-oss, Mixtral, Llama-4, GLM-4.5, MiniMax-M2); each
method is captured R times back to back in one CUDA graph over R rotated weight/input copies
(> 3x the L2), timed with ``triton.testing.do_bench`` (median of replays) / R. Prints µs, the
ratio to cuBLAS and to the peer kernel (TRT-LLM's ``dsv3RouterGemm`` through FlashInfer, or
``--peer FILE``; M <= 16 on the shapes it serves) measured in the same run; writes ``bench.json``
and ``bench.png`` (µs vs M, log-log; the plot needs the ``plot`` extra).

Accuracy: 8192 random tokens per shape (x ~ N(0,1), W ~ N(0,1/K), bf16): relative error vs an
fp64 reference and the % of tokens whose expert set (the model's own routing) changes.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_router_ext.bench_harness import (
    M_LIST,
    PEER,
    SHAPE_BY_NAME,
    SHAPES,
    Peer,
    floor_us,
    load_peer,
    make_inputs,
    rotation_copies,
    time_graph,
)
from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.router_gemm import fp32_weight_terms
from vllm_router_ext.ops.routing_fp64 import changed_expert_sets, select_experts
from vllm_router_ext.plotting import PLOT_MISSING, pyplot

METHODS = {  # each called as fn(x, w, w32, w32_terms)
    "ours bf16-fp32out": lambda x, w, *_: router_gemm(x, w, "bf16-fp32out"),
    "ours fp32": lambda x, w, *_: router_gemm(x, w, "fp32"),
    "ours bf16": lambda x, w, *_: router_gemm(x, w, "bf16"),
    "ours BI bf16-fp32out": lambda x, w, *_: router_gemm(x, w, "bf16-fp32out", batch_invariant=True),
    "ours BI fp32": lambda x, w, *_: router_gemm(x, w, "fp32", batch_invariant=True),
    # as the gate layer calls it: the fp32 weight and its bf16 terms, split once at load
    "ours fp32 (fp32 weight)": lambda x, w, w32, t: router_gemm(x, w32, "fp32", weight_terms=t),
    "cuBLAS mm out_dtype=fp32": lambda x, w, *_: torch.mm(x, w.T, out_dtype=torch.float32),
    "F.linear fp32 upcast": lambda x, w, w32, t: F.linear(x.float(), w32),
    "F.linear bf16": lambda x, w, *_: F.linear(x, w),
}
BASELINE = "cuBLAS mm out_dtype=fp32"
DEFAULT_METHODS = list(METHODS)


def _heuristic(mode: str, batch_invariant: bool = False):
    """Our op without a tuned table (what a GPU without one runs): the table is bypassed while
    the graph is captured, so the replays run the heuristic's kernels."""
    from csrc_triton.tables import table_override

    def call(x, w, *_):
        with table_override("none"):
            return router_gemm(x, w, mode, batch_invariant=batch_invariant)

    return call


def _triton_bf16_fp32out(x, w, *_):
    """Our Triton kernels alone in ``bf16-fp32out``: inside vLLM the op runs vLLM's own gate kernel
    at 1-16 tokens where it can (``csrc_triton.choice.VLLM_GATE_TO_M``); this keeps ours timed."""
    from csrc_triton.choice import choose
    from csrc_triton.dispatch import launch_exactly
    from csrc_triton.problem import Precision, Problem

    launch = choose(Problem.of(x, w, Precision.BF16_FP32OUT), allow_vllm_gate=False)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
    return launch_exactly(launch, x, w, out)


# Not in the default run (``--methods`` names them): the heuristic beside the table, our Triton
# kernels where the op would run vLLM's.
METHODS.update(
    {
        "ours triton bf16-fp32out": _triton_bf16_fp32out,
        "heuristic bf16-fp32out": _heuristic("bf16-fp32out"),
        "heuristic fp32": _heuristic("fp32"),
        "heuristic BI bf16-fp32out": _heuristic("bf16-fp32out", True),
        "heuristic BI fp32": _heuristic("fp32", True),
    }
)


def _git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(commit: str | None = None) -> dict:
    def _smi(q: str) -> str:
        try:
            return subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    import triton

    commit = commit or _git_commit()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "driver": _smi("driver_version"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def run_speed(
    shapes, ms, methods, on_shape_done=None, peer: Peer | None = None, rounds: int = 2
) -> list[dict]:
    """µs per call of each method (and of ``peer`` where it serves the shape and M: else None):
    the best of ``rounds`` medians, the methods taking turns (a clock drift during one method's
    turn shows as noise in one round, not as a ratio)."""
    rows = []
    for shape in shapes:
        for m in ms:
            copies = rotation_copies(m, shape.k, shape.n)
            xs, ws = make_inputs(m, shape.k, shape.n, copies)
            w32s = [w.float() for w in ws]  # a gate weight stored in fp32 (vLLM PR #47410 keeps it so)
            terms = [fp32_weight_terms(w) if "ours fp32 (fp32 weight)" in methods else None for w in w32s]
            row = {
                "shape": shape.name,
                "K": shape.k,
                "N": shape.n,
                "M": m,
                "floor_us": floor_us(m, shape.k, shape.n),
            }
            timed = {
                name: [
                    lambda x=x, w=w, w32=w32, t=t, fn=METHODS[name]: fn(x, w, w32, t)
                    for x, w, w32, t in zip(xs, ws, w32s, terms, strict=True)
                ]
                for name in methods
            }
            if peer is not None:
                row[peer.column] = None
                if peer.serves(m, shape.k, shape.n):
                    timed[peer.column] = [lambda x=x, w=w: peer.fn(x, w) for x, w in zip(xs, ws, strict=True)]
            for _ in range(rounds):
                for name, calls in timed.items():
                    us = time_graph(calls, warmup=10, rep=50)
                    row[name] = us if row.get(name) is None else min(row[name], us)
            rows.append(row)
            base = row.get(BASELINE)
            peer_us = row.get(peer.column) if peer is not None else None
            print(
                f"{shape.name:>17} M={m:>5}  "
                + "  ".join(f"{n.replace('ours ', '')}={row[n]:.2f}" for n in methods)
                + (
                    f"  | ours/cuBLAS={row['ours bf16-fp32out'] / base:.2f}"
                    if base and "ours bf16-fp32out" in row
                    else ""
                )
                + (
                    f"  peer={peer_us:.2f} ours/peer={row['ours bf16-fp32out'] / peer_us:.2f}"
                    if peer_us and "ours bf16-fp32out" in row
                    else ""
                ),
                flush=True,
            )
            del xs, ws, w32s, terms
        if on_shape_done:
            on_shape_done(rows)
    return rows


def run_accuracy(shapes, tokens: int = 8192, seed: int = 7) -> list[dict]:
    rows = []
    for shape in shapes:
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, shape.k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(shape.n, shape.k, device="cuda", generator=g) / shape.k**0.5).to(torch.bfloat16)
        w32 = torch.randn(shape.n, shape.k, device="cuda", generator=g) / shape.k**0.5  # genuinely fp32
        noaux = shape.routing.uses_correction_bias
        bias = (torch.randn(shape.n, device="cuda", generator=g) * 0.01) if noaux else None
        paths = {
            "ours fp32": (router_gemm(x, w, "fp32"), w),
            "ours bf16-fp32out": (router_gemm(x, w, "bf16-fp32out"), w),
            "ours bf16": (router_gemm(x, w, "bf16"), w),
            "ours BI fp32": (router_gemm(x, w, "fp32", batch_invariant=True), w),
            "ours BI bf16-fp32out": (router_gemm(x, w, "bf16-fp32out", batch_invariant=True), w),
            "ours fp32 (fp32 weight)": (
                router_gemm(x, w32, "fp32", weight_terms=fp32_weight_terms(w32)),
                w32,
            ),
            "torch fp32 upcast": (F.linear(x.float(), w.float()), w),
            "cuBLAS bf16->fp32": (torch.mm(x, w.T, out_dtype=torch.float32), w),
            "F.linear bf16": (F.linear(x, w), w),
        }
        refs = {}
        for name, (logits, weight) in paths.items():
            key = id(weight)
            if key not in refs:
                ref = x.double() @ weight.double().T
                refs[key] = (
                    ref,
                    select_experts(ref, shape.routing, None if bias is None else bias.double())[0],
                )
            ref, ref_ids = refs[key]
            rel = ((logits.double() - ref).norm() / ref.norm()).item()
            # Routing in fp64 on each path's logits isolates what the GEMM's output does.
            ids = select_experts(logits.double(), shape.routing, None if bias is None else bias.double())[0]
            changed = changed_expert_sets(ids, ref_ids).float().mean().item() * 100
            rows.append({"shape": shape.name, "path": name, "rel_err": rel, "changed_pct": changed})
            print(
                f"{shape.name:>17} {name:>24}: rel err {rel:.2e}  changed expert sets {changed:.3f} %",
                flush=True,
            )
    return rows


def run_fp32_by_m(ms=(1, 7, 16, 300, 4096, 16384)) -> list[dict]:
    rows = []
    shape = SHAPES[0]
    for m in ms:
        xs, ws = make_inputs(m, shape.k, shape.n, 1, seed=m)
        x, w = xs[0], ws[0]
        ref = x.double() @ w.double().T
        for name, out in (
            ("ours fp32", router_gemm(x, w, "fp32")),
            ("ours BI fp32", router_gemm(x, w, "fp32", batch_invariant=True)),
            ("ours bf16-fp32out", router_gemm(x, w, "bf16-fp32out")),
            ("torch fp32 upcast", F.linear(x.float(), w.float())),
        ):
            rows.append({"M": m, "path": name, "rel_err": ((out.double() - ref).norm() / ref.norm()).item()})
    for r in rows:
        print(f"fp32 accuracy by M  M={r['M']:>5} {r['path']:>18}: {r['rel_err']:.2e}")
    return rows


def peer_column(rows: list[dict]) -> str | None:
    """The rows' peer column (``peer (<kernel>)``), if a peer ran."""
    return next((k for r in rows for k in r if k.startswith("peer (")), None)


def _cell(r: dict, name: str, peer_name: str | None) -> str:
    """µs, (ratio to cuBLAS), [ratio to the peer] for our columns where the peer ran."""
    if r.get(name) is None:
        return "-"
    base, peer = r.get(BASELINE), r.get(peer_name) if peer_name else None
    text = f"{r[name]:.2f}" + (f" ({r[name] / base:.2f})" if base else "")
    return text + (f" [{r[name] / peer:.2f}]" if peer and name.startswith("ours") else "")


def print_tables(rows: list[dict], methods: list[str]) -> None:
    peer_name = peer_column(rows)
    peer = peer_name is not None and any(r.get(peer_name) for r in rows)
    cols = methods + ([peer_name] if peer else [])
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        what = "(ratio to cuBLAS)" + (" [ratio to the peer]" if peer else "")
        print(f"\n### {shape} (K={sub[0]['K']}, N={sub[0]['N']}): µs per call, {what}")
        print("| M | " + " | ".join(cols) + " | floor |")
        print("|---:|" + "---:|" * (len(cols) + 1))
        for r in sub:
            cells = " | ".join(_cell(r, n, peer_name) for n in cols)
            print(f"| {r['M']} | {cells} | {r['floor_us']:.2f} |")


def plot(rows: list[dict], methods: list[str], path: Path) -> bool:
    """Write the µs-vs-M plot; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = methods + [peer_column(rows) or PEER]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        sub = [r for r in rows if r["shape"] == shape]
        ms = [r["M"] for r in sub]
        for name in names:
            points = [(r["M"], r[name]) for r in sub if r.get(name) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=name)
        ax.plot(ms, [r["floor_us"] for r in sub], "k--", lw=1, label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} (K={sub[0]['K']}, N={sub[0]['N']})")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-router-bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        metavar="DIR",
        default="bench-out",
        help="directory for bench.json, bench.log and the plots (default: %(default)s)",
    )
    p.add_argument(
        "--shapes",
        metavar="NAMES",
        default=",".join(s.name for s in SHAPES),
        help=f"comma-separated gate shapes, by model name, from: {', '.join(SHAPE_BY_NAME)} "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--m",
        metavar="M_LIST",
        default=",".join(map(str, M_LIST)),
        help="comma-separated token counts M (default: %(default)s)",
    )
    p.add_argument(
        "--methods",
        metavar="NAMES",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated, from: {', '.join(METHODS)} (default: all)",
    )
    p.add_argument(
        "--skip-accuracy",
        action="store_true",
        help="time only: skip the expert-set accuracy table (default: measure it)",
    )
    p.add_argument(
        "--commit",
        metavar="SHA",
        default=None,
        help="the code's commit, recorded in bench.json (default: git's)",
    )
    p.add_argument(
        "--peer",
        metavar="FILE",
        default=None,
        help="a Python file defining peer_mm(x, w), SHAPES and MS (default: FlashInfer's router GEMMs)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPE_BY_NAME]
    if unknown:
        print(f"unknown shape(s) {unknown}; allowed: {list(SHAPE_BY_NAME)}", file=sys.stderr)
        return 2
    shapes = [SHAPE_BY_NAME[n] for n in names]
    methods = args.methods.split(",")
    if unknown := [n for n in methods if n not in METHODS]:
        print(f"unknown method(s) {unknown}; allowed: {list(METHODS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer, peer_note = load_peer(args.peer)
    env = {**environment(args.commit), "peer": peer_note}
    print(json.dumps(env))
    result = {"environment": env}
    if not args.skip_accuracy:
        result["accuracy"] = run_accuracy(shapes)
        if SHAPES[0] in shapes:
            result["fp32_by_m"] = run_fp32_by_m()

    def save(rows: list[dict]) -> None:  # after every shape: a cut-short run keeps what it measured
        result["speed"] = rows
        (out / "bench.json").write_text(json.dumps(result, indent=1))

    save([])
    rows = run_speed(shapes, [int(m) for m in args.m.split(",")], methods, on_shape_done=save, peer=peer)
    print_tables(rows, methods)
    print(
        f"wrote {out / 'bench.json'}"
        + (f" and {out / 'bench.png'}" if plot(rows, methods, out / "bench.png") else f"; {PLOT_MISSING}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
