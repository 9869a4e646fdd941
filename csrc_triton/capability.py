"""What this Triton and GPU can run. Imports no kernel module, so the config selection and the
kernels can both ask without importing each other."""

from __future__ import annotations

import functools


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


def wgmma_ws_problem(capability: int, x_dtype, w_dtype) -> str | None:
    """Why the ``wgmma_ws`` kernel cannot run on this GPU for these operand dtypes (None: it can,
    given TMA-readable layouts). It needs Hopper (sm_90: wgmma, TMA), Gluon, and 16-bit operands
    of one dtype."""
    import torch

    if capability // 10 != 9:
        return f"compute capability {capability / 10:.1f} (needs 9.x)"
    if not gluon_available():
        return "this Triton has no Gluon warp specialisation"
    if x_dtype != w_dtype or x_dtype not in (torch.bfloat16, torch.float16):
        return f"dtypes {x_dtype} x {w_dtype} (needs bf16 x bf16 or fp16 x fp16)"
    return None
