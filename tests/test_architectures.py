"""Every architecture the override claims, at construction level (no engine; vLLM 0.32 and 0.33):
a tiny checkpoint with the real release's routing, vLLM's own config parsing, the registry's
override class, the release's MoE block built the way the override builds it, and the gate
loaded from the checkpoint. End-to-end generation is in test_vllm_offline.py for the releases
CPU vLLM can run (DeepSeek-V3.2 and GLM-5 cannot: "Sparse Attention is not supported on CPU")."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from vllm_router_ext.tools.tiny_checkpoint import ROUTING_PRESETS, build_tiny_model, cpu_runs_fp8

_LAYER = itertools.count(1)  # vLLM refuses two layers of one name in a process


@pytest.fixture(autouse=True)
def _process_environment_restored():
    """Building a model's VllmConfig on vLLM's CPU platform sets process-wide variables
    (LD_PRELOAD, TORCHINDUCTOR_*, ...); later tests' vLLM subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _vllm_config(path: Path, parallel_config):
    from vllm.config import ModelConfig
    from vllm_configs import engine_free_config

    model_config = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)
    return engine_free_config(model_config=model_config, parallel_config=parallel_config)


def _moe_block(cfg, *, drop_shared_experts: bool = False):
    """The release's MoE block, built as the override builds it (inside the resolved settings)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import router_settings_scope
    from vllm_router_ext.precision import resolve_router_settings

    hf = cfg.model_config.hf_config
    if drop_shared_experts:
        object.__setattr__(hf, "n_shared_experts", None)  # past the config's own validation
    settings = resolve_router_settings(cfg)
    prefix = f"model.layers.{next(_LAYER)}.mlp"
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        with router_settings_scope(settings):
            block = DeepseekV2MoE(hf, cfg.parallel_config, quant_config=cfg.quant_config, prefix=prefix)
    return block, settings


def _checkpoint_tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("model", list(ROUTING_PRESETS))
def test_each_release_builds_our_gate_with_its_routing(vllm_dist, tmp_path, gen, model):
    from vllm import ModelRegistry

    from vllm_router_ext.layers.gate import RouterGateLinear
    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error
    from vllm_router_ext.precision import RouterPrecision

    preset = ROUTING_PRESETS[model]
    path = build_tiny_model(tmp_path / model, model)
    cfg = _vllm_config(path, vllm_dist.parallel_config)
    hf = cfg.model_config.hf_config
    arch = preset["architectures"][0]
    assert hf.architectures == [arch]
    for key in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "topk_method"):
        assert getattr(hf, key) == preset[key], key  # vLLM parsed the release's routing
    entry = ModelRegistry.models[arch]
    from vllm_router_ext.models.override import RouterPrecisionMixin

    assert entry.load_model_cls().__mro__[1] is RouterPrecisionMixin

    block, settings = _moe_block(cfg)
    assert settings.precision is RouterPrecision.FP32 and settings.source == f"auto: architecture {arch}"
    gate = block.gate
    assert type(gate) is RouterGateLinear and gate.router_precision is RouterPrecision.FP32
    assert gate.out_dtype == torch.float32 and tuple(gate.weight.shape) == (preset["n_routed_experts"], 256)
    noaux = preset["topk_method"] == "noaux_tc"
    assert (getattr(gate, "e_score_correction_bias", None) is not None) == noaux
    if noaux:
        assert gate.e_score_correction_bias.dtype == torch.float32
    w = _checkpoint_tensor(path, "model.layers.1.mlp.gate.weight")
    gate.weight_loader(gate.weight, w)
    assert gate.weight.dtype == torch.bfloat16 and torch.equal(gate.weight, w)
    x = torch.randn(7, 256, generator=gen).to(torch.bfloat16)
    out, _ = gate(x)
    assert out.dtype == torch.float32 and relative_error(out, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_an_fp8_checkpoint_keeps_our_gate_unquantized(vllm_dist, tmp_path, gen, model):
    """DeepSeek-V3's FP8 layout (e4m3 projections with 128 x 128 ``weight_scale_inv`` blocks, a bf16
    gate): vLLM reads the checkpoint's quantization_config, the experts are FP8, the gate is ours,
    unquantized, at the resolved precision, and takes the checkpoint's bf16 gate weight. Without
    AMX, vLLM's CPU build has no FP8 linear kernel, so the block is built without its shared
    experts (FP8 linear layers); the routed experts and the gate are built either way."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from vllm_router_ext.layers.gate import RouterGateLinear
    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error
    from vllm_router_ext.precision import RouterPrecision

    path = build_tiny_model(tmp_path / model, model, fp8=True)
    proj = _checkpoint_tensor(path, "model.layers.1.mlp.experts.0.up_proj.weight")
    scale = _checkpoint_tensor(path, "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv")
    assert proj.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (1, 2)
    cfg = _vllm_config(path, vllm_dist.parallel_config)
    assert isinstance(cfg.quant_config, Fp8Config) and cfg.quant_config.weight_block_size == [128, 128]

    block, settings = _moe_block(cfg, drop_shared_experts=not cpu_runs_fp8())
    methods = {type(m.quant_method).__name__ for m in block.modules() if hasattr(m, "quant_method")}
    assert any("Fp8" in name and "MoE" in name for name in methods), methods  # the routed experts
    gate = block.gate
    assert type(gate) is RouterGateLinear and gate.router_precision is RouterPrecision.FP32
    assert isinstance(gate.quant_method, UnquantizedLinearMethod) and gate.is_unquantized
    w = _checkpoint_tensor(path, "model.layers.1.mlp.gate.weight")
    assert w.dtype == torch.bfloat16
    gate.weight_loader(gate.weight, w)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    out, _ = gate(x)
    assert out.dtype == torch.float32 and relative_error(out, reference_logits(x, w)) <= 1e-6


def test_the_audit_reads_only_the_gates_of_an_fp8_checkpoint(tmp_path):
    from vllm_router_ext.audit import open_checkpoint, run_audit

    path = build_tiny_model(tmp_path / "kimi-k2-fp8", "kimi-k2", fp8=True)
    assert any(name.endswith("_scale_inv") for name in open_checkpoint(path).weight_map)
    result = run_audit(path, tokens=64, device="cpu", progress=False)
    assert list(result["layers"]) == ["1"]
    assert result["overall"]["fp32"]["rel_err"] <= 1e-6


#: Family presets whose whole model is built here (the family table's "construction" claims).
BUILT = ["qwen3-moe", "mixtral", "gpt-oss", "llama4", "glm4-moe", "minimax-m2", "ernie4.5-moe", "qwen3-next"]


@pytest.mark.parametrize("mode", ["auto", "fp32"])
@pytest.mark.parametrize("family", BUILT)
def test_each_family_model_builds_its_routers_at_the_setting(vllm_dist, tmp_path, gen, family, mode):
    """The whole model of each other family, built through the registry's override class as
    vLLM builds it (no engine): with ``router_precision`` set every router is ours at that mode,
    with ``auto`` ours where the family's reference routes in fp32 and vLLM's own elsewhere; each
    of ours takes the checkpoint's router weight (and bias) and returns fp32 logits within 1e-6
    of fp64. MiniMax-M2 runs here only: vLLM's CPU router refuses its sigmoid scoring."""
    from safetensors.torch import load_file
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_configs import engine_free_config

    from vllm_router_ext.families import family_of
    from vllm_router_ext.layers.gate import RouterGateLinear
    from vllm_router_ext.ops.routing_fp64 import relative_error
    from vllm_router_ext.tools.tiny_checkpoint import FAMILY_PRESETS, build_tiny_family

    path = build_tiny_family(tmp_path / family, family)
    arch = FAMILY_PRESETS[family]["architectures"][0]
    model_config = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)
    cfg = engine_free_config(
        model_config=model_config,
        parallel_config=vllm_dist.parallel_config,
        additional_config={"router_precision": mode},
    )
    cls = ModelRegistry.models[arch].load_model_cls()
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        model = cls(vllm_config=cfg, prefix="")
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    routers = {n[: -len(".weight")] for n in tensors if n.endswith((".gate.weight", ".router.weight"))}
    gates = {name: m for name, m in model.named_modules() if isinstance(m, GateLinear)}
    assert set(gates) == {r for r in routers if tensors[r + ".weight"].shape[0] > 1}, (set(gates), routers)
    ours = mode == "fp32" or family_of(arch).auto == "fp32"
    for name, gate in gates.items():
        settings = getattr(gate, "router_settings", None)
        if not ours:  # vLLM's own gate: stock, or ours (registered earlier in this process) idle
            assert settings is None and gate.out_dtype is None, name
            continue
        assert type(gate) is RouterGateLinear and settings.precision.value == "fp32", name
        assert gate.out_dtype == torch.float32
        w = tensors[name + ".weight"]
        gate.weight_loader(gate.weight, w)
        ref_bias = 0.0
        if gate.bias is not None:  # gpt-oss's router bias
            gate.weight_loader(gate.bias, tensors[name + ".bias"])
            ref_bias = tensors[name + ".bias"].double()
        x = torch.randn(6, w.shape[1], generator=gen).to(torch.bfloat16)
        out = gate(x)
        out = out[0] if isinstance(out, tuple) else out  # return_bias=False: the logits alone
        ref = x.double() @ w.double().T + ref_bias
        assert out.dtype == torch.float32 and relative_error(out, ref) <= 1e-6, name


#: DeepSeek-V4's architectures whose MoE block is built here (vLLM's ``vllm/models/deepseek_v4``).
V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)


@pytest.mark.parametrize("mode", ["auto", "bf16-fp32out"])
def test_deepseek_v4_builds_our_gate_and_routes_like_fp64(vllm_dist, tmp_path, gen, mode):
    """DeepSeek-V4's MoE block from vLLM's own package (this platform's implementation), built as
    the override builds it: ``auto`` is fp32 (DeepSeek's inference code), the gate is ours with
    fp32 logits and an fp32 correction bias; vLLM's own V4 router (sqrtsoftplus + bias, top-6,
    renormalised, x1.5) picks fp64's experts from our logits; a hash layer keeps vLLM's token-id
    table (its experts are the table's, our logits only weigh them); the whole block runs."""
    import importlib
    import sys

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _sqrtsoftplus_bias_topk
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import RouterGateLinear, router_settings_scope
    from vllm_router_ext.ops.routing_fp64 import (
        RoutingConfig,
        expert_scores,
        near_tie_mask,
        reference_logits,
        relative_error,
        select_experts,
    )
    from vllm_router_ext.precision import RouterPrecision, resolve_router_settings
    from vllm_router_ext.tools.tiny_checkpoint import TINY_V4, write_tiny_deepseek_v4_config

    hash_layer = next(_LAYER)  # a hash layer below num_hash_layers, a scored one above
    # transformers' own V4 config (newer vLLMs) caps the hash layers at the layer count
    path = write_tiny_deepseek_v4_config(
        tmp_path / "v4", num_hash_layers=hash_layer + 1, num_hidden_layers=hash_layer + 2
    )
    cfg = _vllm_config(path, vllm_dist.parallel_config)
    if mode != "auto":
        cfg.additional_config = {"router_precision": mode}
    settings = resolve_router_settings(cfg)
    expect = RouterPrecision.FP32 if mode == "auto" else RouterPrecision(mode)
    assert settings.precision is expect
    if mode == "auto":
        assert settings.source == "auto: architecture DeepseekV4ForCausalLM"
    implementation = importlib.import_module("vllm.models.deepseek_v4")
    module = sys.modules[implementation.DeepseekV4ForCausalLM.__module__]  # the platform's own
    blocks = {}
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        with router_settings_scope(settings):
            for kind, layer in (("hash", hash_layer), ("scored", 10_000 + hash_layer)):
                blocks[kind] = module.DeepseekV4MoE(cfg, prefix=f"model.layers.{layer}.ffn")
    routing = RoutingConfig.from_hf_config(dict(TINY_V4))
    assert routing.scoring_func == "sqrtsoftplus" and routing.uses_correction_bias and routing.renormalize
    n, k, top_k = TINY_V4["n_routed_experts"], TINY_V4["hidden_size"], TINY_V4["num_experts_per_tok"]
    m = 64
    for kind, block in blocks.items():
        gate = block.gate
        assert type(gate) is RouterGateLinear and gate.router_precision is expect, kind
        assert gate.out_dtype == torch.float32 and tuple(gate.weight.shape) == (n, k)
        assert (gate.tid2eid is not None) == (kind == "hash")
        assert (gate.e_score_correction_bias is not None) == (kind == "scored")
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
        gate.weight_loader(gate.weight, w)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, TINY_V4["vocab_size"], (m,), generator=gen)
        logits, _ = gate(x)
        ref = reference_logits(x, w)
        assert logits.dtype == torch.float32 and relative_error(logits, ref) <= 1e-6
        if not hasattr(torch.ops._C, "hash_topk_cpu"):
            continue  # a CUDA wheel imported on a CPU: no CPU router kernels (checked below)
        if kind == "scored":
            bias = torch.randn(n, generator=gen) * 0.1
            gate.e_score_correction_bias.data.copy_(bias)
            assert gate.e_score_correction_bias.dtype == torch.float32
            weights, got = _sqrtsoftplus_bias_topk(logits, top_k, True, gate.e_score_correction_bias, 1.5,
                                                   None, None)  # fmt: skip
            want_ids, want_w = select_experts(ref, routing, bias.double())
            clear = ~near_tie_mask(ref, routing, bias, margin=1e-5 * (ref.abs().max().item() + 1))
            assert clear.float().mean() >= 0.9
        else:
            table = gate.tid2eid.data.clone()
            weights, got = _sqrtsoftplus_bias_topk(logits, top_k, True, None, 1.5, ids, gate.tid2eid)
            assert torch.equal(gate.tid2eid.data, table)  # the table is vLLM's, untouched
            want_ids = table[ids].long().sort(dim=-1).values
            scores = expert_scores(ref, "sqrtsoftplus").gather(1, want_ids)
            want_w = scores / scores.sum(-1, keepdim=True) * 1.5
            clear = torch.ones(m, dtype=torch.bool)
        order = got.long().argsort(dim=-1)
        got_ids, got_w = got.long().gather(1, order), weights.double().gather(1, order)
        assert torch.equal(got_ids[clear], want_ids[clear]), kind
        assert torch.allclose(got_w[clear], want_w[clear], rtol=1e-4, atol=1e-6), kind
        with torch.no_grad():
            for name, p in block.named_parameters():
                if p.dtype.is_floating_point and "gate" not in name.split(".")[0]:
                    p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
            for sub in block.modules():  # as vLLM's loader finishes every layer
                if (method := getattr(sub, "quant_method", None)) is not None:
                    method.process_weights_after_loading(sub)
            calls: list[int] = []
            hook = gate.register_forward_hook(lambda *_, seen=calls: seen.append(1))
            with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=m):
                out = block(x, ids)
            hook.remove()
        assert out.shape == x.shape and torch.isfinite(out.float()).all(), kind
        assert calls, f"the {kind} block routed without calling our gate"
    if not hasattr(torch.ops._C, "hash_topk_cpu"):
        pytest.skip("vLLM's V4 router runs here on its CPU kernels, which this vLLM build lacks (built and "
                    "checked the gates; routing is checked on the CPU build)")  # fmt: skip


def test_deepseek_v41_routes_every_layer_by_our_gate_like_fp64(vllm_dist, tmp_path, gen):
    """DeepSeek-V4.1 (vLLM's ``vllm/models/deepseek_v41``, a multimodal config that nests the text
    model) builds V4's MoE block with no hash layers whatever its config says: layer 0 too holds
    our fp32 gate with its correction bias, no token-id table; the audit's routing of the config says
    the same, and vLLM's V4 router picks fp64's experts from our logits."""
    import importlib
    import sys

    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import RouterGateLinear, router_settings_scope
    from vllm_router_ext.ops.routing_fp64 import (
        RoutingConfig,
        near_tie_mask,
        reference_logits,
        relative_error,
        select_experts,
    )
    from vllm_router_ext.precision import RouterPrecision, resolve_router_settings
    from vllm_router_ext.tools.tiny_checkpoint import TINY_V4, write_tiny_deepseek_v4_config

    layer = next(_LAYER)  # below the config's num_hash_layers: a hash layer in DeepSeek-V4
    text = {k: v for k, v in TINY_V4.items() if k not in ("model_type", "architectures")}
    text.update(num_hash_layers=layer + 1, num_hidden_layers=layer + 2)
    path = write_tiny_deepseek_v4_config(
        tmp_path / "v41",
        model_type="deepseek_v41",
        architectures=["DeepseekV41ForCausalLM"],
        text_config=text,
    )
    routing = RoutingConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert routing.hash_layers == 0 and routing == RoutingConfig.from_hf_config(
        {**TINY_V4, "num_hash_layers": 0}
    )
    cfg = _vllm_config(path, vllm_dist.parallel_config)
    settings = resolve_router_settings(cfg)
    assert settings.precision is RouterPrecision.FP32
    assert settings.source == "auto: architecture DeepseekV41ForCausalLM"
    entry = importlib.import_module("vllm.models.deepseek_v41")
    package = sys.modules[entry.DeepseekV41ForCausalLM.__module__].__name__.rsplit(".", 1)[0]
    module = importlib.import_module(f"{package}.model")  # the platform's own V4.1 model
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        with router_settings_scope(settings):
            block = module.DeepseekV4MoE(cfg, prefix=f"model.layers.{layer}.ffn")
    gate = block.gate
    n, k, top_k = TINY_V4["n_routed_experts"], TINY_V4["hidden_size"], TINY_V4["num_experts_per_tok"]
    assert type(gate) is RouterGateLinear and gate.router_precision is RouterPrecision.FP32
    assert gate.tid2eid is None and gate.e_score_correction_bias is not None
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16)
    logits, _ = gate(x)
    ref = reference_logits(x, w)
    assert logits.dtype == torch.float32 and relative_error(logits, ref) <= 1e-6
    if not hasattr(torch.ops._C, "hash_topk_cpu"):
        pytest.skip("vLLM's V4 router runs here on its CPU kernels, which this vLLM build lacks (the gate "
                    "was built and checked; routing is checked on the CPU build)")  # fmt: skip
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _sqrtsoftplus_bias_topk

    bias = torch.randn(n, generator=gen) * 0.1
    gate.e_score_correction_bias.data.copy_(bias)
    weights, got = _sqrtsoftplus_bias_topk(logits, top_k, True, gate.e_score_correction_bias, 1.5, None, None)
    want_ids, want_w = select_experts(ref, routing, bias.double())
    clear = ~near_tie_mask(ref, routing, bias, margin=1e-5 * (ref.abs().max().item() + 1))
    assert clear.float().mean() >= 0.9
    order = got.long().argsort(dim=-1)
    assert torch.equal(got.long().gather(1, order)[clear], want_ids[clear])
    assert torch.allclose(weights.double().gather(1, order)[clear], want_w[clear], rtol=1e-4, atol=1e-6)


def test_the_served_v41_checkpoint_is_laid_out_as_vllm_reads_it(tmp_path):
    """The tiny V4.1 the GPU suite serves parses in vLLM as V4.1's config: the text model flattened
    from ``text_config`` with every field V4's model reads, its rope built, each layer's compression
    from ``compress_ratios`` one V4.1's attention takes (0, 1, 2; V4's 4 and 128 stop its engine at
    start) with the source layers it shares them from, bf16 experts; a flat V4 config under V4.1's
    type has no rope (vLLM fails building the attention)."""
    try:
        from vllm.models.deepseek_v41.common.rope import build_deepseek_v4_rope
    except ImportError:
        pytest.skip("this vLLM has no DeepSeek-V4.1 package (vllm/models/deepseek_v41)")
    from vllm.config import set_current_vllm_config
    from vllm.transformers_utils.config import get_config
    from vllm_configs import engine_free_config

    from vllm_router_ext.tools.tiny_checkpoint import (
        GPU_V4_SIZES,
        TINY_V4,
        V41_ARCHITECTURE,
        V41_IMAGE_TOKEN,
        V41_SERVE_ARGS,
        build_tiny_deepseek_v4,
        write_tiny_deepseek_v4_config,
    )

    path = build_tiny_deepseek_v4(tmp_path / "v41", v41=True, expert_dtype="bf16")
    cfg = get_config(str(path), trust_remote_code=False)
    assert type(cfg).__name__ == "DeepseekV41Config" and cfg.architectures == ["DeepseekV41ForCausalLM"]
    sizes = {**TINY_V4, **GPU_V4_SIZES}
    for key in ("hidden_size", "n_routed_experts", "num_hidden_layers", "head_dim", "index_topk", "hc_mult"):
        assert getattr(cfg, key) == sizes[key], key
    assert cfg.expert_dtype == "bf16" and cfg.num_nextn_predict_layers == 0
    ratios = cfg.compress_ratios
    assert len(ratios) == sizes["num_hidden_layers"] and set(ratios) == {0, 1, 2}
    # The topology as V4.1's attention reads it: a compressed layer reads the compressed KV of
    # the nearest KV source at or below it (a run of its own ratio) and the indexer of the
    # nearest index source; the model replays from the last KV source (``max`` of the list).
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    assert kv and set(kv) <= set(index) and all(ratios[s] > 0 for s in (*kv, *index))
    for layer, ratio in enumerate(ratios):
        if ratio:
            source = max(s for s in kv if s <= layer)
            assert ratios[source] == ratio and any(s <= layer for s in index), layer
    with set_current_vllm_config(engine_free_config()):
        for ratio in sorted(set(ratios)):
            rope = build_deepseek_v4_rope(
                cfg, head_dim=sizes["head_dim"], rope_head_dim=sizes["qk_rope_head_dim"],
                max_position_embeddings=sizes["max_position_embeddings"], compress_ratio=ratio,
            )  # fmt: skip
            assert isinstance(rope, torch.nn.Module)
    flat = write_tiny_deepseek_v4_config(tmp_path / "flat", **GPU_V4_SIZES, **V41_ARCHITECTURE)
    assert not hasattr(get_config(str(flat), trust_remote_code=False), "rope_parameters")
    # V4.1's tokenizer holds its image placeholder at the release's id (vLLM refuses one without)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    image, image_id = V41_IMAGE_TOKEN
    assert tokenizer.convert_tokens_to_ids(image) == image_id < cfg.vocab_size
    ids = tokenizer(f"def f(x):{image} return x")["input_ids"]
    assert ids.count(image_id) == 1 and max(i for i in ids if i != image_id) < TINY_V4["vocab_size"]
    # Served as the GPU suite serves it (V41_SERVE_ARGS): text only, so vLLM profiles no image
    # encoder, which the checkpoint has no layers for; without those arguments it would.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def image_limit(*args: str) -> int:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        argv = ["--model", str(path), "--load-format", "dummy", "--max-model-len", "512", *args]
        ns = parser.parse_args(argv)
        model_config = EngineArgs.from_cli_args(ns).create_model_config()
        return model_config.multimodal_config.get_limit_per_prompt("image")

    assert json.loads((path / "config.json").read_text())["vision_config"]["num_hidden_layers"] == 0
    assert image_limit(*V41_SERVE_ARGS) == 0 and image_limit() > 0
    try:
        from vllm.models.deepseek_v41.common.mm_preprocess import validate_image_sentinel_ids
    except ImportError:  # a vLLM without V4.1's image path
        return
    validate_image_sentinel_ids(tokenizer)


def test_a_routing_path_that_skips_the_gate_is_refused_when_asked_and_keeps_vllms_gate_on_auto(
    vllm_dist, tmp_path
):
    """DeepSeek-V4 with DeepGEMM's MegaMoE (``moe_backend=deep_gemm_mega_moe``) routes batches above
    16 tokens inside DeepGEMM without calling the gate: a precision the user set is refused in one
    line naming the path and the way out; ``auto`` keeps vLLM's gate and says why. A built block
    that says a bypass is on (V4's MegaMoE, Flint's kernels) while holding our gate is refused."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import GateSettingsError, router_settings_scope
    from vllm_router_ext.models.override import _refuse_bypassed_gates, _unless_bypassed
    from vllm_router_ext.precision import RouterPrecision, resolve_router_settings
    from vllm_router_ext.tools.tiny_checkpoint import write_tiny_deepseek_v4_config

    arch = "DeepseekV4ForCausalLM"
    mega = SimpleNamespace(
        kernel_config=SimpleNamespace(moe_backend="deep_gemm_mega_moe"), additional_config={}
    )
    hf = SimpleNamespace(architectures=[arch])
    auto = resolve_router_settings(
        SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), additional_config={})
    )
    kept = _unless_bypassed(auto, mega, arch)
    assert kept.precision is None and kept.source == (
        "auto: DeepSeek-V4 (DeepseekV4ForCausalLM) keeps vLLM's gate with mega moe on"
    )
    asked = resolve_router_settings(
        SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf), additional_config={"router_precision": "fp32"}
        )
    )
    with pytest.raises(GateSettingsError) as e:
        _unless_bypassed(asked, mega, arch)
    text = str(e.value)
    assert "\n" not in text and "router precision fp32 (from additional_config['router_precision'])" in text
    assert (
        "moe_backend=deep_gemm_mega_moe" in text
        and "bf16_mega_gate" in text
        and "auto keeps vLLM's gate" in text
    )
    plain = SimpleNamespace(kernel_config=SimpleNamespace(moe_backend="auto"), additional_config={})
    assert _unless_bypassed(asked, plain, arch) is asked
    assert _unless_bypassed(asked, mega, "DeepseekV3ForCausalLM") is asked  # V3 has no MegaMoE path

    path = write_tiny_deepseek_v4_config(tmp_path / "v4", num_hash_layers=0)
    cfg = _vllm_config(path, vllm_dist.parallel_config)
    settings = resolve_router_settings(cfg)
    assert settings.precision is RouterPrecision.FP32
    implementation = __import__("vllm.models.deepseek_v4", fromlist=["DeepseekV4ForCausalLM"])
    module = __import__(implementation.DeepseekV4ForCausalLM.__module__, fromlist=["DeepseekV4MoE"])
    with (
        set_current_vllm_config(cfg),
        set_default_torch_dtype(torch.bfloat16),
        router_settings_scope(settings),
    ):
        block = module.DeepseekV4MoE(cfg, prefix=f"model.layers.{20_000 + next(_LAYER)}.ffn")
    model = torch.nn.ModuleDict({"ffn": block})
    _refuse_bypassed_gates(model, settings, arch)  # nothing on: fine
    block.use_native_mega_moe = True
    with pytest.raises(GateSettingsError, match="DeepGEMM's MegaMoE"):
        _refuse_bypassed_gates(model, settings, arch)
