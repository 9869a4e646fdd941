"""CUDA side of ``router_ext::router_gemm``: gathers the tensors' facts, asks
:func:`vllm_router_ext.ops.choice.choose` what runs, and launches it, at run time inside the op."""

from __future__ import annotations

import logging

import torch

import vllm_router_ext.ops.choice as choice
from csrc_triton.launches import (
    CublasLaunch,
    Fp32WeightTermsLaunch,
    GemvLaunch,
    KernelLaunch,
    SplitKLaunch,
    TiledLaunch,
    WgmmaWsLaunch,
    describe,
)
from vllm_router_ext.precision import RouterPrecision

# Under "vllm." so that, inside vLLM, its handlers and format apply (no vLLM import here).
logger = logging.getLogger(f"vllm.{__name__}")


def router_gemm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: RouterPrecision,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    problem = choice.Problem.of(x, weight, precision, batch_invariant, weight_terms is not None)
    if problem.m == 0:
        return torch.empty((0, problem.n), dtype=problem.logits_dtype, device=x.device)
    launch = choice.choose(problem)
    if isinstance(launch, CublasLaunch):
        return _cublas(x, weight, problem.logits_dtype)
    out = torch.empty((problem.m, problem.n), dtype=problem.logits_dtype, device=x.device)
    if isinstance(launch, Fp32WeightTermsLaunch):
        return _by_terms(launch, x, weight_terms.contiguous(), out)
    return _run_fitting(launch, problem, x, weight, out)


def _by_terms(
    launch: Fp32WeightTermsLaunch, x: torch.Tensor, terms: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``x @ weight.T`` for an fp32 weight from its bf16 terms ``[3N, K]``: hi, mid and lo logits
    from one launch, added smallest first. The terms' launch is resolved against the terms tensor
    (its rows, not the fp32 weight's, are what TMA reads)."""
    n = out.shape[1]
    parts = torch.empty((x.shape[0], 3 * n), dtype=torch.float32, device=x.device)
    problem = choice.Problem.of(x, terms, RouterPrecision.FP32)
    _run_fitting(choice.resolve(launch.terms, problem), problem, x, terms, parts)
    torch.add(parts[:, 2 * n :], parts[:, n : 2 * n], out=out)
    return out.add_(parts[:, :n])


def launch_into(
    launch: KernelLaunch, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Launch what :func:`choice.resolve` makes of ``launch`` for these tensors, into ``out`` (its
    dtype gives the logits'): the tuner's and the tests' way to run a launch of their own."""
    precision = RouterPrecision.FP32 if out.dtype == torch.float32 else RouterPrecision.BF16
    problem = choice.Problem.of(x, weight, precision)
    return launch_exactly(choice.resolve(launch, problem), x, weight, out)


#: (device index, launch) -> the launch that ran instead: each shrink is found once per process.
_FITTED: dict[tuple[int | None, KernelLaunch], KernelLaunch] = {}


def _run_fitting(
    launch: KernelLaunch, problem: choice.Problem, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Launch ``launch``; one this GPU cannot hold (Triton's OutOfResources, raised before the
    launch: e.g. less shared memory than the table's GPU) is replaced by :func:`choice.shrink`'s,
    with one warning, instead of failing a serving step. The start-up self-check runs every
    batch-invariant bucket, so a shrink there happens (and is checked bitwise) before traffic."""
    from triton.runtime.errors import OutOfResources

    key = (x.device.index, launch)
    fitted = _FITTED.get(key, launch) if _FITTED else launch  # no hashing on the common path
    while True:
        try:
            return launch_exactly(fitted, x, weight, out)
        except OutOfResources as e:
            smaller = choice.shrink(fitted, problem)
            if smaller is None:
                raise
            logger.warning(
                "vllm-router-ext: %s does not fit this GPU (%s); running %s instead",
                describe(fitted),
                str(e).split(". ")[0],
                describe(smaller),
            )
            fitted = _FITTED[key] = smaller


def _cublas(x: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS allocates its own output: bf16 logits in the bf16 mode, else fp32 from the epilogue."""
    if logits_dtype == x.dtype:
        return torch.mm(x, weight.T)
    return torch.mm(x, weight.T, out_dtype=torch.float32)


def launch_exactly(
    launch: KernelLaunch, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Launch ``launch`` exactly as it is (already resolved for this GPU)."""
    if isinstance(launch, GemvLaunch):
        from csrc_triton.router_gemm_gemv import gemv_launch

        return gemv_launch(x, weight, out, launch)
    if isinstance(launch, SplitKLaunch):
        from csrc_triton.router_gemm_splitk import splitk_launch

        return splitk_launch(x, weight, out, launch)
    if isinstance(launch, TiledLaunch):
        from csrc_triton.router_gemm_tiled import tiled_launch

        return tiled_launch(x, weight, out, launch)
    if isinstance(launch, WgmmaWsLaunch):
        from csrc_triton.router_gemm_wgmma_ws import wgmma_ws_launch

        return wgmma_ws_launch(x, weight, out, launch)
    if isinstance(launch, CublasLaunch):
        return _cublas(x, weight, out.dtype)
    raise TypeError(f"not a kernel launch: {launch!r}")
