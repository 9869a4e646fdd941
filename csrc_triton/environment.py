"""Every environment variable this package reads, read here and nowhere else.

- ``VLLM_ROUTER_PRECISION``: ``auto``, ``fp32``, ``bf16-fp32out`` or ``bf16``; unset = ``auto``.
  Read when a model is built.
- ``VLLM_BATCH_INVARIANT`` (vLLM's own): ``1`` turns batch invariance on; default ``0``. Read when
  a model is built.
- ``VLLM_ROUTER_CAPTURE_DIR`` / ``VLLM_ROUTER_CAPTURE_TOKENS``: record the gates' inputs into that
  directory, that many tokens per gate (default 4096); unset = no capture.
  ``VLLM_ROUTER_CAPTURE_MEMORY_LIMIT_GIB``: the most host memory a capture may need (default a
  quarter of the host's). Read when a model is built.
- ``VLLM_ROUTER_EXT_TABLE``: the tuned kernel table: ``none`` (the heuristic), a shipped table's
  name (``nvidia_h200``) or a JSON path; unset = the GPU's own table. Read once per process.
- ``VLLM_ROUTER_EXT_PDL``: ``0`` launches the K-split sums plainly instead of with programmatic
  dependent launch; default ``1``. Read once per process.
- ``TRITON_INTERPRET`` (Triton's own): ``1`` runs the kernels in Triton's interpreter (CPU tests);
  read at each launch.

Values read once per process are cached; :func:`reread` forgets them (tests, the tuner).
"""

from __future__ import annotations

import functools
import os

PRECISION = "VLLM_ROUTER_PRECISION"
BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
CAPTURE_DIR = "VLLM_ROUTER_CAPTURE_DIR"
CAPTURE_TOKENS = "VLLM_ROUTER_CAPTURE_TOKENS"
CAPTURE_MEMORY_LIMIT = "VLLM_ROUTER_CAPTURE_MEMORY_LIMIT_GIB"
TABLE = "VLLM_ROUTER_EXT_TABLE"
PDL = "VLLM_ROUTER_EXT_PDL"
INTERPRET = "TRITON_INTERPRET"


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip() not in ("", "0")


def precision() -> str | None:
    return os.environ.get(PRECISION)


def batch_invariant() -> bool:
    return _flag(BATCH_INVARIANT, "0")


def capture() -> dict[str, str]:
    """The capture variables that are set ({name: value})."""
    names = (CAPTURE_DIR, CAPTURE_TOKENS, CAPTURE_MEMORY_LIMIT)
    return {name: os.environ[name] for name in names if name in os.environ}


@functools.cache
def table() -> str:
    return os.environ.get(TABLE, "").strip()


@functools.cache
def pdl() -> bool:
    return _flag(PDL, "1")


def interpreting() -> bool:
    """Under Triton's interpreter (read at each launch, so tests can set it per process)."""
    return _flag(INTERPRET, "0")


def reread() -> None:
    """Forget the values read once per process."""
    table.cache_clear()
    pdl.cache_clear()
