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

Tokens are laid out ``[ROWS, GROUPS_P, GROUP_P]`` (groups padded to powers of two), expert
``g * group_size + j``; ``select_experts`` is shared by the routing kernel here and the fused
router (``router_route_gemv``), which runs it on the logits its own GEMV wrote.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv


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

    group_size: int
    groups_p: int
    group_p: int
    k_p: int

    @classmethod
    def of(cls, n_experts: int, routing: Routing) -> RouteShape:
        group_size = n_experts // routing.n_group
        return cls(
            group_size,
            triton.next_power_of_2(routing.n_group),
            triton.next_power_of_2(group_size),
            triton.next_power_of_2(routing.top_k),
        )


@triton.jit
def _max2(v):
    """Per row of ``v`` [R, G, S]: its maximum, [R]."""
    return tl.max(tl.max(v, axis=2), axis=1)


@triton.jit
def _min2(v):
    return tl.min(tl.min(v, axis=2), axis=1)


@triton.jit
def _sum2(v):
    return tl.sum(tl.sum(v, axis=2), axis=1)


@triton.jit
def _scores(logits, valid, SCORING: tl.constexpr):
    """fp32 scores of fp32 ``logits`` [R, G, S]; ``valid`` marks real experts."""
    if SCORING == 0:
        return 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == 1:
        top = _max2(tl.where(valid, logits, float("-inf")))
        e = tl.where(valid, tl.exp(logits - top[:, None, None]), 0.0)
        return e / _sum2(e)[:, None, None]
    else:
        # sqrt(softplus(l)); softplus = max(l, 0) + log1p(exp(-|l|)), log1p(y) accurate for small y
        # as log(1 + y) * y / ((1 + y) - 1); above 20 torch's softplus is the identity.
        y = tl.exp(-tl.abs(logits))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        softplus = tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p)
        return tl.sqrt(softplus)


@triton.jit
def _best_groups(choice, valid, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BIAS: tl.constexpr,
                 GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr):  # fmt: skip
    """``[R, G, 1]`` mask of each token's TOPK_GROUP best groups (lowest group first on ties)."""
    member = tl.arange(0, GROUP_P)[None, None, :]
    c = tl.where(valid, choice, float("-inf"))
    best = tl.max(c, axis=2)
    if BIAS:  # the sum of the two best: the first best's slot (lowest index) out, the next best
        first = tl.min(tl.where((c == best[:, :, None]) & valid, member, GROUP_P), axis=2)
        second = tl.max(tl.where(member == first[:, :, None], float("-inf"), c), axis=2)
        best = best + second
    group = tl.arange(0, GROUPS_P)[None, :]
    real = group < N_GROUP
    chosen = best < best  # all False, [R, G] (best holds no NaN)
    for _ in tl.static_range(TOPK_GROUP):
        cand = tl.where(real & ~chosen, best, float("-inf"))
        top = tl.max(cand, axis=1)
        pick = (cand == top[:, None]) & real & ~chosen  # all groups when every score is -inf/NaN
        g = tl.min(tl.where(pick, group, N_GROUP), axis=1)
        chosen = chosen | (group == g[:, None])
    return chosen[:, :, None]


@triton.jit
def select_experts(logits, bias, valid, expert, scaling,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                   K_P: tl.constexpr, GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr,
                   SCORING: tl.constexpr, BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    """The experts of each token: (ids [R, K_P] int32, weights [R, K_P] fp32), slots >= TOP_K
    unused. ``logits``/``bias`` [R, G, S] fp32 (bias ignored unless BIAS), ``expert`` the expert
    index of each slot, ``valid`` the real experts."""
    logits = tl.where(logits == logits, logits, float("-inf"))  # NaN (padding rows) ranks last
    scores = _scores(logits, valid, SCORING)
    choice = scores
    if BIAS:
        choice = scores + bias
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    allowed = valid
    if N_GROUP > 1:
        allowed = allowed & _best_groups(choice, valid, N_GROUP, TOPK_GROUP, BIAS, GROUPS_P, GROUP_P)
    slot = tl.arange(0, K_P)[None, :]
    ids = tl.zeros((logits.shape[0], K_P), tl.int32)
    weights = tl.zeros((logits.shape[0], K_P), tl.float32)
    taken = choice < choice  # all False, [R, G, S] (choice holds no NaN)
    BIG: tl.constexpr = 2**30
    for t in tl.static_range(TOP_K):
        cand = tl.where(allowed & ~taken, choice, float("-inf"))
        top = _max2(cand)
        pick = (cand == top[:, None, None]) & allowed & ~taken
        e = _min2(tl.where(pick, expert, BIG))
        hit = expert == e[:, None, None]
        w = _sum2(tl.where(hit, scores, 0.0))
        taken = taken | hit
        ids = tl.where(slot == t, e[:, None], ids)
        weights = tl.where(slot == t, w[:, None], weights)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # unused slots hold 0
    return ids, weights * scaling


@triton.jit
def expert_layout(N_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr, GROUPS_P: tl.constexpr,
                  GROUP_P: tl.constexpr):  # fmt: skip
    """The [1, GROUPS_P, GROUP_P] expert index and validity of each slot."""
    GROUP_SIZE: tl.constexpr = N_EXPERTS // N_GROUP
    group = tl.arange(0, GROUPS_P)[None, :, None]
    member = tl.arange(0, GROUP_P)[None, None, :]
    valid = (group < N_GROUP) & (member < GROUP_SIZE)
    return group * GROUP_SIZE + member, valid


@triton.jit
def route_rows(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, row0, M, scaling,
               ROWS: tl.constexpr, N_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr,
               TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPS_P: tl.constexpr,
               GROUP_P: tl.constexpr, K_P: tl.constexpr, SCORING: tl.constexpr, BIAS: tl.constexpr,
               RENORMALIZE: tl.constexpr, VOLATILE: tl.constexpr):  # fmt: skip
    """Route tokens ``row0 .. row0 + ROWS`` (< M) from their logits in memory into ``weights_ptr``
    (fp32) and ``ids_ptr`` (int32). VOLATILE: read the logits past the L1 cache (other programs
    wrote them during this launch)."""
    expert, valid = expert_layout(N_EXPERTS, N_GROUP, GROUPS_P, GROUP_P)
    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows < M
    mask = row_ok[:, None, None] & valid
    ptrs = logits_ptr + rows[:, None, None].to(tl.int64) * stride_lm + expert
    if VOLATILE:
        logits = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        logits = tl.load(ptrs, mask=mask, other=0.0)
    logits = logits.to(tl.float32)
    bias = logits
    if BIAS:
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    ids, weights = select_experts(logits, bias, valid, expert, scaling, N_GROUP, TOPK_GROUP, TOP_K, K_P,
                                  GROUPS_P, GROUP_P, SCORING, BIAS, RENORMALIZE)  # fmt: skip
    slot = tl.arange(0, K_P)[None, :]
    out = rows[:, None].to(tl.int64) * stride_om + slot
    out_mask = row_ok[:, None] & (slot < TOP_K)
    tl.store(ids_ptr + out, ids, mask=out_mask)
    tl.store(weights_ptr + out, weights, mask=out_mask)


@triton.jit
def _route_logits_kernel(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, M, scaling,
                         ROWS: tl.constexpr, N_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPS_P: tl.constexpr,
                         GROUP_P: tl.constexpr, K_P: tl.constexpr, SCORING: tl.constexpr,
                         BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    route_rows(logits_ptr, stride_lm, bias_ptr, weights_ptr, ids_ptr, stride_om, tl.program_id(0) * ROWS,
               M, scaling, ROWS, N_EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, GROUPS_P, GROUP_P, K_P, SCORING,
               BIAS, RENORMALIZE, False)  # fmt: skip


def route_rows_per_program(shape: RouteShape) -> int:
    """Tokens per routing program: about 2,048 padded experts' values in flight (16 fp32 per thread
    of 4 warps), at least one token."""
    return max(1, min(16, 2048 // (shape.groups_p * shape.group_p)))


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
) -> None:
    """Route every row of ``logits`` [M, N] (any float dtype, unit stride along N) into ``weights``
    [M, top_k] fp32 and ``ids`` [M, top_k] int32 (same row stride). ``bias`` [N] when
    ``routing.bias``."""
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
        num_warps=4,
    )
