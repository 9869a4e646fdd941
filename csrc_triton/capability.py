"""What this Triton can run. Imports no kernel module, so the choice and the kernels can both ask."""

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
