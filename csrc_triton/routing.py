"""Expert selection on router logits: scores, correction bias, grouped top-k, weights.

Invariant: each token is routed from its own row of fp32 logits alone (no value of another token
enters), in IEEE fp32, and the experts come out in selection order (best first), ties broken by the
lowest expert index, as vLLM's routing kernels break them. A row of NaN logits (a CUDA graph's
padding) still gets ``top_k`` distinct, valid expert ids.

The routing (:class:`Routing`) covers vLLM's MoE routers on logits: sigmoid + correction bias
with grouped top-k (DeepSeek-V3 ``noaux_tc``: a group scores the sum of its two best biased
scores; Kimi-K2, GLM on one group), softmax top-k with or without renormalisation (Qwen3-MoE,
Mixtral, gpt-oss), grouped softmax without bias (DeepSeek-V2: a group scores its best),
softmax scores chosen with a bias (ERNIE-4.5), the sigmoid of the top-k logits (Llama-4) and
``sqrtsoftplus`` + bias (DeepSeek-V4). Weights are the unbiased scores of the chosen experts,
renormalised if asked, times the routed scaling factor.

``route_rows`` is shared by the routing kernel here and the fused router (``router_route_gemv``),
which runs it on the logits its own GEMV wrote.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.pdl import launch_options, wait_for_primary


class Scoring(enum.IntEnum):
    """How a logit becomes an expert's score (the kernels' ``SCORING`` constexpr)."""

    SIGMOID = 0
    SOFTMAX = 1
    SQRTSOFTPLUS = 2


@dataclass(frozen=True)
class Routing:
    """How a token's experts are picked from its logits. ``n_group`` > 1: grouped top-k (the
    ``topk_group`` best groups; a group's score is the sum of its two best biased scores with a
    correction bias, else its best score). ``bias``: a correction bias is added to the scores
    that choose (never to the weights)."""

    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    n_group: int = 1
    topk_group: int = 1
    bias: bool = False
    renormalize: bool = False
    routed_scaling_factor: float = 1.0

    def check(self, n_experts: int) -> None:
        """Raise ``ValueError`` naming what does not fit ``n_experts`` experts."""
        if not 1 <= self.n_group <= n_experts or n_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide the {n_experts} experts into equal groups")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group}; allowed: 1..n_group ({self.n_group})")
        reachable = self.topk_group * (n_experts // self.n_group)
        if not 1 <= self.top_k <= reachable:
            raise ValueError(
                f"top_k={self.top_k}; allowed: 1..{reachable} (the experts of {self.topk_group} "
                f"of {self.n_group} groups of {n_experts})"
            )


@dataclass(frozen=True)
class RouteShape:
    """The padded register layout of one routing: ``groups_p`` x ``group_p`` per token, ``k_p``
    output slots (powers of two, as Triton's blocks need)."""

    groups_p: int
    group_p: int
    k_p: int

    @classmethod
    def of(cls, n_experts: int, routing: Routing) -> RouteShape:
        return cls(
            triton.next_power_of_2(routing.n_group),
            triton.next_power_of_2(n_experts // routing.n_group),
            triton.next_power_of_2(routing.top_k),
        )


@triton.jit
def _ordered(v):
    """fp32 -> int32 whose signed order is v's (-inf lowest); its own inverse on the int32 side."""
    b = v.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The fp32 value a packed key holds."""
    return _ordered((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _packed(v, index, LAST: tl.constexpr):
    """int64 keys whose maximum is the best ``v``, on ties the lowest ``index`` (<= LAST): one
    reduction picks a value and where it is."""
    return (_ordered(v).to(tl.int64) << 32) | (LAST - index).to(tl.int64)


@triton.jit
def _index(key, LAST: tl.constexpr):
    return LAST - key.to(tl.int32)  # the low 32 bits


@triton.jit
def _fixed_sum(v, axis: tl.constexpr):
    """The sum along ``axis`` of ``v`` in [0, 1] as an exact int64 fixed-point sum (2^-40 units):
    the same bits whatever the layout, warps or rows per program."""
    return tl.sum((v * 1099511627776.0).to(tl.int64), axis=axis).to(tl.float32) * (1.0 / 1099511627776.0)


@triton.jit
def _score(logits, top, total, SCORING: tl.constexpr):
    """The score of each of ``logits`` (the same expression wherever a score is computed)."""
    if SCORING == 0:
        return 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == 1:
        return tl.exp(logits - top) / total
    else:
        # sqrt(softplus(l)); softplus = max(l, 0) + log1p(exp(-|l|)), log1p(y) accurate for small y
        # as log(1 + y) * y / ((1 + y) - 1); above 20 torch's softplus is the identity.
        y = tl.exp(-tl.abs(logits))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        return tl.sqrt(tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p))


@triton.jit
def _best_groups(keys, ROWS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 BIAS: tl.constexpr, GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr):  # fmt: skip
    """[R, N_P] mask of each token's TOPK_GROUP best groups (lowest group first on ties). A group
    scores its best choice value, or with a correction bias the sum of its two best."""
    MISSING: tl.constexpr = -9223372036854775807
    k3 = tl.reshape(keys, (ROWS, GROUPS_P, GROUP_P))
    first = tl.max(k3, axis=2)
    best = _value(first)
    if BIAS:  # keys are unique (each holds its slot): the first best out, then the next best
        second = tl.max(tl.where(k3 == first[:, :, None], MISSING, k3), axis=2)
        best = best + tl.where(second == MISSING, float("-inf"), _value(second))
    group = tl.arange(0, GROUPS_P)[None, :]
    gkeys = tl.where(group < N_GROUP, _packed(best, group, GROUPS_P - 1), MISSING)
    chosen = group < 0  # all False
    for _ in tl.static_range(TOPK_GROUP):
        g = _index(tl.max(gkeys, axis=1), GROUPS_P - 1)[:, None]
        chosen = chosen | (group == g)
        gkeys = tl.where(group == g, MISSING, gkeys)
    chosen3 = tl.broadcast_to(chosen[:, :, None], (ROWS, GROUPS_P, GROUP_P))
    return tl.reshape(chosen3, (ROWS, GROUPS_P * GROUP_P))


@triton.jit
def route_rows(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, row0, M, scaling,
               ROWS: tl.constexpr, N_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr,
               TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPS_P: tl.constexpr,
               GROUP_P: tl.constexpr, K_P: tl.constexpr, SCORING: tl.constexpr, BIAS: tl.constexpr,
               RENORMALIZE: tl.constexpr, VOLATILE: tl.constexpr):  # fmt: skip
    """Route tokens ``row0 .. row0 + ROWS`` (< M) from their logits in memory into ``weights_ptr``
    (fp32) and ``ids_ptr`` (int32). VOLATILE: read the logits past the L1 cache (other programs
    wrote them during this launch).

    Each token's experts sit in a row of N_P = GROUPS_P x GROUP_P slots (group-major, padded);
    every pick is one reduction of int64 keys (the choice value's order, then the lowest expert),
    and the weights are the scores of the chosen experts' logits, read back from memory."""
    N_P: tl.constexpr = GROUPS_P * GROUP_P
    GROUP_SIZE: tl.constexpr = N_EXPERTS // N_GROUP
    MISSING: tl.constexpr = -9223372036854775807
    slot_n = tl.arange(0, N_P)[None, :]
    expert = (slot_n // GROUP_P) * GROUP_SIZE + slot_n % GROUP_P
    valid = (slot_n // GROUP_P < N_GROUP) & (slot_n % GROUP_P < GROUP_SIZE)
    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows[:, None] < M
    row_ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_lm
    if VOLATILE:
        logits = tl.load(row_ptrs + expert, mask=row_ok & valid, other=0.0, cache_modifier=".cg")
    else:
        logits = tl.load(row_ptrs + expert, mask=row_ok & valid, other=0.0)
    logits = logits.to(tl.float32)
    logits = tl.where(logits == logits, logits, float("-inf"))  # NaN (padding rows) ranks last
    if SCORING == 1:
        top = tl.max(tl.where(valid, logits, float("-inf")), axis=1)[:, None]
        total = _fixed_sum(tl.where(valid, tl.exp(logits - top), 0.0), 1)[:, None]
        scores = _score(logits, top, total, SCORING)
    else:
        scores = _score(logits, 0.0, 1.0, SCORING)
    choice = scores
    if BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(choice == choice, choice, float("-inf"))
    keys = tl.where(valid, _packed(choice, slot_n, N_P - 1), MISSING)
    if N_GROUP > 1:
        in_groups = _best_groups(keys, ROWS, N_GROUP, TOPK_GROUP, BIAS, GROUPS_P, GROUP_P)
        keys = tl.where(in_groups, keys, MISSING)
    slot_k = tl.arange(0, K_P)[None, :]
    ids = tl.zeros((ROWS, K_P), tl.int32)
    for t in tl.static_range(TOP_K):
        pick = _index(tl.max(keys, axis=1), N_P - 1)[:, None]  # slot of the best left
        ids = tl.where(slot_k == t, (pick // GROUP_P) * GROUP_SIZE + pick % GROUP_P, ids)
        keys = tl.where(slot_n == pick, MISSING, keys)
    out_mask = row_ok & (slot_k < TOP_K)
    if VOLATILE:
        chosen = tl.load(row_ptrs + ids, mask=out_mask, other=0.0, cache_modifier=".cg")
    else:
        chosen = tl.load(row_ptrs + ids, mask=out_mask, other=0.0)
    chosen = chosen.to(tl.float32)
    chosen = tl.where(chosen == chosen, chosen, float("-inf"))
    if SCORING == 1:
        weights = _score(chosen, top, total, SCORING)
    else:
        weights = _score(chosen, 0.0, 1.0, SCORING)
    weights = tl.where(slot_k < TOP_K, weights, 0.0)
    if RENORMALIZE:  # in selection order, whatever the layout
        norm = tl.zeros((ROWS,), tl.float32)
        for t in tl.static_range(TOP_K):
            norm += tl.sum(tl.where(slot_k == t, weights, 0.0), axis=1)
        weights = weights / norm[:, None]
    out = rows[:, None].to(tl.int64) * stride_om + slot_k
    tl.store(ids_ptr + out, ids, mask=out_mask)
    tl.store(weights_ptr + out, weights * scaling, mask=out_mask)


@triton.jit
def _route_logits_kernel(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, M, scaling,
                         ROWS: tl.constexpr, N_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPS_P: tl.constexpr,
                         GROUP_P: tl.constexpr, K_P: tl.constexpr, SCORING: tl.constexpr,
                         BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_primary(PDL)  # launched early (PDL): the logits are complete only past this
    route_rows(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, tl.program_id(0) * ROWS,
               M, scaling, ROWS, N_EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, GROUPS_P, GROUP_P, K_P, SCORING,
               BIAS, RENORMALIZE, False)  # fmt: skip


#: The routing kernel's warps: one, so that every reduction stays inside a warp (shuffles, no
#: shared memory or barriers).
ROUTE_WARPS = 1


def route_rows_per_program(shape: RouteShape) -> int:
    """Tokens per routing program: about 512 padded experts' values (16 a thread of one warp), at
    least one token."""
    return max(1, min(16, 512 // (shape.groups_p * shape.group_p)))


def routing_constexprs(n_experts: int, routing: Routing) -> dict:
    """The routing's compile-time arguments (the same for the routing kernel and the fused router)."""
    shape = RouteShape.of(n_experts, routing)
    return dict(
        N_EXPERTS=n_experts,
        N_GROUP=routing.n_group,
        TOPK_GROUP=routing.topk_group if routing.n_group > 1 else 1,
        TOP_K=routing.top_k,
        GROUPS_P=shape.groups_p,
        GROUP_P=shape.group_p,
        K_P=shape.k_p,
        SCORING=int(routing.scoring),
        BIAS=routing.bias,
        RENORMALIZE=routing.renormalize,
    )


def route_logits(
    logits: torch.Tensor,
    routing: Routing,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    pdl: bool = False,
) -> None:
    """Route every row of ``logits`` [M, N] (any float dtype, unit stride along N) into ``weights``
    [M, top_k] fp32 and ``ids`` [M, top_k] int32 (same row stride). ``bias`` [N] when
    ``routing.bias``. ``pdl``: launched as a programmatic dependent of the kernel that writes
    ``logits`` (``csrc_triton/pdl.py``): it waits for that kernel's writes before reading."""
    m, n = logits.shape
    if m == 0:
        return
    shape = RouteShape.of(n, routing)
    rows = route_rows_per_program(shape)
    _route_logits_kernel[(cdiv(m, rows),)](
        logits,
        logits.stride(0),
        bias if routing.bias else logits,
        weights,
        ids,
        weights.stride(0),
        m,
        float(routing.routed_scaling_factor),
        ROWS=rows,
        **routing_constexprs(n, routing),
        PDL=pdl,
        num_warps=ROUTE_WARPS,
        **launch_options(pdl),
    )
