"""Tuned tables: per GPU a JSON file in ``configs/`` (written by ``benchmarks/tune.py``) that maps
a (K, N) gate shape and a mode to buckets ``{"max_m": int | null, "kernel": ..., launch fields}``,
looked up by the first bucket whose ``max_m`` >= M. Which table is read: the GPU's own, or
``VLLM_ROUTER_EXT_TABLE``. Nothing here autotunes at run time."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from csrc_triton import environment

CONFIG_DIR = Path(__file__).parent / "configs"


@functools.cache  # called on every dispatch (the config's source note): keep it off the host path
def device_key(name: str) -> str:
    """File-name key of a GPU: 'NVIDIA H200' -> 'nvidia_h200'."""
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


#: Which tuned table the dispatch reads. Unset: the GPU's own (``configs/<gpu name>.json``, e.g.
#: ``nvidia_h200``); ``none``: the heuristic for every shape; a table's name in ``configs/`` (e.g.
#: ``nvidia_h200`` on an H100, whose SMs and shared memory are the H200's); or the path of a JSON
#: table written by ``benchmarks/tune.py`` for this GPU.
TABLE_ENV_VAR = environment.TABLE

#: Set by :func:`table_override` (the benchmark's heuristic columns, tests); wins over the env var.
_FORCED_TABLE: list[str] = []


def available_tables() -> list[str]:
    """Names of the tuned tables shipped with the package."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def table_choice() -> str | None:
    """The validated table override: None (the GPU's own table), ``"none"``, a shipped table's name
    or a JSON path. Raises ValueError naming the bad value and the allowed ones (checked when a
    model is built, so a typo stops the start-up, not a serving step)."""
    value = _FORCED_TABLE[-1] if _FORCED_TABLE else environment.table()
    return _validated_choice(value, CONFIG_DIR) if value else None


def _is_path(value: str) -> bool:
    """A table override that names a file rather than a shipped table."""
    return value.endswith(".json") or os.sep in value


@functools.cache
def _validated_choice(value: str, config_dir: Path) -> str:
    if value.lower() == "none":
        return "none"
    if _is_path(value):
        if not Path(value).is_file():
            raise ValueError(f"{TABLE_ENV_VAR}={value!r}: no such file (a tuned table's JSON path)")
        return value
    if not (config_dir / f"{value}.json").is_file():
        allowed = ", ".join(["none", *available_tables(), "a path to a JSON table"])
        raise ValueError(f"{TABLE_ENV_VAR}={value!r} is not a tuned table; allowed: {allowed}")
    return value


def table_name(device_name: str) -> str | None:
    """What :func:`load_table` reads for this GPU (a table name or a path), None for no table."""
    choice = table_choice()
    if choice == "none":
        return None
    return choice or device_key(device_name)


def table_label(device_name: str) -> str:
    """For logs and a launch's ``source``: the table's name, marked when it is an override."""
    name = table_name(device_name)
    if name is None:
        return "none (heuristic)"
    label = Path(name).name if _is_path(name) else name
    return f"{label} ({TABLE_ENV_VAR})" if table_choice() else label


def load_table(device_name: str) -> dict[str, Any]:
    """The tuned table the dispatch uses on this GPU ({} = none: the heuristic)."""
    name = table_name(device_name)
    return {} if name is None else _read_table(name, CONFIG_DIR)


@functools.cache
def _read_table(name: str, config_dir: Path) -> dict[str, Any]:
    path = Path(name) if _is_path(name) else config_dir / f"{name}.json"
    if not path.exists():
        return {}
    table = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(table, dict) or not isinstance(table.get("shapes", {}), dict):
        raise ValueError(f"{path}: not a tuned table (a JSON object with a 'shapes' object)")
    return table


def clear_table_cache() -> None:
    """Forget tables read so far and re-read ``VLLM_ROUTER_EXT_TABLE`` (the tuner rewrites its
    table while it runs; tests change the variable)."""
    _read_table.cache_clear()
    _validated_choice.cache_clear()
    environment.reread()


@contextlib.contextmanager
def table_override(value: str) -> Iterator[None]:
    """Dispatch with ``value`` as if ``VLLM_ROUTER_EXT_TABLE`` held it (``"none"``: the heuristic).
    The choice is made when a config is selected: a CUDA graph captured inside keeps it."""
    _validated_choice(value, CONFIG_DIR)
    _FORCED_TABLE.append(value)
    try:
        yield
    finally:
        _FORCED_TABLE.pop()


def bucket_for(buckets: list[dict[str, Any]], m: int) -> dict[str, Any] | None:
    """The bucket that serves M: the first whose ``max_m`` >= M (``None`` = unbounded)."""
    return next((b for b in buckets if b["max_m"] is None or m <= b["max_m"]), None)


def table_buckets(device_name: str, k: int, n: int, key: str) -> list[dict[str, Any]]:
    """This GPU's tuned buckets for a [n, k] gate under ``key`` (``fp32``, ``bf16-fp32out``, with
    ``/batch_invariant`` or ``/triton``); [] where the table has none (the heuristic serves)."""
    return load_table(device_name).get("shapes", {}).get(f"{k}x{n}", {}).get(key, [])


def has_shape(device_name: str, k: int, n: int) -> bool:
    """Whether this GPU's table was tuned for a [n, k] gate."""
    return bool(load_table(device_name).get("shapes", {}).get(f"{k}x{n}"))
