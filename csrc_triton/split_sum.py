"""The sum of K-split partials as a kernel of its own: ``out = part[0] + part[1] + ... + part[S-1]``,
in split order, so the logits are the same bits whichever kernel wrote the partials (split-K's
two-launch form, ``wgmma_ws``'s K split). With PDL it is launched while the partials are still
being computed (``pdl.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.pdl import launch_options, wait_for_primary


@triton.jit
def _split_sum_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    stride_ps,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    PDL: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    wait_for_primary(PDL)  # launched early (PDL): the partials are complete only past this
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: split 0, 1, ..., S-1
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if CONTIGUOUS:  # out rows back to back (stride N): the partials' flat offsets, 16-byte stores
        dst = out_ptr + offs
    else:
        dst = out_ptr + (offs // N).to(tl.int64) * stride_om + offs % N
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: Logits per program of the split sum, and its warps: with 6 or more partials, smaller programs
#: (more of them, more loads in flight) measured faster (docs/kernels.md).
_REDUCE_BLOCK = 1024
_REDUCE_BLOCK_MANY = 512
_REDUCE_MANY_FROM = 6
_REDUCE_WARPS = 4


def reduce_partials(part: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """The two-launch form's second kernel: ``out = part[0] + part[1] + ... + part[S-1]``.
    ``pdl``: launched as a programmatic dependent of the kernel that wrote ``part`` (which must
    have called ``launch_dependents``; see ``csrc_triton/pdl.py``): the same adds, launched early."""
    split_k, M, N = part.shape
    block = _REDUCE_BLOCK_MANY if split_k >= _REDUCE_MANY_FROM else _REDUCE_BLOCK
    _split_sum_kernel[(cdiv(M * N, block),)](
        part, out, M, N, part.stride(0), out.stride(0), SPLIT_K=split_k, BLOCK=block,
        CONTIGUOUS=out.stride(0) == N, PDL=pdl, num_warps=_REDUCE_WARPS, **launch_options(pdl),
    )  # fmt: skip
    return out
