"""vllm-router-ext: a vLLM plugin that owns the MoE router GEMM of DeepSeek-family models.

Importing this package does no vLLM, GPU or logging work; vLLM calls :func:`register` through the
``vllm.general_plugins`` entry point in every process it starts.
"""

__version__ = "0.1.0"

#: The vLLM releases this plugin supports: (major, minor) from, up to but not including. Their
#: GateLinear, PluggableLayer and DeepSeek-V2 model file are what the plugin replaces and wraps.
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 34))
SUPPORTED_VLLM_TEXT = "0.32.x and 0.33.x"


def register() -> None:
    """Entry point for ``vllm.general_plugins``: tiny, lazy, idempotent."""
    from vllm_router_ext._plugin import register_all

    register_all()
