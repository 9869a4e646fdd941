"""Start-up description of the CUDA dispatch, apart from the hot path: the log line naming the
kernels that run for a gate by M, and the M at which the batch-invariant config changes (what the
start-up self-check runs). Reads the same selection the op runs (``csrc_triton.configs``)."""

from __future__ import annotations

import torch

from vllm_router_ext.ops import dispatch
from vllm_router_ext.precision import RouterPrecision

#: Batch-invariant buckets are found by looking up every M to here (the heuristic's largest
#: threshold is 8192), or past the table's largest bucket end if that is higher.
BUCKET_SCAN_TO = 16385


def batch_invariant_buckets(
    k: int, n: int, precision: RouterPrecision, name: str, sms: int, cap: int = 90
) -> list:
    """``[(first M, config)]`` of every batch-invariant bucket on this GPU: every M up to
    :data:`BUCKET_SCAN_TO` (or just past the table's last finite ``max_m``) is looked up (~0.1 s),
    because a tuned bucket may end at any M (a retune at 768 tokens) and the heuristic switches
    where the partials outgrow a limit; above that no config changes."""
    from csrc_triton.configs import select_config, table_buckets

    ends = [b["max_m"] for b in table_buckets(name, k, n, precision.value, True) if b["max_m"]]
    buckets: list = []
    for m in range(1, max([BUCKET_SCAN_TO, *(e + 1 for e in ends)]) + 1):
        cfg = select_config(m, k, n, precision.value, True, name, sms, capability=cap)
        if not buckets or buckets[-1][1] != cfg:
            buckets.append((m, cfg))
    return buckets


def batch_invariant_probe_sizes(weight: torch.Tensor, precision: RouterPrecision) -> tuple[int, ...]:
    """M values at and just above every point where the batch-invariant config changes on this
    GPU (tiles, pipelining, splits in one program): the start-up self-check runs all of them."""
    if not weight.is_cuda:
        return ()
    name, sms, cap = dispatch._device_info(weight.device.index or 0)
    buckets = batch_invariant_buckets(weight.shape[1], weight.shape[0], precision, name, sms, cap)
    starts = [m for m, _ in buckets]
    return tuple(sorted({s for m in starts[1:] for s in (m - 1, m)}))


def describe_cuda_dispatch(
    precision: RouterPrecision, batch_invariant: bool, weight_dtype: torch.dtype, k: int, n: int
) -> str:
    """One line for the start-up log: which kernels run on this GPU for a [n, k] gate, by M."""
    from csrc_triton.configs import TABLE_ENV_VAR, load_table, select_config, table_label, table_name

    name, sms, cap = dispatch._device_info(torch.cuda.current_device())
    dot = {0: "16-bit MMA", 1: "fp32 weight split into 3 bf16 MMAs", 2: "IEEE fp32 dot"}[
        dispatch.dot_mode_for(torch.bfloat16, weight_dtype)
    ]
    if batch_invariant:
        buckets = batch_invariant_buckets(k, n, precision, name, sms, cap)
        cfg = buckets[0][1]
        kps, block_k = cfg.params.get("k_per_split"), cfg.params.get("block_k")
        fused = [m for m, c in buckets if c.params.get("splits_in_program")]
        where = f"; splits summed in one program from M={fused[0]}" if fused else ""
        how = (
            "splits summed exactly in fixed point"
            if cfg.params.get("fixed_point")
            else "splits added in order"
        )
        return (
            f"batch-invariant triton split-K, K split {kps} (BLOCK_K {block_k}) fixed for every M, "
            f"{how}{where} ({dot}; {cfg.source})"
        )
    from csrc_triton.capability import wgmma_ws_problem
    from csrc_triton.configs import wgmma_ws_fallback

    label = {
        "gemv": "triton GEMV (fp32 FMA)",
        "splitk": "triton split-K",
        "tiled": "triton tiled",
        "wgmma_ws": "gluon warp-specialised wgmma",
    }
    ranges: list[list] = []  # [kernel, first M, last M]
    for m in (1 << i for i in range(15)):
        kernel = select_config(m, k, n, precision.value, False, name, sms, capability=cap).kernel
        if kernel == "wgmma_ws" and wgmma_ws_problem(cap, torch.bfloat16, weight_dtype) is not None:
            # what runs instead (the dispatch's fallback): e.g. an fp32 weight is not a bf16 TMA tile
            kernel = wgmma_ws_fallback(m, k, n, name, sms, cap, weight_dtype == torch.float32).kernel
        if ranges and ranges[-1][0] == kernel:
            ranges[-1][2] = m
        else:
            ranges.append([kernel, m, m])
    parts = [
        f"{label.get(kernel, 'cuBLAS')} M<={last}"
        if i < len(ranges) - 1
        else f"{label.get(kernel, 'cuBLAS')} above"
        for i, (kernel, _, last) in enumerate(ranges)
    ]
    if load_table(name).get("shapes", {}).get(f"{k}x{n}"):
        tuned = f"tuned table {table_label(name)}"
    elif table_name(name) is None:
        tuned = f"heuristic configs: {TABLE_ENV_VAR}=none"
    else:
        tuned = f"heuristic configs: no {k}x{n} entry in table {table_label(name)}"
    promo = ", promoted fp32 accumulation" if precision is RouterPrecision.FP32 else ""
    terms = ""
    if precision is RouterPrecision.FP32 and weight_dtype == torch.float32:
        terms = (
            f"; from M={dispatch.FP32_WEIGHT_TERMS_FROM_M}: one GEMM on the weight's three bf16 terms "
            "(split once at load), hi + mid + lo added per logit"
            if n >= dispatch.FP32_WEIGHT_TERMS_MIN_N
            else ""
        )
    return f"by M at run time: {', '.join(parts)} ({dot}{promo}; {tuned}){terms}"
