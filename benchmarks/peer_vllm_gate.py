"""vLLM's own GateLinear tier at 1-16 tokens, as the benchmark's peer: what ``GateLinear`` runs on
SM90+ for a bf16 weight and fp32 logits there (its cuteDSL ``ll_bf16_gemm``, vLLM 0.34).

    python -m vllm_router_ext.bench --peer benchmarks/peer_vllm_gate.py --shapes DeepSeek-V4-Flash,...
"""

from vllm.model_executor.kernels.linear.cute_dsl.ll_bf16 import ll_bf16_gemm
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

from vllm_router_ext.bench_harness import FAMILY_SHAPES
from vllm_router_ext.bench_harness import SHAPES as RELEASE_SHAPES

NAME = "vLLM GateLinear cuteDSL ll_bf16"
SHAPES = tuple(dict.fromkeys((s.k, s.n) for s in (*RELEASE_SHAPES, *FAMILY_SHAPES)))
MS = tuple(range(1, GateLinear.LL_BF16_MAX_TOKENS + 1))


def peer_mm(x, w):
    return ll_bf16_gemm(x, w)
