"""Plugin wiring inside real vLLM (CPU build), in-process, no engine."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from cli_log import cli_warnings

from vllm_router_ext.precision import CLI_BATCH_INVARIANT_KEY, CLI_CONFIG_KEY, RouterPrecision, RouterSettings
from vllm_router_ext.tools.tiny_checkpoint import vllm_has_cpu_op

PREFIX = "model.layers.3.mlp.gate"


def _gate(input_size=64, output_size=8, prefix=PREFIX):
    """Build a GateLinear the way a bf16 model does (vLLM sets the default dtype while building)."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(torch.bfloat16):
        return GateLinear(input_size, output_size, prefix=prefix)


def test_entry_point_is_discovered_by_vllm():
    eps = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("router_ext") == "vllm_router_ext:register"
    from vllm.plugins import load_plugins_by_group

    import vllm_router_ext

    assert load_plugins_by_group("vllm.general_plugins")["router_ext"] is vllm_router_ext.register
    assert vllm_router_ext.ENTRY_POINT == "router_ext"  # the name every message tells users to list


def test_register_is_idempotent_and_wraps_every_registry_entry(vllm_dist):
    from vllm import ModelRegistry

    import vllm_router_ext
    from vllm_router_ext.models.override import OverriddenModel

    vllm_router_ext.register()
    vllm_router_ext.register()
    entries = ModelRegistry.models
    assert len(entries) > 300 and all(type(e) is OverriddenModel for e in entries.values())
    assert not any(isinstance(e.entry, OverriddenModel) for e in entries.values())  # wrapped once


@pytest.mark.parametrize(
    "arch,module,name",
    [
        ("DeepseekV3ForCausalLM", "vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
        ("DeepSeekMTPModel", "vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"),  # a draft
        ("Qwen3MoeForCausalLM", "vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM"),
        ("GptOssForCausalLM", "vllm.model_executor.models.gpt_oss", "GptOssForCausalLM"),
        ("LlamaForCausalLM", "vllm.model_executor.models.llama", "LlamaForCausalLM"),  # no router
    ],
)
def test_the_registry_loads_vllms_own_class_with_the_mixin_in_front(vllm_dist, arch, module, name):
    import importlib

    from vllm import ModelRegistry

    from vllm_router_ext.models.override import RouterPrecisionMixin

    entry = ModelRegistry.models[arch]
    assert (entry.entry.module_name, entry.entry.class_name) == (module, name)
    in_tree = getattr(importlib.import_module(module), name)
    cls = entry.load_model_cls()
    assert issubclass(cls, in_tree) and cls.__mro__[1] is RouterPrecisionMixin and cls.__name__ == name
    assert entry.load_model_cls() is cls
    info = [json.dumps(dataclasses.asdict(e.inspect_model_cls())) for e in (entry, entry.entry)]
    assert info[0] == info[1]  # vLLM's own model info (either may come from its json cache)


#: Models in vLLM's router-building modules and packages that build no router themselves (dense
#: variants beside the MoE ones).
DENSE_IN_ROUTER_FILES = {
    "GteModel", "GteNewModel", "GteNewForSequenceClassification", "PanguEmbeddedForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MTP",
}  # fmt: skip


def gate_architectures() -> dict[str, str]:
    """Every registry architecture of the installed vLLM that may build a ``GateLinear``, with
    where: a ``model_executor/models`` module that builds one; a ``vllm/models/<name>`` package
    (any vendor) that builds one or imports a module that does; a Transformers-backend MoE class."""
    from pathlib import Path

    import vllm
    from vllm.model_executor.models.registry import _VLLM_MODELS

    root = Path(vllm.__file__).parent
    builds = re.compile(r"\bGateLinear\(")
    imports = re.compile(r"from vllm\.model_executor\.models\.(\w+) import")
    in_tree = (root / "model_executor" / "models").glob("*.py")
    modules = {p.stem for p in in_tree if builds.search(p.read_text("utf-8"))}
    packages: dict[str, bool] = {}
    for package in (root / "models").iterdir() if (root / "models").is_dir() else ():
        texts = [f.read_text("utf-8") for f in package.rglob("*.py")]
        packages[package.name] = any(builds.search(t) or set(imports.findall(t)) & modules for t in texts)
    found = {}
    for arch, (module, cls) in _VLLM_MODELS.items():
        if module == "transformers":
            if "MoE" in cls:
                found[arch] = f"Transformers backend {cls}"
        elif module.startswith("vllm.models."):
            if packages.get(module.split(".")[2]):
                found[arch] = module
        elif module in modules:
            found[arch] = f"vllm.model_executor.models.{module}"
    return found


def test_every_model_vllm_builds_with_a_gate_linear_is_covered(vllm_dist):
    """Every architecture of the installed vLLM that builds a ``GateLinear`` (its in-tree modules,
    its ``vllm/models`` packages, its Transformers MoE backend) has a family (its ``auto``, its
    name on the precision line), and the registry loads vLLM's own class with the settings mixin
    in front: the flag reaches its routers."""
    from vllm import ModelRegistry

    from vllm_router_ext.families import family_of
    from vllm_router_ext.models.override import RouterPrecisionMixin

    found = gate_architectures()
    assert len(found) >= 80 and any(m.startswith("vllm.models.") for m in found.values())
    missing = {a: m for a, m in found.items() if a not in DENSE_IN_ROUTER_FILES and family_of(a) is None}
    assert not missing, f"{len(missing)} gate architecture(s) without a family: {missing}"
    loaded = 0
    for arch in sorted(found):
        try:
            cls = ModelRegistry.models[arch].load_model_cls()
        except ModuleNotFoundError as e:  # the CPU build's environment has no torchvision (vision models)
            assert e.name == "torchvision", (arch, e)
            continue
        except (ImportError, RuntimeError) as e:  # a vendor package that needs its GPU libraries
            assert found[arch].startswith("vllm.models."), (arch, e)
            continue
        assert cls.__mro__[1] is RouterPrecisionMixin, arch
        loaded += 1
    assert loaded >= 0.75 * len(found), (loaded, len(found))


#: A ``GateLinear(...)`` whose logits are fp32 whatever the config says: an fp32 ``out_dtype``, an fp32
#: weight, or fp32 compute forced.
_FP32_GATE = re.compile(
    r"out_dtype\s*=\s*torch\.float32|params_dtype\s*=\s*torch\.float32|force_fp32_compute\s*=\s*True"
)


def _gate_calls(text: str) -> list[str]:
    calls = []
    for m in re.finditer(r"\bGateLinear\(", text):
        end, depth = m.end(), 1
        while depth and end < len(text):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        calls.append(text[m.start() : end])
    return calls


def _sources_of(where: str) -> list[str]:
    """The source that builds an architecture's gates (:func:`gate_architectures`' ``where``): its
    module, its package, or, for a package that builds none itself, the packages and modules it
    imports its MoE block from."""
    from pathlib import Path

    import vllm

    root = Path(vllm.__file__).parent
    if where.startswith("vllm.model_executor.models."):
        return [(root / "model_executor" / "models" / f"{where.split('.')[-1]}.py").read_text("utf-8")]
    if not where.startswith("vllm.models."):
        return []  # the Transformers backend: the model's own modeling file, at the dtype it traces
    texts = [f.read_text("utf-8") for f in (root / "models" / where.split(".")[2]).rglob("*.py")]
    if any(_gate_calls(t) for t in texts):
        return texts
    packages = {p for t in texts for p in re.findall(r"from vllm\.models\.(\w+)", t)}
    modules = {m for t in texts for m in re.findall(r"from vllm\.model_executor\.models\.(\w+) import", t)}
    files = [f for p in packages for f in (root / "models" / p).rglob("*.py")]
    files += [f for m in modules if (f := root / "model_executor" / "models" / f"{m}.py").exists()]
    return [f.read_text("utf-8") for f in files]


def _gate_calls_of(where: str) -> list[str]:
    return [c for t in _sources_of(where) for c in _gate_calls(t)]


#: A forward that rounds the gate's logits to the model dtype before the routing reads them.
_ROUNDS_LOGITS = re.compile(r"router_logits\s*=\s*router_logits\.to\(hidden_states\.dtype\)")


def test_the_architectures_whose_logits_vllm_rounds_before_routing_are_marked(vllm_dist):
    """A family's ``rounds_logits`` are exactly its architectures whose vLLM source rounds the
    gate's logits to the model dtype before routing; a family all of whose architectures do keeps
    vLLM's gate under ``auto``."""
    from vllm_router_ext.families import FAMILIES, family_of

    rounded: dict[str, dict[str, bool]] = {}
    for arch, where in gate_architectures().items():
        if arch not in DENSE_IN_ROUTER_FILES:
            rounds = any(_ROUNDS_LOGITS.search(t) for t in _sources_of(where))
            rounded.setdefault(family_of(arch).name, {})[arch] = rounds
    assert any(any(by_arch.values()) for by_arch in rounded.values())
    for family in FAMILIES:
        by_arch = rounded.get(family.name, {})
        assert {a for a, r in by_arch.items() if r} == set(family.rounds_logits) & set(by_arch), family.name
        if family.rounds_logits and set(family.rounds_logits) == set(family.architectures):
            assert family.auto is None, family.name


def test_a_gate_built_for_fp32_logits_refuses_bf16_with_one_line(vllm_dist):
    """A model that builds its gate with fp32 logits (or an fp32 weight) routes on them: ``bf16``
    stops the build, naming the gate, the source and the allowed values; the other modes build."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import GateSettingsError, router_settings_scope

    def build(precision: RouterPrecision, **kw):
        settings = RouterSettings(precision, "VLLM_ROUTER_PRECISION", model="Some-MoE (SomeMoeForCausalLM)")
        with set_default_torch_dtype(torch.bfloat16), router_settings_scope(settings):
            return GateLinear(64, 8, prefix=PREFIX, **kw)

    for kw in ({"out_dtype": torch.float32}, {"params_dtype": torch.float32, "out_dtype": torch.float32}):
        with pytest.raises(GateSettingsError) as e:
            build(RouterPrecision.BF16, **kw)
        assert str(e.value) == (
            f"vllm-router-ext: Some-MoE (SomeMoeForCausalLM) routes on fp32 logits (its gate {PREFIX} asks "
            "for them), so router precision bf16 (from VLLM_ROUTER_PRECISION) cannot apply; allowed for this "
            "model: auto, fp32, bf16-fp32out"
        )
        for precision in (RouterPrecision.FP32, RouterPrecision.BF16_FP32OUT):
            assert build(precision, **kw).router_precision is precision
    assert build(RouterPrecision.BF16).router_precision is RouterPrecision.BF16  # a bf16-logit gate


def test_the_families_refused_bf16_before_the_engine_are_those_whose_vllm_gates_give_fp32(vllm_dist):
    """A family marked ``fp32_logits`` (``bf16`` refused where the engine starts) is one whose every
    gate architecture in the installed vLLM builds its ``GateLinear`` with fp32 logits whatever the
    config says, and every such family is marked."""
    from vllm_router_ext.families import FAMILIES, family_of

    fp32: dict[str, list[bool]] = {}
    for arch, where in gate_architectures().items():
        if arch not in DENSE_IN_ROUTER_FILES:
            calls = _gate_calls_of(where)
            fp32.setdefault(family_of(arch).name, []).append(
                bool(calls) and all(map(_FP32_GATE.search, calls))
            )
    marked = [f.name for f in FAMILIES if f.fp32_logits and f.name in fp32]
    assert len(marked) >= 12, marked
    for family in FAMILIES:
        if family.name in fp32:
            assert family.fp32_logits == all(fp32[family.name]), (family.name, fp32[family.name])


def test_gate_linear_is_ours_once_a_model_needs_it_and_a_second_replacement_is_named(vllm_dist):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_router_ext.layers.gate import GateSettingsError, RouterGateLinear, register_gate_linear

    register_gate_linear()
    register_gate_linear()
    assert op_registry_oot["GateLinear"] is RouterGateLinear
    assert type(_gate()) is RouterGateLinear

    class OtherPluginsGate(GateLinear):
        pass

    op_registry_oot["GateLinear"] = OtherPluginsGate  # a hardware plugin registered first
    try:
        with pytest.raises(GateSettingsError) as e:
            register_gate_linear("Qwen3-MoE (Qwen3MoeForCausalLM)")
    finally:
        op_registry_oot["GateLinear"] = RouterGateLinear
    text = str(e.value)
    assert "Qwen3-MoE (Qwen3MoeForCausalLM)" in text and "OtherPluginsGate" in text
    assert "VLLM_PLUGINS" in text and "auto" in text


def test_a_gate_linear_subclass_is_ours_too(vllm_dist, gen):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import (
        GateSettingsError,
        RouterGateMixin,
        register_gate_linear,
        router_settings_scope,
    )

    class FamilyGate(GateLinear):  # a model's own gate class, GateLinear's constructor
        LL_BF16_MAX_TOKENS = 32

    try:
        register_gate_linear("a model")
        settings = RouterSettings(RouterPrecision.FP32, "test")
        with set_default_torch_dtype(torch.bfloat16), router_settings_scope(settings):
            gate = FamilyGate(64, 8, prefix=PREFIX)
        assert isinstance(gate, FamilyGate) and isinstance(gate, RouterGateMixin)
        assert gate.router_precision is RouterPrecision.FP32 and gate.out_dtype == torch.float32
        w = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        gate.weight_loader(gate.weight, w)
        x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
        out, _ = gate(x)
        ref = x.double() @ w.double().T
        # fp32 sums of 64 exact products: error within 64 units of fp32 rounding of the terms' size
        size = x.double().abs() @ w.double().abs().T
        assert out.dtype == torch.float32 and bool(((out.double() - ref).abs() <= 64 * 2**-24 * size).all())
    finally:
        op_registry_oot.pop("FamilyGate", None)

    class OddGate(GateLinear):
        def __init__(self, hidden: int, experts: int) -> None:
            super().__init__(hidden, experts)

    try:
        with pytest.raises(GateSettingsError, match="OddGate, a GateLinear subclass with a constructor"):
            register_gate_linear("a model")
    finally:
        op_registry_oot["OddGate"] = OddGate  # it stays a subclass for this process: mark it seen


def test_gate_outside_the_override_is_stock_vllm(vllm_dist, gen):
    gate = _gate()
    assert gate.router_settings is None and gate.out_dtype is None
    assert not hasattr(gate, "router_gemm")
    w = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    assert torch.equal(gate.weight, w)
    # Settings that own nothing (auto on a family that keeps vLLM's gate) leave it stock; a
    # gate of any name (gpt-oss's `router`) is ours where they do.
    from vllm_router_ext.layers.gate import router_settings_scope

    with router_settings_scope(RouterSettings(None, "auto: a model-dtype family")):
        assert _gate().router_settings is None
    with router_settings_scope(RouterSettings(RouterPrecision.FP32, "test")):
        router = _gate(prefix="model.layers.0.mlp.router")
    assert router.router_precision is RouterPrecision.FP32


@pytest.mark.skipif(
    not vllm_has_cpu_op("convert_weight_packed"),
    reason="vLLM's CUDA wheel on a CPU has no CPU GEMM kernels: a stock gate runs on vLLM's CPU build",
)
def test_stock_gate_forward_is_vllms(vllm_dist, gen):
    gate = _gate()
    w = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    gate.quant_method.process_weights_after_loading(gate)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    out, _ = gate(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out", "bf16"])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_a_gate_bias_is_added_to_fp32_sums(vllm_dist, gen, mode, skip_bias_add):
    """gpt-oss's router has a bias: logits = x W^T + b, with one rounding in bf16 (as F.linear);
    with skip_bias_add the model adds it (K2-Horizon), and gets it back beside the logits."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import register_gate_linear, router_settings_scope

    register_gate_linear()
    settings = RouterSettings(RouterPrecision(mode), "t")
    with set_default_torch_dtype(torch.bfloat16), router_settings_scope(settings):
        gate = GateLinear(96, 12, bias=True, skip_bias_add=skip_bias_add, prefix="m.router")
    w = torch.randn(12, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(12, generator=gen).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    gate.weight_loader(gate.bias, b)
    x = torch.randn(6, 96, generator=gen).to(torch.bfloat16)
    out, bias = gate(x)
    ref = x.double() @ w.double().T + (0 if skip_bias_add else b.double())
    assert (bias is gate.bias) == skip_bias_add and (bias is None) != skip_bias_add
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    if mode == "bf16":
        assert ((out.double() - ref).abs() <= 2**-8 * ref.abs()).all()  # one bf16 rounding
    else:
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_gate_in_scope_turns_off_every_vllm_tier_a_later_one_too(vllm_dist, monkeypatch):
    """Every ``allow_*`` GEMM tier of the installed GateLinear is off in our gate, and so is one
    that a later vLLM release adds (emulated here), while a gate outside the scope keeps it."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_router_ext.layers.gate import router_settings_scope

    stock_init = GateLinear.__init__

    def init_with_a_new_tier(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self.allow_next_release_gemm = True

    monkeypatch.setattr(GateLinear, "__init__", init_with_a_new_tier)
    with router_settings_scope(RouterSettings(RouterPrecision.BF16_FP32OUT, "test")):
        gate = _gate()
    tiers = {name: value for name, value in vars(gate).items() if name.startswith("allow_")}
    assert "allow_next_release_gemm" in tiers and "allow_cublas_router_gemm" in tiers
    assert not any(tiers.values()), tiers
    assert _gate().allow_next_release_gemm  # stock vLLM outside the scope


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out", "bf16"])
def test_gate_in_scope_runs_the_mode(vllm_dist, gen, mode):
    from vllm_router_ext.layers.gate import RouterGemm, router_settings_scope
    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error

    with router_settings_scope(RouterSettings(RouterPrecision(mode), "test")):
        gate = _gate()
    assert isinstance(gate.router_gemm, RouterGemm)
    assert gate.out_dtype == (None if mode == "bf16" else torch.float32)
    w = (torch.randn(8, 64, generator=gen) / 8).to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    gate.quant_method.process_weights_after_loading(gate)
    assert gate.weight.dtype == torch.bfloat16 and torch.equal(gate.weight, w)  # not repacked away
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    out, bias = gate(x)
    assert bias is None
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    assert relative_error(out, reference_logits(x, w)) <= (8e-3 if mode == "bf16" else 1e-6)


@pytest.mark.parametrize(
    "precision,weight_kind,expect_dtype",
    [
        ("fp32", "fp32-inexact", torch.float32),  # an fp32 checkpoint gate bf16 cannot hold: kept
        ("fp32", "fp32-exact", torch.bfloat16),  # kept bf16: round trip exact
        ("fp32", "bf16", torch.bfloat16),
        ("bf16-fp32out", "fp32-inexact", torch.bfloat16),  # asked for: rounds (with a warning)
        ("bf16-fp32out", "fp32-exact", torch.bfloat16),
        ("bf16-fp32out", "bf16", torch.bfloat16),
    ],
)
def test_weight_storage_rules_at_load(vllm_dist, gen, precision, weight_kind, expect_dtype):
    from vllm_router_ext.layers.gate import router_settings_scope
    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error

    settings = RouterSettings(RouterPrecision(precision), "test")
    with router_settings_scope(settings):
        gate = _gate(128, 16)
    w = torch.randn(16, 128, generator=gen) / 11.3
    if weight_kind == "fp32-exact":
        w = w.to(torch.bfloat16).float()
    elif weight_kind == "bf16":
        w = w.to(torch.bfloat16)
    gate.weight_loader(gate.weight, w)
    gate.quant_method.process_weights_after_loading(gate)
    assert gate.router_precision.value == precision
    assert gate.weight.dtype == expect_dtype
    # an fp32 weight also gets its three bf16 terms (the CUDA dispatch's large-M GEMM); exact
    terms = gate.router_weight_terms
    assert (terms is not None) == (expect_dtype == torch.float32)
    if terms is not None:
        assert terms.dtype == torch.bfloat16 and terms.shape == (48, 128)
        assert torch.equal(terms.double().view(3, 16, 128).sum(0), gate.weight.double())
    x = torch.randn(9, 128, generator=gen).to(torch.bfloat16)
    out, _ = gate(x)
    ref_w = w if precision == "fp32" else w.to(torch.bfloat16)
    assert relative_error(out, reference_logits(x, ref_w)) <= 1e-6


def test_cli_flags_in_vllm_serve_parser(vllm_dist):
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # vLLM 0.33
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    action = next(a for a in parser._actions if a.dest == "router_precision")
    assert list(action.choices) == ["auto", "fp32", "bf16-fp32out", "bf16"] and action.help
    args = parser.parse_args(["--model", "m", "--router-precision", "fp32", "--router-batch-invariant"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config[CLI_CONFIG_KEY] == "fp32"
    assert engine_args.additional_config[CLI_BATCH_INVARIANT_KEY] is True
    # The flag merges with, and does not replace, a user's --additional-config.
    args = parser.parse_args(
        ["--model", "m", "--router-precision", "bf16", "--additional-config", '{"router_precision": "fp32"}']
    )
    extra = AsyncEngineArgs.from_cli_args(args).additional_config
    assert extra == {"router_precision": "fp32", CLI_CONFIG_KEY: "bf16"}
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--model", "m", "--router-precision", "nonsense"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "version,expect",
    [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True), ("0.34.0", True),
     ("0.34.1.dev4+g1234abc", True), ("0.31.2", False), ("0.35.0", False), ("1.0.0", False),
     ("nightly", False)],
)  # fmt: skip
def test_tested_vllm_releases(version, expect):
    from vllm_router_ext._plugin import tested

    assert tested(version) is expect


def test_this_vllm_has_every_hook_the_plugin_uses():
    from vllm_router_ext._plugin import missing_hooks

    assert missing_hooks() == []


def _vllm_process(tmp_path, setup: str, argv: list[str]) -> subprocess.CompletedProcess:
    """The ``vllm`` command (``argv``) in a fresh process, after ``setup`` ran in it."""
    code = (
        f"import sys\n{setup}\nsys.argv = {['vllm', *argv]!r}\n"
        "from vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def _plugin_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (p.stdout + p.stderr).splitlines() if "vllm-router-ext" in line]


_FAKE_VERSION = "import vllm, vllm.version\nvllm.__version__ = vllm.version.__version__ = '0.99.0'"


def test_an_untested_vllm_with_every_hook_loads_the_plugin_with_one_warning(tmp_path):
    p = _vllm_process(tmp_path, _FAKE_VERSION, ["serve", "--help=vllm-router-ext"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    lines = _plugin_lines(p)
    warning = [line for line in lines if "is not a release this plugin was tested with" in line]
    assert len(warning) == 1 and "vLLM 0.99.0" in warning[0] and "0.32.x, 0.33.x and 0.34.x" in warning[0]
    assert "--router-precision" in p.stdout  # loaded: its flags are there


def test_vllm_version_works_with_the_plugin_on_an_untested_vllm(tmp_path):
    p = _vllm_process(tmp_path, _FAKE_VERSION, ["--version"])
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(_plugin_lines(p)) == 1


_NO_FORCE_FP32 = """
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
def init(self, input_size, output_size, bias=False, out_dtype=None, params_dtype=None,
         skip_bias_add=False, quant_config=None, prefix="", return_bias=True):
    raise AssertionError("never built here")
GateLinear.__init__ = init
"""


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--help"]])
def test_a_vllm_without_a_hook_runs_without_the_plugin(tmp_path, argv):
    """A vLLM whose GateLinear lost a constructor argument the plugin passes: vLLM's commands
    work, and one error line names the hook, the tested releases and both ways out."""
    p = _vllm_process(tmp_path, _NO_FORCE_FP32, argv)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = _plugin_lines(p)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("vllm-router-ext is not loaded: vLLM ")
    assert "GateLinear(force_fp32_compute=...)" in line
    assert "0.32.x, 0.33.x and 0.34.x" in line and "pip install 'vllm>=0.32,<0.35'" in line
    assert "VLLM_PLUGINS=" in line and "without router_ext" in line
    if argv[0] == "serve":
        assert "--router-precision" not in p.stdout  # not loaded: no flags of ours


def test_a_router_flag_on_a_vllm_without_the_plugin_is_vllms_unknown_argument(tmp_path):
    p = _vllm_process(tmp_path, _NO_FORCE_FP32, ["serve", "m", "--router-precision", "fp32"])
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "unrecognized arguments: --router-precision" in p.stderr or "--router-precision" in p.stderr
    assert len(_plugin_lines(p)) == 1


def test_a_plugin_failure_at_registration_never_breaks_vllm(tmp_path):
    """Whatever goes wrong inside the plugin's registration, vLLM goes on without it: one line."""
    setup = (
        "import vllm_router_ext.cli as c\n"
        "def boom():\n    raise KeyError('surprise')\n"
        "c.install_cli_flags = boom"
    )
    p = _vllm_process(tmp_path, setup, ["--version"])
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = _plugin_lines(p)
    assert len(lines) == 1 and "KeyError" in lines[0] and "surprise" in lines[0]


def test_a_bad_table_override_stops_the_model_build(vllm_dist, table_env):
    """VLLM_ROUTER_EXT_TABLE is checked when a model that owns gates is built (on every device),
    before any weight is loaded or request served."""
    from types import SimpleNamespace

    from vllm_router_ext.models.override import RouterPrecisionMixin

    built = []

    class Base(torch.nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            built.append(prefix)

    class Model(RouterPrecisionMixin, Base):
        pass

    hf_config = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), additional_config={})
    table_env("nvidia_h200")
    Model(vllm_config=config, prefix="ok")
    table_env("h200")
    with pytest.raises(ValueError, match=r"VLLM_ROUTER_EXT_TABLE='h200' is not a tuned table; allowed: none"):
        Model(vllm_config=config, prefix="bad")
    assert built == ["ok"]


def test_the_settings_table_declares_every_key_flag_and_variable_the_code_reads():
    """One declaration (``settings.SETTINGS``) names every ``additional_config`` key, flag and
    environment variable the resolution reads, and docs/troubleshooting.md shows exactly it."""
    import argparse
    from pathlib import Path

    from csrc_triton import environment
    from vllm_router_ext import capture, precision
    from vllm_router_ext.cli import add_router_cli_args
    from vllm_router_ext.settings import KEYS, SETTINGS

    read = {precision.CONFIG_KEY, precision.CLI_CONFIG_KEY, precision.BATCH_INVARIANT_KEY,
            precision.CLI_BATCH_INVARIANT_KEY, precision.DRAFT_CONFIG_KEY, precision.CLI_DRAFT_CONFIG_KEY,
            precision.FUSED_KEY, precision.CLI_FUSED_KEY,
            capture.DIR_KEY, capture.CLI_DIR_KEY, capture.TOKENS_KEY, capture.CLI_TOKENS_KEY,
            capture.MEMORY_LIMIT_KEY, capture.CLI_MEMORY_LIMIT_KEY, precision.CHECKED_KEY}  # fmt: skip
    assert read == KEYS
    flags = {a.option_strings[0] for a in add_router_cli_args(argparse.ArgumentParser())._actions[1:]}
    assert flags == {s.flag for s in SETTINGS if s.flag}
    names = {v for k, v in vars(environment).items() if k.isupper() and v.startswith("VLLM_")}
    assert names == {s.env.split()[0] for s in SETTINGS if s.env}
    text = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    for s in SETTINGS:
        row = next(
            ln for ln in text.splitlines() if ln.startswith("| ") and f"`{s.env or s.key}`".split()[0] in ln
        )
        assert f"| {s.values} | {s.default} |" in row and (s.flag is None or f"`{s.flag}`" in row), row


def test_settings_are_checked_where_the_engine_starts_and_an_unknown_key_is_named(vllm_dist, tmp_path):
    """``check_settings`` (run by ``create_engine_config`` in the process that starts the engine):
    a misspelt ``router_*`` key names the nearest key; keys of other plugins pass; a bad value of
    any source fails; good settings pass."""
    from vllm.config import ModelConfig
    from vllm_configs import engine_free_config

    from vllm_router_ext.cli import check_settings
    from vllm_router_ext.settings import SettingsError
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "tiny")
    model = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)

    def config(extra):
        return engine_free_config(model_config=model, additional_config=extra)

    check_settings(config({"router_precision": "bf16-fp32out", "other_plugin_key": 1}))
    with pytest.raises(SettingsError) as e:
        check_settings(config({"router_capture_token": 8}))
    assert str(e.value).startswith(
        "unknown key additional_config['router_capture_token']; did you mean 'router_capture_tokens'?"
    )
    with pytest.raises(ValueError, match="from additional_config\\['router_precision_draft'\\]"):
        check_settings(config({"router_precision_draft": "bf17"}))


def test_every_engine_process_takes_the_settings_as_checked_where_the_engine_started(
    vllm_dist, tmp_path, monkeypatch
):
    """The settings checked where the engine starts travel in ``additional_config``: a process of
    the engine resolves to them even where its own environment says otherwise (a worker on
    another node), and the precision line says where they came from."""
    from vllm.config import ModelConfig
    from vllm_configs import engine_free_config

    from vllm_router_ext.cli import check_settings
    from vllm_router_ext.precision import CHECKED_KEY, ENV_VAR, RouterPrecision, resolve_router_settings
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "tiny")
    model = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)
    monkeypatch.setenv(ENV_VAR, "bf16-fp32out")
    cfg = engine_free_config(model_config=model, additional_config={"router_batch_invariant": True})
    check_settings(cfg)
    checked = cfg.additional_config[CHECKED_KEY]["target"]
    assert checked["precision"] == "bf16-fp32out" and checked["batch_invariant"] is True
    monkeypatch.setenv(ENV_VAR, "bf16")  # another process's environment
    got = resolve_router_settings(cfg)
    assert got.precision is RouterPrecision.BF16_FP32OUT and got.source == f"environment variable {ENV_VAR}"
    assert got.batch_invariant and got.model == "DeepSeek-V2/V3 (Kimi-K2) (DeepseekV3ForCausalLM)"
    del cfg.additional_config[CHECKED_KEY]
    assert resolve_router_settings(cfg).precision is RouterPrecision.BF16  # re-resolved: the other value


def test_a_draft_precision_without_a_draft_is_named_once(vllm_dist, tmp_path):
    from vllm.config import ModelConfig
    from vllm_configs import engine_free_config

    from vllm_router_ext.cli import check_settings
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "tiny")
    model = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256)
    with cli_warnings() as messages:
        check_settings(
            engine_free_config(model_config=model, additional_config={"router_precision_draft": "vllm"})
        )
    lines = [m for m in messages if "draft router precision" in m]
    assert lines == [
        "vllm-router-ext: the draft router precision (from additional_config['router_precision_draft']) does "
        "nothing without a speculative-decoding draft (--speculative-config)"
    ]


def test_the_checked_capture_travels_with_the_engine(vllm_dist, tmp_path, monkeypatch):
    """The capture checked where the engine starts is what every engine process records with,
    whatever its own environment says."""
    from vllm.config import ModelConfig
    from vllm_configs import engine_free_config

    from vllm_router_ext.capture import resolve_capture
    from vllm_router_ext.cli import check_settings
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "tiny")
    model = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256, enforce_eager=True)
    monkeypatch.setenv("VLLM_ROUTER_CAPTURE_DIR", str(tmp_path / "here"))
    monkeypatch.setenv("VLLM_ROUTER_CAPTURE_TOKENS", "64")
    cfg = engine_free_config(model_config=model)
    check_settings(cfg)
    monkeypatch.setenv("VLLM_ROUTER_CAPTURE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("VLLM_ROUTER_CAPTURE_TOKENS", "abc")
    got = resolve_capture(cfg.additional_config)
    assert got.directory == tmp_path / "here" and got.tokens == 64
    assert got.source == "environment variable VLLM_ROUTER_CAPTURE_DIR" and (tmp_path / "here").is_dir()
    plain = engine_free_config(model_config=model, additional_config={"router_precision": "fp32"})
    monkeypatch.delenv("VLLM_ROUTER_CAPTURE_DIR")
    check_settings(plain)
    monkeypatch.setenv("VLLM_ROUTER_CAPTURE_DIR", str(tmp_path / "elsewhere"))
    assert resolve_capture(plain.additional_config) is None  # none was asked where the engine started


@pytest.mark.vllm
def test_a_settings_check_that_cannot_run_never_stops_vllm(tiny_model, monkeypatch, capfd):
    """``create_engine_config`` with the plugin: a check that breaks on an unexpected config logs
    one warning and the engine config is made as without the plugin."""
    import os

    from vllm.engine.arg_utils import EngineArgs

    import vllm_router_ext.cli as cli

    saved = dict(os.environ)  # vLLM's CPU platform sets process-wide variables while it configures
    cli.install_cli_flags()

    def broken(config):
        raise RuntimeError("odd config")

    monkeypatch.setattr(cli, "check_settings", broken)
    try:
        config = EngineArgs(model=str(tiny_model), max_model_len=256).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert config.model_config.hf_config.architectures == ["DeepseekV3ForCausalLM"]
    out = capfd.readouterr()  # vLLM's own handler writes the line (its loggers may not propagate)
    assert "could not be checked before the engine (RuntimeError('odd config'))" in out.out + out.err
