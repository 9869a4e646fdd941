"""Timing and workload helpers shared by the benchmark and the tuner (CUDA only, no vLLM)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_router_ext.ops.reference import RoutingConfig


@dataclass(frozen=True)
class RouterShape:
    name: str
    k: int
    n: int
    routing: RoutingConfig


#: The five router shapes of the DeepSeek family, with each model's own routing.
SHAPES: tuple[RouterShape, ...] = (
    RouterShape("DeepSeek-V3", 7168, 256, RoutingConfig(8, 8, 4, "sigmoid", "noaux_tc", True, 2.5)),
    RouterShape("Kimi-K2", 7168, 384, RoutingConfig(8, 1, 1, "sigmoid", "noaux_tc", True, 2.827)),
    RouterShape(
        "DeepSeek-V2", 5120, 160, RoutingConfig(6, 8, 3, "softmax", "group_limited_greedy", False, 16.0)
    ),
    RouterShape("GLM-5", 6144, 256, RoutingConfig(8, 1, 1, "sigmoid", "noaux_tc", True, 2.5)),
    RouterShape("DeepSeek-V2-Lite", 2048, 64, RoutingConfig(6, 1, 1, "softmax", "greedy", False, 1.0)),
)

SHAPE_BY_NAME: dict[str, RouterShape] = {s.name: s for s in SHAPES}

M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Rotate weights/inputs until one graph replay touches this many bytes: several times the H200's
#: 60 MB L2, so the weight comes from HBM as it does when 58 layers take turns.
ROTATE_BYTES = 200 * 2**20


def make_inputs(
    m: int, k: int, n: int, copies: int, device: str = "cuda", w_dtype=torch.bfloat16, seed: int = 0
):
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(m, k, device=device, generator=g).to(torch.bfloat16) for _ in range(copies)]
    ws = [(torch.randn(n, k, device=device, generator=g) / k**0.5).to(w_dtype) for _ in range(copies)]
    return xs, ws


def rotation_copies(m: int, k: int, n: int, max_copies: int = 24) -> int:
    per_call = (m * k + n * k) * 2 + m * n * 4
    return max(2, min(max_copies, -(-ROTATE_BYTES // per_call)))


def time_graph(calls: list[Callable[[], object]], warmup: int = 25, rep: int = 100) -> float:
    """Median µs per call of ``calls`` captured back to back in one CUDA graph."""
    import triton.testing

    for c in calls:  # compile / warm up outside the capture
        c()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def time_rotated(fn: Callable, xs, ws, warmup: int = 25, rep: int = 100) -> float:
    """Median µs per call of ``fn(x, w)`` over the rotated copies (:func:`time_graph`)."""
    return time_graph([lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws, strict=True)], warmup, rep)


def time_rotated_into(fn: Callable, xs, ws, warmup: int = 25, rep: int = 100) -> float:
    """The same for ``fn(x, w, out)``: one fp32 ``out`` per copy, allocated before the capture."""
    outs = [torch.empty(x.shape[0], w.shape[0], device=x.device) for x, w in zip(xs, ws, strict=True)]
    calls = [lambda x=x, w=w, o=o: fn(x, w, o) for x, w, o in zip(xs, ws, outs, strict=True)]
    return time_graph(calls, warmup, rep)


def floor_us(m: int, k: int, n: int, bandwidth_tbs: float = 4.3) -> float:
    """Bytes (bf16 weight + bf16 activations + fp32 logits) over the measured copy bandwidth."""
    return ((n * k + m * k) * 2 + m * n * 4) / (bandwidth_tbs * 1e12) * 1e6
