"""What exact routing costs in a served model: decode tokens/s and time to first token through real
CUDA vLLM (compile + CUDA graphs, vLLM's defaults), one server per router precision, side by side.

    python benchmarks/e2e_serve.py --out e2e-out [--shapes deepseek-v3,kimi-k2] [--weights bf16,fp8]
        [--rounds 3] [--concurrency 1,8,64] [--max-tokens 128]

Models: slices of the real ones with random weights (hidden 7168, DeepSeek's MLA sizes, 16 heads,
3 layers of which 2 MoE, narrow experts: the router's share of a step is larger than in the full
model, so a cost shows more, not less). Every server of a run starts together on the one GPU;
then, per round and concurrency, the servers are measured one at a time, the modes taking turns
in a rotated order. Decode tokens/s: ``c`` clients each send one request (16 prompt tokens,
``--max-tokens`` new tokens, EOS ignored), completion tokens / wall time; TTFT: a 256-token
prompt streamed alone, time to the first token, median of 5. Writes ``e2e.json`` and ``e2e.png``
and prints a table with each mode's ratio to ``bf16`` (stock vLLM) per round's median.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from vllm_router_ext.plotting import pyplot
from vllm_router_ext.testing.server import Server, precision_lines, start_server
from vllm_router_ext.testing.tiny_checkpoint import GPU_MLA_SIZES, build_tiny_model

MODES = ("bf16", "bf16-fp32out", "fp32")  # bf16: stock vLLM's logits
SLICE = {
    **GPU_MLA_SIZES,
    "hidden_size": 7168,
    "intermediate_size": 1024,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 1536,
}


def build(root: Path, shape: str, weights: str) -> Path:
    return build_tiny_model(root / f"{shape}-{weights}", shape, fp8=weights == "fp8", config_overrides=SLICE)


def _post(server: Server, body: dict, stream: bool = False) -> tuple[int, float]:
    """(completion tokens, seconds to the first streamed chunk, or to the reply)."""
    req = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps({"model": server.model_name(), **body, "stream": stream}).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        if stream:
            for line in r:
                if line.startswith(b"data: {"):
                    return 0, time.perf_counter() - start
        reply = json.loads(r.read())
    return reply["usage"]["completion_tokens"], time.perf_counter() - start


def decode_tokens_per_s(server: Server, clients: int, max_tokens: int, rng: random.Random) -> float:
    prompts = [[rng.randrange(2, 2000) for _ in range(16)] for _ in range(clients)]
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        tokens = sum(t for t, _ in pool.map(lambda p: _post(server, {**body, "prompt": p}), prompts))
    if tokens != clients * max_tokens:
        raise RuntimeError(f"{server.base_url}: {tokens} tokens, expected {clients * max_tokens}")
    return tokens / (time.perf_counter() - start)


def ttft_ms(server: Server, rng: random.Random, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        prompt = [rng.randrange(2, 2000) for _ in range(256)]
        times.append(_post(server, {"prompt": prompt, "max_tokens": 2, "temperature": 0}, stream=True)[1])
    return statistics.median(times) * 1e3


def start_all(cases: list[tuple[str, str]], root: Path) -> dict[tuple[str, str, str], Server]:
    servers = {}
    for shape, weights in cases:
        model = build(root, shape, weights)
        for mode in MODES:
            work = root / f"{shape}-{weights}-{mode}"
            work.mkdir()
            args = ["--router-precision", mode, "--gpu-memory-utilization", "0.04",
                    "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "64"]  # fmt: skip
            env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
            if weights == "fp8":
                env["VLLM_USE_DEEP_GEMM"] = "0"  # DeepGEMM's first start JIT-compiles for minutes
            servers[(shape, weights, mode)] = start_server(model, work, *args, env=env, eager=False)
    with cf.ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.wait_healthy(timeout=float(os.environ.get("E2E_START_S", "420"))),
                      servers.values()))  # fmt: skip
    for key, server in servers.items():
        lines = precision_lines(server.log())
        if not lines or f"router precision {key[2]} " not in lines[0]:
            raise RuntimeError(f"{key}: the precision line does not say {key[2]}: {lines}")
    return servers


def run(args: argparse.Namespace) -> dict:
    cases = [(s, w) for s in args.shapes.split(",") for w in args.weights.split(",")]
    conc = [int(c) for c in args.concurrency.split(",")]
    root = Path(args.out) / "work"
    root.mkdir(parents=True, exist_ok=True)
    servers = start_all(cases, root)
    rng = random.Random(0)
    rows = []
    try:
        for server in servers.values():  # warm-up: every batch size the rounds use
            for c in conc:
                decode_tokens_per_s(server, c, 16, rng)
        for rnd in range(args.rounds):
            order = MODES[rnd % 3 :] + MODES[: rnd % 3]
            for shape, weights in cases:
                for c in [*conc, "ttft"]:
                    for mode in order:
                        server = servers[(shape, weights, mode)]
                        if c == "ttft":
                            value = ttft_ms(server, rng)
                        else:
                            value = decode_tokens_per_s(server, c, args.max_tokens, rng)
                        metric = "ttft_ms" if c == "ttft" else f"tok_s@{c}"
                        row = {"round": rnd, "shape": shape, "weights": weights, "mode": mode,
                               "metric": metric, "value": value}  # fmt: skip
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return {"rows": rows, "max_tokens": args.max_tokens, "concurrency": conc, "rounds": args.rounds}


def summary(result: dict) -> list[dict]:
    """Median over rounds per (shape, weights, metric, mode), with the ratio to bf16."""
    groups: dict[tuple, list[float]] = {}
    for r in result["rows"]:
        groups.setdefault((r["shape"], r["weights"], r["metric"], r["mode"]), []).append(r["value"])
    out = []
    for (shape, weights, metric, mode), values in groups.items():
        base = statistics.median(groups[(shape, weights, metric, "bf16")])
        med = statistics.median(values)
        out.append({"shape": shape, "weights": weights, "metric": metric, "mode": mode, "median": med,
                    "min": min(values), "max": max(values), "vs_bf16": med / base})  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    metrics = sorted(
        {r["metric"] for r in rows}, key=lambda m: (m == "ttft_ms", int(m.split("@")[-1]) if "@" in m else 0)
    )
    lines = [
        "| model | weights | mode | " + " | ".join(metrics) + " |",
        "|---|---|---|" + "---:|" * len(metrics),
    ]
    by = {(r["shape"], r["weights"], r["mode"], r["metric"]): r for r in rows}
    for shape, weights in dict.fromkeys((r["shape"], r["weights"]) for r in rows):
        for mode in MODES:
            cells = []
            for m in metrics:
                r = by[(shape, weights, mode, m)]
                unit = "ms" if m == "ttft_ms" else "tok/s"
                cells.append(f"{r['median']:.1f} {unit} ({r['vs_bf16']:.3f}×)")
            lines.append(f"| {shape} | {weights} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    cases = list(dict.fromkeys((r["shape"], r["weights"]) for r in rows))
    metrics = [m for m in dict.fromkeys(r["metric"] for r in rows)]
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (shape, weights) in zip(axes[0], cases, strict=True):
        for i, mode in enumerate(MODES):
            vals = [next(r["vs_bf16"] for r in rows if (r["shape"], r["weights"], r["mode"], r["metric"]) ==
                         (shape, weights, mode, m)) for m in metrics]  # fmt: skip
            ax.bar([j + (i - 1) * 0.27 for j in range(len(metrics))], vals, width=0.27, label=mode)
        ax.axhline(0.99, color="k", ls="--", lw=1, label="0.99× (target for tok/s)")
        ax.set_xticks(range(len(metrics)), metrics, rotation=20)
        ax.set_ylim(0.9, 1.1)
        ax.set_ylabel("median / stock bf16")
        ax.set_title(f"{shape} ({weights} weights)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="e2e_serve.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", metavar="DIR", default="e2e-out", help="where e2e.json and e2e.png go (default: %(default)s)"
    )
    p.add_argument("--shapes", metavar="NAMES", default="deepseek-v3,kimi-k2",
                   help="routing presets of the slices (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--weights", metavar="KINDS", default="bf16,fp8", help="bf16 and/or fp8 (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, modes taking turns (default: %(default)s)")
    p.add_argument(
        "--concurrency", metavar="LIST", default="1,8,64", help="clients at once (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)"
    )
    args = p.parse_args(argv)
    result = run(args)
    result["summary"] = summary(result)
    out = Path(args.out)
    (out / "e2e.json").write_text(json.dumps(result, indent=1))
    print(table(result["summary"]))
    plot(result["summary"], out / "e2e.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
