"""vllm-router-ext: a vLLM plugin that owns the MoE router GEMM of DeepSeek-family models.

Importing this package does no vLLM, GPU or logging work; vLLM calls :func:`register` through the
``vllm.general_plugins`` entry point in every process it starts.
"""

__version__ = "0.1.0"

#: The oldest vLLM whose GateLinear / PluggableLayer this plugin replaces.
MIN_VLLM = "0.32.0"


def register() -> None:
    """Entry point for ``vllm.general_plugins``: tiny, lazy, idempotent."""
    from vllm_router_ext._plugin import register_all

    register_all()
