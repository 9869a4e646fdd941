"""Every architecture the override claims, at construction level (no engine; vLLM 0.32 and 0.33):
a tiny checkpoint with the real release's routing, vLLM's own config parsing, the registry's
override class, the release's MoE block built the way the override builds it, and the gate
loaded from the checkpoint. End-to-end generation is in test_vllm_offline.py for the releases
CPU vLLM can run (DeepSeek-V3.2 and GLM-5 cannot: "Sparse Attention is not supported on CPU")."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from vllm_router_ext.testing.tiny_checkpoint import ROUTING_PRESETS, build_tiny_model, cpu_runs_fp8

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
    from vllm_router_ext.ops.reference import reference_logits, relative_error
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
    from vllm_router_ext.ops.reference import reference_logits, relative_error
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


@pytest.mark.parametrize("mode", ["auto", "fp32"])
@pytest.mark.parametrize(
    "family",
    ["qwen3-moe", "mixtral", "gpt-oss", "llama4", "glm4-moe", "minimax-m2", "ernie4.5-moe", "qwen3-next"],
)
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
    from vllm_router_ext.ops.reference import relative_error
    from vllm_router_ext.testing.tiny_checkpoint import FAMILY_PRESETS, build_tiny_family

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
