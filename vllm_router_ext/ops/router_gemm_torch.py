"""Plain-torch router GEMM: the exact semantics of each mode, used on CPU and as a reference.

- ``fp32`` and ``bf16-fp32out``: bf16 x bf16 products are exact in fp32, so both modes are
  ``F.linear(x.float(), w.float())`` in IEEE fp32 (TF32 is switched off around the call).
- ``bf16``: stock vLLM, ``F.linear`` in the activations' dtype.
- batch-invariant: every row is reduced by the same M=1 matrix-vector product, so a row's logits
  cannot depend on the rows next to it (a blocked CPU GEMM may pick its kernel by M).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_router_ext.precision import RouterPrecision


def _linear_fp32_ieee(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:  # TF32 is a CUDA matter; keep the CPU path free of global flags (compile)
        return F.linear(x.float(), weight.float())
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return F.linear(x.float(), weight.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _rowwise_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    w = weight.float()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for i in range(x.shape[0]):
        # A fresh contiguous row: same alignment and the same matvec path for every row.
        out[i] = torch.mv(w, x[i].float().contiguous())
    return out


def router_gemm_torch(
    x: torch.Tensor, weight: torch.Tensor, precision: RouterPrecision, batch_invariant: bool = False
) -> torch.Tensor:
    """Reference semantics of :func:`vllm_router_ext.ops.router_gemm` (inputs already validated)."""
    if batch_invariant:
        out = _rowwise_fp32(x, weight)
        return out if precision is not RouterPrecision.BF16 else out.to(x.dtype)
    if precision is RouterPrecision.BF16:
        return F.linear(x, weight.to(x.dtype))
    return _linear_fp32_ieee(x, weight)
