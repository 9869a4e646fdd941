"""Router-logits dtype and top-k consistency (the regression test the SGLang seed PR lacked)."""

from __future__ import annotations

import pytest
import torch

from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.routing_fp64 import (
    RoutingConfig,
    changed_expert_sets,
    near_tie_mask,
    reference_logits,
    select_experts,
)

DSV3_LIKE = RoutingConfig(
    top_k=8, n_group=8, topk_group=4, scoring_func="sigmoid", topk_method="noaux_tc", renormalize=True
)


@pytest.mark.parametrize("mode,batch_invariant", [("fp32", False), ("bf16-fp32out", False), ("fp32", True)])
def test_fp32_logits_pick_the_fp64_experts_except_ties_within_one_ulp(gen, mode, batch_invariant):
    m, k, n = 2048, 512, 64
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) * 0.01  # fp32, as the checkpoint stores it
    logits = router_gemm(x, w, mode, batch_invariant=batch_invariant)
    assert logits.dtype == torch.float32
    ref = reference_logits(x, w)
    ref_ids, _ = select_experts(ref, DSV3_LIKE, bias.double())
    ids, _ = select_experts(logits, DSV3_LIKE, bias)  # routed in fp32, as vLLM does
    one_ulp = torch.finfo(torch.float32).eps * 2.0  # scores + bias are < 2: one fp32 ulp
    ties = near_tie_mask(ref, DSV3_LIKE, bias, one_ulp / 2)  # gaps within one ulp
    changed = changed_expert_sets(ids, ref_ids)
    assert not (changed & ~ties).any(), f"{int((changed & ~ties).sum())} tokens flipped outside a tie"


def test_bf16_logits_do_flip_experts(gen):
    """Why the plugin exists: bf16 logits change expert sets that fp32 logits keep."""
    m, k, n = 2048, 512, 64
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) * 0.01
    ref_ids, _ = select_experts(reference_logits(x, w), DSV3_LIKE, bias.double())
    bf16_ids, _ = select_experts(router_gemm(x, w, "bf16").float(), DSV3_LIKE, bias)
    fp32_ids, _ = select_experts(router_gemm(x, w, "fp32"), DSV3_LIKE, bias)
    assert changed_expert_sets(bf16_ids, ref_ids).float().mean() > 0.002  # ~2 % expected
    assert changed_expert_sets(fp32_ids, ref_ids).float().mean() < 0.001
