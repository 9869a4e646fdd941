"""Timing and workload helpers shared by the benchmark and the tuner (CUDA only, no vLLM)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_router_ext.families import FAMILIES, Release
from vllm_router_ext.ops.routing_fp64 import RoutingConfig


@dataclass(frozen=True)
class RouterShape:
    name: str
    k: int
    n: int
    routing: RoutingConfig


def release_shape(release: Release) -> RouterShape:
    """A release's gate and its config's routing (as the audit reads a config)."""
    routing = RoutingConfig.from_hf_config(release.config)
    return RouterShape(release.name, release.hidden, release.experts, routing)


#: The family routings DeepSeek's models use (its own config keys, and DeepSeek-V4's).
_DEEPSEEK_ROUTINGS = ("deepseek", "sqrtsoftplus_bias")
_TIMED = [(f, r) for f in FAMILIES for r in f.releases if r.shape_of is None]
#: The router shapes of the DeepSeek family's releases (the family table's), with each model's own
#: routing (V4-Pro's gate has Kimi-K2's shape): what the benchmark and the tuner run by default.
SHAPES: tuple[RouterShape, ...] = tuple(
    release_shape(r) for f, r in _TIMED if f.routing in _DEEPSEEK_ROUTINGS
)
#: The gates of the other MoE families' releases, timed and audited beside the DeepSeek family;
#: each has its own entry in the H200 table (GLM-4.5's is DeepSeek-V2's).
FAMILY_SHAPES: tuple[RouterShape, ...] = tuple(
    release_shape(r) for f, r in _TIMED if f.routing not in _DEEPSEEK_ROUTINGS
)

SHAPE_BY_NAME: dict[str, RouterShape] = {s.name: s for s in SHAPES + FAMILY_SHAPES}

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


#: The peer router GEMM: TRT-LLM's ``dsv3RouterGemm`` (what vLLM, SGLang and FlashInfer run for
#: M <= 16), as FlashInfer exposes it: (K, N) -> function(x, w.T, out, launch_with_pdl).
FLASHINFER_ROUTER_GEMMS = {
    (7168, 256): "mm_M1_16_K7168_N256",
    (7168, 384): "mm_M1_16_K7168_N384",
    (6144, 256): "mm_M1_16_K6144_N256",
}
PEER_MAX_M = 16
PEER = "peer (TRT-LLM dsv3RouterGemm)"


@dataclass(frozen=True)
class Peer:
    """``fn(x, w) -> fp32 logits`` where ``serves(m, k, n)``; ``source`` says where it came from."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shapes: tuple[tuple[int, int], ...]
    ms: tuple[int, ...]
    source: str
    #: Its column in the benchmark's rows and tables: the kernel it times.
    column: str = PEER

    def serves(self, m: int, k: int, n: int) -> bool:
        return (k, n) in self.shapes and m in self.ms


def load_peer(path: str | None = None) -> tuple[Peer | None, str]:
    """The peer kernel and a one-line note: from ``path`` (a Python file defining ``peer_mm(x, w)``,
    ``SHAPES`` and ``MS``, and ``NAME``, the kernel's name for its column, where it is not TRT-LLM's
    router GEMM: e.g. vLLM's own gate kernel), else FlashInfer's when it imports, else None with
    the note saying how to get it."""
    if path:
        import importlib.util

        spec = importlib.util.spec_from_file_location("router_peer", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--peer {path!r}: not a Python file")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        column = f"peer ({mod.NAME})" if hasattr(mod, "NAME") else PEER
        peer = Peer(mod.peer_mm, tuple(mod.SHAPES), tuple(mod.MS), f"{path} (peer_mm)", column)
        return peer, f"peer: {peer.source}"
    try:
        import flashinfer.gemm as fi
    except Exception as e:  # noqa: BLE001 -- any import failure means "no peer here"
        return (
            None,
            f"peer skipped: flashinfer is not importable ({type(e).__name__}); pip install flashinfer-python",
        )

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=torch.float32)
        getattr(fi, FLASHINFER_ROUTER_GEMMS[(w.shape[1], w.shape[0])])(x, w.T, out, False)
        return out

    peer = Peer(fn, tuple(FLASHINFER_ROUTER_GEMMS), tuple(range(1, PEER_MAX_M + 1)), "flashinfer.gemm")
    return peer, f"peer: {peer.source}"
