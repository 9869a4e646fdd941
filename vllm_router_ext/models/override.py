"""The model override: every model vLLM builds is its in-tree class with this mixin in front,
which resolves the router settings once per model and hands them to the gates while vLLM builds
it. A model that asks for nothing of ours (``auto`` on a family that keeps vLLM's gate, or a model
without a router) builds exactly as without the plugin.

vLLM builds a speculative-decoding draft (MTP layers, EAGLE heads) from the target's
``VllmConfig``, so it resolves to the target's settings (a draft routing on bf16 logits while the
target routes on fp32 would propose tokens from other experts than the target would pick), unless
the draft's own precision is set (a draft trained on vLLM's routing may keep it).

The registry's entries are wrapped, not replaced: vLLM's own entry still inspects the class (its
cached model info) and loads it (its per-platform choice); the wrapper puts the mixin in front.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.registry import _BaseRegisteredModel

from vllm_router_ext.families import BYPASSES, family_of, is_draft
from vllm_router_ext.precision import (
    RouterPrecision,
    RouterSettings,
    check_family_logits,
    resolve_router_settings,
)

# Under "vllm." so vLLM's handlers and format apply.
logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class OverriddenModel(_BaseRegisteredModel):
    """A registry entry: vLLM's own ``entry``, whose class is loaded with the mixin in front."""

    entry: Any
    architecture: str = ""

    def inspect_model_cls(self):
        return self.entry.inspect_model_cls()

    def load_model_cls(self) -> type[torch.nn.Module]:
        cls = with_router_settings(self.entry.load_model_cls())
        if is_draft(self.architecture):  # vLLM builds a draft from the target's config: its class says
            DRAFT_CLASSES.add(cls)
        return cls


def override_registry(registry) -> int:
    """Wrap every entry of vLLM's model registry once; the number wrapped."""
    n = 0
    for arch, entry in list(registry.models.items()):
        if not isinstance(entry, OverriddenModel):
            registry.models[arch] = OverriddenModel(entry, arch)
            n += 1
    return n


_CLASSES: dict[type, type] = {}
#: The override classes of speculative-decoding drafts (registry entries of a family's drafts).
DRAFT_CLASSES: set[type] = set()


def with_router_settings(base: type) -> type:
    """``base`` with :class:`RouterPrecisionMixin` in front; one class per base, same name."""
    if issubclass(base, RouterPrecisionMixin):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        attrs = {"__module__": __name__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
        cls = _CLASSES[base] = type(base.__name__, (RouterPrecisionMixin, base), attrs)
    return cls


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
    """Mixed in front of a vLLM model class."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        from csrc_triton.tables import table_choice
        from vllm_router_ext.layers.gate import router_settings_scope

        arch = (getattr(vllm_config.model_config.hf_config, "architectures", None) or [None])[0]
        draft = type(self) in DRAFT_CLASSES or is_draft(arch)
        settings = resolve_router_settings(vllm_config, draft=draft)
        check_family_logits(settings, arch)  # also where no CLI checked it (offline LLM, other launchers)
        settings = _unless_bypassed(settings, vllm_config, arch)
        capture = _capture_settings(vllm_config, draft)
        if capture is not None:
            settings = dataclasses.replace(settings, captures=True)  # our gates record
        if settings.owns_gates:
            table_choice()  # a bad VLLM_ROUTER_EXT_TABLE stops the start-up here, naming the allowed values
        for source, value in settings.overridden:
            logger.warning(
                "vllm-router-ext: conflicting settings: %s from %s overrides %s from %s",
                settings.precision.value,
                settings.source,
                value,
                source,
            )
        with router_settings_scope(settings):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.router_settings = settings
        self._router_weights_final = False
        for gate in router_gates(self):  # each gate's after-load step reaches back to its model
            gate.router_model = weakref.ref(self)
        _refuse_unless_owned(self, settings, capture)
        _refuse_bypassed_gates(self, settings, arch)
        self._router_fused = _install_fused_routers(self, settings)
        if capture is not None:
            _attach_capture(self, vllm_config, settings, capture)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._router_weights_final = False  # a reload: its line and checks again
        loaded = super().load_weights(weights)
        self.router_weights_final()
        return loaded

    def router_weights_final(self) -> None:
        """Once the weights are final (after ``load_weights``, or at the gates' after-load step for
        loaders that never call it, dummy weights): the precision line and the batch-invariance check."""
        if self._router_weights_final:
            return
        self._router_weights_final = True
        self._log_router_settings()
        if self.router_settings.batch_invariant:
            from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

            for gate in router_gates(self)[:1]:
                sizes = probe_sizes(gate.weight, gate.router_settings.precision)
                check_batch_invariance(gate.router_gemm, gate.weight, sizes=sizes)

    def _log_router_settings(self) -> None:
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        gates = router_gates(self)
        if not gates:
            stock = sum(isinstance(m, GateLinear) for m in self.modules())
            if stock:
                logger.info(
                    "vllm-router-ext: %s; %d gate(s) in %s left to vLLM's GateLinear",
                    self.router_settings.describe(),
                    stock,
                    self.router_settings.model,
                )
            return
        by_settings: dict[tuple, list] = {}
        for g in gates:
            key = (g.router_settings, g.weight.dtype, g.weight.device, g.router_weight_kept_bf16)
            by_settings.setdefault(key, []).append(g)
        cls = type(self).__name__
        routing = self._router_fused.describe() if self._router_fused is not None else "vLLM's router"
        for (settings, wdtype, _device, kept_bf16), group in by_settings.items():
            weight_note = str(wdtype).replace("torch.", "")
            if settings.precision is RouterPrecision.FP32:
                weight_note += " (kept: the checkpoint's values are exactly bf16)" if kept_bf16 else ""
            # the class is named where it is not the architecture already named (a draft, a subclass)
            named = settings.model == cls or settings.model.endswith(f"({cls})")
            where = settings.model if named else f"{settings.model} (class {cls})"
            logger.info(
                "vllm-router-ext: %s; %d gate(s) in %s; weight %s; logits %s; implementation: %s; "
                "routing: %s",
                settings.describe(),
                len(group),
                where,
                weight_note,
                "float32" if settings.precision.logits_dtype == torch.float32 else "model dtype",
                describe_implementation(settings, group[0].weight),
                routing,
            )


def _install_fused_routers(model: torch.nn.Module, settings: RouterSettings):
    """The fused router in the MoE layers that hold a gate of ours (its report; None: no gate)."""
    from vllm_router_ext.layers.router import install_fused_routers

    gates = router_gates(model)
    if not gates:
        return None
    return install_fused_routers(model, settings, gates[0].weight.device)


#: What a built model says when a path of :data:`BYPASSES` is on: an attribute of the block that
#: holds the gate (or of the model) and the values that mean "on".
_BYPASS_ATTRIBUTES = {
    "mega_moe": ("use_native_mega_moe", "use_mega_moe"),
    "flint_kernels": ("use_flint_kernel", "bf16_decode"),
    "specialized_decode": ("specialized_decode_config",),
}


def _bypass_in_config(vllm_config, key: str) -> bool:
    """Whether a bypass that the config decides is on (others are seen once the model is built)."""
    if key == "mega_moe":
        kernel_config = getattr(vllm_config, "kernel_config", None)
        return getattr(kernel_config, "moe_backend", None) == "deep_gemm_mega_moe"
    if key == "specialized_decode":
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        return extra.get("decode_backend") == "latency_specialized"
    return False


def _bypass_error(settings: RouterSettings, key: str):
    from vllm_router_ext.layers.gate import GateSettingsError

    asked = "; ".join(settings.asked) or f"router precision {settings.precision} (from {settings.source})"
    return GateSettingsError(
        f"vllm-router-ext: {asked} cannot apply to {settings.model} with {BYPASSES[key]}, never calling "
        "the gate: turn that path off, or leave the router settings unset (auto keeps vLLM's gate there)"
    )


def _unless_bypassed(settings: RouterSettings, vllm_config, arch: str | None) -> RouterSettings:
    """A family path the config turns on that routes without the gate: what the user asked for
    is refused; ``auto`` keeps vLLM's gate (a precision that could not apply is not claimed)."""
    family = family_of(arch)
    on = [k for k in (family.bypassed_by if family else ()) if _bypass_in_config(vllm_config, k)]
    if not on or not settings.owns_gates:
        return settings
    if settings.asked or settings.captures:
        raise _bypass_error(settings, on[0])
    source = f"auto: {settings.model} keeps vLLM's gate with {on[0].replace('_', ' ')} on"
    return dataclasses.replace(settings, precision=None, source=source, batch_invariant=False)


def _refuse_bypassed_gates(model: torch.nn.Module, settings: RouterSettings, arch: str | None) -> None:
    """A built model whose blocks route some batches without calling a gate of ours stops here."""
    family = family_of(arch)
    gates = {id(g) for g in router_gates(model)}
    if family is None or not family.bypassed_by or not gates:
        return
    holders = [model, *(m for m in model.modules() if any(id(c) in gates for c in m.children()))]
    for key in family.bypassed_by:
        for holder in holders:
            if any(getattr(holder, attr, None) not in (None, False) for attr in _BYPASS_ATTRIBUTES[key]):
                raise _bypass_error(settings, key)


def _refuse_unless_owned(model: torch.nn.Module, settings: RouterSettings, capture) -> None:
    """Settings a user asked for that no gate of this model took stop the start-up, named."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    asked = list(settings.asked)
    if capture is not None:
        asked.append(f"router capture into {str(capture.directory)!r} (from {capture.source})")
    if not asked or router_gates(model):
        return
    from vllm_router_ext.layers.gate import GateSettingsError

    stock = [m for m in model.modules() if isinstance(m, GateLinear)]
    why = (
        f"its {len(stock)} GateLinear gate(s) are quantized"
        if stock
        else "it builds no GateLinear router (a dense model, or a router of another layer type)"
    )
    raise GateSettingsError(
        f"vllm-router-ext: {'; '.join(asked)} cannot apply to {settings.model}: {why}. The plugin "
        "owns routers built with vLLM's GateLinear (docs/precision.md lists the families); leave "
        "the router settings unset (auto) for this model"
    )


def _capture_settings(vllm_config, draft: bool):
    """The capture this model runs: None for drafts, and where none is asked for; a clear error
    where it cannot work (bad settings, or a mode whose replayed graphs would skip it)."""
    from vllm_router_ext.capture import CaptureError, resolve_capture

    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    capture = resolve_capture(extra)
    if capture is None or draft:
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
