"""The fused router in vLLM's MoE layers (CPU build, no engine): each router vLLM builds is replayed
by a :class:`Routing` (the same experts as vLLM's router on the same logits, ties aside; weights
within 1e-6 times the scaling), a built DeepSeek-V3 gets it in every MoE layer with its parameters
named as before, and a layer it cannot route keeps vLLM's router (``auto``) or stops the start-up
(``on``)."""

from __future__ import annotations

import pytest
import torch

from vllm_router_ext.ops.route import route_torch
from vllm_router_ext.ops.routing_fp64 import RoutingConfig, near_tie_mask

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

N = 64  # experts
#: name -> (CPURouter's arguments, the fp64 reference's config for the tie mask)
CPU_ROUTERS = {
    "deepseek-v3": (dict(use_grouped_topk=True, num_expert_group=8, topk_group=4, scoring_func="sigmoid",
                         renormalize=True, routed_scaling_factor=2.5, bias=True),
                    RoutingConfig(8, 8, 4, "sigmoid", "noaux_tc", True, 2.5)),
    "kimi-k2": (dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, scoring_func="sigmoid",
                     renormalize=True, routed_scaling_factor=2.827, bias=True),
                RoutingConfig(8, 1, 1, "sigmoid", "noaux_tc", True, 2.827)),
    "deepseek-v2": (dict(use_grouped_topk=True, num_expert_group=8, topk_group=3, scoring_func="softmax",
                         renormalize=False, routed_scaling_factor=16.0, bias=False),
                    RoutingConfig(8, 8, 3, "softmax", "group_limited_greedy", False, 16.0)),
    "qwen3-moe": (dict(scoring_func="softmax", renormalize=True, bias=False),
                  RoutingConfig(8, renormalize=True)),
    "mixtral": (dict(scoring_func="softmax", renormalize=False, bias=False), RoutingConfig(8)),
}  # fmt: skip


def _cpu_router(args: dict, gen: torch.Generator):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    args = dict(args)
    bias = (torch.randn(N, generator=gen) * 0.05) if args.pop("bias") else None
    return CPURouter(top_k=8, global_num_experts=N, e_score_correction_bias=bias, **args)


@pytest.mark.parametrize("name", list(CPU_ROUTERS))
def test_each_cpu_router_is_replayed_exactly(vllm_dist, gen, name):
    """vLLM's CPU router (what every CPU MoE layer routes with) and our routing of the same fp32
    logits: the same expert sets on every token whose fp64 margin is above 1e-6, weights within
    1e-6 x the scaling factor."""
    from vllm_router_ext.layers.router import routing_of

    args, cfg = CPU_ROUTERS[name]
    router = _cpu_router(args, gen)
    routing = routing_of(router, N)
    bias = router.e_score_correction_bias if routing.bias else None
    assert (routing.top_k, routing.renormalize, routing.bias) == (8, cfg.renormalize, args["bias"])
    x = torch.randn(512, 16, generator=gen).bfloat16()
    logits = torch.randn(512, N, generator=gen) * 2
    want_w, want_ids = router.select_experts(x, logits)
    got_w, got_ids = route_torch(logits, routing, bias)
    order_want, order_got = want_ids.long().argsort(1), got_ids.long().argsort(1)
    want_ids, got_ids = want_ids.long().gather(1, order_want), got_ids.long().gather(1, order_got)
    want_w, got_w = want_w.gather(1, order_want), got_w.gather(1, order_got)
    ties = near_tie_mask(logits.double(), cfg, None if bias is None else bias.double(), 1e-6)
    assert int(ties.sum()) <= 5
    assert torch.equal(got_ids[~ties], want_ids[~ties])
    assert (got_w - want_w)[~ties].abs().max().item() <= 1e-6 * cfg.routed_scaling_factor


def test_the_cuda_routers_are_read_as_vllm_routes_with_them(vllm_dist, gen):
    """The routers vLLM's factory builds on CUDA, read into a Routing: DeepSeek-V3's grouped top-k,
    a degenerate grouping (vLLM then routes without groups, scaling only with a bias), Kimi-K2's
    top-k with a bias, softmax top-k (never scaled); what no Routing replays is named."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    from csrc_triton.routing import Routing, Scoring
    from vllm_router_ext.layers.router import routing_of

    bias = torch.randn(N, generator=gen)
    v3 = GroupedTopKRouter(8, N, 8, 4, True, "sigmoid", 2.5, bias)
    assert routing_of(v3, N) == Routing(8, Scoring.SIGMOID, 8, 4, True, True, 2.5)
    assert routing_of(GroupedTopKRouter(8, N, 128, 4, True, "softmax", 2.5), N) == Routing(
        8, Scoring.SOFTMAX, renormalize=True
    )  # more groups than experts: no groups, no scaling (vLLM's fused_topk)
    k2 = FusedTopKBiasRouter(8, N, bias, True, 2.827, scoring_func="sigmoid")
    assert routing_of(k2, N) == Routing(8, Scoring.SIGMOID, 1, 1, True, True, 2.827)
    v4 = FusedTopKBiasRouter(6, N, bias, True, 1.5, scoring_func="sqrtsoftplus")
    assert routing_of(v4, N) == Routing(6, Scoring.SQRTSOFTPLUS, 1, 1, True, True, 1.5)
    assert routing_of(FusedTopKRouter(4, N, "softmax", False), N) == Routing(4, Scoring.SOFTMAX)
    hashed = FusedTopKBiasRouter(6, N, bias, True, 1.5, scoring_func="sqrtsoftplus",
                                 hash_indices_table=torch.zeros(8, 6))  # fmt: skip
    assert routing_of(hashed, N) == "vLLM's FusedTopKBiasRouter with hash-routed experts"
    custom = CPURouter(8, N, custom_routing_function=lambda **_: None)
    assert routing_of(custom, N) == "vLLM's CPURouter with a custom routing function"
    assert routing_of(GroupedTopKRouter(8, N, 8, 4, num_fused_shared_experts=1), N).endswith(
        "with fused shared experts"
    )
    assert routing_of(object(), N) == "vLLM's object (no replay of its routing)"  # fmt: skip


def _build_tiny_v3(vllm_dist, path, extra):
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_configs import engine_free_config

    model_config = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)
    cfg = engine_free_config(model_config=model_config, parallel_config=vllm_dist.parallel_config,
                             additional_config=extra)  # fmt: skip
    cls = ModelRegistry.models["DeepseekV3ForCausalLM"].load_model_cls()
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        return cls(vllm_config=cfg, prefix=""), cfg


def test_a_built_deepseek_v3_routes_every_moe_layer_with_the_fused_router(vllm_dist, tmp_path, gen):
    """``router_fused: on``: every MoE runner holding our gate gets the fused router and, in the
    gate's place, the hand-through (the gate's parameters keep their one name); the MoE block
    runs and picks the experts of vLLM's router on our logits; ``off`` and CPU's ``auto`` keep
    vLLM's router, which the model's report says."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_router_ext.layers.router import FusedGateRouter, HandsThrough
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "tiny")
    fused, cfg = _build_tiny_v3(vllm_dist, path, {"router_precision": "fp32", "router_fused": "on"})
    stock, stock_cfg = _build_tiny_v3(vllm_dist, path, {"router_precision": "fp32"})
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in stock.named_parameters()]
    runners = [m for m in fused.modules() if isinstance(getattr(m, "router", None), FusedGateRouter)]
    assert runners and all(isinstance(r.gate, HandsThrough) for r in runners)
    assert fused._router_fused.describe() == f"fused router (router_ext::route) in {len(runners)} layer(s)"
    assert stock._router_fused.describe().startswith("vLLM's router on our logits in ")
    assert stock._router_fused.describe().endswith(": auto, CPURouter on cpu")
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        pytest.skip("the MoE block runs on vLLM's CPU kernels, which this vLLM build lacks (the routers "
                    "were checked; the block runs on the CPU build)")  # fmt: skip
    with torch.no_grad():
        for (_, p), (_, q) in zip(fused.named_parameters(), stock.named_parameters(), strict=True):
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1, generator=gen)
            q.copy_(p)
        for model in (fused, stock):
            for sub in model.modules():  # as vLLM's loader finishes every layer
                if (method := getattr(sub, "quant_method", None)) is not None and hasattr(
                    method, "process_weights_after_loading"
                ):
                    method.process_weights_after_loading(sub)
    runner = runners[0]
    mlp = next(m for m in fused.modules() if getattr(m, "experts", None) is runner)
    stock_mlp = dict(stock.named_modules())[next(n for n, m in fused.named_modules() if m is mlp)]
    x = torch.randn(24, mlp.gate.input_size, generator=gen).bfloat16()
    seen = {}
    for label, block, config in (("fused", mlp, cfg), ("stock", stock_mlp, stock_cfg)):
        router = block.experts.router
        original = router.select_experts

        def record(*a, _orig=original, _label=label, **kw):
            out = _orig(*a, **kw)
            seen[_label] = out
            return out

        router.select_experts = record
        # the MoE op finds its layer by name in the config's forward context: each model's own
        with set_current_vllm_config(config), set_forward_context(None, config, num_tokens=x.shape[0]):
            seen[label + " out"] = block(x)
    (w_f, ids_f), (w_s, ids_s) = seen["fused"], seen["stock"]
    assert torch.equal(ids_f.long().sort(1).values, ids_s.long().sort(1).values)
    assert torch.allclose(w_f.sort(1).values, w_s.sort(1).values, atol=1e-6)
    assert torch.allclose(seen["fused out"].float(), seen["stock out"].float(), rtol=2e-2, atol=2e-3)


def test_on_stops_the_start_up_where_a_layer_cannot_take_it_and_auto_keeps_vllms_router(vllm_dist, gen):
    """A runner whose router no Routing replays: ``on`` raises one line naming the layer and why,
    ``auto`` on a GPU that would take it keeps vLLM's router and reports why."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    import vllm_router_ext.layers.router as fused_router
    from vllm_router_ext.layers.gate import GateSettingsError, RouterGateLinear, router_settings_scope
    from vllm_router_ext.precision import RouterPrecision, RouterSettings

    def runner(settings):
        with router_settings_scope(settings):
            module = torch.nn.Module()
            module.gate = RouterGateLinear(16, N, prefix="model.layers.1.mlp.gate")
        module.router = CPURouter(8, N, custom_routing_function=lambda **_: None)
        module.routed_experts = SimpleNamespace()
        return module

    on = RouterSettings(RouterPrecision.FP32, "test", fused="on", fused_source="--router-fused", model="M")
    with pytest.raises(GateSettingsError, match=r"^vllm-router-ext: the fused router \(from --router-fused\) "
                       r"cannot route M's model.layers.1.mlp.gate: vLLM's CPURouter with a custom routing "
                       r"function; use --router-fused auto or off$"):  # fmt: skip
        fused_router.install_fused_routers(runner(on), on, torch.device("cpu"))
    auto = RouterSettings(RouterPrecision.FP32, "test", model="M")
    module = runner(auto)
    original = fused_router.fused_by_default
    fused_router.fused_by_default = lambda device, router: True
    try:
        report = fused_router.install_fused_routers(module, auto, torch.device("cpu"))
    finally:
        fused_router.fused_by_default = original
    assert report.fused == 0 and type(module.router) is CPURouter and type(module.gate) is RouterGateLinear
    assert report.describe() == (
        "vLLM's router on our logits in 1 layer(s): vLLM's CPURouter with a custom routing function"
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"router_fused": "yes"}, "invalid router fused value 'yes' from additional_config['router_fused']; "
                                  "allowed: auto, on, off"),
        ({"router_fused_cli": "sometimes"}, "invalid router fused value 'sometimes' from --router-fused; "
                                            "allowed: auto, on, off"),
    ],
)  # fmt: skip
def test_a_bad_fused_value_is_named_with_the_allowed_ones(extra, message):
    from vllm_router_ext.precision import CLI_FUSED_KEY, FUSED_KEY, resolve_fused

    with pytest.raises(ValueError) as e:
        resolve_fused(cli=extra.get(CLI_FUSED_KEY), additional_config=extra.get(FUSED_KEY))
    assert str(e.value) == message
    assert resolve_fused(cli="off", additional_config="on") == ("off", "--router-fused")
    assert resolve_fused(additional_config=True) == ("on", "additional_config['router_fused']")
    assert resolve_fused() == ("auto", "default")


def test_auto_routes_by_the_fused_router_only_where_it_was_measured_faster(vllm_dist, monkeypatch, gen):
    """``auto``: Hopper and later, and only vLLM's ungrouped sigmoid + bias router (Kimi-K2's), the
    one routing the fused router beat at every token count; never on CPU or older GPUs."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    from vllm_router_ext.layers.router import fused_by_default

    bias = torch.randn(N, generator=gen)
    k2 = FusedTopKBiasRouter(8, N, bias, True, 2.827, scoring_func="sigmoid")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fused_by_default(cuda, k2)
    assert not fused_by_default(cuda, GroupedTopKRouter(8, N, 8, 4, True, "sigmoid", 2.5, bias))
    assert not fused_by_default(cuda, FusedTopKRouter(8, N, "softmax", True))
    assert not fused_by_default(cuda, FusedTopKBiasRouter(6, N, bias, True, 1.5, scoring_func="sqrtsoftplus"))
    assert not fused_by_default(torch.device("cpu"), k2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not fused_by_default(cuda, k2)
