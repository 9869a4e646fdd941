"""Start-up check that a batch-invariant router GEMM really is batch-invariant."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Probe batch sizes: below, at and above every M bucket boundary the CUDA dispatch uses.
PROBE_SIZES = (1, 2, 3, 17, 64, 255)


def probe_sizes(weight: torch.Tensor, precision) -> tuple[int, ...]:
    """:data:`PROBE_SIZES` plus, on CUDA, M at and above every point where this GPU's
    batch-invariant configs change (tiles, pipelining, splits summed in one program)."""
    from vllm_router_ext.ops.startup import batch_invariant_probe_sizes

    return tuple(sorted(set(PROBE_SIZES) | set(batch_invariant_probe_sizes(weight, precision))))


class BatchInvarianceError(RuntimeError):
    pass


def check_batch_invariance(
    gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    sizes: tuple[int, ...] = PROBE_SIZES,
    seed: int = 1234,
) -> None:
    """Run ``gemm`` on probe batches and on their first row alone; raise if any row differs
    bitwise. ``dtype`` is the activations' dtype (defaults to the weight's 16-bit dtype)."""
    if dtype is None:
        dtype = weight.dtype if weight.dtype != torch.float32 else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(seed)
    big = torch.randn(max(sizes), weight.shape[1], generator=gen).to(dtype).to(weight.device)
    single = gemm(big[:1], weight)
    for m in sizes:
        out = gemm(big[:m], weight)
        if not torch.equal(out[:1], single):
            diff = (out[:1].double() - single.double()).abs().max().item()
            raise BatchInvarianceError(
                f"router GEMM is not batch-invariant: row 0 of a batch of {m} differs from the "
                f"same row alone (max |diff| {diff:.3e}); refusing to start with batch "
                "invariance requested"
            )
