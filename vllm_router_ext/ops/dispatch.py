"""CUDA dispatch of ``router_ext::router_gemm`` (runs inside the torch op, at run time)."""

from __future__ import annotations

import torch

from vllm_router_ext.ops.native import router_gemm_native
from vllm_router_ext.precision import RouterPrecision


def router_gemm_cuda(
    x: torch.Tensor, weight: torch.Tensor, precision: RouterPrecision, batch_invariant: bool
) -> torch.Tensor:
    if precision is RouterPrecision.BF16_FP32OUT and weight.dtype != torch.float32 and not batch_invariant:
        return torch.mm(x, weight.T, out_dtype=torch.float32)
    return router_gemm_native(x, weight, precision, batch_invariant)


def describe_cuda_dispatch(precision: RouterPrecision, batch_invariant: bool, weight_dtype: torch.dtype) -> str:
    return "cuBLAS torch.mm(out_dtype=float32)"
