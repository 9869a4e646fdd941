"""The router-GEMM kernel library of vllm-router-ext: pure Triton + torch, importing nothing of
vLLM or of the plugin. On CUDA tensors, ``dispatch.router_gemm_cuda(x, weight, Precision.FP32,
batch_invariant)`` runs what ``choice.choose`` picks for the :class:`problem.Problem` they pose
(a tuned table's launch or the heuristic's); ``dispatch.launch_into`` runs a launch of one's own."""


def cdiv(a: int, b: int) -> int:
    """Host-side ceiling division for launch grids. Not ``triton.cdiv``: that is a
    constexpr-function wrapper costing microseconds per call on the op's host path."""
    return -(-a // b)
