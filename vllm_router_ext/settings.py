"""Every setting of the plugin, declared once: its ``additional_config`` key, its flag on vLLM's
command line, its environment variable, the values it takes and its default.

:data:`SETTINGS` lists them (docs/troubleshooting.md shows the same table): the router precision,
a draft's own precision, batch invariance, the fused router (the gate GEMM and the expert selection in
one op), the router capture (directory, tokens, memory limit), and
two kernel-level environment variables (the tuned table, PDL).

A flag's value travels to every vLLM process as its key with ``_cli`` appended (it outranks the
key itself). Every source is checked where the engine is started, before it starts
(:func:`vllm_router_ext.cli.check_settings`): a bad value anywhere, or an unknown ``router_*`` key,
stops the start-up with one line naming the source, the value and what is allowed. The two
kernel-level knobs (the table and PDL) are read by the op itself (:mod:`csrc_triton.environment`).
Imports nothing of vLLM or Triton.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    key: str | None  # the ``additional_config`` key; None: an environment variable only
    flag: str | None
    env: str | None
    values: str
    default: str


SETTINGS: tuple[Setting, ...] = (
    Setting("router_precision", "--router-precision", "VLLM_ROUTER_PRECISION",
            "auto, fp32, bf16-fp32out, bf16", "auto"),
    Setting("router_precision_draft", "--router-precision-draft", None,
            "auto, fp32, bf16-fp32out, bf16, vllm", "auto: the target's"),
    Setting("router_batch_invariant", "--router-batch-invariant", "VLLM_BATCH_INVARIANT (vLLM's)",
            "true, false", "false"),
    Setting("router_fused", "--router-fused", None, "auto, on, off", "auto: on where it is faster"),
    Setting("router_capture_dir", "--router-capture", "VLLM_ROUTER_CAPTURE_DIR",
            "a writable directory", "no capture"),
    Setting("router_capture_tokens", "--router-capture-tokens", "VLLM_ROUTER_CAPTURE_TOKENS",
            "an integer >= 1", "4096"),
    Setting("router_capture_memory_limit_gib", "--router-capture-memory-limit",
            "VLLM_ROUTER_CAPTURE_MEMORY_LIMIT_GIB", "GiB > 0", "25% of the host's memory"),
    Setting(None, None, "VLLM_ROUTER_EXT_TABLE", "none, a shipped table's name, a JSON path",
            "the GPU's own table"),
    Setting(None, None, "VLLM_ROUTER_EXT_PDL", "0, 1", "1"),
)  # fmt: skip

CLI_SUFFIX = "_cli"
PREFIX = "router_"
#: The settings as checked where the engine starts, carried to every engine process (not a user's).
CHECKED = "router_checked_settings"
#: Every ``additional_config`` key of the plugin: each setting's, its flag's twin, the checked set.
KEYS: frozenset[str] = frozenset(
    k for s in SETTINGS if s.key for k in (s.key, *((s.key + CLI_SUFFIX,) if s.flag else ()))
) | {CHECKED}


class SettingsError(ValueError):
    """A setting the plugin cannot take; the message is one line naming the source, the value and
    the allowed values."""


def check_keys(additional_config: Any) -> None:
    """Every ``router_*`` key of ``additional_config`` is one of ours; a misspelt one is refused
    with the nearest key (a silently ignored setting would serve the wrong routing)."""
    if not isinstance(additional_config, dict):
        return
    for key in additional_config:
        if isinstance(key, str) and key.startswith(PREFIX) and key not in KEYS:
            known = [s.key for s in SETTINGS if s.key]
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise SettingsError(
                f"unknown key additional_config[{key!r}]{hint} The plugin's keys: {', '.join(known)}"
            )
