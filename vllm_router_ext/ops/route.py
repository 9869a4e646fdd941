"""``route``: the router GEMM and the expert selection in one op. Imports no vLLM.

Registered as ``torch.ops.router_ext.route`` (with a fake implementation), like ``router_gemm``:
the kernel choice by the number of tokens happens inside the opaque op at run time. On CUDA,
decode batches run one fused launch (GEMV, scores, grouped top-k, weights); larger ones the
router GEMM, then the routing kernel. On CPU: plain torch with the same semantics (fp32 scores,
experts best first, ties to the lowest expert index).
"""

from __future__ import annotations

import torch

from csrc_triton.dispatch import check_weight_terms, route_cuda
from csrc_triton.routing import Routing, Scoring
from vllm_router_ext.ops.router_gemm import KERNEL_PRECISION, check_router_gemm_inputs, register_op
from vllm_router_ext.ops.router_gemm_torch import router_gemm_torch
from vllm_router_ext.precision import RouterPrecision


def check_route_inputs(weight: torch.Tensor, routing: Routing, bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming what does not fit (the GEMM's inputs: ``check_router_gemm_inputs``)."""
    routing.check(weight.shape[0])
    if routing.bias != (bias is not None):
        raise ValueError(
            "routing.bias is True but no bias tensor was given"
            if routing.bias
            else "a bias tensor was given but routing.bias is False"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or tuple(bias.shape) != (weight.shape[0],) or bias.device != weight.device
    ):
        raise ValueError(
            f"bias must be float32 [{weight.shape[0]}] on {weight.device}; got {bias.dtype} "
            f"{list(bias.shape)} on {bias.device}"
        )


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    routing: Routing,
    precision: RouterPrecision | str,
    *,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
    weight_terms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's experts and the logits they come from.

    Args:
        x, weight, precision, batch_invariant, weight_terms: as for ``router_gemm``.
        routing: how experts are picked (:class:`csrc_triton.routing.Routing`).
        bias: the fp32 correction bias ``[N]`` when ``routing.bias``.

    Returns:
        ``(topk_weights [M, top_k] fp32, topk_ids [M, top_k] int32, logits [M, N])``: experts best
        first; the logits in the mode's dtype (fp32, or ``x.dtype`` for ``bf16``).
    """
    precision = RouterPrecision.parse(precision, "the precision argument")
    check_router_gemm_inputs(x, weight, precision)
    check_route_inputs(weight, routing, bias)
    if weight_terms is not None:
        check_weight_terms(weight, weight_terms)
    return torch.ops.router_ext.route(
        x,
        weight,
        bias,
        precision.value,
        bool(batch_invariant),
        weight_terms,
        routing.top_k,
        int(routing.scoring),
        routing.n_group,
        routing.topk_group,
        routing.renormalize,
        float(routing.routed_scaling_factor),
    )


def route_torch(
    logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, ids int32) of ``logits`` in plain torch, fp32, as the routing kernel picks."""
    logits = logits.float().nan_to_num(nan=float("-inf"))
    if routing.scoring is Scoring.SIGMOID:
        scores = logits.sigmoid()
    elif routing.scoring is Scoring.SOFTMAX:
        scores = logits.softmax(dim=-1)
    else:
        scores = torch.nn.functional.softplus(logits).sqrt()
    choice = scores + bias.float() if bias is not None else scores
    choice = choice.nan_to_num(nan=float("-inf"))
    m, n = choice.shape
    if routing.n_group > 1:
        groups = choice.view(m, routing.n_group, n // routing.n_group)
        top2 = groups.sort(dim=-1, descending=True, stable=True).values
        group_scores = top2[..., 0] + top2[..., 1] if bias is not None else top2[..., 0]
        best = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : routing.topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(n // routing.n_group, dim=1), float("-inf"))
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, : routing.top_k]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routing.routed_scaling_factor, ids.to(torch.int32)


def _routing(top_k: int, scoring: int, n_group: int, topk_group: int, bias: torch.Tensor | None,
             renormalize: bool, routed_scaling_factor: float) -> Routing:  # fmt: skip
    """The op's scalar arguments as a :class:`Routing`."""
    return Routing(top_k, Scoring(scoring), n_group, topk_group, bias is not None, renormalize,
                   routed_scaling_factor)  # fmt: skip


def _route_cpu(x, weight, bias, precision, batch_invariant, weight_terms, top_k, scoring, n_group,
               topk_group, renormalize, routed_scaling_factor):  # fmt: skip
    logits = router_gemm_torch(x, weight, RouterPrecision(precision), batch_invariant)
    routing = _routing(top_k, scoring, n_group, topk_group, bias, renormalize, routed_scaling_factor)
    weights, ids = route_torch(logits, routing, bias)
    return weights, ids, logits


def _route_cuda(x, weight, bias, precision, batch_invariant, weight_terms, top_k, scoring, n_group,
                topk_group, renormalize, routed_scaling_factor):  # fmt: skip
    routing = _routing(top_k, scoring, n_group, topk_group, bias, renormalize, routed_scaling_factor)
    return route_cuda(x, weight, KERNEL_PRECISION[precision], routing, bias, batch_invariant, weight_terms)


def _route_fake(x, weight, bias, precision, batch_invariant, weight_terms, top_k, scoring, n_group,
                topk_group, renormalize, routed_scaling_factor):  # fmt: skip
    m, n = x.shape[0], weight.shape[0]
    logits_dtype = x.dtype if precision == RouterPrecision.BF16.value else torch.float32
    return (
        x.new_empty((m, top_k), dtype=torch.float32),
        x.new_empty((m, top_k), dtype=torch.int32),
        x.new_empty((m, n), dtype=logits_dtype),
    )


register_op(
    "route",
    "(Tensor x, Tensor weight, Tensor? bias, str precision, bool batch_invariant, Tensor? weight_terms, "
    "int top_k, int scoring, int n_group, int topk_group, bool renormalize, float routed_scaling_factor) "
    "-> (Tensor, Tensor, Tensor)",
    _route_cpu,
    _route_cuda,
    _route_fake,
)

__all__ = ["Routing", "Scoring", "check_route_inputs", "route", "route_torch"]
