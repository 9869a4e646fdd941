"""Record what a served model's router gates really see, for ``vllm-router-audit``.

Opt in with ``--router-capture DIR`` (or ``additional_config["router_capture_dir"]``, or
``VLLM_ROUTER_CAPTURE_DIR``) and a token budget ``--router-capture-tokens N`` (same keys with
``_tokens``; default :data:`DEFAULT_TOKENS`). Each gate the plugin owns keeps the first N rows of
its input and of the fp32 logits our op produced, from forward passes of scheduled requests
(vLLM's warm-up, profiling and data-parallel padding passes carry no attention metadata and are
skipped). Once every gate holds N rows, one file is written:

    DIR/router-capture-<run>-dp<rank>.safetensors   keys layers.<i> [N, hidden] (model dtype),
                                                      logits.<i> [N, experts] (float32)
    DIR/router-capture-<run>-dp<rank>.json           model, precision, vLLM version, tokens, ranks

``<run>`` is one more than the highest run already in DIR (nothing is overwritten); ``dp<rank>``
is the engine core's data-parallel rank. Tensor-parallel ranks hold the same replicated gate
inputs, so only TP rank 0 records and writes. Speculative-decoding drafts are not recorded.
The capture runs Python in the gate's forward: it needs eager mode (``--enforce-eager``); under
CUDA graphs or torch.compile a replayed graph would skip it, so those refuse to start with it.
A failed write (disk full, permissions) is logged and serving goes on.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from csrc_triton import environment

DIR_KEY = "router_capture_dir"
TOKENS_KEY = "router_capture_tokens"
CLI_DIR_KEY = "router_capture_dir_cli"
CLI_TOKENS_KEY = "router_capture_tokens_cli"
DIR_ENV = environment.CAPTURE_DIR
TOKENS_ENV = environment.CAPTURE_TOKENS
DEFAULT_TOKENS = 4096
FILE_RE = re.compile(r"^router-capture-(\d+)-dp\d+\.(?:safetensors|json)$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class CaptureError(ValueError):
    """A capture setting that cannot work; the message names the value and what is allowed."""


def parse_tokens(value: Any, source: str) -> int:
    try:
        tokens = int(str(value).strip())
    except ValueError:
        tokens = 0
    if tokens <= 0:
        raise CaptureError(
            f"invalid router capture budget {value!r} from {source}; allowed: a positive integer"
        )
    return tokens


def check_directory(value: Any, source: str) -> Path:
    """``value`` as a directory this process can create and write into, else :class:`CaptureError`."""
    path = Path(str(value)).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".router-capture-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CaptureError(
            f"router capture directory {str(path)!r} from {source} is not writable: {e}"
        ) from e
    return path


def next_run(directory: Path) -> int:
    """One more than the highest capture run in ``directory`` (1 in an empty one)."""
    runs = [int(m.group(1)) for p in directory.iterdir() if (m := FILE_RE.match(p.name))]
    return max(runs, default=0) + 1


@dataclass(frozen=True)
class CaptureSettings:
    directory: Path
    tokens: int
    source: str


def resolve_capture(additional_config: dict, env: dict[str, str] | None = None) -> CaptureSettings | None:
    """The capture request from its sources (command line, ``additional_config``, environment:
    first set wins, as for the precision); None when none asks for one. Validates what it uses."""
    env = environment.capture() if env is None else env
    extra = additional_config
    for source, directory, tokens_source, tokens in (
        ("--router-capture", extra.get(CLI_DIR_KEY), "--router-capture-tokens", extra.get(CLI_TOKENS_KEY)),
        (f"additional_config[{DIR_KEY!r}]", extra.get(DIR_KEY), f"additional_config[{TOKENS_KEY!r}]",
         extra.get(TOKENS_KEY)),
        (f"environment variable {DIR_ENV}", env.get(DIR_ENV), f"environment variable {TOKENS_ENV}",
         env.get(TOKENS_ENV)),
    ):  # fmt: skip
        if directory:
            budget = DEFAULT_TOKENS if tokens is None else parse_tokens(tokens, tokens_source)
            return CaptureSettings(check_directory(directory, source), budget, source)
    return None


class GateCapture:
    """One process's capture: the first ``tokens`` rows of each gate's input and logits."""

    def __init__(self, settings: CaptureSettings, gates: list[str], stem: str, meta: dict) -> None:
        self.settings = settings
        self.path = settings.directory / f"{stem}.safetensors"
        self.meta = meta
        self._rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._count: dict[int, int] = {layer_index(g): 0 for g in gates}
        self._lock = threading.Lock()
        self.done = False

    def record(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep what is still missing of this layer's budget; write once every layer is full."""
        take = min(x.shape[0], self.settings.tokens - self._count.get(layer, 0))
        if self.done or take <= 0 or not _serving_pass():
            return
        with self._lock:
            self._rows.setdefault(layer, []).append(
                (x[:take].detach().to("cpu", copy=True), logits[:take].detach().float().to("cpu", copy=True))
            )
            self._count[layer] = self._count.get(layer, 0) + take
            if all(c >= self.settings.tokens for c in self._count.values()):
                self.done = True
                self._write()

    def _write(self) -> None:
        from safetensors.torch import save_file

        from vllm_router_ext.layers.gate import logger

        tensors = {}
        for layer, rows in sorted(self._rows.items()):
            tensors[f"layers.{layer}"] = torch.cat([r[0] for r in rows]).contiguous()
            tensors[f"logits.{layer}"] = torch.cat([r[1] for r in rows]).contiguous()
        self._rows.clear()
        meta = {**self.meta, "tokens_per_layer": self.settings.tokens, "layers": sorted(self._count)}
        try:
            save_file(tensors, str(self.path), metadata={"format": "pt"})
            self.path.with_suffix(".json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        except OSError as e:  # disk full, directory gone: the server keeps serving
            logger.error("vllm-router-ext: could not write the router capture %s: %s", self.path, e)
            return
        logger.info(
            "vllm-router-ext: wrote the router capture %s (%d tokens x %d layers)",
            self.path,
            self.settings.tokens,
            len(self._count),
        )


def layer_index(gate_prefix: str) -> int:
    m = _LAYER_RE.search(gate_prefix)
    if m is None:
        raise CaptureError(f"cannot tell the layer of gate {gate_prefix!r}")
    return int(m.group(1))


def _serving_pass() -> bool:
    """Whether this forward pass runs scheduled requests: vLLM gives those attention metadata;
    its warm-up, profiling and data-parallel padding passes run without."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return True
    return is_forward_context_available() and get_forward_context().attn_metadata is not None
