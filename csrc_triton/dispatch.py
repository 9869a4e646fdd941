"""A router GEMM on CUDA tensors, at run time: the :class:`~csrc_triton.problem.Problem` they pose,
:func:`csrc_triton.choice.choose`'s launch, and the launcher its launch type names. The library's
entry (:func:`router_gemm_cuda`); an op that wraps it keeps the choice inside itself, so compile
and CUDA graphs never freeze a branch on M."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch

from csrc_triton import choice
from csrc_triton.capability import VLLM_GATE_MODULE, vllm_gate_failed
from csrc_triton.launches import (
    CublasLaunch,
    Fp32WeightTermsLaunch,
    GemvLaunch,
    KernelLaunch,
    VllmGateLaunch,
    describe,
)
from csrc_triton.pdl import pdl_enabled
from csrc_triton.problem import Precision, Problem
from csrc_triton.routing import Routing, route_logits

# Under "vllm." so that, inside vLLM, its handlers and format apply (no vLLM import here).
logger = logging.getLogger(f"vllm.{__name__}")


def router_gemm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: Precision,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` in ``precision``'s logits dtype (inputs checked by the caller); ``weight_terms``:
    :func:`fp32_weight_terms` of an fp32 ``weight``, for the large-M GEMM."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    problem = Problem.of(x, weight, precision, batch_invariant, weight_terms is not None)
    if problem.m == 0:
        return torch.empty((0, problem.n), dtype=problem.logits_dtype, device=x.device)
    return _gemm(choice.choose(problem), problem, x, weight, weight_terms)


def _gemm(
    launch: KernelLaunch,
    problem: Problem,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_terms: torch.Tensor | None,
) -> torch.Tensor:
    """The logits of ``launch``, the choice for ``problem`` (M > 0)."""
    if isinstance(launch, CublasLaunch):
        return _cublas(x, weight, problem.logits_dtype)
    if isinstance(launch, VllmGateLaunch):
        try:
            return _vllm_gate(x, weight)
        except Exception as e:  # noqa: BLE001  an incomplete install must not fail a serving step
            vllm_gate_failed()
            fallback = choice.choose(problem, allow_vllm_gate=False)
            logger.warning(
                "vllm-router-ext: vLLM's cuteDSL ll_bf16 kernel failed (%s: %s); our kernels run "
                "bf16-fp32out at 1-%d tokens instead (here %s)",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                choice.VLLM_GATE_TO_M,
                describe(fallback),
            )
            return _gemm(fallback, problem, x, weight, weight_terms)
    out = torch.empty((problem.m, problem.n), dtype=problem.logits_dtype, device=x.device)
    if isinstance(launch, Fp32WeightTermsLaunch):
        return _by_terms(launch, x, weight_terms.contiguous(), out)
    return _run_fitting(launch, problem, x, weight, out)


def route_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: Precision,
    routing: Routing,
    bias: torch.Tensor | None,
    batch_invariant: bool,
    weight_terms: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's experts (``weights`` [M, top_k] fp32, ``ids`` [M, top_k] int32) and the router
    logits they come from: the chosen router GEMM, then the routing kernel (``routing.route_logits``).
    After the GEMV (decode), which releases its dependents at its start, the routing kernel is a
    programmatic dependent launch where the GPU has it (its launch overlaps the GEMM: 0.6-0.8 us on an
    H100); after the other GEMMs a plain launch (as a dependent it cost 0.1-1.0 us there). ``fused``:
    one launch instead where the choice runs the GEMV and the logits are fp32 (``router_route_gemv``);
    both route the same logits identically."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    m = x.shape[0]
    weights = torch.empty((m, routing.top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((m, routing.top_k), dtype=torch.int32, device=x.device)
    problem = Problem.of(x, weight, precision, batch_invariant, weight_terms is not None)
    if m == 0:
        return weights, ids, torch.empty((0, problem.n), dtype=problem.logits_dtype, device=x.device)
    launch = choice.choose(problem, allow_vllm_gate=not fused)  # once: the GEMM below runs this launch
    pdl = pdl_enabled(x.device)
    if isinstance(launch, GemvLaunch):
        logits = torch.empty((m, problem.n), dtype=problem.logits_dtype, device=x.device)
        if fused and problem.logits_dtype == torch.float32:
            from csrc_triton.router_route_gemv import route_gemv_launch

            route_gemv_launch(x, weight, routing, bias, logits, weights, ids, launch)
            return weights, ids, logits
        launch_exactly(launch, x, weight, logits, pdl=pdl)
    else:
        logits = _gemm(launch, problem, x, weight, weight_terms)
        pdl = False
    route_logits(logits, routing, bias, weights, ids, pdl)
    return weights, ids, logits


def _by_terms(
    launch: Fp32WeightTermsLaunch, x: torch.Tensor, terms: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``x @ weight.T`` for an fp32 weight from its bf16 terms ``[3N, K]``: hi, mid and lo logits
    from one launch, added smallest first. The terms' launch is resolved against the terms tensor
    (its rows, not the fp32 weight's, are what TMA reads)."""
    n = out.shape[1]
    parts = torch.empty((x.shape[0], 3 * n), dtype=torch.float32, device=x.device)
    problem = Problem.of(x, terms, Precision.FP32)
    _run_fitting(choice.resolve(launch.terms, problem), problem, x, terms, parts)
    torch.add(parts[:, 2 * n :], parts[:, n : 2 * n], out=out)
    return out.add_(parts[:, :n])


def launch_into(
    launch: KernelLaunch, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Launch what :func:`choice.resolve` makes of ``launch`` for these tensors, into ``out`` (its
    dtype gives the logits'): the tuner's and the tests' way to run a launch of their own."""
    precision = Precision.FP32 if out.dtype == torch.float32 else Precision.BF16
    problem = Problem.of(x, weight, precision)
    return launch_exactly(choice.resolve(launch, problem), x, weight, out)


#: (device index, launch) -> the launch that ran instead: each shrink is found once per process.
_FITTED: dict[tuple[int | None, KernelLaunch], KernelLaunch] = {}


def _run_fitting(
    launch: KernelLaunch, problem: Problem, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
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
    launch: KernelLaunch, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, **options: bool
) -> torch.Tensor:
    """Launch ``launch`` exactly as it is (already resolved for this GPU) with the launcher its
    type names (``options``: that launcher's own, e.g. the GEMV's ``pdl``)."""
    kind = type(launch)
    run = _LAUNCHERS.get(kind)
    if run is None:
        if kind is CublasLaunch:
            run = _cublas_launch
        elif kind is VllmGateLaunch:
            run = _vllm_gate_launch
        elif name := getattr(kind, "launcher", ""):
            module, function = name.split(":")
            run = getattr(importlib.import_module(module), function)
        else:
            raise TypeError(f"not a kernel launch: {launch!r}")
        _LAUNCHERS[kind] = run
    return run(x, weight, out, launch, **options)


#: Launch type -> its launcher, imported on first use (a kernel module compiles nothing on import,
#: but the Gluon one needs a Triton that has Gluon).
_LAUNCHERS: dict[type, Callable[..., torch.Tensor]] = {}


def _cublas_launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, launch: CublasLaunch
) -> torch.Tensor:
    return _cublas(x, weight, out.dtype)


def _vllm_gate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's own gate kernel (it allocates its fp32 output; imported where the choice found it)."""
    return _vllm_gate_gemm()(x, weight)


@functools.cache
def _vllm_gate_gemm() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return importlib.import_module(VLLM_GATE_MODULE).ll_bf16_gemm


def _vllm_gate_launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, launch: VllmGateLaunch
) -> torch.Tensor:
    return out.copy_(_vllm_gate(x, weight))


def fp32_weight_terms(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight ``[N, K]`` as three bf16 terms stacked ``[3N, K]`` (hi, mid, lo; each the
    truncation of what is left): ``hi + mid + lo == weight`` exactly for fp32 values down to
    ~2^-110 (8 significant bits each = fp32's 24; below that lo would be subnormal), so
    ``x @ term.T`` per term is three bf16 GEMMs whose products are exact in fp32. Made once when
    the weight is loaded; the ``fp32`` mode's CUDA dispatch runs them as one GEMM at large M."""
    w = weight.float().contiguous()
    hi = _bf16_truncated(w)
    rest = w - hi.float()  # exact: the low 16 bits of each value
    mid = _bf16_truncated(rest)
    lo = (rest - mid.float()).to(torch.bfloat16)  # exact: <= 8 significant bits remain
    return torch.cat([hi, mid, lo])


def _bf16_truncated(v: torch.Tensor) -> torch.Tensor:
    # Truncation, not rounding: an fp32 value near its maximum would round up to inf in bf16.
    return (v.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def check_weight_terms(weight: torch.Tensor, terms: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``terms`` is what :func:`fp32_weight_terms` makes of ``weight``
    (shape, dtype, device; the values are the caller's promise)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"weight_terms are for an fp32 weight; weight has dtype {weight.dtype}")
    expected = (3 * weight.shape[0], weight.shape[1])
    if terms.dtype != torch.bfloat16 or tuple(terms.shape) != expected or terms.device != weight.device:
        raise ValueError(
            f"weight_terms must be bfloat16 {list(expected)} on {weight.device} "
            f"(fp32_weight_terms(weight)); got {terms.dtype} {list(terms.shape)} on {terms.device}"
        )
