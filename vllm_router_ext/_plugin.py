"""What :func:`vllm_router_ext.register` does, in every vLLM process.

The plugin decides by what it uses of vLLM, not by the version string: :func:`missing_hooks` looks
for each hook it wraps or replaces. All there on a release it was not tested with: it loads, with
one warning line naming the tested ones. One missing: it does not register, and one error line
names the hook and the way out. Either way vLLM itself keeps working (``vllm --version``, ``--help``,
every model without the plugin's flags); nothing the plugin does at registration raises.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable

from vllm_router_ext._version import ENTRY_POINT

#: The vLLM releases this plugin is tested with: (major, minor) from, up to but not including.
TESTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 35))
TESTED_VLLM_TEXT = "0.32.x, 0.33.x and 0.34.x"
INSTALL_TESTED = "pip install 'vllm>=0.32,<0.35'"

#: The ``GateLinear`` constructor arguments the plugin's gate takes and passes on.
GATE_LINEAR_ARGS = (
    "input_size", "output_size", "bias", "out_dtype", "params_dtype", "force_fp32_compute",
    "skip_bias_add", "quant_config", "prefix", "return_bias",
)  # fmt: skip

_LOCK = threading.Lock()
_DONE = False
# Under "vllm." so vLLM's handlers and format apply (vLLM has configured them when it loads plugins).
logger = logging.getLogger(f"vllm.{__name__}")


def _engine_args() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    wanted = ("add_cli_args", "from_cli_args", "create_engine_config")
    return [f"EngineArgs.{name}" for name in wanted if not callable(getattr(EngineArgs, name, None))]


def _registry() -> list[str]:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _BaseRegisteredModel

    missing = []
    if not isinstance(getattr(ModelRegistry, "models", None), dict):
        missing.append("ModelRegistry.models (a dict of architecture -> entry)")
    for name in ("inspect_model_cls", "load_model_cls"):
        if not callable(getattr(_BaseRegisteredModel, name, None)):
            missing.append(f"the model registry entry's {name}")
    return missing


def _custom_op() -> list[str]:
    from vllm.config import get_cached_compilation_config  # noqa: F401  (the op reads it)
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    missing = [
        f"CustomOp.{n}" for n in ("register", "register_oot") if not callable(getattr(CustomOp, n, None))
    ]
    if not isinstance(op_registry_oot, dict):
        missing.append("vllm.model_executor.custom_op.op_registry_oot")
    return missing


def _gate_linear() -> list[str]:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    params = inspect.signature(GateLinear.__init__).parameters
    missing = [f"GateLinear({name}=...)" for name in GATE_LINEAR_ARGS if name not in params]
    for name in ("set_out_dtype", "register_oot", "forward"):
        if not callable(getattr(GateLinear, name, None)):
            missing.append(f"GateLinear.{name}")
    return missing


#: Each hook group: what to call it where its module cannot be imported, and its check.
_HOOKS: tuple[tuple[str, Callable[[], list[str]]], ...] = (
    ("vllm.engine.arg_utils.EngineArgs", _engine_args),
    ("vllm's model registry (ModelRegistry, _BaseRegisteredModel)", _registry),
    ("vllm.model_executor.custom_op.CustomOp", _custom_op),
    ("vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear", _gate_linear),
)


def missing_hooks() -> list[str]:
    """What the plugin wraps or replaces in vLLM that this vLLM lacks; empty where all is there."""
    missing: list[str] = []
    for where, check in _HOOKS:
        try:
            missing += check()
        except Exception as e:  # noqa: BLE001 -- an import that fails is a missing hook
            missing.append(f"{where} ({type(e).__name__}: {e})".replace("\n", " "))
    return missing


def tested(version: str) -> bool:
    """Whether ``version`` (e.g. ``0.33.0``, ``0.32.0+cpu``, ``0.34.1.dev4+g1234``) is a tested release."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        return False
    low, high = TESTED_VLLM
    return low <= release < high


def not_loaded_message(version: str, missing: list[str]) -> str:
    """The one line logged where the plugin does not register."""
    return (
        f"vllm-router-ext is not loaded: vLLM {version} lacks {'; '.join(missing)}, which the plugin "
        f"needs (tested with vLLM {TESTED_VLLM_TEXT}). vLLM runs without it, so its --router-* flags "
        f"are unknown. Fix: {INSTALL_TESTED}, or leave the plugin out: VLLM_PLUGINS=<the other "
        f"plugins> (without {ENTRY_POINT}), or pip uninstall vllm-router-ext"
    )


def untested_message(version: str) -> str:
    """The one line logged where the plugin loads on a vLLM it was not tested with."""
    return (
        f"vllm-router-ext: vLLM {version} is not a release this plugin was tested with ({TESTED_VLLM_TEXT}); "
        f"every hook it needs is there, so it loads. If routing misbehaves: {INSTALL_TESTED}"
    )


def register_all() -> None:
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _DONE = True  # one attempt per process, whatever its outcome: one line, never one per call
        try:
            _register()
        except Exception as e:  # noqa: BLE001 -- the plugin never breaks vLLM
            logger.error(
                "vllm-router-ext is not loaded: registering it failed (%s: %s); vLLM runs without it. "
                "Leave it out with VLLM_PLUGINS=<the other plugins> (without %s)",
                type(e).__name__,
                str(e).replace("\n", " "),
                ENTRY_POINT,
            )


def _register() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    missing = missing_hooks()
    if missing:
        logger.error("%s", not_loaded_message(version, missing))
        return
    if not tested(version):
        logger.warning("%s", untested_message(version))
    from vllm import ModelRegistry

    from vllm_router_ext.cli import install_cli_flags
    from vllm_router_ext.models.override import override_registry

    # Our GateLinear is registered while a model that needs it is built (models/override.py).
    override_registry(ModelRegistry)
    install_cli_flags()
