"""vLLM layers: the router GEMM as a vLLM ``CustomOp`` and the ``GateLinear`` replacement.

The replacement is registered with ``GateLinear.register_oot`` (subclasses under their own names)
so vLLM builds it wherever a model asks for a ``GateLinear``. It changes nothing unless the gate is
built inside :func:`router_settings_scope` with settings that own gates (the model override opens
it): a gate built anywhere else stays exactly what stock vLLM builds.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from vllm_router_ext._version import ENTRY_POINT
from vllm_router_ext.ops.router_gemm import fp32_weight_terms, router_gemm
from vllm_router_ext.ops.router_gemm_torch import router_gemm_torch
from vllm_router_ext.precision import (
    GateSettingsError,
    RouterPrecision,
    RouterSettings,
    bf16_round_trip_exact,
    refuse_bf16_logits,
)

# Under "vllm." so vLLM's handlers and format apply.
logger = init_logger(f"vllm.{__name__}")

_SETTINGS: contextvars.ContextVar[RouterSettings | None] = contextvars.ContextVar(
    "vllm_router_ext_settings", default=None
)


@contextlib.contextmanager
def router_settings_scope(settings: RouterSettings) -> Iterator[None]:
    """Gates built inside this scope use ``settings``; outside it they are stock vLLM. Settings
    that own gates register our ``GateLinear`` first (:func:`register_gate_linear`)."""
    if settings.owns_gates:
        register_gate_linear(settings.model)
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
        return router_gemm_torch(x, weight, self.precision)

    def forward_cuda(
        self, x: torch.Tensor, weight: torch.Tensor, weight_terms: torch.Tensor | None = None
    ) -> torch.Tensor:
        return router_gemm(
            x, weight, self.precision, batch_invariant=self.batch_invariant, weight_terms=weight_terms
        )


# --8<-- [end:router_gemm]


class RouterGateMixin:
    """What makes a ``GateLinear`` (or a subclass with its constructor) ours: built inside
    :func:`router_settings_scope` with settings that own gates, it runs the resolved
    :class:`RouterPrecision`; anywhere else it is the stock layer.

    Weight storage by mode: ``fp32`` keeps fp32 unless the checkpoint's values are exactly bf16
    (then bf16: the products and the fp32 accumulation are the same, at half the bytes);
    ``bf16-fp32out`` and ``bf16`` keep the model's gate dtype. A gate bias is added to the fp32
    sums before the logits are stored (one rounding in ``bf16``, as ``F.linear``).
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
        if settings is not None and settings.owns_gates:
            stock = stock_precision(params_dtype, out_dtype, force_fp32_compute)
            settings = dataclasses.replace(settings, precision=settings.precision or stock)
            check_logits_dtype(settings, stock, prefix)
            out_dtype = settings.precision.logits_dtype
            force_fp32_compute = False
        else:
            settings = None
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
        self.router_model = None  # a weak reference to the model that built this gate (the override's)
        if settings is None:
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
        # Set where the fused router routes this gate's layer (layers.router): warmed with it.
        self.router_fused_routing = None
        # Our op owns every token count: switch off every GEMM tier this GateLinear has (each is
        # an ``allow_*`` flag), also those a later vLLM adds. ``forward`` never calls GateLinear's
        # tiers either; the flags keep anything that reads them (weight processing) off too.
        for tier in [name for name in vars(self) if name.startswith("allow_")]:
            setattr(self, tier, False)
        # On the CPU platform vLLM's GEMM dispatch would repack ``weight`` for oneDNN and delete
        # it after loading; our op reads ``weight`` itself.
        self._cpu_skip_gemm_dispatch = True
        # A bias is added to fp32 sums: bf16 logits then take one rounding, as F.linear's.
        adds_bias = self.bias is not None and not self.skip_bias_add
        gemm = settings.precision
        if adds_bias and gemm is RouterPrecision.BF16:
            gemm = RouterPrecision.BF16_FP32OUT
        self._adds_bias = adds_bias
        self.router_gemm = RouterGemm(gemm, settings.batch_invariant)
        # The kernels are warmed once the weight is final (_RouterGateMethod): for the model's
        # activation dtype (the default dtype while vLLM builds it) and every step size it runs.
        self._router_x_dtype = torch.get_default_dtype()
        self._router_max_tokens = _max_tokens_per_step()
        if type(self.quant_method) is UnquantizedLinearMethod:
            self.quant_method = _RouterGateMethod()

    def _takes_over(self) -> bool:
        """Whether this gate runs our op (also while GateLinear's constructor is still running)."""
        settings = getattr(self, "router_settings", _UNSET)
        if settings is not _UNSET:
            return settings is not None
        building = _SETTINGS.get()
        return building is not None and building.owns_gates and self.is_unquantized

    # vLLM (0.34) registers start-up compiles of the GateLinear tiers a gate may run; a gate of
    # ours runs none of them, so it registers none.
    def _register_sm90_bf16x3_warmup(self) -> None:
        if not self._takes_over():
            super()._register_sm90_bf16x3_warmup()

    def _register_ll_fp32w_warmup(self) -> None:
        if not self._takes_over():
            super()._register_ll_fp32w_warmup()

    def warm_up_router_kernels(self) -> int:
        """Compile every kernel variant this gate can launch for 1..max tokens per step (CUDA;
        once per process for each distinct gate); the number of launches run."""
        if self.router_settings is None:
            return 0
        from vllm_router_ext.ops.warmup import warm_up_gate

        return warm_up_gate(
            self.weight,
            self.router_gemm.precision,
            self.router_gemm.batch_invariant,
            self._router_x_dtype,
            self._router_max_tokens,
            self.router_weight_terms,
            self.router_fused_routing,
        )

    def set_out_dtype(self, out_dtype: torch.dtype) -> None:
        if self.router_settings is None:
            return super().set_out_dtype(out_dtype)
        # The resolved precision already set the logits dtype; the model may only ask for it.
        if out_dtype == torch.float32 and self.router_settings.precision.logits_dtype != torch.float32:
            check_logits_dtype(self.router_settings, RouterPrecision.BF16_FP32OUT, self.prefix)

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
        if self._adds_bias:
            logits = (logits + self.bias.float()).to(self.out_dtype or x.dtype)
        self.logits_seen(x, logits)
        if not self.return_bias:
            return logits
        return logits, (self.bias if self.skip_bias_add else None)

    def logits_seen(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Every input and logits of this gate pass here, from its forward or from the fused
        router's op (``layers.router``): the capture records them (taps wrap this method)."""
        if self.router_capture is not None:
            self._record(x, logits)

    def _record(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        try:
            self.router_capture.record(self._capture_layer, x, logits)
        except Exception as e:  # noqa: BLE001 -- a capture never stops serving
            logger.error("vllm-router-ext: router capture stopped in %s: %r", self.prefix, e)
            self.router_capture = None


class _RouterGateMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear method, then the warm-up of the gate's kernels: every weight
    loader (dummy weights and reloads too) runs this once the weights are final, before vLLM
    arms its JIT monitor."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        model = getattr(layer, "router_model", None)
        if model is not None and (built := model()) is not None:
            built.router_weights_final()  # its line and checks, whichever loader ran (dummy too)
        layer.warm_up_router_kernels()


def _max_tokens_per_step() -> int:
    """The most tokens one forward pass of the model being built takes (0: no engine config)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    scheduled = getattr(config.scheduler_config, "max_num_batched_tokens", None) or 0
    graphs = getattr(config.compilation_config, "cudagraph_capture_sizes", None) or [0]
    return max(int(scheduled), *map(int, graphs))


_UNSET = object()


class RouterGateLinear(RouterGateMixin, GateLinear):
    """``GateLinear`` whose GEMM runs in a resolved :class:`RouterPrecision`."""


def stock_precision(
    params_dtype: torch.dtype | None, out_dtype: torch.dtype | None, force_fp32_compute: bool
) -> RouterPrecision:
    """The precision vLLM's own gate computes with these constructor arguments."""
    if params_dtype == torch.float32:
        return RouterPrecision.FP32
    if out_dtype == torch.float32 or force_fp32_compute:
        return RouterPrecision.BF16_FP32OUT
    return RouterPrecision.BF16


def check_logits_dtype(settings: RouterSettings, stock: RouterPrecision, prefix: str) -> None:
    """A gate whose model asks for fp32 logits (its routing reads them) takes no bf16 logits."""
    if stock is not RouterPrecision.BF16:
        refuse_bf16_logits(settings, f"its gate {prefix or '(unnamed)'} asks for them")


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def active_gate_linear() -> type | None:
    """The out-of-tree ``GateLinear`` replacement vLLM builds now (None: vLLM's own)."""
    from vllm.model_executor.custom_op import op_registry_oot

    return op_registry_oot.get("GateLinear")


def register_gate_linear(model: str = "this model") -> None:
    """Make vLLM build our gates for ``GateLinear`` and its subclasses (idempotent). Called while a
    model that needs our gates is built, after every plugin has registered what it replaces: a
    second replacement of ``GateLinear`` is then named with the way to choose, and a plugin that
    never needs our gates never claims the name."""
    from vllm.model_executor.custom_op import op_registry_oot

    current = active_gate_linear()
    if current is None:
        GateLinear.register_oot(RouterGateLinear)
    elif current is not RouterGateLinear:
        raise GateSettingsError(
            f"vllm-router-ext: {model} asks for router settings of ours, but vLLM's GateLinear is "
            f"replaced by {current.__module__}.{current.__qualname__} from another plugin. Choose one: "
            "list the plugins vLLM may load in VLLM_PLUGINS (comma-separated entry-point names; "
            f"{ENTRY_POINT} is ours), or leave the router settings unset (auto) to keep the other "
            "plugin's gate"
        )
    for sub in _all_subclasses(GateLinear):
        if issubclass(sub, RouterGateMixin) or op_registry_oot.get(sub.__name__) is not None:
            continue
        if sub.__init__ is not GateLinear.__init__:
            raise GateSettingsError(
                f"vllm-router-ext: {model} builds its router with {sub.__module__}.{sub.__qualname__}, "
                "a GateLinear subclass with a constructor of its own, which vllm-router-ext cannot "
                "take over; leave the router settings unset (auto) for this model"
            )
        ours = type(sub.__name__, (RouterGateMixin, sub), {"__module__": __name__})
        sub.register_oot(ours, name=sub.__name__)


__all__ = [
    "GateSettingsError",
    "RouterGateLinear",
    "RouterGateMixin",
    "RouterGemm",
    "register_gate_linear",
    "router_settings_scope",
]
