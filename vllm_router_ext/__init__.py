"""vllm-router-ext: a vLLM plugin that owns the MoE router GEMM of every model vLLM builds with GateLinear.

Importing this package does no vLLM, GPU or logging work; vLLM calls :func:`register` through the
``vllm.general_plugins`` entry point in every process it starts.
"""

from vllm_router_ext._version import ENTRY_POINT, __version__

__all__ = ["ENTRY_POINT", "__version__", "register"]


def register() -> None:
    """Entry point for ``vllm.general_plugins``: tiny, lazy, idempotent."""
    from vllm_router_ext._plugin import register_all

    register_all()
