"""The messages the plugin's CLI logger emits while a block runs (vLLM's loggers may not propagate
to pytest's log capture)."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def cli_warnings():
    """The WARNING messages of the plugin's CLI logger while the block runs (filled at its end)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.vllm_router_ext.cli")
    logger.addHandler(handler)
    messages: list[str] = []
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        messages += [r.getMessage() for r in records if r.levelno == logging.WARNING]
