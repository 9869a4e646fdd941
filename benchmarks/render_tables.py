"""Render a benchmark JSON (``python -m vllm_router_ext.bench``) as the speed tables of
docs/benchmarks.md: µs per call and the ratio to cuBLAS measured in the same run.

    python benchmarks/render_tables.py benchmarks/results/bench-h200-<commit>.json
    python benchmarks/render_tables.py --targets bench.json   # each column as the issues measure it
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable

COLUMNS = [  # (JSON key, table header)
    ("ours bf16-fp32out", "ours bf16-fp32out"),
    ("ours fp32", "ours fp32"),
    ("ours bf16", "ours bf16"),
    ("ours BI bf16-fp32out", "ours BI bf16-fp32out"),
    ("ours BI fp32", "ours BI fp32"),
    ("ours fp32 (fp32 weight)", "ours fp32, fp32 weight"),
    ("cuBLAS mm out_dtype=fp32", "cuBLAS (mm, out fp32)"),
    ("F.linear fp32 upcast", "F.linear fp32 upcast"),
    ("F.linear bf16", "F.linear bf16"),
]
CUBLAS = "cuBLAS mm out_dtype=fp32"


def _tables(rows: list[dict], heading: str, headers: list[str], cells: Callable[[dict], list[str]]) -> str:
    """One markdown table per shape (``heading``: its level), a row per M."""
    by_shape: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_shape[r["shape"]].append(r)
    out = []
    for shape, rs in by_shape.items():
        out.append(f"{heading} {shape} (K={rs[0]['K']}, N={rs[0]['N']})\n")
        out.append("| M | " + " | ".join(headers) + " |")
        out.append("|---:|" + "---:|" * len(headers))
        out += [f"| {r['M']} | " + " | ".join(cells(r)) + " |" for r in rs]
        out.append("")
    return "\n".join(out)


def render(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        return [
            ""
            if key not in r
            else f"{r[key]:.2f}"
            if key == CUBLAS
            else f"{r[key]:.2f} ({r[key] / r[CUBLAS]:.2f}×)"
            for key, _ in COLUMNS
        ] + [f"{r['floor_us']:.2f}"]

    return _tables(rows, "####", [h for _, h in COLUMNS] + ["HBM floor"], cells)


def _fastest_bf16(r: dict) -> float:
    return min(r["ours bf16-fp32out"], r[CUBLAS])


#: (JSON key, header, what its ratio is to): the ratios the issues set their targets on.
TARGET_COLUMNS = [
    ("ours bf16-fp32out", "ours bf16-fp32out (x cuBLAS)", lambda r: r[CUBLAS]),
    (CUBLAS, "cuBLAS (mm, out fp32)", None),
    ("ours fp32", "ours fp32 (x ours bf16-fp32out)", lambda r: r["ours bf16-fp32out"]),
    ("F.linear fp32 upcast", "F.linear fp32 upcast (x ours fp32)", lambda r: r["ours fp32"]),
    ("ours BI bf16-fp32out", "ours BI bf16-fp32out (x fastest)", _fastest_bf16),
    ("ours BI fp32", "ours BI fp32 (x ours fp32)", lambda r: r["ours fp32"]),
]


def render_targets(rows: list[dict]) -> str:
    """One table per shape, each time with the ratio an issue's target is stated on: bf16-fp32out
    to cuBLAS, ``fp32`` to bf16-fp32out, torch's fp32 upcast to ``fp32`` (how many times faster
    we are), batch-invariant to the fastest non-invariant path of its mode."""

    def cells(r: dict) -> list[str]:
        return [
            f"{r[key]:.2f}" + (f" ({r[key] / base(r):.2f}×)" if base else "")
            for key, _, base in TARGET_COLUMNS
        ]

    return _tables(rows, "#####", [h for _, h, _ in TARGET_COLUMNS], cells)


if __name__ == "__main__":
    targets = sys.argv[1] == "--targets"
    speed = json.loads(open(sys.argv[-1]).read())["speed"]
    print(render_targets(speed) if targets else render(speed))
