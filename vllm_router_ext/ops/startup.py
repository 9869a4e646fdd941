"""What the start-up reads from the choice: the log line naming the kernels that run for a gate by
M, and the M values where the batch-invariant launch changes (what the self-check runs)."""

from __future__ import annotations

from dataclasses import replace

import torch

from csrc_triton import choice, problem, tables
from csrc_triton.dot import DotMode
from csrc_triton.launches import SplitKLaunch, WgmmaWsLaunch
from vllm_router_ext.precision import RouterPrecision

_DOT = {
    DotMode.NATIVE: "16-bit MMA",
    DotMode.SPLIT3: "fp32 weight split into 3 bf16 MMAs",
    DotMode.IEEE: "IEEE fp32 dot",
}


def batch_invariant_probe_sizes(weight: torch.Tensor, precision: RouterPrecision) -> tuple[int, ...]:
    """M values at and just above every point where the batch-invariant launch changes on this
    GPU (tiles, pipelining, splits in one program): the start-up self-check runs all of them."""
    if not weight.is_cuda:
        return ()
    problem = _gate(weight.device.index or 0, precision, True, weight.dtype, weight.shape[1], weight.shape[0])
    starts = [m for m, _ in choice.batch_invariant_buckets(problem)]
    return tuple(sorted({s for m in starts[1:] for s in (m - 1, m)}))


def _gate(
    index: int, precision: RouterPrecision, batch_invariant: bool, weight_dtype: torch.dtype, k: int, n: int
) -> problem.Problem:
    """A bf16-activation gate's problem on a CUDA device, for M to be filled in."""
    device = problem.cuda_device(index)
    return problem.Problem(1, k, n, precision.kernel, batch_invariant, torch.bfloat16, weight_dtype, device)


def describe_cuda_dispatch(
    precision: RouterPrecision, batch_invariant: bool, weight_dtype: torch.dtype, k: int, n: int
) -> str:
    """One line for the start-up log: which kernels run on this GPU for a [n, k] gate, by M."""
    problem = _gate(torch.cuda.current_device(), precision, batch_invariant, weight_dtype, k, n)
    dot = _DOT[DotMode.of(torch.bfloat16, weight_dtype)]
    if batch_invariant:
        buckets = choice.batch_invariant_buckets(problem)
        first = buckets[0][1]
        assert isinstance(first, SplitKLaunch)  # the one batch-invariant kernel
        fused = [m for m, launch in buckets if getattr(launch, "splits_in_program", False)]
        where = f"; splits summed in one program from M={fused[0]}" if fused else ""
        return (
            f"batch-invariant triton split-K, K split {first.k_per_split} (BLOCK_K {first.block_k}) fixed "
            f"for every M, splits added in order{where} ({dot}; {first.source})"
        )
    ranges: list[list] = []  # [kernel, first M, last M]
    for m in (1 << i for i in range(15)):
        title = type(choice.choose(replace(problem, m=m))).title
        if ranges and ranges[-1][0] == title:
            ranges[-1][2] = m
        else:
            ranges.append([title, m, m])
    parts = [
        f"{title} M<={last}" if i < len(ranges) - 1 else f"{title} above"
        for i, (title, _, last) in enumerate(ranges)
    ]
    name = problem.device.name
    if tables.has_shape(name, k, n):
        tuned = f"tuned table {tables.table_label(name)}"
    elif tables.table_name(name) is None:
        tuned = f"heuristic configs: {tables.TABLE_ENV_VAR}=none"
    else:
        tuned = f"heuristic configs: no {k}x{n} entry in table {tables.table_label(name)}"
    promo = ", promoted fp32 accumulation" if precision is RouterPrecision.FP32 else ""
    terms = ""
    if precision is RouterPrecision.FP32 and weight_dtype == torch.float32:
        terms = (
            f"; from M={choice.FP32_WEIGHT_TERMS_FROM_M}: one GEMM on the weight's three bf16 terms "
            "(split once at load), hi + mid + lo added per logit"
        )
    absent = ""
    if precision is RouterPrecision.FP32:  # the prefill kernel this mode runs where the GPU allows
        unmet = WgmmaWsLaunch.needs.unmet(problem.device.capability, problem.device.has_gluon)
        absent = f"; no {WgmmaWsLaunch.title} here: {unmet}" if unmet else ""
    return f"by M at run time: {', '.join(parts)} ({dot}{promo}; {tuned}){terms}{absent}"
