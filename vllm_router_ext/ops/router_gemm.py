"""``router_gemm``: the one entry point every part of the plugin calls. Imports no vLLM.

The op is registered with torch as ``torch.ops.router_ext.router_gemm`` (with a fake
implementation), so the choice of kernel by the number of tokens happens *inside* an opaque op at
run time: torch.compile and CUDA-graph capture never freeze a Python branch on ``x.shape[0]``.
The precision is parsed once, here; the op carries its value, and the CUDA implementation hands the
kernel library (``csrc_triton``) its typed :class:`~csrc_triton.problem.Precision`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from csrc_triton.dispatch import check_weight_terms, fp32_weight_terms, router_gemm_cuda
from csrc_triton.problem import Precision
from vllm_router_ext.ops.router_gemm_torch import router_gemm_torch
from vllm_router_ext.precision import RouterPrecision

#: The op's precision value -> the kernel library's (a dict lookup on every call).
KERNEL_PRECISION: dict[str, Precision] = {p.value: p for p in Precision}
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = "bfloat16, float16, float32"


def check_router_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, precision: RouterPrecision) -> None:
    """Raise ``ValueError`` naming the bad value and what is allowed."""
    if precision is RouterPrecision.AUTO:
        raise ValueError(
            "router_gemm needs a resolved precision, got 'auto'; allowed: "
            + ", ".join(p for p in RouterPrecision.choices() if p != "auto")
        )
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("router_gemm expects tensors x [M, K] and weight [N, K]")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x has K={x.shape[1]} but weight has K={weight.shape[1]} (x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)})"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {_DTYPE_NAMES}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if (
        precision is RouterPrecision.BF16_FP32OUT
        and weight.dtype != torch.float32
        and x.dtype != weight.dtype
    ):
        raise ValueError(
            f"bf16-fp32out multiplies x and weight in one 16-bit dtype, got x {x.dtype} and "
            f"weight {weight.dtype}"
        )


def router_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: RouterPrecision | str,
    *,
    batch_invariant: bool = False,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router logits ``x @ weight.T`` in the mode's logits dtype.

    Args:
        x: activations ``[M, K]`` (bf16, fp16 or fp32; any row stride).
        weight: gate weight ``[N, K]`` (bf16/fp16, or fp32 for the ``fp32`` mode).
        precision: a :class:`RouterPrecision` or its string value (``auto`` must be resolved).
        batch_invariant: a row's logits are bitwise independent of the batch it is in.
        weight_terms: for an fp32 ``weight`` only, :func:`fp32_weight_terms` of it (made once by
            the caller): lets the CUDA dispatch run the large-M GEMM on bf16 terms instead of
            splitting fp32 weight tiles in every program. Ignored on CPU and when batch-invariant.

    Returns:
        ``[M, N]``: fp32 for ``fp32`` and ``bf16-fp32out``, ``x.dtype`` for ``bf16``.
    """
    precision = RouterPrecision.parse(precision, "the precision argument")
    check_router_gemm_inputs(x, weight, precision)
    if weight_terms is not None:
        check_weight_terms(weight, weight_terms)
    return torch.ops.router_ext.router_gemm(x, weight, precision.value, bool(batch_invariant), weight_terms)


def _logits_dtype(x: torch.Tensor, precision: str) -> torch.dtype:
    return x.dtype if precision == RouterPrecision.BF16.value else torch.float32


def _router_gemm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    return router_gemm_torch(x, weight, RouterPrecision(precision), batch_invariant)


def _router_gemm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    return router_gemm_cuda(x, weight, KERNEL_PRECISION[precision], batch_invariant, weight_terms)


def _router_gemm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=_logits_dtype(x, precision))


def register_op(name: str, schema: str, cpu: Callable, cuda: Callable, fake: Callable) -> None:
    """Register ``torch.ops.router_ext.<name>`` (``schema``: its arguments and results) with its
    CPU, CUDA and fake implementations, once per process."""
    if hasattr(torch.ops.router_ext, name):
        return
    lib = torch.library.Library("router_ext", "FRAGMENT")
    lib.define(f"{name}{schema}")
    lib.impl(name, cpu, "CPU")
    lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"router_ext::{name}", fake, lib=lib)
    _LIBS.append(lib)  # a Library deregisters its ops when garbage-collected


_LIBS: list[torch.library.Library] = []
register_op(
    "router_gemm",
    "(Tensor x, Tensor weight, str precision, bool batch_invariant, Tensor? weight_terms=None) -> Tensor",
    _router_gemm_cpu,
    _router_gemm_cuda,
    _router_gemm_fake,
)

__all__ = ["check_router_gemm_inputs", "check_weight_terms", "fp32_weight_terms", "router_gemm"]
