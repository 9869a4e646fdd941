"""The multiply-accumulate step shared by the router GEMM kernels.

``DOT_MODE`` (constexpr, a :class:`DotMode`, fixed by the operands' dtypes):
  0 ``NATIVE``: 16-bit x 16-bit tensor-core MMA with fp32 accumulation (bf16 or fp16).
  1 ``SPLIT3``: fp32 weight split exactly into three bf16 terms (hi + mid + lo, each the
    truncation of what is left: 8 significant bits each = fp32's 24) and three bf16 MMAs; every
    product is exact in fp32.
  2 ``IEEE``: fp32 operands, ``input_precision="ieee"`` (never TF32), for fp32 activations.

``UPCAST`` (constexpr) is set only under ``TRITON_INTERPRET=1``: the interpreter multiplies bf16
bit patterns in ``tl.dot`` (triton-lang/triton#11584, unsupported), while bf16 -> fp32 casts are
exact, so each 16-bit operand is upcast right before its ``tl.dot`` and multiplied in IEEE fp32.
Everything else (loads, masks, the weight split, promotion, stores) is the GPU code path.
"""

from enum import IntEnum

import torch
import triton
import triton.language as tl


class DotMode(IntEnum):
    NATIVE = 0
    SPLIT3 = 1
    IEEE = 2

    @classmethod
    def of(cls, x_dtype: torch.dtype, w_dtype: torch.dtype) -> "DotMode":
        """fp32 activations: IEEE fp32 dots; an fp32 weight with bf16 activations: three bf16
        MMAs; otherwise one 16-bit MMA."""
        if x_dtype == torch.float32 or (w_dtype == torch.float32 and x_dtype != torch.bfloat16):
            return cls.IEEE
        if w_dtype == torch.float32:
            return cls.SPLIT3
        return cls.NATIVE


@triton.jit
def _dot16(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def mma(a, b, acc, DOT_MODE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with a [BM, BK] activations, b [BK, BN] weight (transposed view)."""
    if DOT_MODE == 0:
        return _dot16(a, b, acc, UPCAST)
    elif DOT_MODE == 1:
        # Truncated, not rounded, terms: fp32 values near the maximum would round up to inf.
        hi = (b.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        r = b - hi  # exact: the low 16 bits
        mid = (r.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        lo = (r - mid).to(tl.bfloat16)  # exact: <= 8 significant bits remain
        hi = hi.to(tl.bfloat16)  # exact: 8 significant bits
        mid = mid.to(tl.bfloat16)
        a16 = a.to(tl.bfloat16)
        acc = _dot16(a16, lo, acc, UPCAST)  # smallest terms first
        acc = _dot16(a16, mid, acc, UPCAST)
        return _dot16(a16, hi, acc, UPCAST)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def load_chunk(x_rows, w_cols, mask_m, mask_n, k0, K, BLOCK_K: tl.constexpr):
    """The K chunk ``[k0, k0 + BLOCK_K)`` of the activations [BM, BLOCK_K] and of the weight
    [BLOCK_K, BN] (transposed view), zero outside M, N and K. x_rows: [BM, 1] row pointers,
    w_cols: [1, BN]."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    b = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    return a, b


@triton.jit
def promoted_group(
    x_rows,
    w_cols,
    mask_m,
    mask_n,
    k0,
    K,
    acc,
    BLOCK_K: tl.constexpr,
    PROMOTE_CHUNKS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc + part``, where ``part`` is one fresh MMA chain over PROMOTE_CHUNKS chunks of BLOCK_K
    starting at ``k0`` (promotion: tensor-core accumulation chains stay that short). With two or
    more chunks the compiler cannot fold ``part`` into ``acc``; with one it does (Triton rewrites
    ``acc + dot(a, b, 0)`` as ``dot(a, b, acc)``), so the fp32 mode never promotes every chunk
    (``choice.FP32_PROMOTE_CHUNKS``). x_rows: [BM, 1] row pointers, w_cols: [1, BN]."""
    part = tl.zeros(acc.shape, dtype=tl.float32)
    for j in tl.static_range(PROMOTE_CHUNKS):
        a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, k0 + j * BLOCK_K, K, BLOCK_K)
        part = mma(a, b, part, DOT_MODE, UPCAST)
    return acc + part
