"""Offline ``vllm.LLM`` on a tiny random DeepSeek-V3 (real vLLM, CPU build), one subprocess each."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_router_ext.ops.routing_fp64 import (
    RoutingConfig,
    near_tie_mask,
    reference_logits,
    relative_error,
    select_experts,
)

pytestmark = pytest.mark.vllm

# fp32 logits: fp32 accumulation of exact products (≈1e-7 relative); bf16: one bf16 rounding.
LOGIT_TOL = {"fp32": 1e-5, "bf16-fp32out": 1e-5, "bf16": 1e-2}


def _score_margin(mode: str, max_abs_logit: float) -> float:
    """Largest change of a selection score that the mode's rounding can cause (score units):
    the logit error times sigmoid's slope (<= 1/4), plus bf16 rounding of the score itself
    (vLLM applies sigmoid in the logits' dtype)."""
    if mode == "bf16":
        return 2**-9 * max_abs_logit / 4 + 2**-9
    return 1e-5 * max_abs_logit / 4 + 1e-7


def _check_gate_records(result, model_dir, mode, model="target"):
    """Logits vs fp64 and vLLM's chosen experts vs the fp64 reference, token by token
    (``model="draft"``: the speculative-decoding draft's gates)."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    routing = RoutingConfig.from_hf_config(cfg)
    prefix = "draft_" if model == "draft" else ""
    gate = {g["name"]: g for g in result[f"{prefix}gates"][0]}
    records = result[f"{prefix}records"]
    gate_recs = [r for r in records if r["kind"] == "gate"]
    router_recs = [r for r in records if r["kind"] == "router"]
    assert gate_recs and len(gate_recs) == len(router_recs)
    tokens = compared = 0
    for g, r in zip(gate_recs, router_recs, strict=True):
        info = gate[g["name"]]
        ref = reference_logits(g["x"], info["weight"])
        assert g["logits"].dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
        assert relative_error(g["logits"], ref) <= LOGIT_TOL[mode], g["name"]
        bias = None if info["bias"] is None else info["bias"].double()
        ref_ids, _ = select_experts(ref, routing, bias)
        vllm_ids = r["ids"].long().sort(dim=-1).values
        margin = _score_margin(mode, ref.abs().max().item())
        ties = near_tie_mask(ref, routing, info["bias"], margin)
        same = (vllm_ids == ref_ids).all(dim=-1)
        assert same[~ties].all(), f"{(~same & ~ties).sum()} non-tied tokens routed differently"
        tokens += len(same)
        compared += int((~ties).sum())
    # The tie mask must not hide the comparison: most tokens are compared (bf16's wider margin
    # flags more of the 54 tokens as near-ties).
    assert compared >= (0.75 if mode == "bf16" else 0.9) * tokens, (compared, tokens)


@pytest.mark.parametrize(
    "mode,expect,weight_dtype",
    [
        ("fp32", "fp32", "torch.bfloat16"),  # bf16 checkpoint: exact in bf16, so kept bf16
        ("bf16-fp32out", "bf16-fp32out", "torch.bfloat16"),
        ("bf16", "bf16", "torch.bfloat16"),
        ("auto", "fp32", "torch.bfloat16"),
    ],
)
def test_each_mode_generates_and_routes_like_fp64(tiny_model, run_offline, mode, expect, weight_dtype):
    result = run_offline(tiny_model, additional_config={"router_precision": mode})
    assert all(len(t) > 0 for t in result["texts"])
    (gates,) = result["gates"]
    assert len(gates) == 1  # layer 0 is dense (first_k_dense_replace=1)
    for g in gates:
        assert g["class"] == "RouterGateLinear"
        assert g["model_class"] == "vllm_router_ext.models.override.DeepseekV3ForCausalLM"
        assert g["precision"] == expect
        assert g["weight_dtype"] == weight_dtype
        assert g["bias_dtype"] == "torch.float32"  # e_score_correction_bias stays fp32
        assert g["out_dtype"] == ("None" if expect == "bf16" else "torch.float32")
    _check_gate_records(result, tiny_model, expect)
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert len(lines) == 1 and f"router precision {expect}" in lines[0]


def test_auto_keeps_an_fp32_checkpoint_gate_in_fp32(tmp_path, run_offline):
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    model = build_tiny_deepseek_v3(tmp_path / "fp32-gate", seed=3, gate_dtype=torch.float32)
    result = run_offline(model)
    (g,) = result["gates"][0]
    assert g["precision"] == "fp32" and g["weight_dtype"] == "torch.float32"
    assert g["source"] == "auto: architecture DeepseekV3ForCausalLM"
    _check_gate_records(result, model, "fp32")


@pytest.mark.parametrize("model", ["deepseek-v2", "deepseek-v2-lite", "kimi-k2"])
def test_each_release_cpu_vllm_runs_generates_and_routes_like_fp64(tmp_path, run_offline, model):
    """Each release's routing (softmax with group-limited or plain greedy top-k, 160 / 64 experts;
    Kimi-K2's 384 experts in one group), served by the override with auto's precision. DeepSeek-V3.2
    and GLM-5 are built in test_architectures.py: CPU vLLM has no sparse attention for them."""
    from vllm_router_ext.tools.tiny_checkpoint import ROUTING_PRESETS, build_tiny_model

    path = build_tiny_model(tmp_path / model, model)
    arch = ROUTING_PRESETS[model]["architectures"][0]
    result = run_offline(path)
    assert all(len(t) > 0 for t in result["texts"])
    (g,) = result["gates"][0]
    assert g["model_class"] == f"vllm_router_ext.models.override.{arch}"
    assert g["precision"] == "fp32" and g["source"] == f"auto: architecture {arch}"
    assert g["out_dtype"] == "torch.float32"
    _check_gate_records(result, path, "fp32")


def test_an_fp8_checkpoint_generates_with_our_gate(tmp_path, run_offline):
    """DeepSeek-V3's FP8 layout end to end: needs vLLM's CPU FP8 linear kernels, i.e. AMX."""
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3, cpu_runs_fp8

    if not cpu_runs_fp8():
        pytest.skip(
            "vLLM's CPU build runs FP8 block-quantized linear layers only with AMX (Sapphire Rapids or "
            "newer) and this CPU has none; test_architectures.py builds the FP8 MoE block on any CPU"
        )
    path = build_tiny_deepseek_v3(tmp_path / "fp8", fp8=True)
    result = run_offline(path)
    assert all(len(t) > 0 for t in result["texts"])
    (g,) = result["gates"][0]
    assert (
        g["class"] == "RouterGateLinear"
        and g["precision"] == "fp32"
        and g["weight_dtype"] == "torch.bfloat16"
    )
    _check_gate_records(result, path, "fp32")


def test_hf_overrides_and_env_sources_reach_the_workers(tiny_model, run_offline):
    result = run_offline(tiny_model, hf_overrides={"router_precision": "bf16"})
    assert result["gates"][0][0]["precision"] == "bf16"
    result = run_offline(tiny_model, env={"VLLM_ROUTER_PRECISION": "fp32"})
    (g,) = result["gates"][0]
    assert g["precision"] == "fp32" and "VLLM_ROUTER_PRECISION" in g["source"]


def test_tensor_parallel_2_both_ranks_use_the_resolved_precision(tiny_model, run_offline, tmp_path):
    """...and a router capture is written once, by TP rank 0 (the gate is replicated)."""
    capture = tmp_path / "capture"
    extra = {"router_precision": "fp32", "router_capture_dir": str(capture), "router_capture_tokens": 8}
    result = run_offline(tiny_model, additional_config=extra, tp=2)
    assert sorted(p.name for p in capture.iterdir()) == [
        "router-capture-1-dp0.json",
        "router-capture-1-dp0.safetensors",
    ]
    meta = json.loads((capture / "router-capture-1-dp0.json").read_text(encoding="utf-8"))
    assert meta["tensor_parallel_size"] == 2 and meta["rows_per_layer"] == {"1": 8} and meta["complete"]
    assert len(result["gates"]) == 2
    for rank_gates in result["gates"]:
        assert [g["precision"] for g in rank_gates] == ["fp32"]
        assert [g["out_dtype"] for g in rank_gates] == ["torch.float32"]
    assert all(len(t) > 0 for t in result["texts"])
    _check_gate_records(result, tiny_model, "fp32")


def test_the_capture_holds_exactly_what_a_hook_on_the_gate_saw(tiny_model, run_offline, tmp_path):
    from safetensors.torch import load_file

    capture = tmp_path / "capture"
    extra = {"router_capture_dir": str(capture), "router_capture_tokens": 16}
    result = run_offline(tiny_model, additional_config=extra)
    data = load_file(str(capture / "router-capture-1-dp0.safetensors"))
    seen = [r for r in result["records"] if r["kind"] == "gate" and r["name"] == "model.layers.1.mlp.gate"]
    x = torch.cat([r["x"] for r in seen])[:16]
    logits = torch.cat([r["logits"] for r in seen])[:16]
    assert torch.equal(data["layers.1"], x) and torch.equal(data["logits.1"], logits)


def test_an_offline_run_that_ends_before_the_budget_keeps_every_row(tiny_model, run_offline, tmp_path):
    """The LLM is shut down (its worker killed) long before 100 000 tokens: every row the gate saw
    is in the capture, which says it is partial."""
    from vllm_router_ext.capture import read_capture

    capture = tmp_path / "capture"
    extra = {"router_capture_dir": str(capture), "router_capture_tokens": 100_000}
    result = run_offline(tiny_model, additional_config=extra)
    read = read_capture(capture, "router-capture-1-dp0")
    seen = [r for r in result["records"] if r["kind"] == "gate" and r["name"] == "model.layers.1.mlp.gate"]
    assert torch.equal(read.tensors["layers.1"], torch.cat([r["x"] for r in seen]))
    assert torch.equal(read.tensors["logits.1"], torch.cat([r["logits"] for r in seen]))
    assert read.info["complete"] is False and read.info["budget_tokens"] == 100_000


def test_batch_invariant_request_reaches_gates_and_passes_the_startup_check(tiny_model, run_offline):
    result = run_offline(
        tiny_model, additional_config={"router_precision": "fp32", "router_batch_invariant": True}
    )
    (g,) = result["gates"][0]
    assert g["precision"] == "fp32" and g["batch_invariant"] is True
    _check_gate_records(result, tiny_model, "fp32")
    (line,) = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert "batch-invariant on (from additional_config['router_batch_invariant'])" in line


@pytest.mark.parametrize("fused", ["off", "on"])
def test_torch_compile_mode(tiny_model, run_offline, fused):
    """vLLM's default (compiled) mode: the gate (or the fused router's op) traces into torch.compile
    and serves requests. (Hooks added after compilation do not fire inside the compiled graph, so the
    numbers are checked by the eager tests; here: it compiles, runs our gate in fp32, generates; on
    CPU every fp32-output mode is the same function.)"""
    mode = "fp32"
    extra = {"router_precision": mode, "router_fused": fused}
    result = run_offline(tiny_model, additional_config=extra, compile=True)
    (line,) = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    kept = "vLLM's router on our logits in 1 layer(s): --router-fused off"
    assert line.endswith("fused router (router_ext::route) in 1 layer(s)" if fused == "on" else kept), line
    (g,) = result["gates"][0]
    assert g["class"] == "RouterGateLinear" and g["precision"] == mode and g["out_dtype"] == "torch.float32"
    assert all(len(t) > 0 for t in result["texts"])
    # vLLM's own evidence of compile mode: its compile warm-up, and the AOT artifact saved (or, from
    # a cache, loaded).
    compiled = ("Warming up model for the compilation", "saved AOT compiled function", "Directly load AOT")
    assert any(line in result["log"] for line in compiled), "the model was not compiled"


def test_the_fused_router_routes_the_model_like_fp64(tiny_model, run_offline):
    """``router_fused: on``: the MoE layer routes with one op of ours (GEMM, scores, grouped top-k);
    the tokens it saw and its logits match fp64, and the experts it hands vLLM's experts are fp64's
    on every non-tied token; the precision line says which router runs."""
    result = run_offline(tiny_model, additional_config={"router_precision": "fp32", "router_fused": "on"})
    assert all(len(t) > 0 for t in result["texts"])
    _check_gate_records(result, tiny_model, "fp32")
    (line,) = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert line.endswith("routing: fused router (router_ext::route) in 1 layer(s)"), line


@pytest.mark.parametrize(
    "extra,mode,source,bi",
    [
        ({}, "fp32", "auto: architecture DeepseekV3ForCausalLM", False),
        (
            {"router_precision": "fp32", "router_batch_invariant": True},
            "fp32",
            "additional_config['router_precision']",
            True,
        ),
    ],
    ids=["auto", "fp32-batch-invariant"],
)
def test_mtp_draft_routes_with_the_targets_settings(tmp_path, run_offline, extra, mode, source, bi):
    """Speculative decoding with DeepSeek's MTP layer: the draft model has a router gate of its
    own, and it must route like the target (the same precision and batch invariance, fp32
    logits), not on vLLM's bf16 logits. With batch invariance both models pass the start-up check."""
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    model = build_tiny_deepseek_v3(tmp_path / "mtp", seed=5, mtp_layers=1)
    result = run_offline(
        model,
        additional_config=extra,
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
    )
    assert all(len(t) > 0 for t in result["texts"])
    (target,) = result["gates"][0]
    (draft,) = result["draft_gates"][0]
    assert draft["name"] == "model.layers.2.mtp_block.mlp.gate"
    assert draft["model_class"] == "vllm_router_ext.models.override.DeepSeekMTP"
    for g in (target, draft):
        assert g["class"] == "RouterGateLinear"
        # auto names the architecture it resolved for: the draft's own (its MTP model's)
        own = source.replace("DeepseekV3ForCausalLM", "DeepSeekMTPModel") if g is draft else source
        assert g["precision"] == mode and g["source"] == own
        assert g["batch_invariant"] is bi
        assert g["out_dtype"] == "torch.float32" and g["bias_dtype"] == "torch.float32"
    _check_gate_records(result, model, mode)
    _check_gate_records(result, model, mode, model="draft")
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert len(lines) == 2, lines
    assert any("(DeepseekV3ForCausalLM); weight" in ln and "(class " not in ln for ln in lines), lines
    assert any("1 gate(s) in " in ln and "(class DeepSeekMTP);" in ln for ln in lines)
    assert all(f"batch-invariant {'on' if bi else 'off'}" in ln for ln in lines)


@pytest.mark.parametrize("draft_mode", ["bf16-fp32out", "vllm"])
def test_an_mtp_draft_takes_its_own_precision_where_set(tmp_path, run_offline, draft_mode):
    """``router_precision_draft``: the target keeps its own (``auto``: fp32), the MTP draft's gate
    runs the draft's (``bf16-fp32out``: ours, logits against fp64) or vLLM's own gate (``vllm``)."""
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    model = build_tiny_deepseek_v3(tmp_path / "mtp", seed=6, mtp_layers=1)
    result = run_offline(
        model,
        additional_config={"router_precision_draft": draft_mode},
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
    )
    assert all(len(t) > 0 for t in result["texts"])
    (target,) = result["gates"][0]
    (draft,) = result["draft_gates"][0]
    assert target["precision"] == "fp32" and target["source"] == "auto: architecture DeepseekV3ForCausalLM"
    _check_gate_records(result, model, "fp32")
    if draft_mode == "vllm":
        assert draft["precision"] is None and draft["source"] is None  # vLLM's own gate, untouched
    else:
        assert draft["class"] == "RouterGateLinear" and draft["precision"] == draft_mode
        assert draft["source"] == "additional_config['router_precision_draft']"
        _check_gate_records(result, model, draft_mode, model="draft")
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert any("(DeepseekV3ForCausalLM); weight" in ln and "router precision fp32 " in ln for ln in lines)


def test_random_dummy_weights_still_log_the_precision_and_check_batch_invariance(tiny_model, run_offline):
    """``--load-format dummy`` (benchmarks, smoke tests) never calls the model's ``load_weights``:
    the precision line and the batch-invariance check come from the gates' after-load step then,
    once; the gates are ours and their logits are fp64's of the random weights."""
    result = run_offline(tiny_model, additional_config={"router_batch_invariant": True}, load_format="dummy")
    assert all(len(t) > 0 for t in result["texts"])
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert (
        len(lines) == 1
        and "router precision fp32 (from auto: architecture DeepseekV3ForCausalLM)" in lines[0]
    )
    assert "batch-invariant on" in lines[0]
    for g in result["gates"][0]:
        assert g["class"] == "RouterGateLinear" and g["precision"] == "fp32" and g["batch_invariant"] is True
    records = [r for r in result["records"] if r["kind"] == "gate"]
    weights = {g["name"]: g["weight"] for g in result["gates"][0]}
    for r in records:
        ref = r["x"].double() @ weights[r["name"]].double().T
        assert relative_error(r["logits"], ref) <= 1e-5, r["name"]


def test_eagle_draft_head_routes_with_the_targets_precision(tmp_path, run_offline):
    """Speculative decoding with an EAGLE head of DeepSeek MoE layers (vLLM builds it as
    ``EagleDeepSeekMTPModel``): its router gate runs the target's precision too."""
    from vllm_router_ext.tools.tiny_checkpoint import (
        build_tiny_deepseek_eagle_head,
        build_tiny_deepseek_v3,
    )

    model = build_tiny_deepseek_v3(tmp_path / "target", seed=1)
    head = build_tiny_deepseek_eagle_head(tmp_path / "eagle-head", seed=2)
    result = run_offline(
        model, speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 1}
    )
    assert all(len(t) > 0 for t in result["texts"])
    (draft,) = result["draft_gates"][0]
    assert draft["model_class"] == "vllm_router_ext.models.override.EagleDeepseekV3ForCausalLM"
    assert draft["class"] == "RouterGateLinear" and draft["precision"] == "fp32"
    assert draft["source"] == "auto: architecture EagleDeepSeekMTPModel"  # the draft's own, as resolved
    assert draft["out_dtype"] == "torch.float32" and draft["bias_dtype"] == "torch.float32"
    _check_gate_records(result, model, "fp32")
    _check_gate_records(result, head, "fp32", model="draft")
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert any("1 gate(s) in " in ln and "(class EagleDeepseekV3ForCausalLM);" in ln for ln in lines), lines
