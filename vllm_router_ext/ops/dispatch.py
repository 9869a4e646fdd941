"""CUDA side of ``router_ext::router_gemm``: picks a kernel by M at run time, inside the op.

- ``bf16-fp32out`` / ``bf16``: split-K Triton kernel at small M, tiled kernel at large M, cuBLAS
  where the tuned table measured it faster on this GPU ("never slower than cuBLAS").
- ``fp32``: the same kernels with promoted fp32 accumulation (from ~1024 tokens on Hopper the
  warp-specialised wgmma kernel, ``wgmma_ws``: same sums, the promotion hidden behind a second
  warpgroup's MMAs; where it cannot run, the table's fastest Triton config for that M); an fp32
  weight is split exactly into three bf16 terms (inside the kernels, or from 1024 tokens one GEMM
  on the terms the gate layer made at load); fp32 activations use IEEE fp32 dots. Never TF32.
- batch-invariant: the split-K kernel with one K structure for every M (no switch of kernel, dtype
  or K split by M); only tiles and where the split sum happens (a ticket or a second launch at
  small M, in registers of one program at large M) vary, among configs verified bitwise equal. A
  tuned table may instead fix the exact fixed-point split sum (one atomic per logit at small M):
  same rules.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from vllm_router_ext.precision import RouterPrecision

if TYPE_CHECKING:
    from csrc_triton.configs import KernelConfig

# Under "vllm." so that, inside vLLM, its handlers and format apply (no vLLM import here).
logger = logging.getLogger(f"vllm.{__name__}")


def dot_mode_for(x_dtype: torch.dtype, w_dtype: torch.dtype) -> int:
    from csrc_triton.dot import DOT_IEEE, DOT_NATIVE, DOT_SPLIT3

    if x_dtype == torch.float32 or (w_dtype == torch.float32 and x_dtype != torch.bfloat16):
        return DOT_IEEE
    if w_dtype == torch.float32:
        return DOT_SPLIT3
    return DOT_NATIVE


@functools.lru_cache(maxsize=8)
def _device_info(index: int) -> tuple[str, int, int]:
    """(name, SM count, compute capability x10) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count, props.major * 10 + props.minor


def _capability(x: torch.Tensor) -> int:
    """Compute capability x10 of ``x``'s GPU (90 off-GPU: the interpreter, compiled as for Hopper)."""
    return _device_info(x.device.index or 0)[2] if x.is_cuda else 90


def config_for(x: torch.Tensor, weight: torch.Tensor, precision: RouterPrecision, batch_invariant: bool):
    from csrc_triton.configs import select_config

    name, sms, cap = _device_info(x.device.index or 0) if x.is_cuda else ("cpu-interpreter", 132, 90)
    return select_config(
        x.shape[0],
        x.shape[1],
        weight.shape[0],
        precision.value,
        batch_invariant,
        name,
        sms,
        cublas=x.is_cuda,
        capability=cap,
        fp32_weight=weight.dtype == torch.float32,
    )


def _cublas(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == x.dtype:  # the bf16 mode: stock cuBLAS GEMM, bf16 logits
        return torch.mm(x, weight.T)
    return torch.mm(x, weight.T, out_dtype=torch.float32)  # fp32 written by the GEMM epilogue


def run_config(
    cfg,
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    dot_mode: int,
    capability: int | None = None,
) -> torch.Tensor:
    """Launch what ``cfg`` becomes here (:func:`csrc_triton.configs.config_to_run`: the fallback
    of a ``wgmma_ws`` config that cannot run, an fp32 weight's tiles) into ``out``. Used by the
    dispatch, the tuner and the tests. ``capability`` (x10) defaults to the device's (90 off-GPU)."""
    if capability is None:
        capability = _capability(x)
    return _launch(_to_run(cfg, x, weight, out, capability), x, weight, out, dot_mode)


#: Reasons already logged for running a ``wgmma_ws`` config on another kernel (once each).
_WGMMA_WS_FALLBACKS: set[str] = set()


def _to_run(cfg, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, capability: int, problem=None):
    """:func:`config_to_run` with the facts only the tensors know: why a ``wgmma_ws`` config
    cannot run them (``problem`` given: it did not fit this GPU)."""
    from csrc_triton.configs import config_to_run

    if cfg.kernel == "wgmma_ws" and problem is None:
        from csrc_triton.router_gemm_wgmma_ws import unsupported_reason

        problem = unsupported_reason(x, weight, capability)
        if problem is None and out.dtype != torch.float32:
            problem = f"{out.dtype} logits (needs float32)"
    name, sms = _device_info(x.device.index or 0)[:2] if x.is_cuda else ("cpu-interpreter", 132)
    m, k = x.shape
    ran = config_to_run(
        cfg, m, k, weight.shape[0], name, sms, capability, weight.dtype == torch.float32, problem
    )
    if ran.kernel != cfg.kernel and problem not in _WGMMA_WS_FALLBACKS:
        _WGMMA_WS_FALLBACKS.add(problem)
        logger.info(
            "vllm-router-ext: %s cannot run (%s); running %s", cfg.describe(), problem, ran.describe()
        )
    return ran


def _launch(cfg, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, dot_mode: int) -> torch.Tensor:
    """Launch ``cfg`` exactly as it is."""
    from csrc_triton.router_gemm_gemv import gemv_launch
    from csrc_triton.router_gemm_splitk import splitk_launch
    from csrc_triton.router_gemm_tiled import tiled_launch

    params = dict(cfg.params)
    if cfg.kernel == "cublas":
        return _cublas(x, weight, out.dtype)
    if cfg.kernel == "gemv":  # fp32 FMA: exact for every mode and weight dtype, no dot mode
        return gemv_launch(x, weight, out, **params)
    if cfg.kernel == "splitk":
        return splitk_launch(x, weight, out, dot_mode=dot_mode, **params)
    if cfg.kernel == "tiled":
        return tiled_launch(x, weight, out, dot_mode=dot_mode, **params)
    if cfg.kernel == "wgmma_ws":
        from csrc_triton.router_gemm_wgmma_ws import wgmma_ws_launch

        return wgmma_ws_launch(x, weight, out, **params)
    raise ValueError(f"unknown kernel {cfg.kernel!r}; allowed: gemv, splitk, tiled, wgmma_ws, cublas")


#: Where an fp32 gate weight's GEMM runs on its three bf16 terms (one promoted fp32-mode GEMM on
#: the stacked [3N, K] terms, then hi + mid + lo per logit) rather than splitting fp32 weight tiles
#: inside every program: from 1024 tokens and 128 experts. Measured on the H200: 0.32-0.81x the
#: in-kernel split's time from 2048 tokens on the four large shapes (DeepSeek-V3 M=8192 682 -> 219
#: µs), 0.31-0.66x at 1024 tokens, 0.91-1.27x at 128-512; DeepSeek-V2-Lite (64 experts) 0.83-1.72x:
#: it keeps the in-kernel split.
FP32_WEIGHT_TERMS_FROM_M = 1024
FP32_WEIGHT_TERMS_MIN_N = 128


def _fp32_weight_by_terms(
    x: torch.Tensor, weight: torch.Tensor, terms: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``x @ weight.T`` for an fp32 weight from its bf16 terms: the fp32 mode's promoted GEMM on
    ``terms`` [3N, K] gives hi, mid and lo logits; they are added smallest first."""
    n = weight.shape[0]
    parts = torch.empty((x.shape[0], 3 * n), dtype=torch.float32, device=x.device)
    cfg = config_for(x, terms, RouterPrecision.FP32, False)  # never cuBLAS in the fp32 mode
    run_fitting_config(cfg, x, terms, parts, dot_mode_for(x.dtype, terms.dtype))
    torch.add(parts[:, 2 * n :], parts[:, n : 2 * n], out=out)
    return out.add_(parts[:, :n])


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
    out_dtype = x.dtype if precision is RouterPrecision.BF16 else torch.float32
    if x.shape[0] == 0:
        return torch.empty((0, weight.shape[0]), dtype=out_dtype, device=x.device)
    if (
        weight_terms is not None
        and precision is RouterPrecision.FP32
        and not batch_invariant  # one kernel for every M there: no switch by M
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.float32
        and x.shape[0] >= FP32_WEIGHT_TERMS_FROM_M
        and weight.shape[0] >= FP32_WEIGHT_TERMS_MIN_N
    ):
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype, device=x.device)
        return _fp32_weight_by_terms(x, weight, weight_terms.contiguous(), out)
    cfg = config_for(x, weight, precision, batch_invariant)
    if cfg.kernel == "cublas":
        return _cublas(x, weight, out_dtype)  # allocates its own output
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype, device=x.device)
    return run_fitting_config(cfg, x, weight, out, dot_mode_for(x.dtype, weight.dtype))


#: (device index, config) -> the config that ran instead: each shrink is found once per process.
_FITTED: dict[tuple[int | None, KernelConfig], KernelConfig] = {}


def run_fitting_config(
    cfg: KernelConfig, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, dot_mode: int
) -> torch.Tensor:
    """:func:`run_config`, except that a config this GPU cannot hold (Triton's OutOfResources,
    raised before the launch: e.g. a GPU with less shared memory than the one a table or the
    heuristic was made for) is replaced by :func:`shrink_config`'s, with one warning, instead of
    failing a serving step. Batch invariance is unaffected: the start-up self-check runs every
    bucket's config, so a shrink happens (and is checked bitwise) before the first request."""
    from triton.runtime.errors import OutOfResources

    from csrc_triton.configs import shrink_config

    key = (x.device.index, cfg)
    fitted = _FITTED.get(key, cfg) if _FITTED else cfg  # no hashing on the common path
    while True:
        try:
            result = run_config(fitted, x, weight, out, dot_mode)
        except OutOfResources as e:
            smaller = shrink_config(fitted)
            if smaller is None and fitted.kernel == "wgmma_ws":  # the Triton kernels' same sums
                smaller = _to_run(fitted, x, weight, out, _capability(x), "does not fit this GPU")
            if smaller is None:
                raise
            logger.warning(
                "vllm-router-ext: %s does not fit this GPU (%s); running %s instead",
                fitted.describe(),
                str(e).split(". ")[0],
                smaller.describe(),
            )
            fitted = smaller
            _FITTED[key] = fitted
            continue
        return result
