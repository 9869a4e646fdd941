"""The plugin's flags on vLLM's engine CLI, and its hook where an engine is started.

A general plugin gets no parser hook, but vLLM loads general plugins before it builds the engine
arguments (``AsyncEngineArgs.add_cli_args``), so :func:`install_cli_flags` wraps
``EngineArgs.add_cli_args`` (adds the flags) and ``EngineArgs.from_cli_args`` (copies the values
into ``additional_config``, which reaches the engine core and every worker). It also wraps
``EngineArgs.create_engine_config``, which runs in the process that starts the engine (``vllm
serve``'s API server, the offline ``LLM``'s), before the engine starts: every router setting is
checked there (:func:`check_settings`; on vLLM's command line a bad one exits 2 with one line), and
a router capture there is finished when that process exits, as vLLM's workers are killed without
a chance to.
"""

from __future__ import annotations

import argparse
import atexit
from typing import Any

from vllm_router_ext.capture import (
    CLI_DIR_KEY,
    CLI_MEMORY_LIMIT_KEY,
    CLI_TOKENS_KEY,
    DEFAULT_TOKENS,
    MEMORY_SHARE,
    CaptureError,
    check_directory,
    parse_gib,
    parse_tokens,
)
from vllm_router_ext.precision import (
    CLI_BATCH_INVARIANT_KEY,
    CLI_CONFIG_KEY,
    CLI_DRAFT_CONFIG_KEY,
    CLI_FUSED_KEY,
    FUSED_CHOICES,
    RouterPrecision,
    draft_choices,
)
from vllm_router_ext.settings import SettingsError, check_keys

_MARK = "_vllm_router_ext_wrapped"
_FROM_CLI = "_vllm_router_ext_from_cli"  # set on engine arguments parsed from vLLM's command line


def _logger():
    """This module's logger, under "vllm." so vLLM's handlers and format apply (vLLM imported late)."""
    from vllm.logger import init_logger

    return init_logger(f"vllm.{__name__}")


def add_router_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to a vLLM (or any argparse) parser; safe to call twice."""
    if any(getattr(a, "dest", None) == "router_precision" for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="vllm-router-ext", description="MoE router GEMM precision (every GateLinear router)."
    )
    # Defaults stay None (unset: lower-precedence sources apply). Each help names the real default;
    # its empty "%(default).0s" stops vLLM's help formatter from appending "(default: None)".
    group.add_argument(
        "--router-precision",
        choices=RouterPrecision.choices(),
        default=None,
        help="MoE router GEMM precision. auto (default): per model family, as its reference "
        "implementation routes (fp32 for DeepSeek, GLM-4.5, MiniMax-M2, ...; vLLM's own gate for "
        "Qwen, gpt-oss, Mixtral, ...: docs/precision.md); fp32: fp32 accumulation and logits, "
        "never TF32; bf16-fp32out: bf16 products, fp32 accumulation and logits; bf16: bf16 logits, "
        "as stock vLLM.%(default).0s",
    )
    group.add_argument(
        "--router-precision-draft",
        choices=draft_choices(),
        default=None,
        help="The router precision of a speculative-decoding draft (MTP layers, EAGLE heads, DSpark). "
        "auto (default): the target's; vllm: vLLM's own gate, for a draft trained on vLLM's routing; "
        "or one of the --router-precision modes.%(default).0s",
    )
    group.add_argument(
        "--router-capture",
        type=_argparse_check(lambda v: str(check_directory(v, "--router-capture"))),
        default=None,
        metavar="DIR",
        help="Record the first --router-capture-tokens inputs (and logits) of every router gate into "
        "DIR, for vllm-router-audit --hidden-states DIR. Needs --enforce-eager. "
        "Default: no capture.%(default).0s",
    )
    group.add_argument(
        "--router-capture-tokens",
        type=_argparse_check(lambda v: parse_tokens(v, "--router-capture-tokens")),
        default=None,
        metavar="N",
        help=f"Tokens (rows) per gate that --router-capture records; default {DEFAULT_TOKENS}. Host "
        "memory and disk: N x hidden size x 2 bytes per gate, plus N x experts x 4 bytes of logits. Rows "
        "reach DIR as each forward pass ends: a stop or a crash keeps what was recorded.%(default).0s",
    )
    group.add_argument(
        "--router-capture-memory-limit",
        type=_argparse_check(lambda v: parse_gib(v, "--router-capture-memory-limit")),
        default=None,
        metavar="GIB",
        help="The most host memory (GiB) a --router-capture budget may need (the audit reads a "
        "capture whole); a larger budget is refused at start-up. "
        f"Default: {MEMORY_SHARE:.0%}% of the host's memory.%(default).0s",
    )
    group.add_argument(
        "--router-batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Make router logits bitwise independent of the batch. Default: off, or on with "
        "VLLM_BATCH_INVARIANT=1 (which --no-router-batch-invariant does not override).%(default).0s",
    )
    group.add_argument(
        "--router-fused",
        choices=FUSED_CHOICES,
        default=None,
        help="Route each MoE layer with one op of ours (the gate GEMM, the scores and the top-k) instead "
        "of vLLM's router on our logits. auto (default): on where it is faster (docs/benchmarks.md); "
        "on: everywhere vLLM's router allows it (else the start-up stops, naming why); off: vLLM's "
        "router.%(default).0s",
    )
    return parser


def _argparse_check(check):
    """An argparse ``type`` from a check that raises :class:`CaptureError`: exit 2, its message."""

    def parse(value: str):
        try:
            return check(value)
        except CaptureError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def apply_router_cli_args(engine_args: Any, args: argparse.Namespace) -> Any:
    """Copy the parsed flags into ``engine_args.additional_config``."""
    updates = {}
    if getattr(args, "router_precision", None) is not None:
        updates[CLI_CONFIG_KEY] = args.router_precision
    if getattr(args, "router_precision_draft", None) is not None:
        updates[CLI_DRAFT_CONFIG_KEY] = args.router_precision_draft
    if getattr(args, "router_batch_invariant", None) is not None:
        updates[CLI_BATCH_INVARIANT_KEY] = bool(args.router_batch_invariant)
    if getattr(args, "router_fused", None) is not None:
        updates[CLI_FUSED_KEY] = args.router_fused
    if getattr(args, "router_capture", None) is not None:
        updates[CLI_DIR_KEY] = args.router_capture
    if getattr(args, "router_capture_tokens", None) is not None:
        updates[CLI_TOKENS_KEY] = args.router_capture_tokens
    if getattr(args, "router_capture_memory_limit", None) is not None:
        updates[CLI_MEMORY_LIMIT_KEY] = args.router_capture_memory_limit
    if CLI_DIR_KEY not in updates:
        for key, flag in ((CLI_TOKENS_KEY, "--router-capture-tokens"),
                          (CLI_MEMORY_LIMIT_KEY, "--router-capture-memory-limit")):  # fmt: skip
            if key in updates:
                _logger().warning(
                    "vllm-router-ext: %s %s does nothing without --router-capture DIR", flag, updates[key]
                )
    if updates:
        extra = engine_args.additional_config
        engine_args.additional_config = {**(extra if isinstance(extra, dict) else {}), **updates}
    return engine_args


def install_cli_flags() -> None:
    """Wrap ``EngineArgs.add_cli_args`` / ``from_cli_args`` once per process."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, _MARK, False):
        return
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser, *a, **kw):
        return add_router_cli_args(original_add(parser, *a, **kw))

    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = apply_router_cli_args(original_from(cls, args), args)
        object.__setattr__(engine_args, _FROM_CLI, True)
        return engine_args

    original_create = EngineArgs.create_engine_config

    def create_engine_config(self, *a, **kw):
        config = original_create(self, *a, **kw)
        try:
            check_settings(config)
        except ValueError as e:
            if not getattr(self, _FROM_CLI, False):
                raise SettingsError(str(e)) from None
            message = str(e) if str(e).startswith("vllm-router-ext:") else f"vllm-router-ext: {e}"
            _logger().error("%s", message)
            raise SystemExit(2) from None
        except Exception as e:  # noqa: BLE001 -- a check that cannot run never stops vLLM
            _logger().warning(
                "vllm-router-ext: the router settings could not be checked before the engine (%r); "
                "each model's build checks them", e,
            )  # fmt: skip
        finish_captures_at_exit(config.additional_config)
        return config

    setattr(add_cli_args, _MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def check_settings(vllm_config: Any) -> None:
    """Every router setting of the engine about to start, from every source, as each model's build
    would resolve it: unknown ``router_*`` keys, every precision source (the target's and a draft's),
    batch invariance, the capture (its directory, budget values, ``--enforce-eager``), the kernel
    table, a routing path that skips the gate, bf16 logits where the family routes on fp32 ones.
    Raises ValueError with one line."""
    from vllm_router_ext.models.override import _capture_settings, _unless_bypassed
    from vllm_router_ext.precision import (
        CHECKED_KEY,
        DRAFT_CONFIG_KEY,
        check_family_logits,
        resolve_draft_precision,
        resolve_router_settings,
    )

    check_keys(vllm_config.additional_config)
    models = {"target": vllm_config}
    speculative = getattr(vllm_config, "speculative_config", None)
    draft_model = getattr(speculative, "draft_model_config", None)
    if draft_model is not None and draft_model is not vllm_config.model_config:
        models["draft"] = _with_model(vllm_config, draft_model)
    checked = {}
    for role, config in models.items():
        arch = (getattr(config.model_config.hf_config, "architectures", None) or [None])[0]
        settings = resolve_router_settings(config, draft=role == "draft")
        check_family_logits(settings, arch)
        capture = _capture_settings(config, role == "draft")
        if capture is not None:
            _check_capture_floor(capture, config.model_config.hf_config)
        if role == "target":  # drafts never capture
            checked["capture"] = None if capture is None else capture.to_json()
        settings = _unless_bypassed(settings, config, arch)
        if settings.owns_gates:
            from csrc_triton.tables import table_choice

            table_choice()
        checked[role] = settings.to_json()
    if isinstance(vllm_config.additional_config, dict):  # every engine process takes these as checked
        vllm_config.additional_config[CHECKED_KEY] = checked
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    own = resolve_draft_precision(
        cli=extra.get(CLI_DRAFT_CONFIG_KEY), additional_config=extra.get(DRAFT_CONFIG_KEY)
    )
    if own is not None and "draft" not in models:
        _logger().warning(
            "vllm-router-ext: the draft router precision (from %s) does nothing without a speculative-"
            "decoding draft (--speculative-config)", own[1],
        )  # fmt: skip


def _check_capture_floor(capture: Any, hf_config: Any) -> None:
    """A capture budget that one gate of this model alone could not hold is refused before any
    engine starts (the whole model's budget is checked when its gates are built)."""
    import torch

    from vllm_router_ext.capture import GateShape, check_budget
    from vllm_router_ext.ops.routing_fp64 import num_experts, routing_fields

    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    hidden, experts = routing_fields(cfg).get("hidden_size"), num_experts(cfg)
    if hidden and experts:
        check_budget(capture, [GateShape(0, int(hidden), int(experts), torch.bfloat16)], floor=True)


def _with_model(vllm_config: Any, model_config: Any) -> Any:
    """``vllm_config`` seen as the draft's build sees it: its model config in place."""
    from types import SimpleNamespace

    fields = {name: getattr(vllm_config, name, None) for name in ("additional_config", "kernel_config")}
    return SimpleNamespace(model_config=model_config, **fields)


_FINISHING: set[str] = set()


def finish_captures_at_exit(additional_config: Any) -> None:
    """At this process's exit, trim and log the captures the engine about to start leaves unfinished."""
    from vllm_router_ext.capture import next_run, resolve_capture, trim_unfinished

    try:
        capture = resolve_capture(additional_config if isinstance(additional_config, dict) else {})
    except CaptureError:
        return  # the engine's model build names the bad setting
    if capture is None or str(capture.directory) in _FINISHING:
        return
    _FINISHING.add(str(capture.directory))
    atexit.register(trim_unfinished, capture.directory, next_run(capture.directory))
