"""Triton kernels of vllm-router-ext (pure Triton + torch; no vLLM)."""


def cdiv(a: int, b: int) -> int:
    """Host-side ceiling division for launch grids. Not ``triton.cdiv``: that is a
    constexpr-function wrapper costing microseconds per call on the op's host path."""
    return -(-a // b)
