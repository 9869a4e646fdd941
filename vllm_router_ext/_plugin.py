"""What :func:`vllm_router_ext.register` does, in every vLLM process."""

from __future__ import annotations

import threading

#: The vLLM releases this plugin supports: (major, minor) from, up to but not including. Their
#: GateLinear, PluggableLayer and model registry are what the plugin replaces and wraps.
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 34))
SUPPORTED_VLLM_TEXT = "0.32.x and 0.33.x"
_LOCK = threading.Lock()
_DONE = False


class UnsupportedVllmError(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` naming ``version`` and the supported releases unless
    ``version`` (e.g. ``0.33.0``, ``0.32.0+cpu``, ``0.33.1.dev4+g1234``) is one of them."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = None
    low, high = SUPPORTED_VLLM
    if release is None or not low <= release < high:
        raise UnsupportedVllmError(
            f"vllm-router-ext supports vLLM {SUPPORTED_VLLM_TEXT}; this is vLLM {version}. Install a "
            f"supported vLLM (pip install 'vllm>={low[0]}.{low[1]},<{high[0]}.{high[1]}'), or run "
            "without the plugin: pip uninstall vllm-router-ext, or leave it out of VLLM_PLUGINS "
            "(a comma-separated list of the plugins vLLM loads)."
        )


def _check_vllm() -> None:
    import vllm

    check_vllm_version(vllm.__version__)


def register_all() -> None:
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _check_vllm()
        from vllm import ModelRegistry

        from vllm_router_ext.cli import install_cli_flags
        from vllm_router_ext.models.override import override_registry

        # Our GateLinear is registered while a model that needs it is built (models/override.py).
        override_registry(ModelRegistry)
        install_cli_flags()
        _DONE = True
