"""The start-up self-check for batch invariance (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_router_ext.ops import router_gemm
from vllm_router_ext.selfcheck import BatchInvarianceError, check_batch_invariance


def test_accepts_the_batch_invariant_plain_torch_path(gen):
    w = (torch.randn(32, 256, generator=gen) / 16).to(torch.bfloat16)
    for mode in ("fp32", "bf16-fp32out", "bf16"):
        check_batch_invariance(lambda x, w, mode=mode: router_gemm(x, w, mode, batch_invariant=True), w)


def test_refuses_an_implementation_that_switches_by_m(gen):
    """A dispatch that changes the logits' dtype by M (as a kernel switch would) is refused."""
    w = (torch.randn(32, 256, generator=gen) / 16).to(torch.bfloat16)

    def switching(x, w):
        if x.shape[0] <= 16:
            return router_gemm(x, w, "fp32", batch_invariant=True)
        return F.linear(x, w).float()  # bf16 logits above 16 tokens

    with pytest.raises(BatchInvarianceError, match="row 0 of a batch of (17|64|255) differs"):
        check_batch_invariance(switching, w)


def test_refuses_split_k_that_depends_on_m(gen):
    w = (torch.randn(32, 1024, generator=gen) / 32).to(torch.bfloat16)

    def split_by_m(x, w):
        splits = 1 if x.shape[0] == 1 else 4
        xf, wf = x.float(), w.float()
        parts = [F.linear(xc, wc) for xc, wc in zip(xf.chunk(splits, 1), wf.chunk(splits, 1), strict=True)]
        return torch.stack(parts).sum(0)

    with pytest.raises(BatchInvarianceError):
        check_batch_invariance(split_by_m, w)
