"""vLLM layers: the router GEMM as a vLLM ``CustomOp`` and the ``GateLinear`` replacement.

The replacement is registered with ``@GateLinear.register_oot`` so vLLM builds it wherever a model
asks for a ``GateLinear``. It changes nothing unless the gate is built inside
:func:`router_settings_scope` (our DeepSeek-family model override opens it): every other model's
gate (MiniMax, HY-V3, gpt-oss, ...) stays exactly what stock vLLM builds.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

from vllm_router_ext.ops.native import router_gemm_native
from vllm_router_ext.ops.router_gemm import fp32_weight_terms, router_gemm
from vllm_router_ext.precision import (
    RouterPrecision,
    RouterSettings,
    bf16_round_trip_exact,
)

# Under "vllm." so vLLM's handlers and format apply.
logger = init_logger(f"vllm.{__name__}")

_SETTINGS: contextvars.ContextVar[RouterSettings | None] = contextvars.ContextVar(
    "vllm_router_ext_settings", default=None
)


@contextlib.contextmanager
def router_settings_scope(settings: RouterSettings) -> Iterator[None]:
    """Gates built inside this scope use ``settings``; outside it they are stock vLLM."""
    token = _SETTINGS.set(settings)
    try:
        yield
    finally:
        _SETTINGS.reset(token)


# --8<-- [start:router_gemm]
@CustomOp.register("router_ext_router_gemm")
class RouterGemm(CustomOp):
    """The router GEMM of one gate: ``forward_native`` is plain torch (CPU, reference);
    ``forward_cuda`` calls the ``router_ext::router_gemm`` torch op, which picks the kernel by the
    number of tokens at run time, out of sight of torch.compile and CUDA-graph capture."""

    def __init__(self, precision: RouterPrecision, batch_invariant: bool) -> None:
        # On by default: with inductor vLLM turns custom ops off unless listed, which would send
        # CUDA to forward_native (an fp32 upcast). "-router_ext_router_gemm" still turns it off.
        from vllm.config import get_cached_compilation_config

        disabled = "-router_ext_router_gemm" in get_cached_compilation_config().custom_ops
        super().__init__(enforce_enable=not disabled)
        self.precision = precision
        self.batch_invariant = batch_invariant

    def forward_native(
        self, x: torch.Tensor, weight: torch.Tensor, weight_terms: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.batch_invariant:
            # Row-by-row on CPU: behind the torch op so compile sees no loop over tokens.
            return router_gemm(x, weight, self.precision, batch_invariant=True)
        return router_gemm_native(x, weight, self.precision)

    def forward_cuda(
        self, x: torch.Tensor, weight: torch.Tensor, weight_terms: torch.Tensor | None = None
    ) -> torch.Tensor:
        return router_gemm(
            x, weight, self.precision, batch_invariant=self.batch_invariant, weight_terms=weight_terms
        )


# --8<-- [end:router_gemm]


class RouterGateLinear(GateLinear):
    """``GateLinear`` whose GEMM runs in a resolved :class:`RouterPrecision`.

    Weight storage by mode: ``fp32`` keeps fp32 unless the checkpoint's values are exactly bf16
    (then bf16: the products and the fp32 accumulation are the same, at half the bytes);
    ``bf16-fp32out`` and ``bf16`` keep the model dtype.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        out_dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        force_fp32_compute: bool = False,
        skip_bias_add: bool = False,
        quant_config=None,
        prefix: str = "",
        return_bias: bool = True,
    ) -> None:
        settings = _SETTINGS.get()
        applies = settings is not None and not bias and prefix.endswith(".gate")
        if applies:
            out_dtype = settings.precision.logits_dtype
            force_fp32_compute = False
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            out_dtype=out_dtype,
            params_dtype=params_dtype,
            force_fp32_compute=force_fp32_compute,
            skip_bias_add=skip_bias_add,
            quant_config=quant_config,
            prefix=prefix,
            return_bias=return_bias,
        )
        self.router_settings: RouterSettings | None = None
        self.router_capture = None  # a capture.GateCapture while --router-capture records
        if not applies:
            return
        if not self.is_unquantized:
            logger.warning_once(
                "vllm-router-ext: gate %s is quantized; leaving it to vLLM's GateLinear.", prefix
            )
            return
        self.router_settings = settings
        self.router_weight_kept_bf16: bool | None = None
        # fp32 mode, fp32 weight: its three bf16 terms (made when the weight is loaded) for the
        # large-M GEMM on CUDA. Not a checkpoint tensor.
        self.router_weight_terms: torch.Tensor | None = None
        # Our op owns every token count: switch off every GEMM tier this GateLinear has (each is
        # an ``allow_*`` flag), also those a later vLLM adds. ``forward`` never calls GateLinear's
        # tiers either; the flags keep anything that reads them (weight processing) off too.
        for tier in [name for name in vars(self) if name.startswith("allow_")]:
            setattr(self, tier, False)
        # On the CPU platform vLLM's GEMM dispatch would repack ``weight`` for oneDNN and delete
        # it after loading; our op reads ``weight`` itself.
        self._cpu_skip_gemm_dispatch = True
        self.router_gemm = RouterGemm(settings.precision, settings.batch_invariant)

    @property
    def router_precision(self) -> RouterPrecision | None:
        return None if self.router_settings is None else self.router_settings.precision

    def weight_loader(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.router_settings is None or param is not self.weight:
            return super().weight_loader(param, loaded_weight)
        settings = self.router_settings
        exact = bf16_round_trip_exact(loaded_weight)
        if settings.precision is RouterPrecision.FP32:
            keep_bf16 = exact and param.dtype == torch.bfloat16
            storage = torch.bfloat16 if keep_bf16 else torch.float32
            self.router_weight_kept_bf16 = keep_bf16
        else:
            storage = param.dtype
            if not exact and loaded_weight.dtype == torch.float32 and storage != torch.float32:
                logger.warning_once(
                    "vllm-router-ext: the checkpoint stores %s in fp32 with values bf16 cannot "
                    "hold; router precision %s rounds them. Use --router-precision fp32 (auto's "
                    "choice) to keep them.",
                    self.prefix,
                    settings.precision.value,
                )
        if storage != param.dtype:
            param.data = torch.empty(param.shape, dtype=storage, device=param.device)
        super().weight_loader(param, loaded_weight)
        # Made again at every load (weight updates too), so the terms never go stale. Only the
        # CUDA dispatch reads them, in the fp32 mode without batch invariance (forward_native
        # computes in fp32 from the weight itself).
        uses_terms = settings.precision is RouterPrecision.FP32 and not settings.batch_invariant
        self.router_weight_terms = (
            fp32_weight_terms(param.data) if uses_terms and param.dtype == torch.float32 else None
        )

    def attach_capture(self, capture) -> None:
        from vllm_router_ext.capture import layer_index

        self.router_capture = capture
        self._capture_layer = layer_index(self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        if self.router_settings is None:
            return super().forward(x)
        logits = self.router_gemm(x, self.weight, self.router_weight_terms)
        if self.router_capture is not None:
            self._record(x, logits)
        return self._return(logits)

    def _record(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        try:
            self.router_capture.record(self._capture_layer, x, logits)
        except Exception as e:  # noqa: BLE001 -- a capture never stops serving
            logger.error("vllm-router-ext: router capture stopped in %s: %r", self.prefix, e)
            self.router_capture = None


def register_gate_linear() -> None:
    """Register :class:`RouterGateLinear` as vLLM's out-of-tree ``GateLinear`` (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot

    current = op_registry_oot.get("GateLinear")
    if current is RouterGateLinear:
        return
    if current is not None:
        raise RuntimeError(
            f"another plugin already replaced vLLM's GateLinear with {current.__module__}."
            f"{current.__qualname__}; vllm-router-ext cannot own the router GEMM as well"
        )
    GateLinear.register_oot(RouterGateLinear)


__all__ = [
    "RouterGateLinear",
    "RouterGemm",
    "register_gate_linear",
    "router_settings_scope",
]
