"""Render a benchmark JSON (``python -m vllm_router_ext.bench``): one speed table per shape (µs per
call, ×cuBLAS and ×peer measured in the same run), the accuracy table, and with ``--plots DIR``
one log-log plot per mode. ``--summary`` renders docs/benchmarks.md's speed summary instead: one
row per shape from several JSONs (oldest first; each point from the newest run that has it).

    python benchmarks/render_tables.py benchmarks/results/bench-h200-<commit>.json [--plots docs/assets]
    python benchmarks/render_tables.py --summary OLDEST.json ... NEWEST.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

CUBLAS = "cuBLAS mm out_dtype=fp32"
HEURISTIC = "heuristic fp32"
UPCAST = "F.linear fp32 upcast"
PEER = "peer (TRT-LLM dsv3RouterGemm)"
#: The page's M points (the benchmark may measure more).
PAGE_MS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)
#: (JSON key, header): our columns carry ×cuBLAS and, where the peer ran, ×peer.
COLUMNS = [
    ("ours fp32", "fp32 (default)"),
    ("ours bf16-fp32out", "bf16-fp32out"),
    ("ours BI fp32", "batch-inv. fp32"),
    (CUBLAS, "cuBLAS bf16→fp32"),
    (UPCAST, "torch fp32 upcast"),
    (PEER, "peer"),
]
#: mode -> our JSON key, for the plots.
MODES = {"fp32": "ours fp32", "bf16-fp32out": "ours bf16-fp32out", "batch-invariant fp32": "ours BI fp32"}
ACCURACY_PATHS = [
    ("ours fp32", "ours fp32"),
    ("ours BI fp32", "ours batch-invariant fp32"),
    ("ours bf16-fp32out", "ours bf16-fp32out"),
    ("cuBLAS bf16->fp32", "cuBLAS bf16→fp32"),
    ("torch fp32 upcast", "torch fp32 upcast"),
    ("ours bf16", "bf16 logits (stock vLLM)"),
]


def _by_shape(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["M"] in PAGE_MS:
            out[r["shape"]].append(r)
    return out


def _cell(r: dict, key: str) -> str:
    value = r.get(key)
    if value is None:
        return "-"
    if not key.startswith("ours"):
        return f"{value:.2f}"
    text = f"{value:.2f} ({value / r[CUBLAS]:.2f}×)"
    return text + (f" [{value / r[PEER]:.2f}×]" if r.get(PEER) else "")


def render_speed(rows: list[dict]) -> str:
    out = []
    for shape, rs in _by_shape(rows).items():
        keys = [(k, h) for k, h in COLUMNS if any(r.get(k) is not None for r in rs)]
        out.append(f"**{shape}** (K={rs[0]['K']}, N={rs[0]['N']})\n")
        out.append("| M | " + " | ".join(h for _, h in keys) + " |")
        out.append("|---:|" + "---:|" * len(keys))
        out += [f"| {r['M']} | " + " | ".join(_cell(r, k) for k, _ in keys) + " |" for r in rs]
        out.append("")
    return "\n".join(out)


def render_accuracy(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    got = {(r["shape"], r["path"]): r for r in rows}
    out = ["| path | " + " | ".join(shapes) + " |", "|---|" + "---:|" * len(shapes)]
    for key, label in ACCURACY_PATHS:
        cells = [f"{got[s, key]['rel_err']:.1e} / {got[s, key]['changed_pct']:.3f} %" for s in shapes]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_modes(rows: list[dict], out_dir: Path, stem: str) -> list[Path]:
    """One figure per mode: ours beside cuBLAS, torch's fp32 upcast and the peer, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    shapes = _by_shape(rows)
    for mode, ours in MODES.items():
        fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), squeeze=False)
        for ax, (shape, rs) in zip(axes[0], shapes.items(), strict=True):
            for key, label, style in (
                (ours, f"ours {mode}", "o-"),
                (CUBLAS, "cuBLAS bf16→fp32", "s--"),
                (UPCAST, "torch fp32 upcast", "^:"),
                (PEER, "peer (TRT-LLM)", "d-"),
            ):
                points = [(r["M"], r[key]) for r in rs if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), style, ms=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(shape, fontsize=9)
            ax.set_xlabel("M (tokens)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("µs per call")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"router GEMM, {mode} mode (H200, CUDA graph, median)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{stem}-{mode.replace(' ', '-')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


#: The summary's columns of ``ours fp32`` ×cuBLAS, by M.
SUMMARY_MS = (1, 16, 1024, 16384)
BF16_FP32OUT, FP32 = "ours bf16-fp32out", "ours fp32"


def _worst(points: list[tuple[int, float]]) -> str:
    m, ratio = max(points, key=lambda p: p[1])
    return f"{ratio:.2f}× ({m})"


def render_summary(runs: list[tuple[str, list[dict]]]) -> str:
    """One row per shape: the worst ``bf16-fp32out`` ×cuBLAS and ``fp32`` ×``bf16-fp32out`` over
    every M measured (at which M), ``fp32`` ×cuBLAS at :data:`SUMMARY_MS`, the peer's range at 1-16
    tokens; each (shape, M) from the newest run holding it, whose names the last column lists."""
    latest: dict[tuple[str, int], tuple[str, dict]] = {}
    for name, rows in runs:
        for r in rows:
            if r.get(FP32) is not None and r.get(CUBLAS) is not None:
                latest[r["shape"], r["M"]] = (name, r)
    shapes = list(dict.fromkeys(shape for shape, _ in latest))
    heads = ["shape (K × N)", "bf16-fp32out ×cuBLAS, worst (M)", "fp32 ×bf16-fp32out, worst (M)"]
    heads += [f"fp32 ×cuBLAS at {m}" for m in SUMMARY_MS] + ["fp32 ×peer at 1-16", "runs"]
    out = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 2) + "---|"]
    for shape in shapes:
        got = sorted((m, nr) for (s, m), nr in latest.items() if s == shape)
        rows = [r for _, (_, r) in got]
        bf16 = _worst([(r["M"], r[BF16_FP32OUT] / r[CUBLAS]) for r in rows if r.get(BF16_FP32OUT)])
        fp32 = _worst([(r["M"], r[FP32] / r[BF16_FP32OUT]) for r in rows if r.get(BF16_FP32OUT)])
        at = {r["M"]: r for r in rows}
        cells = [f"{at[m][FP32] / at[m][CUBLAS]:.2f}×" if m in at else "-" for m in SUMMARY_MS]
        peers = [r[FP32] / r[PEER] for r in rows if r["M"] <= 16 and r.get(PEER)]
        peer = f"{min(peers):.2f}-{max(peers):.2f}×" if peers else "-"
        names = ", ".join(dict.fromkeys(f"`{n}`" for _, (n, _) in got))
        out.append(f"| {shape} ({rows[0]['K']} × {rows[0]['N']}) | {bf16} | {fp32} | " + " | ".join(cells)
                   + f" | {peer} | {names} |")  # fmt: skip
    return "\n".join(out)


def render_by_triton(runs: list[dict], ms: tuple[int, ...] | None = None) -> str:
    """One row per shape and M: our ``fp32`` µs under each run's Triton (the first run the
    reference: its ratio in brackets), the fastest alternative of each run (the heuristic, cuBLAS)
    beside it; runs of the same benchmark under different Tritons."""
    tritons = [run["environment"]["triton"] for run in runs]
    by_point = [{(r["shape"], r["M"]): r for r in run["speed"]} for run in runs]
    points = list(dict.fromkeys(p for run in by_point for p in run))
    heads = ["shape", "M"] + [f"fp32, Triton {v}" for v in tritons]
    heads += [f"best other, Triton {v}" for v in tritons]
    out = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
    for point in points:
        if not all(point in run for run in by_point) or (ms and point[1] not in ms):
            continue
        rows = [run[point] for run in by_point]
        ours = [r[FP32] for r in rows]
        cells = [f"{ours[0]:.2f}"] + [f"{t:.2f} ({t / ours[0]:.2f}×)" for t in ours[1:]]
        for r in rows:
            other = {k: r[k] for k in (HEURISTIC, CUBLAS) if r.get(k)}
            name, best = min(other.items(), key=lambda kv: kv[1])
            cells.append(f"{best:.2f} ({'heuristic' if name == HEURISTIC else 'cuBLAS'})")
        out.append(f"| {point[0]} | {point[1]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="a benchmark JSON (with --summary: several, oldest first)")
    p.add_argument("--plots", default=None, help="write bench-h200-<mode>.png files into this folder")
    p.add_argument("--summary", action="store_true", help="one row per shape from every JSON given")
    p.add_argument(
        "--by-triton",
        action="store_true",
        help="several runs of the same benchmark under different Tritons: our fp32 under each",
    )
    p.add_argument("--m", default=None, help="with --by-triton: only these M (comma-separated)")
    args = p.parse_args(argv)
    if args.by_triton:
        ms = tuple(int(m) for m in args.m.split(",")) if args.m else None
        print(render_by_triton([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.json], ms))
        return 0
    if args.summary:
        runs = [(Path(f).stem, json.loads(Path(f).read_text(encoding="utf-8"))["speed"]) for f in args.json]
        print(render_summary(runs))
        return 0
    if len(args.json) != 1:
        p.error("one JSON, or several with --summary")
    data = json.loads(Path(args.json[0]).read_text(encoding="utf-8"))
    print(render_speed(data["speed"]))
    if "accuracy" in data:
        print(render_accuracy(data["accuracy"]))
    if args.plots:
        for path in plot_modes(data["speed"], Path(args.plots), "bench-h200"):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
