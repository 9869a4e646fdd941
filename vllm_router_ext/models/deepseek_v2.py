"""DeepSeek-V2-family model override: resolve the router settings once per model and hand them
to the gates while vLLM builds the model. Everything else is the in-tree class, unchanged.

The draft models of speculative decoding for this family (MTP layers, EAGLE heads) are overridden
too: their MoE layers have router gates of their own, and vLLM builds a draft from the target's
``VllmConfig``, so it resolves to the same settings as the target (a draft routing on bf16 logits
while the target routes on fp32 would propose tokens from different experts than the target would
pick).

Classes are built on first access (module ``__getattr__``) from the class vLLM itself would load,
so the override follows vLLM's per-platform choice (e.g. DeepSeek-V3.2's CUDA model).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from vllm.logger import init_logger

from vllm_router_ext.precision import (
    DEEPSEEK_V2_DRAFTS,
    RouterPrecision,
    RouterSettings,
    resolve_router_settings,
)

# Under "vllm." so vLLM's handlers and format apply.
logger = init_logger(f"vllm.{__name__}")

#: architecture -> (vLLM module, class) of the in-tree implementation this plugin wraps.
IN_TREE_CLASSES: dict[str, tuple[str, str]] = {
    "DeepseekForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekForCausalLM"),
    "DeepseekV2ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("vllm.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    # Speculative-decoding drafts: vLLM rewrites a draft's architecture to these for the methods
    # "mtp" / "deepseek_mtp" (MTP layers) and "eagle" (an EAGLE head with DeepSeek MoE layers).
    "DeepSeekMTPModel": ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"),
    "DeepseekV32MTPModel": ("vllm.models.deepseek_v32", "DeepseekV32MTP"),  # V3.2 and GLM-5
    "EagleDeepSeekMTPModel": ("vllm.model_executor.models.deepseek_eagle", "EagleDeepseekV3ForCausalLM"),
}


def router_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The gates of ``model`` that this plugin owns."""
    from vllm_router_ext.layers.gate import RouterGateLinear

    return [m for m in model.modules() if isinstance(m, RouterGateLinear) and m.router_settings is not None]


def describe_implementation(settings: RouterSettings, weight: torch.Tensor) -> str:
    if weight.device.type != "cuda":
        return f"plain torch on {weight.device.type} (forward_native)"
    from vllm_router_ext.ops.startup import describe_cuda_dispatch

    n, k = weight.shape
    return describe_cuda_dispatch(settings.precision, settings.batch_invariant, weight.dtype, k, n)


class RouterPrecisionMixin:
    """Mixed in front of an in-tree DeepSeek-family ``*ForCausalLM``."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from csrc_triton.tables import table_choice
        from vllm_router_ext.layers.gate import router_settings_scope

        settings = resolve_router_settings(vllm_config)
        table_choice()  # a bad VLLM_ROUTER_EXT_TABLE stops the start-up here, naming the allowed values
        for source, value in settings.overridden:
            logger.warning(
                "vllm-router-ext: conflicting settings: %s from %s overrides %s from %s",
                settings.precision.value,
                settings.source,
                value,
                source,
            )
        capture = _capture_settings(vllm_config, type(self).__name__)
        with router_settings_scope(settings):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.router_settings = settings
        if capture is not None:
            _attach_capture(self, vllm_config, settings, capture)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self._log_router_settings()
        if self.router_settings.batch_invariant:
            from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

            for gate in router_gates(self)[:1]:
                sizes = probe_sizes(gate.weight, gate.router_settings.precision)
                check_batch_invariance(gate.router_gemm, gate.weight, sizes=sizes)
        return loaded

    def _log_router_settings(self) -> None:
        gates = router_gates(self)
        if not gates:
            logger.info("vllm-router-ext: no router gates to own in this model")
            return
        by_settings: dict[tuple, list] = {}
        for g in gates:
            key = (g.router_settings, g.weight.dtype, g.weight.device, g.router_weight_kept_bf16)
            by_settings.setdefault(key, []).append(g)
        for (settings, wdtype, _device, kept_bf16), group in by_settings.items():
            weight_note = str(wdtype).replace("torch.", "")
            if settings.precision is RouterPrecision.FP32:
                weight_note += " (kept: the checkpoint's values are exactly bf16)" if kept_bf16 else ""
            logger.info(
                "vllm-router-ext: %s; %d gate(s) in %s; weight %s; logits %s; implementation: %s",
                settings.describe(),
                len(group),
                type(self).__name__,
                weight_note,
                "float32" if settings.precision.logits_dtype == torch.float32 else "model dtype",
                describe_implementation(settings, group[0].weight),
            )


def _capture_settings(vllm_config, arch: str):
    """The capture this model runs: None for drafts, and where none is asked for; a clear error
    where it cannot work (bad settings, or a mode whose replayed graphs would skip it)."""
    from vllm_router_ext.capture import CaptureError, resolve_capture

    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    capture = resolve_capture(extra)
    if capture is None or arch in DEEPSEEK_V2_DRAFTS:
        return None
    if not vllm_config.model_config.enforce_eager:
        raise CaptureError(
            f"router capture into {str(capture.directory)!r} (from {capture.source}) records in the "
            "gate's forward pass, which CUDA graphs and torch.compile replay without it: add "
            "--enforce-eager (enforce_eager=True) to capture"
        )
    return capture


def _attach_capture(model, vllm_config, settings: RouterSettings, capture) -> None:
    """Tensor-parallel rank 0 records (the gate is replicated); one file per data-parallel rank.
    The rows are written when the budget is reached, or when the model or the process ends."""
    from multiprocessing.util import Finalize

    import vllm
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_router_ext._version import __version__
    from vllm_router_ext.capture import (
        GateCapture,
        GateShape,
        check_budget,
        layer_index,
        next_run,
        size_text,
        track_scheduled_steps,
    )

    if get_tensor_model_parallel_rank() != 0:
        return
    gates = router_gates(model)
    dtype = vllm_config.model_config.dtype
    shapes = [GateShape(layer_index(g.prefix), g.input_size, g.output_size, dtype) for g in gates]
    need = check_budget(capture, shapes)
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    run = next_run(capture.directory)
    meta = {
        "model": str(vllm_config.model_config.model),
        "architecture": type(model).__name__,
        "precision": settings.precision.value,
        "batch_invariant": settings.batch_invariant,
        "vllm": vllm.__version__,
        "vllm_router_ext": __version__,
        "run": run,
        "data_parallel_rank": dp_rank,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
    }
    recorder = GateCapture(capture, shapes, f"router-capture-{run}-dp{dp_rank}", meta)
    track_scheduled_steps()  # warm-up and autotune passes are not recorded
    for gate in gates:
        gate.attach_capture(recorder)
    # Runs when the model is garbage-collected, and at a normal exit of this process (fork or spawn).
    Finalize(model, recorder.close, exitpriority=100)
    logger.info(
        "vllm-router-ext: capturing %d tokens of %d gate(s) into %s (from %s): up to %s on disk, "
        "written as rows arrive",
        capture.tokens,
        len(gates),
        recorder.path,
        capture.source,
        size_text(need),
    )


def _build(arch: str) -> type:
    module_name, class_name = IN_TREE_CLASSES[arch]
    base = getattr(importlib.import_module(module_name), class_name)
    cls = type(arch, (RouterPrecisionMixin, base), {"__module__": __name__, "__qualname__": arch})
    globals()[arch] = cls
    return cls


def __getattr__(name: str) -> type:
    if name in IN_TREE_CLASSES:
        return _build(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
