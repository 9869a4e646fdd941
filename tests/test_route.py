"""The router (GEMM + expert selection) against fp64 routing: the routing kernel, the fused decode
router and the ``router_ext::route`` op. On CPU the kernels run under TRITON_INTERPRET=1; on a GPU
the same tests run the compiled kernels (the fused router's tickets across real programs).

Tolerances: in ``fp32`` the logits are fp32-exact sums, the scores one fp32 evaluation of
sigmoid / softmax / sqrt(softplus): expert ids equal fp64's wherever the selection's margin is
above fp32 rounding (1e-6 in logit units; random tokens, and near-tie tokens built with a margin
of 2^-14), weights within 1e-6 times the routed scaling factor.
"""

from __future__ import annotations

import pytest
import torch

import csrc_triton.router_route_gemv as fused
from csrc_triton import choice
from csrc_triton.dispatch import route_cuda
from csrc_triton.launches import GemvLaunch
from csrc_triton.problem import Precision, Problem
from csrc_triton.router_gemm_gemv import gemv_launch
from csrc_triton.routing import Routing, Scoring, route_logits
from vllm_router_ext.ops.route import route, route_torch
from vllm_router_ext.ops.routing_fp64 import RoutingConfig, near_tie_mask, select_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"

#: name -> (experts, our routing, the fp64 reference's config): vLLM's routers on logits.
ROUTINGS = {
    "deepseek-v3": (256, Routing(8, Scoring.SIGMOID, 8, 4, True, True, 2.5),
                    RoutingConfig(8, 8, 4, "sigmoid", "noaux_tc", True, 2.5)),
    "kimi-k2": (384, Routing(8, Scoring.SIGMOID, 1, 1, True, True, 2.827),
                RoutingConfig(8, 1, 1, "sigmoid", "noaux_tc", True, 2.827)),
    "glm-4.5": (160, Routing(8, Scoring.SIGMOID, 1, 1, True, True, 2.5),
                RoutingConfig(8, 1, 1, "sigmoid", "noaux_tc", True, 2.5)),
    "qwen3-moe": (128, Routing(8, Scoring.SOFTMAX, renormalize=True), RoutingConfig(8, renormalize=True)),
    "softmax-no-renorm": (64, Routing(6, Scoring.SOFTMAX), RoutingConfig(6)),
    "deepseek-v2": (160, Routing(6, Scoring.SOFTMAX, 8, 3, routed_scaling_factor=16.0),
                    RoutingConfig(6, 8, 3, "softmax", "group_limited_greedy", routed_scaling_factor=16.0)),
    "ernie-4.5": (64, Routing(8, Scoring.SOFTMAX, bias=True, renormalize=True),
                  RoutingConfig(8, topk_method="noaux_tc", renormalize=True)),
    "llama-4": (16, Routing(1, Scoring.SIGMOID), RoutingConfig(1, scoring_func="sigmoid")),
    "deepseek-v4": (256, Routing(6, Scoring.SQRTSOFTPLUS, bias=True, renormalize=True,
                                 routed_scaling_factor=1.5),
                    RoutingConfig(6, scoring_func="sqrtsoftplus", topk_method="noaux_tc", renormalize=True,
                                  routed_scaling_factor=1.5)),
}  # fmt: skip


def _bias(gen, n, routing):
    return (torch.randn(n, generator=gen) * 0.05).to(DEV) if routing.bias else None


def _reference(logits, cfg, bias):
    """fp64 expert ids (ascending) and weights."""
    return select_experts(logits.double().cpu(), cfg, None if bias is None else bias.double().cpu())


def _sorted(ids, weights):
    order = ids.long().cpu().argsort(dim=-1)
    return ids.long().cpu().gather(1, order), weights.double().cpu().gather(1, order)


def _poisoned_outputs(m, top_k):
    return (
        torch.full((m, top_k), float("nan"), device=DEV),
        torch.full((m, top_k), -7, dtype=torch.int32, device=DEV),
    )


#: Selection margins (in logit units) below fp32's own rounding of the logits and scores: a token
#: whose fp64 choice is that close is a tie at fp32 resolution, where fp32 may pick either.
FP32_TIE = 1e-6


def _assert_routes_as_fp64(ids, weights, logits, cfg, bias):
    """Expert ids equal fp64's on every token whose fp64 margin is above fp32 resolution (at most
    1 % of random tokens, or 2, are that close), weights within 1e-6 (times the routed scaling
    factor) wherever the ids agree."""
    ref_ids, ref_weights = _reference(logits, cfg, bias)
    got_ids, got_weights = _sorted(ids, weights)
    ties = near_tie_mask(logits.double().cpu(), cfg, None if bias is None else bias.double().cpu(), FP32_TIE)
    assert int(ties.sum()) <= max(2, 0.01 * len(ties))
    bad = (got_ids != ref_ids).any(dim=1) & ~ties
    assert not bad.any(), f"{int(bad.sum())} tokens differ: {got_ids[bad][0]} vs {ref_ids[bad][0]}"
    same = (got_ids == ref_ids).all(dim=1)
    assert (got_weights - ref_weights)[same].abs().max().item() <= 1e-6 * max(1.0, cfg.routed_scaling_factor)


def _near_tie_logits(gen, m, n, routing, bias):
    """Random logits (sigmoid scores, one group) where, per token, the top_k-th and the next
    expert's choice scores differ by 2^-14 (fp32 resolves it; a bf16 logit would not)."""
    logits = torch.randn(m, n, generator=gen, dtype=torch.float64)
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double().cpu()
    choice = logits.sigmoid() + b
    order = choice.argsort(dim=1, descending=True)
    k = routing.top_k
    inside, outside = order[:, k - 1], order[:, k]
    # put the first expert left out 2^-14 below the last one kept, in choice-score units
    target = choice.gather(1, inside[:, None]).squeeze(1) - 2.0**-14 - b[outside]
    logits.scatter_(1, outside[:, None], torch.logit(target.clamp(1e-6, 1 - 1e-6))[:, None])
    return logits


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_kernel_routes_as_fp64(gen, name):
    n, routing, cfg = ROUTINGS[name]
    m = 67
    bias = _bias(gen, n, routing)
    logits = (torch.randn(m, n, generator=gen) * 2).to(DEV)
    weights, ids = _poisoned_outputs(m, routing.top_k)
    route_logits(logits, routing, bias, weights, ids)
    _assert_routes_as_fp64(ids, weights, logits, cfg, bias)


@pytest.mark.parametrize("name", ["kimi-k2", "glm-4.5"])
def test_near_tie_tokens_route_as_fp64(gen, name):
    n, routing, cfg = ROUTINGS[name]
    bias = _bias(gen, n, routing)
    logits64 = _near_tie_logits(gen, 64, n, routing, bias)
    logits = logits64.float().to(DEV)
    weights, ids = _poisoned_outputs(64, routing.top_k)
    route_logits(logits, routing, bias, weights, ids)
    _assert_routes_as_fp64(ids, weights, logits64, cfg, bias)
    # the margins are real: bf16 logits change the experts of some of these tokens
    bf16_ids, _ = _reference(logits64.bfloat16(), cfg, bias)
    assert (bf16_ids != _reference(logits64, cfg, bias)[0]).any(dim=1).sum() >= 8


def test_ties_go_to_the_lowest_expert_and_best_comes_first():
    routing = Routing(3, Scoring.SOFTMAX, n_group=4, topk_group=2)
    logits = torch.zeros(2, 16, device=DEV)
    logits[0, [5, 9, 13]] = 1.0  # groups 1, 2, 3 tie at the top: groups 1 and 2 are kept
    logits[1, 15] = 2.0  # the best first, then the lowest of the tied rest in the kept groups
    weights, ids = _poisoned_outputs(2, 3)
    route_logits(logits, routing, None, weights, ids)
    assert ids.tolist() == [[5, 9, 4], [15, 0, 1]]
    route_w, route_ids = route_torch(logits.cpu(), routing, None)
    assert route_ids.tolist() == ids.cpu().tolist()
    torch.testing.assert_close(route_w, weights.cpu(), rtol=0, atol=1e-7)


def test_nan_rows_still_get_distinct_valid_experts():
    n, routing, _ = ROUTINGS["deepseek-v3"]
    logits = torch.full((3, n), float("nan"), device=DEV)
    bias = torch.zeros(n, device=DEV)
    weights, ids = _poisoned_outputs(3, routing.top_k)
    route_logits(logits, routing, bias, weights, ids)
    for row in ids.cpu().tolist():
        assert len(set(row)) == routing.top_k and all(0 <= e < n for e in row)


def _fused_inputs(gen, m, k, n, w_dtype):
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype).to(DEV)
    return x, w


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "qwen3-moe"])
@pytest.mark.parametrize(
    "m,launch", [(1, GemvLaunch(1, 32)), (5, GemvLaunch(2, 64)), (16, GemvLaunch(8, 16))]
)
def test_fused_router_is_the_gemv_then_the_routing_kernel(gen, name, m, launch):
    """Bit for bit: the logits of the GEMV launch, the experts of the routing kernel on them; and the
    tickets are back at zero for the next launch (run twice on fresh inputs)."""
    n, routing, cfg = ROUTINGS[name]
    bias = _bias(gen, n, routing)
    for _ in range(2):
        x, w = _fused_inputs(gen, m, 320, n, torch.float32)
        logits = torch.full((m, n), float("nan"), device=DEV)
        weights, ids = _poisoned_outputs(m, routing.top_k)
        fused.route_gemv_launch(x, w, routing, bias, logits, weights, ids, launch)
        gemv_logits = torch.full((m, n), float("nan"), device=DEV)
        gemv_launch(x, w, gemv_logits, launch)
        assert torch.equal(logits, gemv_logits)
        kernel_weights, kernel_ids = _poisoned_outputs(m, routing.top_k)
        route_logits(gemv_logits, routing, bias, kernel_weights, kernel_ids)
        assert torch.equal(ids, kernel_ids) and torch.equal(weights, kernel_weights)
        assert not fused.tickets_for(x.device, 1).any()
    logits64 = x.double().cpu() @ w.double().cpu().T
    _assert_routes_as_fp64(ids, weights, logits64, cfg, bias)


@pytest.mark.parametrize("m", [1, 3, 16, 80])
@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out"])
@pytest.mark.parametrize("one_launch", [False, True])
def test_dispatch_routes_after_the_chosen_gemm_or_in_one_launch(gen, monkeypatch, m, mode, one_launch):
    """The router GEMM the choice picks, then the routing kernel; with ``fused`` the decode GEMV and
    the routing in one launch. Either way the experts are fp64's."""
    n, routing, cfg = ROUTINGS["deepseek-v3"]
    calls = []
    real = fused.route_gemv_launch
    monkeypatch.setattr(fused, "route_gemv_launch", lambda *a: calls.append(a[-1]) or real(*a))
    bias = _bias(gen, n, routing)
    x, w = _fused_inputs(gen, m, 512, n, torch.float32 if mode == "fp32" else torch.bfloat16)
    weights, ids, logits = route_cuda(x, w, Precision(mode), routing, bias, False, fused=one_launch)
    assert logits.dtype == torch.float32 and logits.shape == (m, n)
    gemv = isinstance(choice.choose(Problem.of(x, w, Precision(mode))), GemvLaunch)
    assert bool(calls) == (gemv and one_launch) and (gemv or m > 1), f"fused launches: {calls}"
    _assert_routes_as_fp64(ids, weights, x.double().cpu() @ w.double().cpu().T, cfg, bias)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-moe", "deepseek-v4"])
def test_the_op_on_cpu_routes_as_fp64(gen, name):
    """The registered op's CPU implementation (plain torch) on 8192 random tokens."""
    n, routing, cfg = ROUTINGS[name]
    x = torch.randn(8192, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, 64, generator=gen) / 8
    bias = torch.randn(n, generator=gen) * 0.05 if routing.bias else None
    weights, ids, logits = route(x, w, routing, "fp32", bias=bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and logits.dtype == torch.float32
    _assert_routes_as_fp64(ids, weights, x.double() @ w.double().T, cfg, bias)


def test_the_op_has_a_fake_and_a_schema():
    n, routing, _ = ROUTINGS["deepseek-v3"]
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.randn(n, 32)
    bias = torch.zeros(n)
    args = (x, w, bias, "fp32", False, None, 8, int(Scoring.SIGMOID), 8, 4, True, 2.5)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.router_ext.route.default, args, test_utils=checks)


@pytest.mark.parametrize(
    "routing,bias,message",
    [
        (Routing(8, Scoring.SIGMOID, 7, 4, True), torch.zeros(256), "n_group=7 must divide the 256 experts"),
        (Routing(8, Scoring.SIGMOID, 8, 9, True), torch.zeros(256), "topk_group=9; allowed: 1..n_group (8)"),
        (Routing(80, Scoring.SIGMOID, 8, 2, True), torch.zeros(256), "top_k=80; allowed: 1..64"),
        (Routing(8, Scoring.SIGMOID, bias=True), None, "routing.bias is True but no bias tensor"),
        (Routing(8, Scoring.SIGMOID, bias=True), torch.zeros(256).bfloat16(), "bias must be float32 [256]"),
    ],
)
def test_bad_routing_is_refused_with_what_is_allowed(routing, bias, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        route(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(256, 32), routing, "fp32", bias=bias)


def test_batch_invariant_routing_of_a_token_is_its_routing_alone(gen):
    """Batch-invariant: a token's logits, experts and weights are bitwise those it gets alone."""
    n, routing, _ = ROUTINGS["deepseek-v3"]
    bias = _bias(gen, n, routing)
    x, w = _fused_inputs(gen, 24, 512, n, torch.float32)
    batch = route_cuda(x, w, Precision.FP32, routing, bias, batch_invariant=True)
    for i in (0, 7, 23):
        alone = route_cuda(x[i : i + 1], w, Precision.FP32, routing, bias, batch_invariant=True)
        for got, ref in zip(alone, batch, strict=True):
            assert torch.equal(got[0], ref[i])


def test_route_compiles_as_one_opaque_op_for_every_m(gen):
    """torch.compile (fullgraph, dynamic) traces the op through its fake: one graph serves every M
    and its results are the eager op's."""
    n, routing, _ = ROUTINGS["deepseek-v3"]
    w = torch.randn(n, 64, generator=gen).to(DEV)
    bias = _bias(gen, n, routing)

    def stage(x):
        weights, ids, _ = route(x, w, routing, "fp32", bias=bias)
        return weights * 2, ids

    torch._dynamo.reset()
    compiled = torch.compile(stage, fullgraph=True, dynamic=True)
    for m in (1, 5, 33):
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16).to(DEV)
        got, want = compiled(x), stage(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
