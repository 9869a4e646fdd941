"""Functions for ``vllm.LLM.apply_model``: they run inside vLLM's worker processes, so they live
in an importable module (workers unpickle them by reference): that is why it ships."""

from __future__ import annotations

from typing import Any

import torch

_RECORD_ATTR = "_router_ext_gate_records"


def _gates(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return [(name, m) for name, m in model.named_modules() if isinstance(m, GateLinear)]


def _correction_bias(model: torch.nn.Module, name: str, gate: torch.nn.Module) -> torch.Tensor | None:
    """The selection bias of a sigmoid router: on the gate (DeepSeek, GLM) or its MoE block (MiniMax)."""
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None and "." in name:
        bias = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "e_score_correction_bias", None)
    return bias


def gate_summary(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every ``GateLinear`` of the model: class, dtypes and the precision it runs."""
    out = []
    for name, m in _gates(model):
        bias = _correction_bias(model, name, m)
        linear_bias = getattr(m, "bias", None)
        settings = getattr(m, "router_settings", None)
        out.append(
            {
                "name": name,
                "class": type(m).__name__,
                "weight_dtype": str(m.weight.dtype),
                "out_dtype": str(m.out_dtype),
                "precision": None if settings is None else settings.precision.value,
                "source": None if settings is None else settings.source,
                "batch_invariant": None if settings is None else settings.batch_invariant,
                "bias_dtype": None if bias is None else str(bias.dtype),
                "weight": m.weight.detach().float().cpu().clone(),
                "bias": None if bias is None else bias.detach().cpu().clone(),
                "linear_bias": None if linear_bias is None else linear_bias.detach().float().cpu().clone(),
                "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            }
        )
    return out


def install_gate_recorders(model: torch.nn.Module) -> int:
    """Record (input, logits) of every gate call and the expert ids vLLM's router picks."""
    records: list[dict[str, Any]] = []
    setattr(model, _RECORD_ATTR, records)
    n = 0
    gate_names = {name for name, _ in _gates(model)}
    for name, m in model.named_modules():
        if name in gate_names and hasattr(m, "logits_seen"):  # ours: its forward and the fused router's op

            def logits_seen(x, logits, _orig=m.logits_seen, name=name):
                _orig(x, logits)
                records.append({"kind": "gate", "name": name, "x": x.detach().cpu().clone(),
                                "logits": logits.detach().cpu().clone()})  # fmt: skip

            m.logits_seen = logits_seen
            n += 1
        elif name in gate_names:

            def hook(mod, args, output, name=name):
                logits = output[0] if isinstance(output, tuple) else output
                records.append(
                    {
                        "kind": "gate",
                        "name": name,
                        "x": args[0].detach().cpu().clone(),
                        "logits": logits.detach().cpu().clone(),
                    }
                )

            m.register_forward_hook(hook)
            n += 1
        router = getattr(m, "router", None)
        if router is not None and hasattr(router, "select_experts") and not hasattr(router, "_recorded"):
            original = router.select_experts

            def select_experts(*a, _orig=original, _name=name, **kw):
                weights, ids = _orig(*a, **kw)
                records.append({"kind": "router", "name": _name, "ids": ids.detach().cpu().clone()})
                return weights, ids

            router.select_experts = select_experts
            router._recorded = True
    return n


def collect_gate_records(model: torch.nn.Module) -> list[dict[str, Any]]:
    return list(getattr(model, _RECORD_ATTR, []))


# The speculative-decoding draft (e.g. DeepSeek's MTP layer) is not what ``apply_model`` sees:
# these run through ``LLM.collective_rpc`` on the worker and reach its model runner's drafter.
def _draft_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.drafter.model


def draft_gate_summary(worker: Any) -> list[dict[str, Any]]:
    return gate_summary(_draft_model(worker))


def install_draft_gate_recorders(worker: Any) -> int:
    return install_gate_recorders(_draft_model(worker))


def collect_draft_gate_records(worker: Any) -> list[dict[str, Any]]:
    return collect_gate_records(_draft_model(worker))
