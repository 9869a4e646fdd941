"""The typed problem the choice takes: one router GEMM ``[m, k] x [n, k]^T`` in a :class:`Precision`
mode on a :class:`Device`, with the facts of its operands the choice depends on."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from csrc_triton.capability import gluon_available, vllm_gate_available
from csrc_triton.environment import interpreting


class Precision(str, enum.Enum):
    """How a router GEMM multiplies and stores its logits: ``fp32`` (fp32-exact products and sums,
    fp32 logits), ``bf16-fp32out`` (16-bit products summed in fp32, fp32 logits) or ``bf16`` (the
    activations' dtype throughout, as stock vLLM)."""

    FP32 = "fp32"
    BF16_FP32OUT = "bf16-fp32out"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Device:
    """The facts of a GPU the choice depends on. ``gluon`` None: ask this Triton; ``vllm_gate``
    None: ask this process (vLLM's own gate kernel, :func:`vllm_gate_available`)."""

    name: str
    sm_count: int
    capability: int  # compute capability x10
    cublas: bool = True
    gluon: bool | None = None
    vllm_gate: bool | None = None

    @property
    def has_gluon(self) -> bool:
        return gluon_available() if self.gluon is None else self.gluon

    @property
    def has_vllm_gate(self) -> bool:
        return vllm_gate_available() if self.vllm_gate is None else self.vllm_gate


#: Off-GPU (the interpreter): compiled as for an H200-sized Hopper, without cuBLAS or vLLM's kernel.
CPU_INTERPRETER = Device("cpu-interpreter", 132, 90, cublas=False, vllm_gate=False)


@functools.lru_cache(maxsize=8)
def cuda_device(index: int) -> Device:
    props = torch.cuda.get_device_properties(index)
    return Device(props.name, props.multi_processor_count, props.major * 10 + props.minor)


@dataclass(frozen=True)
class Problem:
    """One router GEMM ``[m, k] x [n, k]^T`` to run. ``weight_terms``: an fp32 weight's three bf16
    terms are at hand; ``layout_problem``: why TMA cannot read the operands (None: it can);
    ``contiguous``: both operands are dense row-major (what vLLM's gate kernel takes)."""

    m: int
    k: int
    n: int
    precision: Precision
    batch_invariant: bool = False
    x_dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype = torch.bfloat16
    device: Device = CPU_INTERPRETER
    weight_terms: bool = False
    layout_problem: str | None = None
    interpreting: bool = False
    contiguous: bool = True

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        weight: torch.Tensor,
        precision: Precision,
        batch_invariant: bool = False,
        weight_terms: bool = False,
    ) -> Problem:
        """The problem these tensors pose on their device."""
        device = cuda_device(x.device.index or 0) if x.is_cuda else CPU_INTERPRETER
        return cls(
            x.shape[0],
            x.shape[1],
            weight.shape[0],
            precision,
            batch_invariant,
            x.dtype,
            weight.dtype,
            device,
            weight_terms,
            tma_problem(x, weight),
            interpreting(),
            x.is_contiguous() and weight.is_contiguous(),
        )

    @property
    def fp32(self) -> bool:
        return self.precision is Precision.FP32

    @property
    def fp32_weight(self) -> bool:
        return self.weight_dtype == torch.float32

    @property
    def logits_dtype(self) -> torch.dtype:
        return self.x_dtype if self.precision is Precision.BF16 else torch.float32

    @property
    def cublas(self) -> bool:
        """cuBLAS may serve: a GPU, a 16-bit mode (it has no fp32-accurate GEMM), one operand dtype."""
        return self.device.cublas and not self.fp32 and self.x_dtype == self.weight_dtype

    @property
    def hopper(self) -> bool:
        return self.device.capability // 10 == 9


def tma_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why TMA cannot read ``x`` or ``weight`` (rows not 16-byte aligned); None: it can."""
    for name, t in (("x", x), ("weight", weight)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} layout (stride {tuple(t.stride())}, not 16-byte aligned rows)"
    return None
