"""Router GEMM op (no vLLM import): ``router_gemm`` and its plain-torch/fp64 references."""

from vllm_router_ext.ops.router_gemm import check_router_gemm_inputs, router_gemm

__all__ = ["router_gemm", "check_router_gemm_inputs"]
