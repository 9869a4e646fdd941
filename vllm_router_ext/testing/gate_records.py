"""Functions for ``vllm.LLM.apply_model``: they run inside vLLM's worker processes, so they live
in an importable module (workers unpickle them by reference): that is why it ships."""

from __future__ import annotations

from typing import Any

import torch

_RECORD_ATTR = "_router_ext_gate_records"


def gate_summary(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every ``*.mlp.gate`` of the model: class, dtypes and the precision it runs."""
    out = []
    for name, m in model.named_modules():
        if not name.endswith("mlp.gate"):
            continue
        bias = getattr(m, "e_score_correction_bias", None)
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
                "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            }
        )
    return out


def install_gate_recorders(model: torch.nn.Module) -> int:
    """Record (input, logits) of every gate call and the expert ids vLLM's router picks."""
    records: list[dict[str, Any]] = []
    setattr(model, _RECORD_ATTR, records)
    n = 0
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):

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
