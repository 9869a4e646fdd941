"""What this Triton and GPU can run. Imports no kernel module, so the choice and the kernels can
both ask; each launch type declares its kernel's :class:`GpuNeeds` beside it (``launches.py``)."""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuNeeds:
    """What a kernel needs of the GPU and of Triton, declared once beside its launch type: the
    compute capability (x10) it compiles for, from ``min_capability`` up to (not including)
    ``below_capability``, and Gluon's warp specialisation. The choice, the start-up line and the
    GPU tests read it."""

    min_capability: int = 0
    below_capability: int | None = None
    gluon: bool = False
    #: What the range stands for, for the messages (e.g. "Hopper, sm_90").
    gpus: str = "any CUDA GPU"

    def unmet(self, capability: int, has_gluon: bool | None = None) -> str | None:
        """Why a GPU of ``capability`` (x10) with this Triton cannot run the kernel; None: it can.
        ``has_gluon`` None: ask this Triton."""
        below = self.below_capability
        if capability < self.min_capability or (below is not None and capability >= below):
            return f"compute capability {capability / 10:.1f} (needs {self.gpus})"
        if self.gluon and not (gluon_available() if has_gluon is None else has_gluon):
            return "this Triton has no Gluon warp specialisation"
        return None


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has Gluon with Hopper warp specialisation (the ``wgmma_ws`` kernel):
    Triton >= 3.6."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


#: vLLM's own low-latency router GEMM (``GateLinear``'s first tier from vLLM 0.34): bf16 x bf16
#: products summed in fp32 on tensor cores, the ``bf16-fp32out`` mode's arithmetic.
VLLM_GATE_MODULE = "vllm.model_executor.kernels.linear.cute_dsl.ll_bf16"
_vllm_gate: bool | None = None


def vllm_gate_available() -> bool:
    """Whether this process runs a vLLM whose cuteDSL ``ll_bf16_gemm`` works here (a CUDA GPU,
    CUTLASS's Python DSL). Only a process that has imported vLLM asks it: outside vLLM nothing
    imports vLLM for a router GEMM (a later import of vLLM is seen then)."""
    global _vllm_gate
    if _vllm_gate is None:
        if "vllm" not in sys.modules:
            return False
        try:
            import torch

            _vllm_gate = torch.cuda.is_available() and bool(
                importlib.import_module(VLLM_GATE_MODULE).is_available()
            )
        except Exception:  # noqa: BLE001  an older vLLM, one built for another platform, no cutlass
            _vllm_gate = False
    return _vllm_gate


def vllm_gate_failed() -> None:
    """vLLM's gate kernel failed to run here (e.g. a package its compile imports is missing): the
    choice stops asking for it in this process."""
    global _vllm_gate
    _vllm_gate = False
