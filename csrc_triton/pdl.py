"""Programmatic dependent launch (PDL) between our own kernels: the split sum's second launch.

Invariant: PDL changes when the second kernel of a two-launch sum may start, never what it adds.
The second kernel waits (``griddepcontrol.wait``) for the whole first kernel and its writes before
it reads a partial, so the logits are bitwise those of two plain launches.

Why: a dependent kernel node in a CUDA graph pays its launch before it runs. With PDL the first
kernel lets the second launch at once (``griddepcontrol.launch_dependents`` at its start), so the
second one's programs are resident and waiting when the last partial lands (docs/kernels.md).
Hopper and newer (sm_90+) only; elsewhere, under the interpreter, or with
``VLLM_ROUTER_EXT_PDL=0`` both launches are plain (the kernels' PDL constexpr is False).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from csrc_triton import environment
from csrc_triton.environment import interpreting

ENV_VAR = environment.PDL

try:  # Triton >= 3.3 has the grid-dependency-control instructions and the launch flag
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_PDL = True
except ImportError:
    TRITON_PDL = False


_forced: bool | None = None  # set by :func:`forced` only


@contextmanager
def forced(on: bool) -> Iterator[None]:
    """Launch with (or without) PDL whatever the device: for compiling the PDL forms on CPU
    tensors (``vllm_router_ext.tools.compile_check``)."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


@functools.lru_cache(maxsize=8)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` may use PDL (``VLLM_ROUTER_EXT_PDL=0`` turns it off)."""
    if _forced is not None:
        return _forced and TRITON_PDL
    if device.type != "cuda" or not TRITON_PDL or interpreting():
        return False
    if not environment.pdl():
        return False
    return _capability_major(device.index or 0) >= 9


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launcher keyword of a dependent kernel (none at all without PDL: older Triton and the
    interpreter do not take it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """First kernel: the next kernel in the stream may launch now (it waits in :func:`wait_for_primary`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_primary(PDL: tl.constexpr):
    """Second kernel: block until the kernel before it has finished and its writes are visible."""
    if PDL:
        gdc_wait()
