"""``router_gemm``: the one entry point every part of the plugin calls. Imports no vLLM.

The op is registered with torch as ``torch.ops.router_ext.router_gemm`` (with a fake
implementation), so the choice of kernel by the number of tokens happens *inside* an opaque op at
run time: torch.compile and CUDA-graph capture never freeze a Python branch on ``x.shape[0]``.
"""

from __future__ import annotations

import torch

from vllm_router_ext.ops.native import router_gemm_native
from vllm_router_ext.precision import RouterPrecision

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


def fp32_weight_terms(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight ``[N, K]`` as three bf16 terms stacked ``[3N, K]`` (hi, mid, lo; each the
    truncation of what is left): ``hi + mid + lo == weight`` exactly for fp32 values down to
    ~2^-110 (8 significant bits each = fp32's 24; below that lo would be subnormal), so
    ``x @ term.T`` per term is three bf16 GEMMs whose products are exact in fp32. Made once when
    the weight is loaded; the ``fp32`` mode's CUDA dispatch runs them as one GEMM at large M."""
    w = weight.float().contiguous()
    hi = _bf16_truncated(w)
    rest = w - hi.float()  # exact: the low 16 bits of each value
    mid = _bf16_truncated(rest)
    lo = (rest - mid.float()).to(torch.bfloat16)  # exact: <= 8 significant bits remain
    return torch.cat([hi, mid, lo])


def _bf16_truncated(v: torch.Tensor) -> torch.Tensor:
    # Truncation, not rounding: an fp32 value near its maximum would round up to inf in bf16.
    return (v.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


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


def check_weight_terms(weight: torch.Tensor, terms: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``terms`` is what :func:`fp32_weight_terms` makes of ``weight``
    (shape, dtype, device; the values are the caller's promise)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"weight_terms are for an fp32 weight; weight has dtype {weight.dtype}")
    expected = (3 * weight.shape[0], weight.shape[1])
    if terms.dtype != torch.bfloat16 or tuple(terms.shape) != expected or terms.device != weight.device:
        raise ValueError(
            f"weight_terms must be bfloat16 {list(expected)} on {weight.device} "
            f"(fp32_weight_terms(weight)); got {terms.dtype} {list(terms.shape)} on {terms.device}"
        )


def _logits_dtype(x: torch.Tensor, precision: str) -> torch.dtype:
    return x.dtype if precision == RouterPrecision.BF16.value else torch.float32


def _router_gemm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    return router_gemm_native(x, weight, RouterPrecision(precision), batch_invariant)


def _router_gemm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    from vllm_router_ext.ops.dispatch import router_gemm_cuda

    return router_gemm_cuda(x, weight, RouterPrecision(precision), batch_invariant, weight_terms)


def _router_gemm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=_logits_dtype(x, precision))


def _register() -> None:
    if hasattr(torch.ops.router_ext, "router_gemm"):
        return
    lib = torch.library.Library("router_ext", "FRAGMENT")
    lib.define(
        "router_gemm(Tensor x, Tensor weight, str precision, bool batch_invariant, "
        "Tensor? weight_terms=None) -> Tensor"
    )
    lib.impl("router_gemm", _router_gemm_cpu, "CPU")
    lib.impl("router_gemm", _router_gemm_cuda, "CUDA")
    torch.library.register_fake("router_ext::router_gemm", _router_gemm_fake, lib=lib)
    _LIBS.append(lib)  # a Library deregisters its ops when garbage-collected


_LIBS: list[torch.library.Library] = []
_register()
