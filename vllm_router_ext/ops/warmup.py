"""Every kernel a gate can launch, compiled before serving.

A Triton kernel compiles once per set of compile-time arguments (the launch the choice makes) and
per specialisation of its integer arguments: Triton treats an integer equal to 1 as a constant and
records whether it is divisible by 16. Every integer the launchers pass is the token count M, a
fixed size of the gate, or a product of the two, so M == 1 and M mod 16 decide them all. For a gate,
:func:`warmup_sizes` names one M for each (launch, M == 1, M mod 16) class that any M from 1 to the
engine's largest step falls in; :func:`warm_up_gate` runs the op once at each, which compiles (or
loads from Triton's cache) every variant serving can reach; a gate routed by the fused router runs
``route`` there too (its GEMM launches as a programmatic primary, then the routing kernel: other
variants). vLLM arms its JIT monitor
(``--jit-monitor-mode``) only after the model is loaded, so nothing compiles after that.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from csrc_triton import choice, tables
from csrc_triton.problem import Problem
from csrc_triton.routing import Routing
from vllm_router_ext.precision import RouterPrecision

# Under "vllm." so that, inside vLLM, its handlers and format apply (no vLLM import here).
logger = logging.getLogger(f"vllm.{__name__}")

#: Triton's integer specialisation: divisibility by this (and equality to 1).
SPECIALISATION_DIVISOR = 16


def scan_limit(p: Problem) -> int:
    """Above this M the choice no longer changes for ``p``'s gate: past the heuristic's largest
    threshold and every bucket end the table has for the gate (and its fp32 weight's terms), plus
    one round of residues."""
    shapes = tables.load_table(p.device.name).get("shapes", {})
    ends = [
        bucket["max_m"]
        for n in (p.n, 3 * p.n)
        for buckets in shapes.get(f"{p.k}x{n}", {}).values()
        if isinstance(buckets, list)  # beside the buckets: notes such as the model's name
        for bucket in buckets
        if bucket.get("max_m")
    ]
    return max([choice.BUCKET_SCAN_TO, *(e + 1 for e in ends)]) + SPECIALISATION_DIVISOR


def warmup_sizes(p: Problem, max_m: int) -> tuple[int, ...]:
    """The smallest M of every (launch, M == 1, M mod 16) class among M = 1..``max_m`` for
    ``p``'s gate (its ``m`` is ignored), ascending."""
    first: dict[tuple, int] = {}
    for m in range(1, min(max_m, scan_limit(p)) + 1):
        first.setdefault((choice.choose(replace(p, m=m)), m == 1, m % SPECIALISATION_DIVISOR), m)
    return tuple(sorted(first.values()))


@dataclass(frozen=True)
class GateSignature:
    """What the choice and the kernels' compiled variants depend on for one gate."""

    device: int
    k: int
    n: int
    precision: RouterPrecision
    batch_invariant: bool
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    weight_terms: bool
    routing: Routing | None


_WARMED: set[GateSignature] = set()


def warm_up_gate(
    weight: torch.Tensor,
    precision: RouterPrecision,
    batch_invariant: bool,
    x_dtype: torch.dtype,
    max_m: int,
    weight_terms: torch.Tensor | None = None,
    routing: Routing | None = None,
) -> int:
    """Run the router op (and ``route`` with ``routing``: the fused router's) once per
    :func:`warmup_sizes` M for this gate (CUDA only; once per process for each distinct gate); the
    number of sizes run."""
    if not weight.is_cuda or max_m < 1:
        return 0
    sig = GateSignature(
        weight.device.index or 0, weight.shape[1], weight.shape[0], precision, batch_invariant,
        x_dtype, weight.dtype, weight_terms is not None, routing,
    )  # fmt: skip
    if sig in _WARMED:
        return 0
    from vllm_router_ext.ops.route import route
    from vllm_router_ext.ops.router_gemm import router_gemm

    start = time.perf_counter()
    with torch.cuda.device(weight.device):
        x_template = torch.empty((1, sig.k), dtype=x_dtype, device=weight.device)
        problem = Problem.of(x_template, weight, precision.kernel, batch_invariant, sig.weight_terms)
        sizes = warmup_sizes(problem, max_m)
        x = torch.zeros((sizes[-1], sig.k), dtype=x_dtype, device=weight.device)
        with_bias = routing is not None and routing.bias  # fp32, as the model holds it
        bias = torch.zeros(sig.n, dtype=torch.float32, device=weight.device) if with_bias else None
        for m in sizes:
            router_gemm(x[:m], weight, precision, batch_invariant=batch_invariant, weight_terms=weight_terms)
            if routing is not None:
                route(x[:m], weight, routing, precision, bias=bias, batch_invariant=batch_invariant,
                      weight_terms=weight_terms)  # fmt: skip
        torch.cuda.synchronize(weight.device)
        del x
    _WARMED.add(sig)
    logger.info(
        "vllm-router-ext: warmed the router kernels of a %dx%d gate (%s%s%s) for M 1..%d before "
        "serving: %d launches in %.1f s",
        sig.k,
        sig.n,
        precision.value,
        ", batch-invariant" if batch_invariant else "",
        ", with the fused router's routing" if routing is not None else "",
        max_m,
        len(sizes),
        time.perf_counter() - start,
    )
    return len(sizes)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_router_ext.ops.warmup``: fill Triton's cache (``TRITON_CACHE_DIR``) with
    every kernel one gate can launch on this GPU, e.g. while building a container image, so a
    server started from it warms up from the cache."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vllm_router_ext.ops.warmup",
        description="Compile every router kernel variant of one gate on this GPU into Triton's cache "
        "(TRITON_CACHE_DIR), as a server's start-up would.",
    )
    parser.add_argument("--hidden-size", type=int, required=True, help="the gate's K (e.g. 7168)")
    parser.add_argument("--experts", type=int, required=True, help="the gate's N (e.g. 256)")
    parser.add_argument(
        "--precision",
        required=True,
        choices=[p.value for p in RouterPrecision if p is not RouterPrecision.AUTO],
    )
    parser.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=8192, help="--max-num-batched-tokens of the server")
    args = parser.parse_args(argv)
    for name in ("hidden_size", "experts", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the kernels compile for the GPU they run on)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    precision = RouterPrecision(args.precision)
    weight = torch.zeros(
        (args.experts, args.hidden_size), dtype=getattr(torch, args.weight_dtype), device="cuda"
    )
    terms = None
    if weight.dtype == torch.float32 and precision is RouterPrecision.FP32 and not args.batch_invariant:
        from csrc_triton.dispatch import fp32_weight_terms

        terms = fp32_weight_terms(weight)
    warm_up_gate(weight, precision, args.batch_invariant, torch.bfloat16, args.max_tokens, terms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
