"""What exact routing costs in a served model: decode tokens/s and time to first token through real
CUDA vLLM (compile + CUDA graphs, vLLM's defaults), one server per router precision, side by side.

    python benchmarks/e2e_serve.py --out e2e-out [--cases deepseek-v3:bf16,deepseek-v3:fp8,kimi-k2:bf16]
        [--rounds 3] [--concurrency 1,8,64] [--max-tokens 128]

Models: slices of the real ones with random weights (hidden 7168, DeepSeek's MLA sizes, 16 heads,
3 layers of which 2 MoE, narrow experts: the router's share of a step is larger than in the full
model, so a cost shows more, not less). Every server of a run starts together on the one GPU;
then, per round and concurrency, the servers are measured one at a time, the modes taking turns
in a rotated order, with vLLM's own serving benchmark (``vllm bench serve``: random prompts, EOS
ignored). Decode: ``c`` concurrent clients, 4c requests (at least 6) of 16 prompt tokens and
``--max-tokens`` new ones: output tokens/s, median time per output token (TPOT), and the GPU time
of one decode step (``workers.step_timer``: the median replay of the most replayed CUDA graph,
vLLM's FULL graph for the batch). TTFT: 256-token prompts one at a time, the median. Ratios are
to ``bf16`` (stock vLLM) of the same round, then the median over rounds: host noise that drifts
between rounds cancels. Writes ``e2e.json`` and ``e2e.png``, prints the table and the verdict on
the throughput target (``fp32`` >= 0.99x stock tok/s), decided by the decode step's GPU time
where it was measured (the host work a graph replay does is the same in every mode).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
from pathlib import Path

from vllm_router_ext.plotting import pyplot
from vllm_router_ext.tools.server import Server, precision_lines, start_server
from vllm_router_ext.tools.tiny_checkpoint import GPU_MLA_SIZES, build_tiny_model

#: Mode -> the plugin's settings. bf16: stock vLLM's logits; the unfused modes keep vLLM's router on
#: our logits, ``fp32-fused`` routes with this plugin's fused router (GEMM + scores + top-k).
MODE_ARGS = {
    "bf16": ("--router-precision", "bf16", "--router-fused", "off"),
    "bf16-fp32out": ("--router-precision", "bf16-fp32out", "--router-fused", "off"),
    "fp32": ("--router-precision", "fp32", "--router-fused", "off"),
    "fp32-fused": ("--router-precision", "fp32", "--router-fused", "on"),
}
MODES = ("bf16", "bf16-fp32out", "fp32")  # the default run
TIMER = "vllm_router_ext.workers.step_timer.StepTimer"
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


def bench_serve(
    server: Server, model: Path, *, clients: int, prompts: int, input_len: int, output_len: int, seed: int
) -> dict:
    """One run of vLLM's own serving benchmark (``vllm bench serve``, in this process) against
    ``server``: random prompts of ``input_len`` tokens, ``output_len`` new tokens each, EOS ignored."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        "--backend", "vllm", "--base-url", server.base_url, "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
        str(output_len), "--random-range-ratio", "0", "--num-prompts", str(prompts), "--max-concurrency",
        str(clients), "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--percentile-metrics",
        "ttft,tpot,itl",
    ]  # fmt: skip
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv))
    if result["completed"] != prompts or result["total_output_tokens"] != prompts * output_len:
        raise RuntimeError(f"{server.base_url}: {result['completed']} of {prompts} requests completed")
    return result


MODELS: dict[tuple[str, str], Path] = {}


def start_all(
    cases: list[tuple[str, str]], modes: tuple[str, ...], root: Path
) -> dict[tuple[str, str, str], Server]:
    servers = {}
    for shape, weights in cases:
        model = build(root, shape, weights)
        MODELS[(shape, weights)] = model
        for mode in modes:
            work = root / f"{shape}-{weights}-{mode}"
            work.mkdir()
            args = [*MODE_ARGS[mode], "--gpu-memory-utilization", "0.04",
                    "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "64"]  # fmt: skip
            args += ["--worker-extension-cls", TIMER]
            env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"}
            if weights == "fp8":
                env["VLLM_USE_DEEP_GEMM"] = "0"  # DeepGEMM's first start JIT-compiles for minutes
            servers[(shape, weights, mode)] = start_server(model, work, *args, env=env, eager=False)
    with cf.ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.wait_healthy(timeout=float(os.environ.get("E2E_START_S", "420"))),
                      servers.values()))  # fmt: skip
    for key, server in servers.items():
        lines = precision_lines(server.log())
        precision = MODE_ARGS[key[2]][1]
        if not lines or f"router precision {precision} " not in lines[0]:
            raise RuntimeError(f"{key}: the precision line does not say {precision}: {lines}")
        fused = key[2].endswith("-fused")
        if fused != any("fused router" in line for line in lines):
            raise RuntimeError(
                f"{key}: the precision lines {'do not ' if fused else ''}name the fused router: {lines}"
            )
    return servers


def run(args: argparse.Namespace) -> dict:
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    bad = [c for c in cases if len(c) != 2 or c[1] not in ("bf16", "fp8")]
    if bad:
        raise SystemExit(f"--cases: {bad} are not PRESET:bf16 or PRESET:fp8")
    modes = tuple(args.modes.split(","))
    unknown = [m for m in modes if m not in MODE_ARGS]
    if unknown or "bf16" not in modes:
        raise SystemExit(
            f"--modes {args.modes}: each from {', '.join(MODE_ARGS)}, bf16 (the baseline) among them"
        )
    conc = [int(c) for c in args.concurrency.split(",")]
    root = Path(args.out) / "work"
    root.mkdir(parents=True, exist_ok=True)
    servers = start_all(cases, modes, root)
    rows = []

    def measure(key: tuple[str, str, str], metric: str, seed: int) -> None:
        server, model = servers[key], MODELS[key[:2]]
        if metric == "ttft":
            r = bench_serve(server, model, clients=1, prompts=8, input_len=256, output_len=4, seed=seed)
            values = {"ttft_ms": r["median_ttft_ms"]}
        else:
            c = int(metric)
            server.rpc("router_steps_start")
            r = bench_serve(server, model, clients=c, prompts=max(6, 4 * c), input_len=16,
                            output_len=args.max_tokens, seed=seed)  # fmt: skip
            step = server.rpc("router_steps_stop")[0]["graphs"][0]  # the decode graph: most replayed
            values = {f"tok_s@{c}": r["output_throughput"], f"tpot_ms@{c}": r["median_tpot_ms"],
                      f"gpu_step_us@{c}": step["median_us"]}  # fmt: skip
            print(f"{key} c={c}: decode graph {step['graph']}, {step['replays']} replays", flush=True)
        for name, value in values.items():
            row = {"round": rnd, "shape": key[0], "weights": key[1], "mode": key[2], "metric": name,
                   "value": value}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)

    try:
        for key, server in servers.items():  # warm-up: every batch size the rounds use
            for c in conc:
                bench_serve(
                    server, MODELS[key[:2]], clients=c, prompts=c, input_len=16, output_len=8, seed=99
                )
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            for shape, weights in cases:
                for metric in [*map(str, conc), "ttft"]:
                    for mode in order:
                        measure((shape, weights, mode), metric, seed=rnd)
            (root.parent / "e2e-rows.json").write_text(json.dumps(rows))  # kept if a later round fails
    finally:
        for server in servers.values():
            server.stop()
    return {"rows": rows, "max_tokens": args.max_tokens, "concurrency": conc, "rounds": args.rounds,
            "modes": list(modes)}  # fmt: skip


def summary(result: dict) -> list[dict]:
    """Per (shape, weights, metric, mode): the median over rounds, and the ratio to bf16 measured
    in the same round (the modes ran back to back), its median and range over rounds."""
    groups: dict[tuple, dict[int, float]] = {}
    for r in result["rows"]:
        groups.setdefault((r["shape"], r["weights"], r["metric"], r["mode"]), {})[r["round"]] = r["value"]
    out = []
    for (shape, weights, metric, mode), values in groups.items():
        base = groups[(shape, weights, metric, "bf16")]
        ratios = [v / base[rnd] for rnd, v in values.items() if rnd in base]
        out.append({"shape": shape, "weights": weights, "metric": metric, "mode": mode,
                    "median": statistics.median(values.values()), "vs_bf16": statistics.median(ratios),
                    "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(ratios)})  # fmt: skip
    return out


def _metric_order(m: str) -> tuple:
    kinds = ("tok_s", "tpot_ms", "gpu_step_us", "ttft_ms")
    name, _, c = m.partition("@")
    return (kinds.index(name) if name in kinds else len(kinds), int(c) if c else 0)


def _modes(rows: list[dict]) -> list[str]:
    return [m for m in MODE_ARGS if any(r["mode"] == m for r in rows)]


def table(rows: list[dict]) -> str:
    metrics = sorted({r["metric"] for r in rows}, key=_metric_order)
    lines = [
        "| model | weights | mode | " + " | ".join(metrics) + " |",
        "|---|---|---|" + "---:|" * len(metrics),
    ]
    by = {(r["shape"], r["weights"], r["mode"], r["metric"]): r for r in rows}
    units = {"tok_s": "tok/s", "gpu_step_us": "µs"}
    for shape, weights in dict.fromkeys((r["shape"], r["weights"]) for r in rows):
        for mode in _modes(rows):
            cells = []
            for m in metrics:
                r = by[(shape, weights, mode, m)]
                unit = units.get(m.split("@")[0], "ms")
                spread = "" if mode == "bf16" else f"; {r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
                cells.append(f"{r['median']:.1f} {unit} ({r['vs_bf16']:.3f}×{spread})")
            lines.append(f"| {shape} | {weights} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Each mode's target, as stock / mode on the decode step's GPU time (tok/s where it was not
#: measured): exact routing costs at most 1 %; the fused router's exact routing beats stock's.
TARGETS = {"fp32": 0.99, "fp32-fused": 1.0}


def verdict(rows: list[dict]) -> list[str]:
    """The targets per case and concurrency (:data:`TARGETS`), from the paired medians. Where the
    decode step's GPU time was measured it decides: a FULL CUDA graph replays the same host work
    in every mode, so stock / mode GPU time bounds what the mode can cost a step."""
    out = []
    for mode, target in TARGETS.items():
        by = {(r["shape"], r["weights"], r["metric"]): r for r in rows if r["mode"] == mode}
        order = sorted(by.items(), key=lambda kv: (kv[0][:2], _metric_order(kv[0][2])))
        for (shape, weights, metric), r in order:
            if not metric.startswith("tok_s@"):
                continue
            rounds = f"(rounds {r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
            line = f"{shape} {weights} {metric}: {mode} / stock {r['vs_bf16']:.3f} {rounds}"
            gpu = by.get((shape, weights, metric.replace("tok_s@", "gpu_step_us@")))
            if gpu is None:
                out.append(f"{line} -> {'met' if r['vs_bf16'] >= target else 'MISSED'}")
                continue
            bound = 1 / gpu["vs_bf16"]
            out.append(
                f"{line}; decode step GPU time stock / {mode} {bound:.3f} (rounds {1 / gpu['ratio_max']:.3f}-"
                f"{1 / gpu['ratio_min']:.3f}) -> {'met' if bound >= target else 'MISSED'} by the GPU step"
            )
    return out


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    cases = list(dict.fromkeys((r["shape"], r["weights"]) for r in rows))
    metrics = sorted({r["metric"] for r in rows}, key=_metric_order)
    by = {(r["shape"], r["weights"], r["mode"], r["metric"]): r for r in rows}
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, (shape, weights) in zip(axes[0], cases, strict=True):
        modes = _modes(rows)
        for i, mode in enumerate(modes):
            picked = [by[(shape, weights, mode, m)] for m in metrics]
            vals = [r["vs_bf16"] for r in picked]
            spread = [[v - r["ratio_min"] for v, r in zip(vals, picked, strict=True)],
                      [r["ratio_max"] - v for v, r in zip(vals, picked, strict=True)]]  # fmt: skip
            width = 0.8 / len(modes)
            ax.bar([j + (i - (len(modes) - 1) / 2) * width for j in range(len(metrics))], vals, width=width,
                   label=mode, yerr=spread, capsize=2, error_kw={"lw": 0.8})  # fmt: skip
        ax.axhline(0.99, color="k", ls="--", lw=1, label="0.99× (target for tok/s)")
        ax.set_xticks(range(len(metrics)), metrics, rotation=30, fontsize=7)
        ratios = [r[k] for r in rows for k in ("ratio_min", "ratio_max")]
        ax.set_ylim(min(0.9, min(ratios) - 0.02), max(1.1, max(ratios) + 0.02))
        ax.set_ylabel("/ stock bf16 of the same round")
        ax.set_title(f"{shape} ({weights} weights); bars: range over rounds", fontsize=9)
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
    p.add_argument("--cases", metavar="LIST", default="deepseek-v3:bf16,deepseek-v3:fp8,kimi-k2:bf16",
                   help="slices as ROUTING_PRESET:bf16|fp8 (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--modes",
        metavar="LIST",
        default=",".join(MODES),
        help=f"from {', '.join(MODE_ARGS)}; bf16, the baseline, among them (default: %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, modes taking turns (default: %(default)s)")
    p.add_argument(
        "--concurrency", metavar="LIST", default="1,8,64", help="clients at once (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)"
    )
    p.add_argument("--render", metavar="JSON", default=None,
                   help="print the table and draw the plot of a saved e2e.json (default: run)")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        result["summary"] = summary(result)
        out.mkdir(parents=True, exist_ok=True)
        print(table(result["summary"]), *verdict(result["summary"]), sep="\n")
        plot(result["summary"], out / "e2e.png")
        return 0
    result = run(args)
    result["summary"] = summary(result)
    (out / "e2e.json").write_text(json.dumps(result, indent=1))
    print(table(result["summary"]), *verdict(result["summary"]), sep="\n")
    plot(result["summary"], out / "e2e.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
