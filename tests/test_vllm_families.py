"""Router precision on other MoE families: offline ``vllm.LLM`` (real vLLM, CPU build) on tiny
random checkpoints of each family, one subprocess each. Each case checks the gate that ran, its
logits against fp64 of the same inputs, and vLLM's chosen experts against fp64's."""

from __future__ import annotations

import pytest
import torch

from vllm_router_ext.families import family_of
from vllm_router_ext.ops.routing_fp64 import relative_error
from vllm_router_ext.tools.tiny_checkpoint import FAMILY_PRESETS, build_tiny_family

pytestmark = pytest.mark.vllm

LOGIT_TOL = {"fp32": 1e-5, "bf16-fp32out": 1e-5, "bf16": 1e-2}


def _expected(family: str, mode: str) -> str | None:
    """The precision the gate runs: the flag's, or auto's (None: vLLM's own gate)."""
    if mode != "auto":
        return mode
    return family_of(FAMILY_PRESETS[family]["architectures"][0]).auto


def _selection_scores(logits: torch.Tensor, info: dict, family: str) -> torch.Tensor:
    """The score whose top-k vLLM's CPU build takes: the logits (softmax top-k: softmax keeps their
    order; gpt-oss: its router bias is in the logits), or sigmoid + correction bias. ERNIE-4.5's
    correction bias is dropped there (its CPU router takes a plain softmax top-k when ungrouped;
    CUDA's adds it): the logits decide."""
    if info["bias"] is not None and family != "ernie4.5-moe":
        return logits.sigmoid() + info["bias"].double()
    return logits


def _checkpoint_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _check(result, mode: str | None, k: int, path, family: str) -> None:
    """vLLM's own gate on CPU hands its weight to oneDNN (the module's is emptied): the reference
    reads the checkpoint's gate weight, which every gate stores exactly."""
    checkpoint = _checkpoint_weights(path)
    gates = {g["name"]: g for g in result["gates"][0]}
    records = result["records"]
    gate_recs = [r for r in records if r["kind"] == "gate"]
    router_recs = [r for r in records if r["kind"] == "router"]
    assert gate_recs and len(gate_recs) == len(router_recs)
    compared = tokens = 0
    for g, r in zip(gate_recs, router_recs, strict=True):
        info = gates[g["name"]]
        weight = info["weight"] if info["weight"].numel() else checkpoint[g["name"] + ".weight"]
        ref = g["x"].double() @ weight.double().T
        if info["linear_bias"] is not None:
            ref = ref + info["linear_bias"].double()
        logits = g["logits"]
        if mode is not None:
            assert logits.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
            assert relative_error(logits, ref) <= LOGIT_TOL[mode], g["name"]
        scores = _selection_scores(ref, info, family)
        top = scores.topk(k + 1, dim=-1).values
        margin = (2**-7 if mode in (None, "bf16") else 1e-5) * (ref.abs().max().item() + 1)
        clear = (top[:, k - 1] - top[:, k]) > margin  # no near-tie at the k-th expert
        ref_ids = scores.topk(k, dim=-1).indices.sort(dim=-1).values
        ids = r["ids"].long().sort(dim=-1).values
        same = (ids == ref_ids).all(dim=-1)
        assert same[clear].all(), f"{int((~same & clear).sum())} clearly ranked tokens routed differently"
        compared += int(clear.sum())
        tokens += len(clear)
    assert compared >= (0.6 if mode in (None, "bf16") else 0.9) * tokens, (compared, tokens)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return lambda family: build_tiny_family(root / family, family)


#: (family preset, mode) served here; the family table's "CPU build" claims rest on it.
SERVED = [
    ("qwen3-moe", "auto"),
    ("qwen3-moe", "fp32"),
    ("mixtral", "bf16-fp32out"),
    ("gpt-oss", "fp32"),
    ("llama4", "fp32"),
    ("glm4-moe", "auto"),
    ("glm4-moe", "bf16-fp32out"),
    ("qwen3-next", "fp32"),
    ("ernie4.5-moe", "auto"),
]


@pytest.mark.parametrize("family,mode", SERVED)
def test_each_family_serves_with_the_flag_and_routes_like_fp64(checkpoints, run_offline, family, mode):
    path = checkpoints(family)
    arch = FAMILY_PRESETS[family]["architectures"][0]
    result = run_offline(path, additional_config={"router_precision": mode})
    assert all(len(t) > 0 for t in result["texts"])
    expect = _expected(family, mode)
    gates = result["gates"][0]
    assert gates
    for g in gates:
        assert g["model_class"] == f"vllm_router_ext.models.override.{arch}"
        assert g["precision"] == expect
        if expect is None:
            assert g["source"] is None and g["out_dtype"] == "None"  # vLLM's own gate, as built without us
        else:
            assert g["class"] == "RouterGateLinear"
            assert g["out_dtype"] == ("None" if expect == "bf16" else "torch.float32")
    preset = FAMILY_PRESETS[family]
    _check(result, expect, preset.get("num_experts_per_tok", preset.get("moe_k")), path, family)
    lines = [ln for ln in result["log"].splitlines() if "vllm-router-ext: router precision" in ln]
    assert len(lines) == 1 and family_of(arch).name in lines[0] and arch in lines[0], lines


@pytest.mark.parametrize("family", ["mixtral", "gpt-oss"])
def test_a_capture_of_another_family_holds_what_its_routers_saw_and_the_audit_reads_it(
    checkpoints, run_offline, tmp_path, family
):
    """``--router-capture`` on a family whose routers are not ``mlp.gate`` (Mixtral's
    ``block_sparse_moe.gate``, gpt-oss's ``mlp.router``): one row set per MoE layer, exactly what
    the router saw and returned, and the audit routes that capture like the family."""
    from safetensors.torch import load_file

    from vllm_router_ext.audit import run_audit

    path = checkpoints(family)
    capture = tmp_path / "capture"
    extra = {"router_precision": "fp32", "router_capture_dir": str(capture), "router_capture_tokens": 12}
    result = run_offline(path, additional_config=extra)
    data = load_file(str(capture / "router-capture-1-dp0.safetensors"))
    gates = [g["name"] for g in result["gates"][0]]
    layers = sorted(n.split(".")[2] for n in gates)
    assert sorted(k for k in data if k.startswith("layers.")) == [f"layers.{i}" for i in layers]
    for name in gates:
        seen = [r for r in result["records"] if r["kind"] == "gate" and r["name"] == name]
        layer = name.split(".")[2]
        assert torch.equal(data[f"layers.{layer}"], torch.cat([r["x"] for r in seen])[:12])
        assert torch.equal(data[f"logits.{layer}"], torch.cat([r["logits"] for r in seen])[:12])
    audit = run_audit(path, hidden_states=capture, progress=False)
    assert audit["tokens"] == 12 and sorted(audit["layers"]) == layers
    assert audit["overall"]["fp32"]["rel_err"] <= 1e-6 and audit["overall"]["fp32"]["changed_pct"] == 0.0
