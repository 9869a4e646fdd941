"""What :func:`vllm_router_ext.register` does, in every vLLM process."""

from __future__ import annotations

import threading

from vllm_router_ext import MIN_VLLM

_LOCK = threading.Lock()
_DONE = False


def _check_vllm() -> None:
    try:
        from vllm.model_executor.custom_op import PluggableLayer  # noqa: F401
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"vllm-router-ext needs vLLM >= {MIN_VLLM} (PluggableLayer and GateLinear); "
            f"this vLLM lacks them: {e}"
        ) from e


def register_all() -> None:
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _check_vllm()
        from vllm import ModelRegistry

        from vllm_router_ext.cli import install_cli_flags
        from vllm_router_ext.layers.gate import register_gate_linear
        from vllm_router_ext.models.deepseek_v2 import IN_TREE_CLASSES

        register_gate_linear()
        supported = set(ModelRegistry.get_supported_archs())
        for arch in IN_TREE_CLASSES:
            if arch in supported:
                ModelRegistry.register_model(arch, f"vllm_router_ext.models.deepseek_v2:{arch}")
        install_cli_flags()
        _DONE = True
