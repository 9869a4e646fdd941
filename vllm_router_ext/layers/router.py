"""The fused router: the gate GEMM and the expert selection of an MoE layer in one op of ours.

vLLM's MoE runner holds the gate (DeepSeek-V2/V3, Kimi-K2, GLM, ...): it calls the gate for the
logits, then its router's ``select_experts`` on them. Where our gate is that gate, the runner gets
:class:`FusedGateRouter` (a vLLM ``BaseRouter``: EPLB, the routed-experts capture and the index
dtype stay vLLM's) and, in the gate's place, :class:`HandsThrough`, which hands the hidden states
on; the router then runs ``router_ext::route`` (GEMM, scores, grouped top-k, weights) on them. A
routing this op does not replay exactly as vLLM's router (a custom routing function, hash-routed
layers, fused shared experts, padding rows skipped, ...) keeps vLLM's router on our logits.

Invariant: the fused router picks the experts vLLM's router would pick on the same logits, ties to
the lowest expert, weights as vLLM computes them (scaling, renormalisation); only the logits' round
trip through memory and one launch go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

from csrc_triton.routing import Routing, Scoring
from vllm_router_ext.ops.route import route
from vllm_router_ext.precision import RouterSettings

_SCORING = {"sigmoid": Scoring.SIGMOID, "softmax": Scoring.SOFTMAX, "sqrtsoftplus": Scoring.SQRTSOFTPLUS}


def fused_by_default(device: torch.device, router: object) -> bool:
    """``auto``: where the fused router routes a layer: on CUDA GPUs of compute capability 9.0 and
    above, for the routing it was measured faster on than vLLM's router on our logits at every
    token count (docs/benchmarks.md, the router stage): sigmoid + correction bias without groups,
    which vLLM routes with ``FusedTopKBiasRouter`` (Kimi-K2). vLLM's grouped top-k (DeepSeek-V3)
    and softmax top-k (Qwen3-MoE) kernels were as fast or faster: their layers keep them."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return (
        type(router).__name__ == "FusedTopKBiasRouter" and getattr(router, "scoring_func", None) == "sigmoid"
    )


def routing_of(router: object, n_experts: int) -> Routing | str:
    """The :class:`Routing` that replays vLLM's ``router`` for a gate of ``n_experts``, as its
    ``_compute_routing`` routes (with ``routing.bias``: the router's ``e_score_correction_bias``),
    or why none does."""
    name = type(router).__name__
    unreplayed = (("custom_routing_function", "a custom routing function"),
                  ("_hash_indices_table", "hash-routed experts"), ("bias_vl", "a vision bias"))  # fmt: skip
    for attr, what in unreplayed:
        if getattr(router, attr, None) is not None:
            return f"vLLM's {name} with {what}"
    if getattr(router, "num_fused_shared_experts", 0):
        return f"vLLM's {name} with fused shared experts"
    if getattr(router, "skip_padding", False):
        return f"vLLM's {name} skipping padding rows"
    scoring = _SCORING.get(getattr(router, "scoring_func", None))
    bias = getattr(router, "e_score_correction_bias", None)
    scale = float(getattr(router, "routed_scaling_factor", 1.0))
    n_group = topk_group = 1
    if name == "GroupedTopKRouter" or (name == "CPURouter" and router.use_grouped_topk):
        if scoring not in (Scoring.SIGMOID, Scoring.SOFTMAX):
            return f"vLLM's {name} with scoring {router.scoring_func!r}"
        n_group, topk_group = int(router.num_expert_group or 1), int(router.topk_group or 1)
        if name == "GroupedTopKRouter" and (n_experts <= n_group or n_experts % n_group):
            n_group = topk_group = 1  # vLLM routes without groups then, scaling only with a bias
            scale = scale if bias is not None else 1.0
    elif name == "FusedTopKBiasRouter":
        if scoring is None or bias is None:
            return f"vLLM's {name} with scoring {router.scoring_func!r} and bias {bias is not None}"
    elif name == "FusedTopKRouter":
        if scoring not in (Scoring.SIGMOID, Scoring.SOFTMAX):
            return f"vLLM's {name} with scoring {router.scoring_func!r}"
        bias, scale = None, 1.0
    elif name == "CPURouter":  # ungrouped: sqrtsoftplus + bias, or softmax top-k without bias or scale
        if scoring is Scoring.SOFTMAX:
            bias, scale = None, 1.0
        elif scoring is not Scoring.SQRTSOFTPLUS or bias is None:
            return f"vLLM's {name} with scoring {router.scoring_func!r}"
    else:
        return f"vLLM's {name} (no replay of its routing)"
    routing = Routing(int(router.top_k), scoring, n_group, topk_group, bias is not None,
                      bool(router.renormalize), scale)  # fmt: skip
    try:
        routing.check(n_experts)
    except ValueError as e:
        return f"vLLM's {name}: {e}"
    return routing


class FusedGateRouter(BaseRouter):
    """vLLM's router of one MoE layer, replaced: the experts come from ``router_ext::route`` on the
    hidden states and our gate's weight. Everything ``BaseRouter`` does after the routing (the
    routed-experts capture, EPLB's physical ids, the index dtype) is vLLM's."""

    def __init__(self, gate: torch.nn.Module, routing: Routing, stock: BaseRouter):
        super().__init__(top_k=stock.top_k, global_num_experts=stock.global_num_experts,
                         eplb_state=stock.eplb_state)  # fmt: skip
        for attr in ("capture_fn", "_routing_replay_out", "bias_vl", "image_sentinel_lo"):
            if hasattr(stock, attr):
                setattr(self, attr, getattr(stock, attr))
        self.gate = gate
        self.routing = routing
        self.stock = stock  # holds the correction bias: read at each call, as weight loading left it

    @property
    def routing_method_type(self):
        return self.stock.routing_method_type

    def _compute_routing(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        indices_type: torch.dtype | None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.gate
        weights, ids, logits = route(
            hidden_states,
            gate.weight,
            self.routing,
            gate.router_gemm.precision,
            bias=self.stock.e_score_correction_bias if self.routing.bias else None,
            batch_invariant=gate.router_gemm.batch_invariant,
            weight_terms=gate.router_weight_terms,
        )
        gate.logits_seen(hidden_states, logits)
        return weights, ids


class HandsThrough(torch.nn.Module):
    """Stands in the runner's gate: hands the hidden states on as the "logits" the fused router
    reads. Where the experts read the logits themselves (a monolithic kernel), the gate runs."""

    def __init__(self, gate: torch.nn.Module, runner: torch.nn.Module) -> None:
        super().__init__()
        # Plain references, not submodules: the gate's parameters keep their one name.
        self.__dict__["_gate"] = gate
        self.__dict__["_runner"] = runner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self._runner.routed_experts.quant_method.is_monolithic:
            return self._gate(x)
        return x, None


@dataclass(frozen=True)
class FusedReport:
    """What :func:`install_fused_routers` did: layers routed by our op, and why others were not."""

    fused: int
    kept: dict[str, int]

    def describe(self) -> str:
        parts = [f"fused router (router_ext::route) in {self.fused} layer(s)"] if self.fused else []
        parts += [f"vLLM's router on our logits in {n} layer(s): {why}" for why, n in self.kept.items()]
        return "; ".join(parts) or "no MoE runner holds a gate of ours"


def _why_not(runner: torch.nn.Module, gate: torch.nn.Module) -> str | None:
    """Why this runner cannot take the fused router, or None."""
    if getattr(runner, "shared_expert_gate", None) is not None:
        return "the shared experts' gate is fused with the router's"
    if getattr(gate, "_adds_bias", False):
        return "the gate has a bias"
    config = getattr(runner, "moe_config", None)
    if getattr(runner, "do_naive_dispatch_combine", False) or getattr(config, "pcp_size", 1) > 1:
        return "the logits are dispatched across ranks"
    if not hasattr(runner, "routed_experts"):
        return "vLLM's MoE layer has no routed experts to hand the routing to"
    return None


def install_fused_routers(
    model: torch.nn.Module, settings: RouterSettings, device: torch.device
) -> FusedReport:
    """Give every MoE runner of ``model`` whose gate is ours the fused router, where the setting
    (or ``auto`` on ``device``) wants it and vLLM's routing allows; ``on`` where it cannot apply
    stops the start-up with why."""
    from vllm_router_ext.layers.gate import GateSettingsError, RouterGateMixin

    fused, kept = 0, {}
    for runner in model.modules():
        gate, router = getattr(runner, "gate", None), getattr(runner, "router", None)
        if not isinstance(gate, RouterGateMixin) or gate.router_settings is None:
            continue
        if not isinstance(router, BaseRouter):
            continue
        if settings.fused == "off" or (settings.fused == "auto" and not fused_by_default(device, router)):
            why = (
                "--router-fused off"
                if settings.fused == "off"
                else f"auto, {type(router).__name__} on {device.type}"
            )
            kept[why] = kept.get(why, 0) + 1
            continue
        found = _why_not(runner, gate) or routing_of(router, gate.weight.shape[0])
        if isinstance(found, str):
            if settings.fused == "on":
                raise GateSettingsError(
                    f"vllm-router-ext: the fused router (from {settings.fused_source}) cannot route "
                    f"{settings.model}'s {gate.prefix or 'gate'}: {found}; use --router-fused auto or off"
                )
            kept[found] = kept.get(found, 0) + 1
            continue
        runner.router = FusedGateRouter(gate, found, router)
        gate.router_fused_routing = found  # the warm-up runs its route launches too
        runner.gate = HandsThrough(gate, runner)
        fused += 1
    return FusedReport(fused, kept)


__all__ = ["FusedGateRouter", "FusedReport", "HandsThrough", "fused_by_default", "install_fused_routers",
           "routing_of"]  # fmt: skip
